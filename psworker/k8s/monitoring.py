"""Prometheus for a Kubernetes run: each task's metrics port (named `metrics`), the `prometheus.io/*` scrape
annotations, a PodMonitor (prometheus-operator's monitoring.coreos.com/v1) and the NetworkPolicy rule that lets a
scraper read the port. Each task serves its own /metrics (`psworker ps|worker --metrics_port P`)."""

from __future__ import annotations

from typing import Any

from psworker.k8s.options import LABEL_JOB, LABEL_RUN, METRICS_PATH, K8sOptions, metadata

Obj = dict[str, Any]

PORT_NAME = "metrics"
PORT_ENV = "PSWORKER_METRICS_PORT"   # a user's command: where its pod's scrapers look


def container_ports(options: K8sOptions) -> list[Obj]:
    """The metrics port of every task's container: none with `--metrics_port 0`."""
    if options.metrics_port is None:
        return []
    return [{"name": PORT_NAME, "containerPort": options.metrics_port, "protocol": "TCP"}]


def task_flags(options: K8sOptions) -> list[str]:
    """The flags that make a psworker task serve /metrics on the pod's metrics port."""
    return [] if options.metrics_port is None else ["--metrics_port", str(options.metrics_port)]


def command_env(options: K8sOptions) -> list[Obj]:
    """A user's command is told the metrics port it may serve (the port is named and open either way)."""
    return [] if options.metrics_port is None else [{"name": PORT_ENV, "value": str(options.metrics_port)}]


def pod_annotations(options: K8sOptions) -> dict[str, str]:
    """With `--metrics`: the `prometheus.io/*` annotations that annotation-based scrape configs read."""
    if not options.metrics:
        return {}
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(options.metrics_port),
            "prometheus.io/path": METRICS_PATH}


def pod_monitor(options: K8sOptions, index_label: str) -> Obj:
    """A PodMonitor scraping every pod of the run on its `metrics` port.

    Each series gets the pod's run, job and index labels as target labels; `honorLabels` keeps the tasks' own
    `job` and `task` labels (which docs/alerts.yml's rules use) instead of renaming them `exported_*`.
    """
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
            "metadata": metadata(options.name, options),
            "spec": {"selector": {"matchLabels": {LABEL_RUN: options.name}},
                     "podTargetLabels": [LABEL_RUN, LABEL_JOB, index_label],
                     "podMetricsEndpoints": [{"port": PORT_NAME, "path": METRICS_PATH, "honorLabels": True}]}}


def ingress_rules(options: K8sOptions) -> list[Obj]:
    """The NetworkPolicy rule for the metrics port: from anywhere. /metrics is read-only (no control, no model
    values beyond the loss), unlike TensorFlow's unauthenticated gRPC port, which stays closed to other pods; a
    scraper usually runs in another namespace."""
    if options.metrics_port is None:
        return []
    return [{"ports": [{"protocol": "TCP", "port": options.metrics_port}]}]


__all__ = ["PORT_ENV", "PORT_NAME", "command_env", "container_ports", "ingress_rules", "pod_annotations",
           "pod_monitor", "task_flags"]
