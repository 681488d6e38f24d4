"""Kubernetes manifests for a psworker run: pure functions from a spec to a list of objects (dicts).

Three flavors, one registry (`FLAVORS`): `tfjob` (Kubeflow's v1 training operator injects TF_CONFIG), `plain`
(a headless Service and an Indexed Job per psworker job; nothing to install) and `jobset` (JobSet). In the last
two, TF_CONFIG names each task by its pod's stable DNS name. A user's command (`psworker k8s manifest SPEC ...
-- COMMAND`) runs in every pod instead of psworker's tasks, with TF_CONFIG, PSWORKER_JOB_NAME, PSWORKER_TASK_INDEX
(from the pod's index: the Indexed Job's annotation, TFJob's replica-index label), PSWORKER_PS_HOSTS and
PSWORKER_WORKER_HOSTS, and its placeholders replaced per replica (`{task_index}` as `$(PSWORKER_TASK_INDEX)`,
expanded by Kubernetes). Every flavor
adds a NetworkPolicy that admits the gRPC port only from the run's own pods, and labels every object and pod
with `psworker.dev/run` (and pods with `psworker.dev/job`); the controllers label each pod's task index
(`batch.kubernetes.io/job-completion-index`, `training.kubeflow.org/replica-index`).

Restart semantics follow psworker/errors.py: exit codes 1-127 are permanent (fail the run), 128-255 (signals,
170 for a peer gone) are retried, each task keeping its index and so its DNS name. Every pod has
`terminationGracePeriodSeconds` (the chief writes a checkpoint on SIGTERM) and a port named `metrics` where its
task serves Prometheus /metrics (`monitoring`); `--queue` hands the workload to Kueue, created suspended.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any, Optional, Sequence, Union

import yaml

from psworker.errors import EXIT_PEER_GONE, UsageError
from psworker.spec.interop import command_env, command_values, fill_command
from psworker.k8s import monitoring
from psworker.k8s import options as k8s_options
from psworker.k8s.options import LABEL_JOB, LABEL_QUEUE, LABEL_RUN, K8sOptions, grace_secs_for, run_name
from psworker.spec.plan import task_counts
from psworker.spec import DEFAULT_PORT_BASE, ClusterSpec, CountSpec, TrainConfig, build_cluster
from psworker.spec.train_config import setting_argv

Spec = Union[ClusterSpec, CountSpec]
Obj = dict[str, Any]

CONTAINER = "tensorflow"          # TFJob requires this name; the other flavors use it too
PORT_NAME = "tfjob-port"          # TFJob reads the port of this name into TF_CONFIG
INDEX_ENV = "PSWORKER_TASK_INDEX"
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
TFJOB_INDEX_LABEL = "training.kubeflow.org/replica-index"   # the training operator labels each pod with it
DEFAULT_TRAIN_DIR = "/psworker/train"
RUN_AS = 1000                     # the Dockerfile's unprivileged user
PERMANENT_EXIT_CODES = list(range(1, 128))   # errors.py: 1-127 permanent; 128-255 (incl. 170) retried
assert EXIT_PEER_GONE not in PERMANENT_EXIT_CODES

# psworker job -> TFJob replica type. `chief` and `evaluator` slot in once specs have those jobs.
REPLICA_TYPES = {"chief": "Chief", "ps": "PS", "worker": "Worker", "evaluator": "Evaluator"}
# the jobs whose success ends the run (TFJob successPolicy AllWorkers, JobSet successPolicy targets)
FINISHING_JOBS = ("chief", "worker")


def check_options(options: K8sOptions) -> None:
    """`options.check_options` against this module's flavors (UsageError naming the flag)."""
    k8s_options.check_options(options, tuple(FLAVORS))


# ----------------------------------------------------------------------------------------- pod pieces

def task_argv(job: str, train: TrainConfig) -> list[str]:
    """The container's argv for a task of `job`: `psworker ps` or `psworker worker --flag value ...`.

    The cluster and the task index come from TF_CONFIG; every set train setting travels as a flag, so the pod
    needs no spec file.
    """
    if job == "ps":
        return ["psworker", "ps"]
    if job == "worker":
        flags = []
        for f in dataclasses.fields(TrainConfig):
            value = getattr(train, f.name)
            if value is not None:
                flags += setting_argv(f.name, value)
        return ["psworker", "worker", *flags]
    raise UsageError(f"psworker has no Kubernetes command for a {job!r} job yet")


def command_argv(command: Sequence[str], job: str, cluster: ClusterSpec) -> list[str]:
    """A user's command for the pods of `job`: `{job_name}`, `{ps_hosts}` and `{worker_hosts}` replaced, and
    `{task_index}` by `$(PSWORKER_TASK_INDEX)`, which Kubernetes expands in each pod from its own index."""
    return fill_command(command, command_values(cluster, job, f"$({INDEX_ENV})"))


def _command_env(job: str, cluster: ClusterSpec) -> list[Obj]:
    """The PSWORKER_* variables of a user's command (PSWORKER_TASK_INDEX comes with each flavor's index)."""
    env = command_env(command_values(cluster, job, ""))
    return [{"name": name, "value": value} for name, value in env.items() if name != INDEX_ENV]


def _template_metadata(options: K8sOptions, job: str) -> Obj:
    """A pod template's metadata: the run's labels, and with `--metrics` the scrape annotations."""
    annotations = monitoring.pod_annotations(options)
    return {"labels": k8s_options.labels(options, job), **({"annotations": annotations} if annotations else {})}


def _port(spec: Spec, options: K8sOptions) -> int:
    if options.port is not None:
        return options.port
    return spec.port if isinstance(spec, CountSpec) else DEFAULT_PORT_BASE


def _train(spec: Spec) -> TrainConfig:
    train = spec.train
    return train if train.train_dir else dataclasses.replace(train, train_dir=DEFAULT_TRAIN_DIR)


def _tf_config_env(cluster: ClusterSpec, job: str) -> list[Obj]:
    """TF_CONFIG with this pod's Indexed-Job completion index, expanded by Kubernetes (`$(VAR)`)."""
    config = {"cluster": cluster.as_dict(), "task": {"type": job, "index": "INDEX"}}
    text = json.dumps(config, separators=(",", ":")).replace('"INDEX"', f"$({INDEX_ENV})")
    return [{"name": INDEX_ENV, "valueFrom": {"fieldRef": {
                "fieldPath": f"metadata.annotations['{INDEX_ANNOTATION}']"}}},
            {"name": "TF_CONFIG", "value": text}]


def _pod_spec(spec: Spec, job: str, options: K8sOptions, env: list[Obj], restart_policy: Optional[str],
              subdomain: Optional[str] = None, cluster: Optional[ClusterSpec] = None) -> Obj:
    train = _train(spec)
    if options.command:
        argv = command_argv(options.command, job, cluster)
        env = [*env, *_command_env(job, cluster), *monitoring.command_env(options)]
    else:
        argv = [*task_argv(job, train), *monitoring.task_flags(options)]
    container: Obj = {
        "name": CONTAINER, "image": options.image, "command": argv[:1], "args": argv[1:],
        "env": [*env, {"name": "PYTHONUNBUFFERED", "value": "1"}],
        "ports": [{"name": PORT_NAME, "containerPort": _port(spec, options), "protocol": "TCP"},
                  *monitoring.container_ports(options)],
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    if options.cpu or options.memory:
        requests = {k: v for k, v in (("cpu", options.cpu), ("memory", options.memory)) if v}
        container["resources"] = {"requests": requests, **({"limits": {"memory": options.memory}}
                                                           if options.memory else {})}
    pod: Obj = {"automountServiceAccountToken": False,   # tasks never talk to the API server
                # the Dockerfile's user; fsGroup makes a train_dir volume writable for it (restricted PSS)
                "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS,
                                    "fsGroup": RUN_AS, "seccompProfile": {"type": "RuntimeDefault"}},
                # SIGTERM to SIGKILL: the chief's checkpoint on a stop, and the ps tasks serving it meanwhile
                "terminationGracePeriodSeconds": grace_secs_for(options, train.step_timeout_secs)}
    if restart_policy:
        pod["restartPolicy"] = restart_policy
    if subdomain:
        pod["subdomain"] = subdomain
    if job != "ps":
        volume: Obj = ({"persistentVolumeClaim": {"claimName": options.train_dir_volume}}
                       if options.train_dir_volume else {"emptyDir": {}})
        container["volumeMounts"] = [{"name": "train-dir", "mountPath": train.train_dir}]
        pod["volumes"] = [{"name": "train-dir", **volume}]
    pod["containers"] = [container]
    return pod


def _pod_failure_policy() -> Obj:
    """Exit codes 1-127 fail the Job at once; evictions and preemptions do not count; the rest retry."""
    return {"rules": [
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        {"action": "FailJob", "onExitCodes": {"containerName": CONTAINER, "operator": "In",
                                               "values": PERMANENT_EXIT_CODES}},
    ]}


def _indexed_job_spec(spec: Spec, job: str, n: int, options: K8sOptions, cluster: ClusterSpec,
                      subdomain: Optional[str]) -> Obj:
    return {
        "completionMode": "Indexed", "completions": n, "parallelism": n,
        "backoffLimitPerIndex": options.retries, "podFailurePolicy": _pod_failure_policy(),
        "template": {"metadata": _template_metadata(options, job),
                     "spec": _pod_spec(spec, job, options, _tf_config_env(cluster, job), "Never", subdomain,
                                       cluster=cluster)},
    }


def _fqdn(hostname: str, subdomain: str, options: K8sOptions) -> str:
    """A pod's full DNS name. Fully qualified because kubelet writes exactly this name into the pod's /etc/hosts,
    so a task resolves its own address (psworker's bind check) before cluster DNS has caught up."""
    return f"{hostname}.{subdomain}.{options.namespace}.svc.{options.cluster_domain}"


def _cluster(spec: Spec, host: Callable[[str, int], str], port: int) -> ClusterSpec:
    """The run's cluster with each task at its stable pod DNS name `host(job, index)`."""
    addresses = {job: [f"{host(job, i)}:{port}" for i in range(n)] for job, n in task_counts(spec).items()}
    return build_cluster(addresses["ps"], addresses["worker"], "kubernetes", train=spec.train,
                         chief=addresses.get("chief"), evaluator=addresses.get("evaluator"))


def network_policy(spec: Spec, options: K8sOptions) -> Obj:
    """Admits the gRPC port only from this run's pods (TensorFlow's servers are unauthenticated), and the
    read-only metrics port from anywhere (`monitoring.ingress_rules`)."""
    own = {"matchLabels": {LABEL_RUN: options.name}}
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": k8s_options.metadata(f"{options.name}-grpc", options),
            "spec": {"podSelector": own, "policyTypes": ["Ingress"],
                     "ingress": [{"from": [{"podSelector": own}],
                                  "ports": [{"protocol": "TCP", "port": _port(spec, options)}]},
                                 *monitoring.ingress_rules(options)]}}


# -------------------------------------------------------------------------------------------- flavors

def tfjob_objects(spec: Spec, options: K8sOptions) -> list[Obj]:
    """A Kubeflow TFJob (kubeflow.org/v1): one replica spec per job, `restartPolicy: ExitCode`."""
    replicas = {}
    # the operator's service names, as in the TF_CONFIG it writes: <name>-<replica type>-<index>.<namespace>.svc
    name, namespace = options.name, options.namespace
    cluster = _cluster(spec, lambda job, i: f"{name}-{REPLICA_TYPES[job].lower()}-{i}.{namespace}.svc",
                       _port(spec, options))
    for job, n in task_counts(spec).items():
        index = [{"name": INDEX_ENV,
                  "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{TFJOB_INDEX_LABEL}']"}}}]
        template = {"metadata": _template_metadata(options, job),
                    "spec": _pod_spec(spec, job, options, index if options.command else [], None, cluster=cluster)}
        replicas[REPLICA_TYPES[job]] = {"replicas": n, "restartPolicy": "ExitCode", "template": template}
    run_policy = {"cleanPodPolicy": "Running", "backoffLimit": options.retries, **_suspend(options)}
    tfjob = {"apiVersion": "kubeflow.org/v1", "kind": "TFJob",
             "metadata": k8s_options.metadata(options.name, options, workload=True),
             "spec": {"runPolicy": run_policy,
                      # psworker's workers all finish; a user's program: TFJob's default, the chief or worker 0
                      **({} if options.command else {"successPolicy": "AllWorkers"}), "tfReplicaSpecs": replicas}}
    return [tfjob, network_policy(spec, options)]


def plain_objects(spec: Spec, options: K8sOptions) -> list[Obj]:
    """A headless Service (stable pod DNS names) and one Indexed Job per psworker job."""
    name, port = options.name, _port(spec, options)
    cluster = _cluster(spec, lambda job, i: _fqdn(f"{name}-{job}-{i}", name, options), port)
    service = {"apiVersion": "v1", "kind": "Service", "metadata": k8s_options.metadata(name, options),
               "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                        "selector": {LABEL_RUN: name},
                        "ports": [{"name": "grpc", "port": port, "targetPort": port, "protocol": "TCP"}]}}
    jobs = [{"apiVersion": "batch/v1", "kind": "Job",
             "metadata": k8s_options.metadata(f"{name}-{job}", options, job, workload=True),
             "spec": {**_suspend(options), **_indexed_job_spec(spec, job, n, options, cluster, subdomain=name)}}
            for job, n in task_counts(spec).items()]
    return [service, *jobs, network_policy(spec, options)]


def jobset_objects(spec: Spec, options: K8sOptions) -> list[Obj]:
    """A JobSet (jobset.x-k8s.io/v1alpha2): one replicatedJob per psworker job, done when the workers are."""
    name = options.name
    cluster = _cluster(spec, lambda job, i: _fqdn(f"{name}-{job}-0-{i}", name, options), _port(spec, options))
    counts = task_counts(spec)
    replicated = [{"name": job, "replicas": 1,
                   "template": {"metadata": {"labels": k8s_options.labels(options, job)},
                                "spec": _indexed_job_spec(spec, job, n, options, cluster, subdomain=None)}}
                  for job, n in counts.items()]
    jobset = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
              "metadata": k8s_options.metadata(name, options, workload=True),
              "spec": {**_suspend(options),
                       "network": {"enableDNSHostnames": True, "subdomain": name, "publishNotReadyAddresses": True},
                       "successPolicy": {"operator": "All", "targetReplicatedJobs": _finishing(counts, options)},
                       "failurePolicy": {"maxRestarts": options.retries, "rules": [
                           {"name": "PermanentExitCode", "action": "FailJobSet",
                            "onJobFailureReasons": ["PodFailurePolicy"]}]},
                       "replicatedJobs": replicated}}
    return [jobset, network_policy(spec, options)]


def _suspend(options: K8sOptions) -> Obj:
    """`--queue`: created suspended, so that Kueue admits it (unsuspends it) when its queue has room."""
    return {"suspend": True} if options.queue else {}


def _finishing(counts: dict[str, int], options: K8sOptions) -> list[str]:
    """The replicated jobs whose completion ends a JobSet: psworker's chief and workers; for a user's program the
    chief job, else the workers (JobSet cannot single out worker 0, TFJob's rule without a chief)."""
    if options.command and "chief" in counts:
        return ["chief"]
    return [j for j in FINISHING_JOBS if j in counts]


FLAVORS: dict[str, Callable[[Spec, K8sOptions], list[Obj]]] = {
    "tfjob": tfjob_objects, "plain": plain_objects, "jobset": jobset_objects}


def manifests(spec: Spec, options: K8sOptions) -> list[Obj]:
    """The objects that run `spec` on Kubernetes in the chosen flavor.

    Args:
        spec: an address-list spec (only its task counts matter) or a count spec; its train section (with any
            command-line overrides already merged) becomes the workers' flags.
        options: names, image, flavor, resources, volume, retry limits, grace period, metrics and queue.

    Returns:
        Kubernetes objects as plain dicts, in the order to create them (with `options.metrics`, a PodMonitor last).

    Raises:
        UsageError: bad options, or a job psworker cannot run on Kubernetes yet.
    """
    check_options(options)
    if spec.elastic is not None:
        raise UsageError(
            f"{spec.source or 'the spec'}: cluster.worker: an elastic worker job ({spec.elastic.describe()}) is not "
            "supported on Kubernetes yet: the manifests run a fixed set of worker pods, and none of the flavors can "
            "start a reserved worker later or tell a pod it is scaled away rather than failed. Give a fixed "
            "`worker: N`, or run the elastic job with `psworker local`, `ssh` or `slurm`")
    if options.metrics_port is not None and options.metrics_port == _port(spec, options):
        raise UsageError(f"--metrics_port {options.metrics_port} is the tasks' gRPC port; give another")
    objects = FLAVORS[options.flavor](spec, options)
    if options.metrics:
        # the controllers' index label on each pod (Indexed Jobs label it as they annotate it)
        index_label = TFJOB_INDEX_LABEL if options.flavor == "tfjob" else INDEX_ANNOTATION
        objects.append(monitoring.pod_monitor(options, index_label))
    return objects


class _Dumper(yaml.SafeDumper):
    """Writes lists of numbers (exit codes) on one line and everything else in block style."""


_Dumper.add_representer(list, lambda d, data: d.represent_sequence(
    "tag:yaml.org,2002:seq", data, flow_style=bool(data) and all(isinstance(x, int) for x in data)))


def to_yaml(objects: list[Obj]) -> str:
    """A multi-document YAML stream, keys in insertion order."""
    return yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)


__all__ = ["FLAVORS", "K8sOptions", "command_argv", "manifests", "to_yaml", "run_name", "task_argv", "check_options",
           "network_policy", "LABEL_RUN", "LABEL_JOB", "LABEL_QUEUE"]
