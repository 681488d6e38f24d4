"""Elastic worker ranges in the spec (issue 18 item 1): both forms, defaults, every rule's error, and what
`validate`, `plan` and `tf-config` show. Pure: nothing starts a server."""

import json
import subprocess
import sys

import pytest

from psworker.errors import SpecError
from psworker.spec.plan import layout
from psworker.spec import ClusterSpec, CountSpec, Elastic, dump_spec, parse_spec, with_addresses

ADDRS = '["127.0.0.1:auto", "127.0.0.1:auto", "127.0.0.1:auto", "127.0.0.1:auto"]'


def spec_text(worker: str, train: str = "{}") -> str:
    return f'cluster:\n  ps: ["127.0.0.1:auto"]\n  worker: {worker}\ntrain: {train}\n'


def test_the_documented_address_form_reserves_every_address_up_to_max():
    spec = parse_spec(spec_text(f"{{addresses: {ADDRS}, min: 1, start: 2}}"), "s.yaml")
    assert isinstance(spec, ClusterSpec)
    assert len(spec.worker) == 4
    assert spec.elastic == Elastic(min=1, start=2, max=4)
    assert len(spec.as_dict()["worker"]) == 4          # every server's ClusterSpec holds all of them


def test_defaults_are_min_1_and_start_max_and_a_plain_list_stays_fixed():
    assert parse_spec(spec_text(f"{{addresses: {ADDRS}}}"), "s").elastic == Elastic(1, 4, 4)
    assert parse_spec(spec_text(ADDRS), "s").elastic is None


def test_the_count_form_and_its_layout_keep_the_range():
    text = 'cluster:\n  ps: 1\n  worker: {max: 8, min: 2, start: 4}\n'
    spec = parse_spec(text, "c.yaml", allow_counts=True)
    assert isinstance(spec, CountSpec)
    assert spec.count("worker") == 8 and spec.elastic == Elastic(2, 4, 8)
    cluster = layout(spec, [f"node{i}" for i in range(9)], 1)
    assert len(cluster.worker) == 8 and cluster.elastic == Elastic(2, 4, 8)


def test_dump_and_reload_keep_the_range_and_new_addresses_keep_it_too():
    spec = parse_spec(spec_text(f"{{addresses: {ADDRS}, min: 1, start: 2}}"), "s")
    assert parse_spec(dump_spec(spec), "s").elastic == spec.elastic
    moved = with_addresses(spec, ["127.0.0.1:3000"], [f"127.0.0.1:{3001 + i}" for i in range(4)])
    assert moved.elastic == spec.elastic


@pytest.mark.parametrize("worker, train, path, words", [
    ('{addresses: ["127.0.0.1:2223"], min: 2}', "{}", "cluster.worker.min", "not between 1"),
    (f"{{addresses: {ADDRS}, start: 0}}", "{}", "cluster.worker.start", "not between 1"),
    (f"{{addresses: {ADDRS}, start: 5}}", "{}", "cluster.worker.start", "max (4)"),
    (f"{{addresses: {ADDRS}, min: 3, start: 2}}", "{}", "cluster.worker.start", "below min (3)"),
    (f"{{addresses: {ADDRS}, mni: 1}}", "{}", "cluster.worker.mni", "did you mean 'min'"),
    ("{min: 1}", "{}", "cluster.worker", "needs `addresses`"),
    (f"{{addresses: {ADDRS}, max: 4}}", "{}", "cluster.worker.max", "not both"),
    (f"{{addresses: {ADDRS}, min: yes}}", "{}", "cluster.worker.min", "expected a number"),
    (f"{{addresses: {ADDRS}, min: 1}}", "{mode: sync}", "cluster.worker.min", "replicas_to_aggregate <= min"),
    (f"{{addresses: {ADDRS}, min: 1}}", "{mode: sync, replicas_to_aggregate: 2}", "cluster.worker.min",
     "at least train.replicas_to_aggregate (2)"),
    (f"{{addresses: {ADDRS}, min: 1}}", "{replication: in-graph}", "cluster.worker", "between-graph"),
    ('"127.0.0.1:1"', "{}", "cluster.worker", "expected"),
])
def test_every_rule_names_its_field(worker, train, path, words):
    with pytest.raises(SpecError) as err:
        parse_spec(spec_text(worker, train), "bad.yaml")
    assert err.value.field_path == path and words in str(err.value)


def test_sync_with_min_at_replicas_to_aggregate_is_valid():
    spec = parse_spec(spec_text(f"{{addresses: {ADDRS}, min: 2, start: 3}}",
                                "{mode: sync, replicas_to_aggregate: 2}"), "s")
    assert spec.elastic == Elastic(2, 3, 4)


def psworker(*argv, cwd):
    return subprocess.run([sys.executable, "-m", "psworker", *argv], capture_output=True, text=True, cwd=cwd,
                          timeout=120)


def test_validate_plan_and_tf_config_show_the_range_and_a_bad_range_exits_2(tmp_path):
    good = tmp_path / "elastic.yaml"
    good.write_text(spec_text('{addresses: ["127.0.0.1:2223", "127.0.0.1:2224", "127.0.0.1:2225"], min: 1, '
                              'start: 2}').replace("auto", "2222"))
    bad = tmp_path / "bad.yaml"
    bad.write_text(spec_text(f"{{addresses: {ADDRS}, min: 5}}"))
    out = psworker("validate", str(good), str(bad), cwd=tmp_path)
    assert out.returncode == 2 and "elastic: min 1, start 2, max 3" in out.stdout
    assert "cluster.worker.min: 5 is not between 1" in out.stderr and "Traceback" not in out.stderr
    plan = psworker("plan", str(good), cwd=tmp_path)
    assert plan.returncode == 0 and "3 workers (elastic: min 1, start 2, max 3)" in plan.stdout
    assert "starts worker:0-1" in plan.stdout
    tfc = psworker("tf-config", str(good), "--job", "worker", "--task_index", "2", cwd=tmp_path)
    assert tfc.returncode == 0 and len(json.loads(tfc.stdout)["cluster"]["worker"]) == 3
    assert "elastic (min 1, start 2, max 3)" in tfc.stderr


def test_kubernetes_manifests_refuse_an_elastic_job_with_a_reason(tmp_path):
    spec = tmp_path / "elastic.yaml"
    spec.write_text('cluster:\n  ps: 1\n  worker: {max: 4, min: 2, start: 2}\n')
    out = psworker("k8s", "manifest", str(spec), "--image", "psworker:test", cwd=tmp_path)
    assert out.returncode == 2 and out.stdout == "", out
    assert "elastic worker job (min 2, start 2, max 4) is not supported on Kubernetes yet" in out.stderr
    assert "Traceback" not in out.stderr
    fixed = tmp_path / "fixed.yaml"
    fixed.write_text('cluster:\n  ps: 1\n  worker: 4\n')
    assert psworker("k8s", "manifest", str(fixed), "--image", "psworker:test", cwd=tmp_path).returncode == 0


def test_a_launch_config_holds_the_command_rules_for_every_caller():
    """The CLI's rules live in LaunchConfig, so a library call (`launch.run_local(spec, command=...)`) meets them:
    an elastic job runs psworker's trainer only; a user's ps (server.join()) gets 1 s once the workers are done."""
    from psworker.errors import UsageError
    from psworker.launcher.config import LaunchConfig

    elastic = parse_spec(spec_text(f"{{addresses: {ADDRS}, min: 1, start: 2}}"), "e.yaml")
    with pytest.raises(UsageError, match=r"e\.yaml: cluster\.worker: an elastic worker job \(min 1, start 2, max 4\) "
                                         "runs psworker's own trainer only"):
        LaunchConfig(spec=elastic, command=("python", "train.py"))
    fixed = parse_spec(spec_text(ADDRS), "f.yaml")
    assert LaunchConfig(spec=elastic).ps_exit_grace_secs == 15.0
    assert LaunchConfig(spec=fixed, command=("python", "train.py")).ps_exit_grace_secs == 1.0
    assert LaunchConfig(spec=fixed, command=("x",), ps_exit_grace_secs=3.0).ps_exit_grace_secs == 3.0


def test_run_local_with_a_command_refuses_an_elastic_job_before_writing_anything(tmp_path):
    """The library call meets the CLI's rule: `run_local(spec, command=...)` raises before it picks a run dir."""
    from psworker.errors import UsageError
    from psworker.launcher.launch import run_local

    run_dir = tmp_path / "run"
    elastic = parse_spec(spec_text(f"{{addresses: {ADDRS}, min: 1, start: 2}}", f"{{train_dir: {run_dir}}}"), "e.yaml")
    with pytest.raises(UsageError, match="runs psworker's own trainer only"):
        run_local(elastic, command=(sys.executable, "-c", "pass"), install_signal_handlers=False)
    assert not run_dir.exists()


def test_run_and_ssh_with_a_command_refuse_an_elastic_job_before_starting_anything(tmp_path):
    """A user's script does not speak the join/leave protocol: `run -- CMD` (and `ssh -- CMD`) exit 2 up front."""
    spec = tmp_path / "elastic.yaml"
    spec.write_text(spec_text('{addresses: ["127.0.0.1:auto", "127.0.0.1:auto"], min: 1, start: 1}'))
    marker = tmp_path / "ran"
    for launcher in ("run", "ssh"):
        out = psworker(launcher, str(spec), "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')", cwd=tmp_path)
        assert out.returncode == 2, out
        assert "elastic worker job (min 1, start 1, max 2) runs psworker's own trainer only" in out.stderr
        assert "Traceback" not in out.stderr and not marker.exists()
