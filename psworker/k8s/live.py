"""Live cluster commands: apply, status, logs and delete a run, through the official `kubernetes` client.

The client is the optional extra `k8s` (`pip install 'psworker[k8s]'`), imported only here and only when a
command runs. Objects are found by the `psworker.dev/run` label that `manifests` puts on each of them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional

from psworker.errors import ClusterError, UsageError
from psworker.k8s.manifests import LABEL_JOB, LABEL_RUN

log = logging.getLogger(__name__)

EXTRA = "pip install 'psworker[k8s]'"
# every kind a flavor writes, in creation order; delete walks it backwards
KINDS = (("networking.k8s.io/v1", "NetworkPolicy"), ("v1", "Service"), ("batch/v1", "Job"),
         ("kubeflow.org/v1", "TFJob"), ("jobset.x-k8s.io/v1alpha2", "JobSet"),
         ("monitoring.coreos.com/v1", "PodMonitor"))
INDEX_LABELS = ("batch.kubernetes.io/job-completion-index", "training.kubeflow.org/replica-index")


@dataclass(frozen=True)
class PodStatus:
    """One task's pod: which task, its phase, restarts and last exit code."""

    pod: str
    job: str
    index: str
    phase: str
    restarts: int
    exit_code: Optional[int]
    reason: str


def _client_module() -> Any:
    try:
        import kubernetes
    except ImportError:
        raise UsageError(f"the k8s apply/status/logs/delete commands need the Kubernetes client: {EXTRA}") from None
    return kubernetes


def connect(context: Optional[str] = None) -> Any:
    """A DynamicClient for the current kubeconfig context (or the in-cluster service account).

    Raises:
        UsageError: the `kubernetes` package is missing, or no cluster is configured.
    """
    kubernetes = _client_module()
    from kubernetes.config.config_exception import ConfigException
    from kubernetes.dynamic import DynamicClient
    try:
        kubernetes.config.load_kube_config(context=context)
    except (ConfigException, FileNotFoundError, TypeError) as e:
        try:
            kubernetes.config.load_incluster_config()
        except ConfigException:
            raise UsageError(f"no Kubernetes cluster configured (KUBECONFIG, ~/.kube/config or in-cluster): {e}") \
                from None
    with _api_errors("discovering the cluster's API"):   # DynamicClient asks the server what it serves
        return DynamicClient(kubernetes.client.ApiClient())


@contextlib.contextmanager
def _api_errors(what: str) -> Iterator[None]:
    """Turns the client's API and connection errors into a ClusterError naming `what`."""
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError
    try:
        yield
    except ApiException as e:
        raise ClusterError(f"{what}: {e.status} {e.reason}: {e.body}") from None
    except (HTTPError, OSError) as e:   # connection refused, timeouts, TLS
        raise ClusterError(f"{what}: cannot reach the Kubernetes API server: {e}") from None


def _resource(client: Any, api_version: str, kind: str) -> Any:
    from kubernetes.dynamic.exceptions import ResourceNotFoundError
    try:
        return client.resources.get(api_version=api_version, kind=kind)
    except ResourceNotFoundError:
        return None


def apply(client: Any, objects: list[dict]) -> list[str]:
    """Creates or updates each object by server-side apply (field manager `psworker`).

    Returns:
        `Kind/name` of each object applied.

    Raises:
        ClusterError: a kind the cluster does not serve (e.g. TFJob without the training operator), or a refusal.
    """
    done = []
    for obj in objects:
        api_version, kind, meta = obj["apiVersion"], obj["kind"], obj["metadata"]
        with _api_errors(f"{kind}/{meta['name']}"):
            resource = _resource(client, api_version, kind)
            if resource is None:
                raise ClusterError(f"this cluster does not serve {kind} ({api_version}); install its operator or "
                                   f"write the manifests with another --flavor")
            client.server_side_apply(resource, body=obj, namespace=meta.get("namespace"), field_manager="psworker",
                                     force_conflicts=True)
        done.append(f"{kind}/{meta['name']}")
    return done


def status(client: Any, name: str, namespace: str) -> list[PodStatus]:
    """The run's pods (by label), sorted by job and index."""
    with _api_errors(f"pods of run {name}"):
        found = client.resources.get(api_version="v1", kind="Pod").get(
            namespace=namespace, label_selector=f"{LABEL_RUN}={name}").items
    rows = []
    for pod in found:
        labels = dict(pod.metadata.labels or {})
        index = next((labels[k] for k in INDEX_LABELS if k in labels), "?")
        statuses = (pod.status.containerStatuses or []) if pod.status else []
        restarts = sum(s.restartCount or 0 for s in statuses)
        exit_code, reason = None, ""
        for s in statuses:
            term = (s.state and s.state.terminated) or (s.lastState and s.lastState.terminated)
            if term:
                exit_code, reason = term.exitCode, term.reason or ""
        rows.append(PodStatus(pod.metadata.name, labels.get(LABEL_JOB, "?"), index, pod.status.phase or "?",
                              restarts, exit_code, reason))
    return sorted(rows, key=lambda r: (r.job, int(r.index) if r.index.isdigit() else -1, r.pod))


def format_status(rows: list[PodStatus]) -> str:
    """A table for people: TASK POD PHASE RESTARTS EXIT."""
    table = [("TASK", "POD", "PHASE", "RESTARTS", "EXIT")]
    table += [(f"{r.job}:{r.index}", r.pod, r.phase, str(r.restarts),
               "" if r.exit_code is None else f"{r.exit_code} {r.reason}".strip()) for r in rows]
    widths = [max(len(row[c]) for row in table) for c in range(5)]
    return "\n".join("  ".join(row[c].ljust(widths[c]) for c in range(5)).rstrip() for row in table)


def logs(client: Any, name: str, namespace: str, job: Optional[str] = None, index: Optional[int] = None,
         tail_lines: Optional[int] = None) -> Iterator[tuple[str, str]]:
    """Yields `(task name, log text)` for each of the run's pods, or only those of `job` / `index`."""
    from kubernetes import client as k8s_client
    core = k8s_client.CoreV1Api(client.client)
    for row in status(client, name, namespace):
        if (job is None or row.job == job) and (index is None or row.index == str(index)):
            kwargs = {"tail_lines": tail_lines} if tail_lines else {}
            with _api_errors(f"log of pod {row.pod}"):
                text = core.read_namespaced_pod_log(row.pod, namespace, **kwargs)
            yield f"{row.job}:{row.index}", text


def delete(client: Any, name: str, namespace: str) -> list[str]:
    """Deletes every object of the run (by label) and, through propagation, its pods.

    Returns:
        `Kind/name` of each object deleted.
    """
    gone = []
    for api_version, kind in reversed(KINDS):
        with _api_errors(f"deleting {kind} objects of run {name}"):
            resource = _resource(client, api_version, kind)
            if resource is None:   # e.g. no JobSet CRD here: the run cannot have one
                continue
            for obj in client.get(resource, namespace=namespace, label_selector=f"{LABEL_RUN}={name}").items:
                client.delete(resource, name=obj.metadata.name, namespace=namespace, propagation_policy="Background")
                gone.append(f"{kind}/{obj.metadata.name}")
    return gone


__all__ = ["connect", "apply", "status", "format_status", "logs", "delete", "PodStatus", "ClusterError", "KINDS"]
