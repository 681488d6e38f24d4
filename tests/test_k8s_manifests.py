"""Kubernetes manifests: validated offline against real schemas, checked for behaviour, and golden files.

- Core objects (Service, Job, NetworkPolicy, and the pod and Job templates inside TFJob and JobSet) against the
  Kubernetes OpenAPI schemas of `KUBERNETES_VERSION`, strictly (unknown fields rejected), with kubernetes-validate.
- TFJob, JobSet and PodMonitor against their CRDs' own schemas (tests/k8s_crds/), with jsonschema; unknown fields
  are rejected as the API server's strict field validation (kubectl's default) does.
- Golden files for two specs in each flavor: regenerate with `PSWORKER_UPDATE_GOLDEN=1 python -m pytest
  tests/test_k8s_manifests.py`, then review the diff.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import jsonschema
import kubernetes_validate
import pytest
import yaml

from psworker.cli import build_parser, main
from psworker.errors import EXIT_PEER_GONE, UsageError
from psworker.spec.interop import resolve_cluster
from psworker.k8s.manifests import (FLAVORS, LABEL_JOB, LABEL_QUEUE, LABEL_RUN, K8sOptions, manifests, run_name,
                                    to_yaml)
from psworker.k8s.options import DEFAULT_METRICS_PORT
from psworker.spec import load_spec
from tests import docs_pages

ROOT = pathlib.Path(__file__).resolve().parents[1]
CRDS = ROOT / "tests" / "k8s_crds"
GOLDEN = ROOT / "tests" / "k8s_golden"
KUBERNETES_VERSION = "1.33.0"   # backoffLimitPerIndex is GA from 1.33; podFailurePolicy from 1.31
CORE_KINDS = {"Service", "Job", "NetworkPolicy"}
CRD_FILES = {"TFJob": "kubeflow.org_tfjobs.yaml", "JobSet": "jobset.x-k8s.io_jobsets.yaml",
             "PodMonitor": "monitoring.coreos.com_podmonitors.yaml"}

TWO_PS = load_spec(ROOT / "cluster_specs" / "two-ps.yaml")
SCHEDULED = load_spec(ROOT / "cluster_specs" / "scheduled.yaml", allow_counts=True)
# golden cases: (file stem, spec, options minus flavor). two-ps: the defaults; scheduled: every option, with
# Prometheus (--metrics) and a Kueue queue
CASES = {
    "two-ps": (TWO_PS, dict(name="two-ps", image="registry.example/psworker:0.1.0")),
    "scheduled": (SCHEDULED, dict(name="scheduled", image="registry.example/psworker:0.1.0", namespace="ml",
                                  cpu="2", memory="4Gi", train_dir_volume="psworker-train", retries=5,
                                  grace_secs=300, metrics_port=9500, metrics=True, queue="ml-batch")),
}


def objects(stem: str, flavor: str) -> list[dict]:
    spec, options = CASES[stem]
    return manifests(spec, K8sOptions(flavor=flavor, **options))


def all_objects():
    return [(stem, flavor) for stem in CASES for flavor in FLAVORS]


# ------------------------------------------------------------------------------------------ validators

def _structural(schema):
    """A CRD's openAPIV3Schema as JSON Schema: `x-kubernetes-*` dropped, unknown fields rejected."""
    if isinstance(schema, list):
        return [_structural(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _structural(v) for k, v in schema.items() if not k.startswith("x-kubernetes-")}
    if ("properties" in schema and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@functools.lru_cache(maxsize=None)
def crd_validator(kind: str, version: str) -> jsonschema.Draft4Validator:
    return jsonschema.Draft4Validator(crd_schema(kind, version))


def crd_schema(kind: str, version: str) -> dict:
    crd = yaml.safe_load((CRDS / CRD_FILES[kind]).read_text())
    assert crd["spec"]["names"]["kind"] == kind
    (found,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return _structural(found["schema"]["openAPIV3Schema"])


def validate(obj: dict) -> None:
    """Raises a ValidationError (of either library) when `obj` breaks its schema."""
    kind = obj["kind"]
    if kind in CORE_KINDS:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        return
    group_version = obj["apiVersion"].split("/")[1]
    crd_validator(kind, group_version).validate(obj)
    if kind == "PodMonitor":
        return
    # the embedded templates, against the core schemas too
    meta = {"name": obj["metadata"]["name"]}
    if kind == "TFJob":
        for replica in obj["spec"]["tfReplicaSpecs"].values():
            kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": meta,
                                          "template": replica["template"]}, KUBERNETES_VERSION, strict=True)
    else:
        for rjob in obj["spec"]["replicatedJobs"]:
            kubernetes_validate.validate({"apiVersion": "batch/v1", "kind": "Job", "metadata": meta,
                                          "spec": rjob["template"]["spec"]}, KUBERNETES_VERSION, strict=True)


INVALID = (kubernetes_validate.ValidationError, jsonschema.ValidationError)


@pytest.mark.parametrize("stem, flavor", all_objects())
def test_every_object_validates_against_its_schema(stem, flavor):
    objs = objects(stem, flavor)
    monitor = {"PodMonitor"} if CASES[stem][1].get("metrics") else set()
    assert {o["kind"] for o in objs} == monitor | {"tfjob": {"TFJob", "NetworkPolicy"},
                                                   "jobset": {"JobSet", "NetworkPolicy"},
                                                   "plain": {"Service", "Job", "NetworkPolicy"}}[flavor]
    for obj in objs:
        validate(obj)


def _tfjob_replicas(objs):
    objs[0]["spec"]["tfReplicaSpecs"]["Worker"]["replicas"] = "three"


def _tfjob_unknown_field(objs):
    objs[0]["spec"]["runPolicy"]["cleanPodPolicyy"] = "Running"


def _jobset_operator(objs):
    objs[0]["spec"]["successPolicy"]["operator"] = "Most"


def _jobset_pod_port(objs):
    objs[0]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["ports"][0][
        "containerPort"] = "grpc"


def _job_completions(objs):
    objs[1]["spec"]["completions"] = "3"


def _job_policy_action(objs):
    objs[1]["spec"]["podFailurePolicy"]["rules"][0]["actions"] = "Ignore"


def _service_cluster_ip(objs):
    objs[0]["spec"]["clusterIP"] = None
    objs[0]["spec"]["ports"][0]["port"] = "2222x"


def _network_policy(objs):
    objs[-1]["spec"]["ingress"][0]["from"] = {"podSelector": {}}


@pytest.mark.parametrize("flavor, breaker", [
    ("tfjob", _tfjob_replicas), ("tfjob", _tfjob_unknown_field), ("jobset", _jobset_operator),
    ("jobset", _jobset_pod_port), ("plain", _job_completions), ("plain", _job_policy_action),
    ("plain", _service_cluster_ip), ("plain", _network_policy),
])
def test_a_broken_manifest_is_rejected(flavor, breaker):
    objs = copy.deepcopy(objects("two-ps", flavor))
    breaker(objs)
    with pytest.raises(INVALID):
        for obj in objs:
            validate(obj)


def _monitor_interval(objs):
    objs[-1]["spec"]["podMetricsEndpoints"][0]["interval"] = "15 seconds"


def _monitor_unknown_field(objs):
    objs[-1]["spec"]["podMetricsEndpoints"][0]["portName"] = "metrics"


def _job_suspend(objs):
    objs[1]["spec"]["suspend"] = "yes"


def _jobset_suspend(objs):
    objs[0]["spec"]["suspend"] = "true"


def _tfjob_suspend(objs):
    objs[0]["spec"]["runPolicy"]["suspend"] = 1


def _pod_grace(objs):
    objs[1]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "60s"


def _pod_annotation(objs):
    objs[1]["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] = 9500


@pytest.mark.parametrize("flavor, breaker", [
    ("plain", _monitor_interval), ("jobset", _monitor_unknown_field), ("plain", _job_suspend),
    ("jobset", _jobset_suspend), ("tfjob", _tfjob_suspend), ("plain", _pod_grace), ("plain", _pod_annotation),
])
def test_a_broken_monitor_queue_or_stop_setting_is_rejected(flavor, breaker):
    objs = copy.deepcopy(objects("scheduled", flavor))
    for obj in objs:
        validate(obj)
    breaker(objs)
    with pytest.raises(INVALID):
        for obj in objs:
            validate(obj)


# ------------------------------------------------------------------------------------------ behaviour

def _pod_templates(obj):
    """(psworker job, Job-or-None, pod template) for each job in a flavor's main object."""
    if obj["kind"] == "Job":
        yield obj["metadata"]["labels"][LABEL_JOB], obj, obj["spec"]["template"]
    elif obj["kind"] == "JobSet":
        for rjob in obj["spec"]["replicatedJobs"]:
            yield rjob["name"], rjob["template"], rjob["template"]["spec"]["template"]
    elif obj["kind"] == "TFJob":
        for rtype, replica in obj["spec"]["tfReplicaSpecs"].items():
            yield rtype.lower(), None, replica["template"]


def _expand(value: str, env: dict) -> str:
    """Kubernetes' `$(VAR)` expansion of env values and args."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), value)


def _pod_dns(flavor, obj, job, i, pod_spec, ns):
    """The FQDN kubelet writes into the pod's /etc/hosts: <hostname>.<subdomain>.<ns>.svc.cluster.local."""
    if flavor == "plain":   # Indexed Job pods are named <job-name>-<index>; the Service is their subdomain
        return f"{obj['metadata']['name']}-{i}.{pod_spec['subdomain']}.{ns}.svc.cluster.local"
    # JobSet: <jobset>-<replicatedJob>-<jobIndex>-<podIndex>.<subdomain>
    return f"{obj['metadata']['name']}-{job}-0-{i}.{obj['spec']['network']['subdomain']}.{ns}.svc.cluster.local"


@pytest.mark.parametrize("stem", CASES)
@pytest.mark.parametrize("flavor", ["plain", "jobset"])
def test_tf_config_names_every_pod_and_psworker_reads_it(stem, flavor):
    spec, options = CASES[stem]
    objs = objects(stem, flavor)
    ns = options.get("namespace", "default")
    main = [o for o in objs if o["kind"] in ("Job", "JobSet")]
    counts = {"ps": 2, "worker": 3} if stem == "two-ps" else {"ps": 2, "worker": 4}
    for obj in main:
        for job, job_obj, template in _pod_templates(obj):
            pod_spec = template["spec"]
            (container,) = pod_spec["containers"]
            assert job_obj["spec"]["completions"] == counts[job] and job_obj["spec"]["completionMode"] == "Indexed"
            for i in range(counts[job]):
                env = {"PSWORKER_TASK_INDEX": str(i)}   # what the fieldRef yields for completion index i
                for e in container["env"]:
                    if "value" in e:
                        env[e["name"]] = _expand(e["value"], env)
                cluster, index = resolve_cluster(job, environ={"TF_CONFIG": env["TF_CONFIG"]})
                assert index == i
                assert [str(a) for a in cluster.addresses(job)][i] == \
                    f"{_pod_dns(flavor, obj, job, i, pod_spec, ns)}:{container['ports'][0]['containerPort']}"
                assert {j: len(cluster.addresses(j)) for j in counts} == counts


def test_tfjob_tf_config_from_the_operator_is_read_by_psworker():
    tfjob = objects("scheduled", "tfjob")[0]
    name, ns = tfjob["metadata"]["name"], tfjob["metadata"]["namespace"]
    replicas = tfjob["spec"]["tfReplicaSpecs"]
    port = replicas["PS"]["template"]["spec"]["containers"][0]["ports"][0]
    assert port["name"] == "tfjob-port"   # the operator takes the port of this name (and container "tensorflow")
    # the training operator's genTFConfig: lower-cased replica types, <name>-<type>-<i>.<ns>.svc:<port>
    cluster = {rtype.lower(): [f"{name}-{rtype.lower()}-{i}.{ns}.svc:{port['containerPort']}"
                               for i in range(r["replicas"])] for rtype, r in replicas.items()}
    tf_config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 3}, "environment": "cloud"})
    spec, index = resolve_cluster("worker", environ={"TF_CONFIG": tf_config})
    assert index == 3 and len(spec.ps) == 2 and len(spec.worker) == 4
    assert tfjob["spec"]["successPolicy"] == "AllWorkers" and tfjob["spec"]["runPolicy"]["cleanPodPolicy"] == "Running"
    assert {r["restartPolicy"] for r in replicas.values()} == {"ExitCode"}


def _tasks_take_metrics_port() -> bool:
    """Whether this checkout's `psworker ps|worker` has `--metrics_port` (each task's own /metrics, issue 36)."""
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return all("--metrics_port" in sub.choices[job]._option_string_actions for job in ("ps", "worker"))


@pytest.mark.parametrize("stem, flavor", all_objects())
def test_container_argv_is_a_psworker_command_with_the_train_settings(stem, flavor):
    spec, options = CASES[stem]
    whole = _tasks_take_metrics_port()
    for obj in objects(stem, flavor):
        for job, _, template in _pod_templates(obj):
            (container,) = template["spec"]["containers"]
            argv = container["command"] + container["args"]
            assert argv[:2] == ["psworker", job] and container["name"] == "tensorflow"
            assert argv[-2:] == ["--metrics_port", str(options.get("metrics_port", DEFAULT_METRICS_PORT))]
            # psworker's own parser accepts it (without the last flag where the tasks do not serve metrics yet)
            args = build_parser().parse_args(argv[1:] if whole else argv[1:-2])
            if job == "worker":
                train = {f.name: getattr(args, f.name) for f in dataclasses.fields(spec.train)}
                assert train["max_steps"] == str(spec.train.max_steps) and train["mode"] == spec.train.mode
                mounts = {m["mountPath"] for m in container["volumeMounts"]}
                assert train["train_dir"] in mounts


@pytest.mark.parametrize("flavor", FLAVORS)
def test_restart_semantics_follow_the_exit_code_table(flavor):
    main = objects("two-ps", flavor)[:-1]
    for obj in main:
        for _, job_obj, _ in _pod_templates(obj):
            if job_obj is None:
                continue
            rules = job_obj["spec"]["podFailurePolicy"]["rules"]
            fail = next(r for r in rules if r["action"] == "FailJob")["onExitCodes"]
            assert fail["operator"] == "In" and fail["values"] == list(range(1, 128))
            assert EXIT_PEER_GONE not in fail["values"] and not {130, 137, 143} & set(fail["values"])
            assert job_obj["spec"]["backoffLimitPerIndex"] == 3
    if flavor == "jobset":
        policy = main[0]["spec"]["failurePolicy"]
        assert policy["maxRestarts"] == 3 and policy["rules"][0]["action"] == "FailJobSet"
        assert main[0]["spec"]["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["worker"]}


@pytest.mark.parametrize("stem, flavor", all_objects())
def test_labels_tie_everything_to_the_run_and_the_policy_admits_only_its_pods(stem, flavor):
    objs = objects(stem, flavor)
    run = CASES[stem][1]["name"]
    assert all(o["metadata"]["labels"][LABEL_RUN] == run for o in objs)
    (policy,) = [o for o in objs if o["kind"] == "NetworkPolicy"]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert policy["spec"]["ingress"][0]["from"] == [{"podSelector": {"matchLabels": selector}}]
    (rule_port,) = policy["spec"]["ingress"][0]["ports"]
    for obj in objs:
        for job, _, template in _pod_templates(obj):
            labels = template["metadata"]["labels"]
            assert selector.items() <= labels.items() and labels[LABEL_JOB] == job
            assert template["spec"]["containers"][0]["ports"][0]["containerPort"] == rule_port["port"]
            assert template["spec"]["automountServiceAccountToken"] is False
    for svc in (o for o in objs if o["kind"] == "Service"):
        assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["selector"].items() <= selector.items()


@pytest.mark.parametrize("stem, flavor", all_objects())
def test_every_pod_has_the_grace_period_and_a_metrics_port_open_to_scrapers(stem, flavor):
    options = CASES[stem][1]
    port = options.get("metrics_port", DEFAULT_METRICS_PORT)
    objs = objects(stem, flavor)
    templates = [t for o in objs for _, _, t in _pod_templates(o)]
    assert len(templates) == 2   # ps and worker
    for template in templates:
        # SIGTERM to SIGKILL: the chief finishes its step and writes its checkpoint, the ps tasks serve it meanwhile
        # for at most step_timeout_secs (300 s in these specs) + 70 s: the default grace covers that bound
        assert template["spec"]["terminationGracePeriodSeconds"] == options.get("grace_secs", 370)
        (container,) = template["spec"]["containers"]
        assert {"name": "metrics", "containerPort": port, "protocol": "TCP"} in container["ports"]
    (policy,) = [o for o in objs if o["kind"] == "NetworkPolicy"]
    grpc, metrics = policy["spec"]["ingress"]
    assert metrics == {"ports": [{"protocol": "TCP", "port": port}]}   # no `from`: any scraper (read-only)
    assert grpc["from"] and port not in [p["port"] for p in grpc["ports"]]


def _index_label(flavor):
    return "training.kubeflow.org/replica-index" if flavor == "tfjob" else "batch.kubernetes.io/job-completion-index"


@pytest.mark.parametrize("flavor", FLAVORS)
def test_with_metrics_every_pod_is_annotated_and_the_pod_monitor_selects_it(flavor):
    objs = objects("scheduled", flavor)
    monitor = objs[-1]
    assert monitor["kind"] == "PodMonitor" and monitor["metadata"]["namespace"] == "ml"
    selector = monitor["spec"]["selector"]["matchLabels"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint == {"port": "metrics", "path": "/metrics", "honorLabels": True}
    assert monitor["spec"]["podTargetLabels"] == [LABEL_RUN, LABEL_JOB, _index_label(flavor)]
    templates = [t for o in objs for _, _, t in _pod_templates(o)]
    assert len(templates) == 2
    for template in templates:
        assert selector.items() <= template["metadata"]["labels"].items()
        assert template["metadata"]["annotations"] == {"prometheus.io/scrape": "true", "prometheus.io/port": "9500",
                                                       "prometheus.io/path": "/metrics"}
        (container,) = template["spec"]["containers"]
        assert {p["name"]: p["containerPort"] for p in container["ports"]}[endpoint["port"]] == 9500
    without = objects("two-ps", flavor)   # no --metrics: the port is named, nothing more
    assert "PodMonitor" not in {o["kind"] for o in without}
    assert all("annotations" not in t["metadata"] for o in without for _, _, t in _pod_templates(o))


@pytest.mark.parametrize("flavor", FLAVORS)
def test_a_queue_labels_the_workload_and_creates_it_suspended(flavor):
    objs = objects("scheduled", flavor)
    workloads = [o for o in objs if o["kind"] in ("Job", "JobSet", "TFJob")]
    assert len(workloads) == (2 if flavor == "plain" else 1)
    for obj in objs:
        assert (obj["metadata"]["labels"].get(LABEL_QUEUE) == "ml-batch") == (obj in workloads), obj["kind"]
    for obj in workloads:
        assert (obj["spec"]["runPolicy"] if obj["kind"] == "TFJob" else obj["spec"])["suspend"] is True
        for _, job_obj, template in _pod_templates(obj):
            # Kueue gates the workload, not its pods (its pod integration would gate labelled pods one by one)
            assert LABEL_QUEUE not in template["metadata"]["labels"]
            if obj["kind"] == "JobSet":   # JobSet suspends and resumes its Jobs itself
                assert "suspend" not in job_obj["spec"]
    for obj in objects("two-ps", flavor):   # no --queue: started at once
        assert LABEL_QUEUE not in obj["metadata"]["labels"]
        assert "suspend" not in obj["spec"] and "suspend" not in obj["spec"].get("runPolicy", {})


@pytest.mark.parametrize("options, fragment", [
    (dict(name="Two_PS"), "--name 'Two_PS' must be a DNS label"),
    (dict(name="a" * 41), "at most 40 characters"),
    (dict(image=""), "--image"),
    (dict(flavor="helm"), "--flavor 'helm' is not one of tfjob, plain, jobset"),
    (dict(port=0), "--port 0 is out of range"),
    (dict(retries=-1), "--retries must be >= 0"),
    (dict(cluster_domain="cluster local"), "--cluster_domain 'cluster local'"),
    (dict(metrics_port=70000), "--metrics_port 70000 is out of range 1-65535"),
    (dict(metrics=True, metrics_port=None), "--metrics needs a metrics port"),
    (dict(metrics_port=2222), "--metrics_port 2222 is the tasks' gRPC port"),
    (dict(queue="ML_Queue"), "--queue 'ML_Queue' must be a Kueue LocalQueue name"),
    (dict(queue="q" * 64), "at most 63"),
    (dict(grace_secs=-1), "--grace_secs must be >= 0, got -1"),
])
def test_bad_options_are_usage_errors(options, fragment):
    with pytest.raises(UsageError, match=re.escape(fragment)):
        manifests(TWO_PS, K8sOptions(**{"name": "r", "image": "i", **options}))


def test_run_name_from_spec_path():
    assert run_name("cluster_specs/two_ps.yaml") == "two-ps"
    assert run_name("x/9lives.YML") == "run-9lives"


# ------------------------------------------------------------------------------------------------ golden

@pytest.mark.parametrize("stem, flavor", all_objects())
def test_golden_files(stem, flavor):
    path = GOLDEN / f"{stem}-{flavor}.yaml"
    text = to_yaml(objects(stem, flavor))
    if os.environ.get("PSWORKER_UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.exists(), f"no golden file {path}; run with PSWORKER_UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"{path} differs; if intended, regenerate with PSWORKER_UPDATE_GOLDEN=1"
    assert list(yaml.safe_load_all(text)) == objects(stem, flavor)


def test_cli_writes_the_golden_manifest(tmp_path):
    out = tmp_path / "run.yaml"
    args = [ROOT / "cluster_specs" / "scheduled.yaml", "--image", "registry.example/psworker:0.1.0", "--namespace",
            "ml", "--cpu", "2", "--memory", "4Gi", "--train_dir_volume", "psworker-train", "--retries", "5",
            "--grace_secs", "300", "--metrics_port", "9500", "--metrics", "--queue", "ml-batch",
            "--flavor", "jobset", "-o", out]
    r = subprocess.run([sys.executable, "-m", "psworker", "k8s", "manifest", *map(str, args)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert out.read_text() == (GOLDEN / "scheduled-jobset.yaml").read_text()


def test_cli_errors_exit_2_with_the_field():
    def run(*args):
        return subprocess.run([sys.executable, "-m", "psworker", "k8s", "manifest", *map(str, args)], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
    r = run(ROOT / "tests" / "bad_specs" / "port_out_of_range.yaml", "--image", "i")
    assert r.returncode == 2 and "cluster.worker[1]: port 70000" in r.stderr and "Traceback" not in r.stderr
    r = run(ROOT / "cluster_specs" / "two-ps.yaml", "--image", "i", "--max_steps", "0")
    assert r.returncode == 2 and "--max_steps: must be >= 1" in r.stderr
    r = run(ROOT / "cluster_specs" / "two-ps.yaml", "--image", "i", "--name", "Bad_Name")
    assert r.returncode == 2 and "--name 'Bad_Name'" in r.stderr


def test_dockerfile_installs_psworker_as_the_user_the_pods_run_as():
    from psworker.k8s.manifests import RUN_AS
    lines = [line.split() for line in (ROOT / "Dockerfile").read_text().splitlines() if line and line[0] != "#"]
    assert lines[0] == ["FROM", "python:3.11-slim"]
    assert ["RUN", "pip", "install", ".", "&&", "rm", "-rf", "/src"] in lines
    assert ["USER", str(RUN_AS)] in lines and f"--uid {RUN_AS}" in (ROOT / "Dockerfile").read_text()


# -------------------------------------------------------------- a user's command (`k8s manifest SPEC -- CMD`)

PSS = load_spec(ROOT / "cluster_specs" / "ps-strategy.yaml")      # chief, ps, 2 workers
USER_COMMAND = ("python", "train.py", "--job_name={job_name}", "--task_index={task_index}", "--ps_hosts={ps_hosts}",
                "--worker_hosts", "{worker_hosts}")


@pytest.mark.parametrize("flavor", FLAVORS)
def test_a_user_command_runs_in_every_pod_with_its_values_per_replica(flavor):
    """Schema-valid in every flavor; each replica's argv and PSWORKER_* (Kubernetes' `$(VAR)` expansion done here
    as a kubelet does) name its own task, and TF_CONFIG names the same cluster (the operator's, for TFJob)."""
    objs = manifests(PSS, K8sOptions(name="pss", image="registry.example/train:1", flavor=flavor,
                                     command=USER_COMMAND))
    for obj in objs:
        validate(obj)
    counts = {"chief": 1, "ps": 1, "worker": 2}
    seen = set()
    for obj in objs:
        for job, _, template in _pod_templates(obj):
            (container,) = template["spec"]["containers"]
            values = {e["name"]: e for e in container["env"]}
            # the metrics port is named and told to the program, which may serve /metrics there
            assert values["PSWORKER_METRICS_PORT"]["value"] == str(DEFAULT_METRICS_PORT)
            assert {"name": "metrics", "containerPort": DEFAULT_METRICS_PORT, "protocol": "TCP"} in container["ports"]
            index_from = values["PSWORKER_TASK_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]
            assert index_from.endswith(("['training.kubeflow.org/replica-index']" if flavor == "tfjob" else
                                        "['batch.kubernetes.io/job-completion-index']"))
            for i in range(counts[job]):
                env = {"PSWORKER_TASK_INDEX": str(i)}   # what the fieldRef yields for replica i
                env.update({k: _expand(e["value"], env) for k, e in values.items() if "value" in e})
                argv = [_expand(a, env) for a in container["command"] + container["args"]]
                ps_hosts, workers = env["PSWORKER_PS_HOSTS"], env["PSWORKER_WORKER_HOSTS"]
                assert argv == ["python", "train.py", f"--job_name={job}", f"--task_index={i}",
                                f"--ps_hosts={ps_hosts}", "--worker_hosts", workers]
                assert env["PSWORKER_JOB_NAME"] == job and len(workers.split(",")) == 2
                if flavor != "tfjob":       # TFJob's operator writes TF_CONFIG itself, with these service names
                    assert json.loads(env["TF_CONFIG"])["cluster"]["ps"] == [ps_hosts]
                    assert json.loads(env["TF_CONFIG"])["task"] == {"type": job, "index": i}
                else:
                    assert ps_hosts == f"pss-ps-0.default.svc:{container['ports'][0]['containerPort']}"
                seen.add((job, i))
    assert seen == {("chief", 0), ("ps", 0), ("worker", 0), ("worker", 1)}


def test_the_cli_takes_a_user_command_after_the_flags(tmp_path):
    out = tmp_path / "m.yaml"
    rc = main(["k8s", "manifest", str(ROOT / "cluster_specs" / "ps-strategy.yaml"), "--image", "i", "--flavor",
               "jobset", "-o", str(out), "--", *USER_COMMAND])
    assert rc == 0
    (jobset, _) = [o for o in yaml.safe_load_all(out.read_text()) if o]
    assert jobset["spec"]["successPolicy"]["targetReplicatedJobs"] == ["chief"]   # the chief decides, as TFJob's rule
    containers = [r["template"]["spec"]["template"]["spec"]["containers"][0] for r in jobset["spec"]["replicatedJobs"]]
    assert {c["command"][0] for c in containers} == {"python"}
    assert all("--task_index=$(PSWORKER_TASK_INDEX)" in c["args"] for c in containers)


def test_cli_metrics_port_0_names_none_and_a_queue_on_plain_jobs_warns(tmp_path, capsys):
    out = tmp_path / "m.yaml"
    rc = main(["k8s", "manifest", str(ROOT / "cluster_specs" / "two-ps.yaml"), "--image", "i", "--metrics_port", "0",
               "--queue", "ml-batch", "-o", str(out)])
    assert rc == 0
    objs = [o for o in yaml.safe_load_all(out.read_text()) if o]
    for obj in objs:
        validate(obj)
    for obj in objs:
        for _, _, template in _pod_templates(obj):
            (container,) = template["spec"]["containers"]
            assert [p["name"] for p in container["ports"]] == ["tfjob-port"]
            assert "--metrics_port" not in container["args"]
    (policy,) = [o for o in objs if o["kind"] == "NetworkPolicy"]
    assert len(policy["spec"]["ingress"]) == 1
    assert [o["spec"]["suspend"] for o in objs if o["kind"] == "Job"] == [True, True]
    assert "psworker: warning: --queue with the plain flavor: Kueue admits the ps Job and the worker Job each on its " \
           "own" in capsys.readouterr().err


def test_the_readme_manifest_commands_write_valid_manifests(tmp_path, monkeypatch):
    """The `psworker k8s manifest` commands of docs/kubernetes.md's first ```bash block, as written (their `-o run.yaml`
    in a temp dir): each exits 0 and writes objects that validate; the second is scraped and queued."""
    block = docs_pages.fenced(docs_pages.page("kubernetes.md"), "bash")[0]
    commands = [shlex.split(line, comments=True) for line in block.replace("\\\n", " ").splitlines()]
    manifest = [argv for argv in commands if argv[:3] == ["psworker", "k8s", "manifest"]]
    assert len(manifest) == 2, commands
    monkeypatch.chdir(ROOT)   # the spec paths are relative to the repository
    kinds = []
    for argv in manifest:
        out = tmp_path / "run.yaml"
        assert main([str(out) if arg == "run.yaml" else arg for arg in argv[1:]]) == 0
        objs = [o for o in yaml.safe_load_all(out.read_text()) if o]
        for obj in objs:
            validate(obj)
        kinds.append([o["kind"] for o in objs])
    assert kinds == [["Service", "Job", "Job", "NetworkPolicy"], ["JobSet", "NetworkPolicy", "PodMonitor"]]
    assert objs[0]["spec"]["suspend"] is True and objs[0]["metadata"]["labels"][LABEL_QUEUE] == "ml-batch"
