"""Pure tests of TF_CONFIG / classic flags conversion and of where a task finds its cluster."""

from __future__ import annotations

import json

import pytest

from psworker.errors import SpecError, UsageError
from psworker.spec.interop import from_flags, from_tf_config, resolve_cluster, to_flags, to_tf_config
from psworker.spec import Address, dump_spec, parse_spec

SPEC = parse_spec({"cluster": {"ps": ["ps0:2222", "ps1:2222"], "worker": ["w0:2222", "w1:2222", "w2:2222"]}},
                  "two.yaml")
IPV6 = parse_spec({"cluster": {"ps": ["[::1]:2222"], "worker": ["[::1]:2223", "localhost:2224"]}}, "v6.yaml")


def test_to_tf_config_shape():
    assert to_tf_config(SPEC, "worker", 1) == {
        "cluster": {"ps": ["ps0:2222", "ps1:2222"], "worker": ["w0:2222", "w1:2222", "w2:2222"]},
        "task": {"type": "worker", "index": 1}}


@pytest.mark.parametrize("spec", [SPEC, IPV6], ids=["dns", "ipv6"])
def test_tf_config_round_trip(spec):
    for job in ("ps", "worker"):
        for i in range(len(spec.addresses(job))):
            back, back_job, back_index = from_tf_config(json.dumps(to_tf_config(spec, job, i)))
            assert (back, back_job, back_index) == (spec, job, i)
            assert back.source == "TF_CONFIG"


@pytest.mark.parametrize("spec", [SPEC, IPV6], ids=["dns", "ipv6"])
def test_flags_round_trip(spec):
    flags = to_flags(spec, "worker", 1)
    assert flags[2:] == ["--job_name=worker", "--task_index=1"]
    values = dict(f[2:].split("=", 1) for f in flags)
    assert from_flags(values["ps_hosts"], values["worker_hosts"]) == spec


def test_to_flags_shape():
    assert to_flags(SPEC, "ps", 0) == ["--ps_hosts=ps0:2222,ps1:2222", "--worker_hosts=w0:2222,w1:2222,w2:2222",
                                      "--job_name=ps", "--task_index=0"]


def test_auto_ports_cannot_be_exported():
    spec = parse_spec({"cluster": {"ps": ["localhost:auto"], "worker": ["localhost:1"]}}, "l.yaml")
    for fn in (to_tf_config, to_flags):
        with pytest.raises(SpecError, match="automatic port 'localhost:auto'"):
            fn(spec, "worker", 0)


def test_export_index_out_of_range_names_both_numbers():
    with pytest.raises(UsageError, match="--task_index 3 but the spec has 3 workers"):
        to_tf_config(SPEC, "worker", 3)
    with pytest.raises(UsageError, match="unknown job 'chief'"):
        to_flags(SPEC, "chief", 0)


def test_from_tf_config_without_task():
    spec, job, index = from_tf_config('{"cluster": {"ps": ["a:1"], "worker": ["b:2"]}}')
    assert spec.worker == (Address("b", 2),) and job is None and index is None


@pytest.mark.parametrize("text, field_path, fragment", [
    ("{not json", "", "is not valid JSON"),
    ('["a"]', "", "expected a JSON object"),
    ('{"cluster": {"chief": ["c:1"], "ps": ["a:1"], "worker": ["b:2"]}}', "cluster.chief", "worker 0 as the chief"),
    ('{"cluster": {"evaluator": ["e:1"], "ps": ["a:1"], "worker": ["b:2"]}}', "cluster.evaluator",
     "unknown job type 'evaluator'"),
    ('{"cluster": {"ps": ["a:1"]}}', "cluster.worker", "missing"),
    ('{"cluster": {"ps": ["a:1"], "worker": ["b:99999"]}}', "cluster.worker[0]", "out of range"),
    ('{"cluster": {"ps": ["a:1"], "worker": ["b:2"]}, "task": {"type": "chief", "index": 0}}', "task.type",
     "chief is worker 0"),
    ('{"cluster": {"ps": ["a:1"], "worker": ["b:2"]}, "task": {"type": "worker", "index": 1}}', "task.index",
     "1 but the cluster has 1 worker"),
    ('{"cluster": {"ps": ["a:1"], "worker": ["b:2"]}, "task": {"type": "worker", "index": "0"}}', "task.index",
     "expected an integer"),
    ('{"cluster": {"ps": ["a:1"], "worker": ["b:2"]}, "tsk": {}}', "tsk", "unknown key"),
])
def test_from_tf_config_errors(text, field_path, fragment):
    with pytest.raises(SpecError) as info:
        from_tf_config(text)
    assert info.value.source == "TF_CONFIG" and info.value.field_path == field_path
    assert fragment in info.value.message


def test_from_flags_errors_name_the_flag():
    with pytest.raises(SpecError) as info:
        from_flags("a:1", "b:2,b:70000")
    assert str(info.value) == "--flags: --worker_hosts[1]: port 70000 is out of range 1-65535"
    with pytest.raises(SpecError, match="--ps_hosts: empty"):
        from_flags("", "b:2")
    with pytest.raises(SpecError, match=r"--worker_hosts\[0\]: duplicate address a:1 \(also at --ps_hosts\[0\]\)"):
        from_flags("a:1", "a:1")


# ------------------------------------------------------------------------------------ resolve_cluster

@pytest.fixture
def spec_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(dump_spec(SPEC))
    return str(path)


def tf_config(job="worker", index=2, spec=SPEC):
    return json.dumps(to_tf_config(spec, job, index))


def test_resolve_from_spec_flag(spec_file):
    spec, index = resolve_cluster("worker", spec_path=spec_file, task_index=1, environ={})
    assert spec == SPEC and index == 1


def test_resolve_from_classic_flags():
    spec, index = resolve_cluster("ps", ps_hosts="ps0:2222,ps1:2222", worker_hosts="w0:2222,w1:2222,w2:2222",
                                  job_name="ps", task_index=1, environ={})
    assert spec == SPEC and index == 1


def test_spec_flag_beats_environment(spec_file, tmp_path):
    other = tmp_path / "other.yaml"
    other.write_text("cluster: {ps: ['x:1'], worker: ['y:2']}")
    env = {"PSWORKER_SPEC": str(other), "TF_CONFIG": tf_config()}
    spec, index = resolve_cluster("worker", spec_path=spec_file, task_index=0, environ=env)
    assert spec == SPEC and index == 0


def test_psworker_spec_env_beats_tf_config(spec_file):
    other = json.dumps({"cluster": {"ps": ["x:1"], "worker": ["y:2"]}, "task": {"type": "worker", "index": 0}})
    spec, index = resolve_cluster("worker", task_index=2, environ={"PSWORKER_SPEC": spec_file, "TF_CONFIG": other})
    assert spec == SPEC and index == 2


def test_tf_config_index_used_and_task_index_beats_it():
    assert resolve_cluster("worker", environ={"TF_CONFIG": tf_config(index=2)}) == (SPEC, 2)
    assert resolve_cluster("worker", task_index=0, environ={"TF_CONFIG": tf_config(index=2)}) == (SPEC, 0)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(spec_path="x.yaml", ps_hosts="a:1", worker_hosts="b:2", task_index=0), "not both"),
    (dict(ps_hosts="a:1", task_index=0), "--worker_hosts is required"),
    (dict(ps_hosts="a:1", worker_hosts="b:2", job_name="ps", task_index=0),
     "--job_name ps disagrees with the 'worker'"),
    (dict(ps_hosts="a:1", worker_hosts="b:2"), "--task_index is required"),
    (dict(ps_hosts="a:1", worker_hosts="b:2,c:3", task_index=3), "--task_index 3 but the spec has 2 workers"),
    (dict(ps_hosts="a:1", worker_hosts="b:2,c:3", task_index=-1), "must be >= 0"),
    (dict(environ={"TF_CONFIG": tf_config(job="ps", index=0)}), "TF_CONFIG task type 'ps' disagrees"),
    (dict(task_index=5, environ={"TF_CONFIG": tf_config()}), "--task_index 5 but the spec has 3 workers"),
    (dict(environ={"TF_CONFIG": '{"cluster": {"ps": ["a:1"], "worker": ["b:2"]}}'}), "--task_index is required"),
])
def test_resolve_errors(kwargs, fragment):
    kwargs.setdefault("environ", {})
    with pytest.raises(UsageError) as info:
        resolve_cluster("worker", **kwargs)
    assert fragment in str(info.value) and info.value.exit_code == 2


def test_resolve_with_nothing_lists_the_three_ways():
    with pytest.raises(UsageError) as info:
        resolve_cluster("ps", environ={"TF_CONFIG": "", "PSWORKER_SPEC": ""})
    message = str(info.value)
    assert "--spec" in message and "PSWORKER_SPEC" in message and "TF_CONFIG" in message


def test_resolve_reports_bad_sources_precisely(tmp_path):
    with pytest.raises(SpecError, match="no such file"):
        resolve_cluster("worker", task_index=0, environ={"PSWORKER_SPEC": str(tmp_path / "missing.yaml")})
    with pytest.raises(SpecError, match="^TF_CONFIG: is not valid JSON"):
        resolve_cluster("worker", task_index=0, environ={"TF_CONFIG": "{"})
    spec, index = resolve_cluster("ps", ps_hosts="a:1", worker_hosts="b:2", task_index=0, environ={})
    assert spec.source == "--flags" and index == 0
