"""Task counts laid out on hosts: pure tests, and agreement with TensorFlow's SlurmClusterResolver.

The resolver reads SLURM_* variables; the tests set them in-process (no Slurm needed) and compare TF_CONFIG
clusters and each rank's task with `plan.layout` and `plan.task_of_rank`.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from psworker.errors import SpecError
from psworker.spec.interop import to_tf_config
from psworker.spec.plan import layout, nodes_needed, placeholder_hosts, task_counts, task_of_rank
from psworker.spec import CountSpec, TrainConfig, load_spec, parse_spec

ROOT = pathlib.Path(__file__).resolve().parents[1]


def counts(ps: int, worker: int, port: int = 2222, **train) -> CountSpec:
    return parse_spec({"cluster": {"ps": ps, "worker": worker, "port": port}, "train": train}, "c.yaml",
                      allow_counts=True)


def test_count_spec_parses_with_defaults_and_keeps_address_specs_unchanged():
    spec = parse_spec({"cluster": {"ps": 2, "worker": 8}, "train": {"mode": "sync"}}, "c.yaml", allow_counts=True)
    assert spec == CountSpec((("ps", 2), ("worker", 8)), 2222, TrainConfig(mode="sync"))
    assert spec.count("worker") == 8 and task_counts(spec) == {"ps": 2, "worker": 8}
    listed = parse_spec({"cluster": {"ps": ["a:1"], "worker": ["b:2"]}}, "l.yaml", allow_counts=True)
    assert listed == parse_spec({"cluster": {"ps": ["a:1"], "worker": ["b:2"]}}, "l.yaml")
    assert task_counts(listed) == {"ps": 1, "worker": 1}


@pytest.mark.parametrize("cluster, field_path, fragment", [
    ({"ps": 2, "worker": 0}, "cluster.worker", "must be >= 1, got 0"),
    ({"ps": -1, "worker": 2}, "cluster.ps", "must be >= 1, got -1"),
    ({"ps": 2, "worker": ["h:auto"]}, "cluster.worker", "every job as a count or every job as an address list"),
    ({"ps": ["h:1"], "worker": 2}, "cluster.ps", "not both"),
    ({"ps": 2, "worker": "8"}, "cluster.worker", "got str '8'"),
    ({"ps": 2, "worker": 1.5}, "cluster.worker", "got float 1.5"),
    ({"ps": 2}, "cluster.worker", "missing"),
    ({"ps": 1, "worker": 2, "port": "auto"}, "cluster.port", "expected a fixed port number"),
    ({"ps": 1, "worker": 2, "port": 0}, "cluster.port", "out of range 1-65535"),
    ({"ps": 1, "worker": 2, "port": True}, "cluster.port", "got bool true"),
    ({"ps": ["a:1"], "worker": ["b:2"], "port": 2222}, "cluster.port", "applies only to task counts"),
    ({"ps": 1, "worker": 2, "prot": 1}, "cluster.prot", "did you mean 'port'?"),
])
def test_bad_count_specs_name_the_field(cluster, field_path, fragment):
    with pytest.raises(SpecError) as info:
        parse_spec({"cluster": cluster}, "c.yaml", allow_counts=True)
    assert (info.value.source, info.value.field_path) == ("c.yaml", field_path)
    assert fragment in info.value.message and info.value.exit_code == 2


def test_replicas_to_aggregate_is_checked_against_the_count():
    with pytest.raises(SpecError, match="3 is not between 1 and the number of workers \\(2\\)"):
        counts(1, 2, mode="sync", replicas_to_aggregate=3)


def test_commands_that_need_addresses_reject_counts_by_field(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("cluster: {ps: 1, worker: 2}\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert info.value.field_path == "cluster.ps" and "needs hosts from a scheduler" in info.value.message
    assert isinstance(load_spec(path, allow_counts=True), CountSpec)


def test_layout_fills_hosts_in_name_order_with_port_offsets():
    cluster = layout(counts(2, 3, port=3000, max_steps=7), ["b", "a", "c"], tasks_per_node=2)
    assert cluster.as_dict() == {"ps": ["a:3000", "a:3001"], "worker": ["b:3000", "b:3001", "c:3000"]}
    assert cluster.train.max_steps == 7 and cluster.source == "c.yaml"
    assert [task_of_rank(counts(2, 3), r) for r in range(5)] == [("ps", 0), ("ps", 1), ("worker", 0),
                                                                  ("worker", 1), ("worker", 2)]


def test_layout_with_slots_per_host_and_placeholders():
    spec = counts(1, 4)
    assert layout(spec, ["n1", "n2"], [3, 2]).as_dict() == {
        "ps": ["n1:2222"], "worker": ["n1:2223", "n1:2224", "n2:2222", "n2:2223"]}
    hosts = placeholder_hosts(nodes_needed(counts(3, 9), 1))
    assert hosts[:2] == ["node00", "node01"] and hosts[-1] == "node11" and hosts == sorted(hosts)


@pytest.mark.parametrize("hosts, per_node, field_path, fragment", [
    (["a"], 2, "cluster", "requested 3 tasks, only 2 slots (1 hosts, 2 tasks per node)"),
    (["a", "a"], 2, "--hosts[1]", "duplicate host 'a'"),
    (["a;b"], 3, "--hosts[0]", "contains ';'"),
    (["a"], 0, "--tasks_per_node", "must be an integer >= 1, got 0"),
    (["a", "b"], [2], "--tasks_per_node", "1 slot counts for 2 hosts"),
])
def test_layout_errors(hosts, per_node, field_path, fragment):
    with pytest.raises(SpecError) as info:
        layout(counts(1, 2), hosts, per_node)
    assert info.value.field_path == field_path and fragment in info.value.message


def test_layout_port_past_65535_is_an_error():
    with pytest.raises(SpecError, match="port 65536 is out of range"):
        layout(counts(1, 1, port=65535), ["a"], 2)


# ------------------------------------------------------------------------- agreement with TensorFlow

# (SLURM_STEP_NODELIST, SLURM_STEP_TASKS_PER_NODE, jobs, port_base)
SLURM_CASES = [
    ("n[1-3]", "2(x3)", {"ps": 2, "worker": 4}, 2222),
    ("n10,n2,n9", "1(x3)", {"ps": 1, "worker": 2}, 8888),          # name order: n10 < n2 < n9
    ("gpu[08-10],cpu1", "3(x2),2,1", {"worker": 5, "ps": 4}, 4000),  # heterogeneous, jobs given out of order
    ("a1", "4", {"ps": 1, "worker": 3}, 2222),
]


@pytest.mark.parametrize("nodelist, per_node, jobs, port_base", SLURM_CASES)
def test_layout_agrees_with_slurm_cluster_resolver(monkeypatch, nodelist, per_node, jobs, port_base):
    from tensorflow.python.distribute.cluster_resolver import slurm_cluster_resolver as slurm

    hosts = slurm.expand_hostlist(nodelist)
    slots = slurm.expand_tasks_per_node(per_node)
    spec = counts(jobs["ps"], jobs["worker"], port=port_base)
    cluster = layout(spec, hosts, slots)
    total = sum(jobs.values())
    for rank in range(total):
        for name, value in {"PROCID": rank, "STEP_NUM_TASKS": total, "STEP_NODELIST": nodelist,
                            "STEP_TASKS_PER_NODE": per_node}.items():
            monkeypatch.setenv(f"SLURM_{name}", str(value))
        resolver = slurm.SlurmClusterResolver(jobs=dict(jobs), port_base=port_base, gpus_per_node=max(slots),
                                              gpus_per_task=1, auto_set_gpu=False)
        tf_cluster = resolver.cluster_spec().as_dict()
        job, index = resolver.get_task_info()
        assert (job, index) == task_of_rank(spec, rank)
        assert to_tf_config(cluster, job, index) == {"cluster": tf_cluster, "task": {"type": job, "index": index}}


def test_plan_cli_lays_out_counts(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("cluster: {ps: 1, worker: 3, port: 5000}\n")
    run = lambda *a: subprocess.run([sys.executable, "-m", "psworker", "plan", str(path), *a], cwd=ROOT,  # noqa: E731
                                    capture_output=True, text=True, timeout=60)
    r = run("--hosts", "h2,h1", "--tasks_per_node", "2")
    assert r.returncode == 0, r.stderr
    assert "worker:0  h1:5001" in r.stdout and "worker:2  h2:5001" in r.stdout and "- h1:5000" in r.stdout
    r = run()
    assert r.returncode == 0 and "node0, node1, node2, node3" in r.stdout
    r = run("--hosts", "h1", "--tasks_per_node", "2")
    assert r.returncode == 2 and "requested 4 tasks, only 2 slots" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "psworker", "validate", str(path)], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "(1 ps, 3 workers)" in r.stdout
