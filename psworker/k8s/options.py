"""What a Kubernetes run takes besides its spec (`K8sOptions`): names, image, resources, retries, the stop grace
period, the metrics port and a Kueue queue; and their checks, each naming its flag."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Any, Optional

from psworker.errors import UsageError
from psworker.task.stop import ps_wait_secs

LABEL_RUN = "psworker.dev/run"
LABEL_JOB = "psworker.dev/job"
LABEL_QUEUE = "kueue.x-k8s.io/queue-name"   # Kueue admits a suspended workload labelled with its LocalQueue
_DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
# a Kueue LocalQueue: an object name that is also a label value (at most 63 characters)
_QUEUE_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")
MAX_NAME = 40   # leaves room for `-<job>-<jobIndex>-<podIndex>` in a 63-character pod hostname
DEFAULT_METRICS_PORT = 9400       # each task's Prometheus /metrics (`psworker ps|worker --metrics_port`)
METRICS_PATH = "/metrics"


@dataclass(frozen=True)
class K8sOptions:
    """What the spec does not say: names, image, resources, volumes, retry limits, stops, metrics and queueing."""

    name: str                               # the run: object names, DNS names, the psworker.dev/run label
    image: str
    namespace: str = "default"
    flavor: str = "plain"                   # manifests.FLAVORS
    port: Optional[int] = None              # None: a count spec's port, else DEFAULT_PORT_BASE
    cpu: Optional[str] = None               # requests.cpu, e.g. "2"
    memory: Optional[str] = None            # requests.memory and limits.memory, e.g. "4Gi"
    train_dir_volume: Optional[str] = None  # a PersistentVolumeClaim mounted at train_dir; None: emptyDir
    retries: int = 3                        # per task (backoffLimitPerIndex, TFJob backoffLimit, JobSet maxRestarts)
    cluster_domain: str = "cluster.local"   # kubelet's clusterDomain: pod FQDNs are in each pod's /etc/hosts
    command: tuple[str, ...] = ()           # a user's program run in every pod instead of psworker's tasks
    grace_secs: Optional[int] = None        # every pod's terminationGracePeriodSeconds; None: `grace_secs_for`
    metrics_port: Optional[int] = DEFAULT_METRICS_PORT   # named `metrics` in every pod; None: no metrics
    metrics: bool = False                   # prometheus.io/* annotations and a PodMonitor
    queue: Optional[str] = None             # a Kueue LocalQueue: the workload is labelled with it and suspended


def check_options(options: K8sOptions, flavors: tuple[str, ...]) -> None:
    """Checks names and limits, naming the flag.

    Raises:
        UsageError: a name that is not a DNS label or too long, an empty image, a bad port, retry count, grace
            period or queue name, the metrics port on the gRPC port, or `--metrics` without a metrics port.
    """
    for flag, value, limit in (("--name", options.name, MAX_NAME), ("--namespace", options.namespace, 63)):
        if not _DNS_LABEL.fullmatch(value) or len(value) > limit:
            raise UsageError(f"{flag} {value!r} must be a DNS label of at most {limit} characters "
                             f"(lower-case letters, digits and '-', starting with a letter)")
    if not options.image.strip() or any(c.isspace() for c in options.image):
        raise UsageError(f"--image {options.image!r} must be an image reference without spaces")
    if options.flavor not in flavors:
        raise UsageError(f"--flavor {options.flavor!r} is not one of {', '.join(flavors)}")
    for flag, port in (("--port", options.port), ("--metrics_port", options.metrics_port)):
        if port is not None and not 1 <= port <= 65535:
            raise UsageError(f"{flag} {port} is out of range 1-65535")
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", options.cluster_domain):
        raise UsageError(f"--cluster_domain {options.cluster_domain!r} is not a DNS name")
    if options.retries < 0:
        raise UsageError(f"--retries must be >= 0, got {options.retries}")
    if options.grace_secs is not None and options.grace_secs < 0:
        raise UsageError(f"--grace_secs must be >= 0, got {options.grace_secs}")
    _check_metrics_and_queue(options)


def _check_metrics_and_queue(options: K8sOptions) -> None:
    if options.metrics and options.metrics_port is None:
        raise UsageError("--metrics needs a metrics port: drop --metrics_port 0, or give one")
    if options.queue is not None and (not _QUEUE_NAME.fullmatch(options.queue) or len(options.queue) > 63):
        raise UsageError(f"--queue {options.queue!r} must be a Kueue LocalQueue name: at most 63 lower-case "
                         f"letters, digits, '-' and '.', starting and ending with a letter or digit")


def labels(options: K8sOptions, job: Optional[str] = None) -> dict[str, str]:
    """The labels of every object and pod of the run (pods: with their psworker job)."""
    found = {"app.kubernetes.io/name": "psworker", "app.kubernetes.io/instance": options.name,
             LABEL_RUN: options.name}
    return {**found, LABEL_JOB: job} if job else found


def metadata(name: str, options: K8sOptions, job: Optional[str] = None, workload: bool = False) -> dict[str, Any]:
    """An object's metadata; a workload's (Job, JobSet, TFJob) carries the Kueue queue label with `--queue`."""
    found = labels(options, job)
    if workload and options.queue:
        found[LABEL_QUEUE] = options.queue
    return {"name": name, "namespace": options.namespace, "labels": found}


def run_name(spec_path: str) -> str:
    """A run name from a spec file name: `cluster_specs/two_ps.yaml` -> `two-ps`."""
    stem = re.sub(r"\.ya?ml$", "", os.path.basename(spec_path).lower())
    name = re.sub(r"[^a-z0-9]+", "-", stem).strip("-")[:MAX_NAME].rstrip("-")
    return name if name[:1].isalpha() else f"run-{name}"[:MAX_NAME].rstrip("-")


__all__ = ["DEFAULT_METRICS_PORT", "K8sOptions", "LABEL_JOB", "LABEL_QUEUE", "LABEL_RUN",
           "MAX_NAME", "METRICS_PATH", "check_options", "grace_secs_for", "labels", "metadata", "run_name"]


def grace_secs_for(options: K8sOptions, step_timeout_secs: float) -> int:
    """The pods' grace period: `--grace_secs`, else as long as a stopping ps serves its chief (`ps_wait_secs`: the
    running step, the peers' stop, the checkpoint), so that SIGKILL never cuts a checkpoint the tasks would write."""
    if options.grace_secs is not None:
        return options.grace_secs
    return math.ceil(ps_wait_secs(step_timeout_secs))
