"""The `psworker k8s` commands: write Kubernetes manifests for a spec (pure), and apply, watch, read logs of and
delete a run through the official client (the `k8s` extra)."""

from __future__ import annotations

import argparse
import logging
import re
import sys

from psworker.cli.flags import COMMAND_EPILOG, add_train_flags, int_type, port_type, value_type, with_train_flags
from psworker.errors import UsageError
from psworker.spec import JOBS, load_spec

log = logging.getLogger(__name__)

# A Kubernetes resource quantity (k8s.io/apimachinery's resource.Quantity): a number, then a binary or decimal SI
# suffix or an exponent.
_QUANTITY = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E|[eE][+-]?\d+)?\Z")


def check_quantity(text: str) -> str:
    """A positive Kubernetes quantity, as a pod's resources take it: `2`, `500m`, `4Gi`, `1.5G`, `1e9`.

    Raises:
        ValueError: not a quantity (e.g. `4GB`: Kubernetes writes 4G or 4Gi), or zero.
    """
    m = _QUANTITY.match(text)
    if m is None:
        raise ValueError(f"{text!r} is not a Kubernetes quantity: a number with an optional suffix, e.g. 2, 500m, "
                         f"4Gi, 4G")
    if float(m.group(1)) == 0:
        raise ValueError(f"{text!r}: a resource request must be > 0")
    return text


def cmd_k8s_manifest(args: argparse.Namespace) -> int:
    """`psworker k8s manifest SPEC --image IMAGE ... [-- COMMAND...]`: writes the run's Kubernetes objects as YAML
    (COMMAND: run in every pod instead of psworker's tasks)."""
    from psworker.k8s import manifests as k8s
    spec = with_train_flags(load_spec(args.spec, allow_counts=True), args)
    options = k8s.K8sOptions(
        name=args.name or k8s.run_name(args.spec), image=args.image, namespace=args.namespace, flavor=args.flavor,
        port=args.port, cpu=args.cpu, memory=args.memory, train_dir_volume=args.train_dir_volume,
        retries=args.retries, cluster_domain=args.cluster_domain, command=tuple(args.user_command),
        grace_secs=args.grace_secs, metrics_port=args.metrics_port or None, metrics=args.metrics, queue=args.queue)
    text = k8s.to_yaml(k8s.manifests(spec, options))
    if options.queue and options.flavor == "plain":
        print("psworker: warning: --queue with the plain flavor: Kueue admits the ps Job and the worker Job each on "
              "its own, so one may wait while the other runs; --flavor jobset is admitted as one workload",
              file=sys.stderr)
    if args.output in (None, "-"):
        sys.stdout.write(text)
    else:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
        log.info("wrote %s (%s flavor, run %s)", args.output, options.flavor, options.name)
    return 0


def cmd_k8s_apply(args: argparse.Namespace) -> int:
    """`psworker k8s apply FILE`: creates or updates the objects of a manifest file."""
    import yaml

    from psworker.k8s import live
    try:
        with open(args.file, encoding="utf-8") as f:
            objects = [o for o in yaml.safe_load_all(f) if o]
    except (OSError, yaml.YAMLError) as e:
        raise UsageError(f"{args.file}: cannot read the manifest: {e}") from None
    for applied in live.apply(live.connect(args.context), objects):
        print(f"psworker: applied {applied}")
    return 0


def cmd_k8s_status(args: argparse.Namespace) -> int:
    """`psworker k8s status NAME`: one line per task pod."""
    from psworker.k8s import live
    print(live.format_status(live.status(live.connect(args.context), args.name, args.namespace)))
    return 0


def cmd_k8s_logs(args: argparse.Namespace) -> int:
    """`psworker k8s logs NAME [--job J] [--task_index I]`: each pod's log, prefixed `[worker:1] `."""
    from psworker.k8s import live
    for task, text in live.logs(live.connect(args.context), args.name, args.namespace, args.job, args.task_index,
                                args.tail):
        for line in text.splitlines():
            print(f"[{task}] {line}")
    return 0


def cmd_k8s_delete(args: argparse.Namespace) -> int:
    """`psworker k8s delete NAME`: deletes every object labelled with the run."""
    from psworker.k8s import live
    for gone in live.delete(live.connect(args.context), args.name, args.namespace):
        print(f"psworker: deleted {gone}")
    return 0


def manifest_flags(p: argparse.ArgumentParser) -> None:
    from psworker.k8s.manifests import FLAVORS

    p.add_argument("spec", metavar="SPEC")
    p.add_argument("--image", required=True, help="a container image with psworker installed (see Dockerfile)")
    p.add_argument("--name", help="the run's name (default: from the spec file name)")
    p.add_argument("--namespace", default="default")
    p.add_argument("--flavor", choices=list(FLAVORS), default="plain",
                   help="tfjob: Kubeflow TFJob; plain: Service + Indexed Jobs (default); jobset: JobSet")
    p.add_argument("--port", type=port_type(), metavar="PORT",
                   help="every task's gRPC port (default: the spec's port, else 2222)")
    quantity = value_type(check_quantity, "quantity")
    p.add_argument("--cpu", type=quantity, help="CPU request per task, e.g. 2 or 500m (default: none)")
    p.add_argument("--memory", type=quantity, help="memory request and limit per task, e.g. 4Gi (default: none)")
    p.add_argument("--train_dir_volume", metavar="CLAIM",
                   help="PersistentVolumeClaim mounted at --train_dir on workers (default: an emptyDir, lost "
                        "with the pod)")
    p.add_argument("--retries", type=int_type(0), default=3, metavar="N",
                   help="restarts of a task after a retryable exit (128-255) before the run fails (default 3)")
    p.add_argument("--cluster_domain", default="cluster.local",
                   help="the cluster's DNS domain, in the pods' names (plain, jobset; default cluster.local)")
    monitoring_flags(p)
    p.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    add_train_flags(p)
    context_flag(p)
    p.epilog = COMMAND_EPILOG


def monitoring_flags(p: argparse.ArgumentParser) -> None:
    """Stops, metrics and queueing of `k8s manifest`."""
    from psworker.k8s.options import DEFAULT_METRICS_PORT
    p.add_argument("--grace_secs", type=int_type(0), default=None, metavar="SECS",
                   help="every pod's terminationGracePeriodSeconds: from SIGTERM (a deletion, preemption or "
                        "eviction) to SIGKILL, time for the chief to finish its step and write a checkpoint "
                        "(default: as long as a stopping ps serves its chief, step_timeout_secs + 70; 370 with "
                        "the default step timeout)")
    p.add_argument("--metrics_port", type=port_type(free_ok=True), default=DEFAULT_METRICS_PORT, metavar="PORT",
                   help="each task serves Prometheus /metrics on this port, named `metrics` in every pod "
                        f"(default {DEFAULT_METRICS_PORT}; 0: none)")
    p.add_argument("--metrics", action="store_true",
                   help="also add the prometheus.io/scrape|port|path pod annotations and a PodMonitor "
                        "(monitoring.coreos.com/v1, the Prometheus operator's)")
    p.add_argument("--queue", metavar="NAME",
                   help="a Kueue LocalQueue: the workload is labelled kueue.x-k8s.io/queue-name=NAME and created "
                        "suspended, and Kueue starts it when admitted (without Kueue it stays suspended)")


def apply_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE")
    context_flag(p)


def run_flags(p: argparse.ArgumentParser) -> None:
    """`status`, `logs` and `delete`: a run by its name."""
    p.add_argument("name", metavar="NAME", help="the run's name")
    p.add_argument("--namespace", default="default")
    context_flag(p)


def logs_flags(p: argparse.ArgumentParser) -> None:
    run_flags(p)
    p.add_argument("--job", choices=JOBS)
    p.add_argument("--task_index", type=int_type(0), metavar="INT")
    p.add_argument("--tail", type=int_type(1), metavar="LINES", help="only each pod's last LINES lines")


def context_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--context", help="kubeconfig context (default: the current one)")


__all__ = ["apply_flags", "check_quantity", "cmd_k8s_apply", "cmd_k8s_delete", "cmd_k8s_logs", "cmd_k8s_manifest",
           "cmd_k8s_status", "logs_flags", "manifest_flags", "monitoring_flags", "run_flags"]
