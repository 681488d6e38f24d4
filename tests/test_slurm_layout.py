"""Pure Slurm pieces: hostlists, the allocation the slurm backend lays the tasks out on (checked against
SlurmClusterResolver itself), srun argv."""

from __future__ import annotations

from pathlib import Path

import pytest

from psworker.errors import SpecError, UsageError
from psworker.launcher.backends.slurm.allocation import (allocation_from_environ, check_allocation, count_spec,
                                                         expand_hostlist, expand_tasks_per_node)
from psworker.launcher.backends.slurm.steps import parse_steps, signal_step_argv, srun_argv, steps_argv
from psworker.spec.plan import layout, plan, task_of_rank
from psworker.spec import ClusterSpec, CountSpec, load_spec


def counts(jobs, port=2222):
    return CountSpec(tuple(jobs.items()), port)


def placed(spec, nodes, tasks_per_node):
    """The slurm backend's layout: the allocation checked against the spec, then TensorFlow's rules."""
    return layout(spec, nodes, check_allocation(spec, nodes, tasks_per_node))

HOSTLISTS = ["node[01-03,07]", "n[1-2],m5,o[3-4,6,7-9]", "vm", "a,b,c", "node[9-11]", "x[098-101]",
             "gpu[1],cpu[0-1]"]


@pytest.mark.parametrize("hostlist", HOSTLISTS)
def test_expand_hostlist_agrees_with_tensorflow(hostlist):
    from tensorflow.python.distribute.cluster_resolver import slurm_cluster_resolver as tf_slurm

    assert expand_hostlist(hostlist) == tf_slurm.expand_hostlist(hostlist)


def test_expand_hostlist_examples_and_errors():
    assert expand_hostlist("node[01-03,07]") == ["node01", "node02", "node03", "node07"]
    assert expand_hostlist("rack[1-2]-n[1-2]") == ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]
    for bad in ("n[1-", "n[3-1]", "n[a]", "n[]", "", "a,,b", "n]1["):
        with pytest.raises(ValueError, match="invalid Slurm hostlist"):
            expand_hostlist(bad)


def test_expand_tasks_per_node():
    assert expand_tasks_per_node("3(x2),2,1") == [3, 3, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    with pytest.raises(ValueError, match="tasks-per-node"):
        expand_tasks_per_node("2(x)")


ALLOCATIONS = [
    ({"ps": 1, "worker": 2}, "vm", "3", 8888),
    ({"ps": 2, "worker": 4}, "node[01-03]", "2(x3)", 2222),
    ({"ps": 1, "worker": 4}, "node[9-10]", "3,2", 8888),        # sorted as strings: node10 first
    ({"ps": 1, "worker": 5}, "b[1-2],a7", "1,3,2", 5000),       # uneven counts, unsorted list
    ({"ps": 2, "worker": 1}, "n[1-3]", "1(x3)", 8888),
    ({"chief": 1, "ps": 1, "worker": 2}, "vm", "4", 5000),      # TF2 ParameterServerStrategy: chief first
]


@pytest.mark.parametrize("jobs,nodelist,tasks_per_node,port_base", ALLOCATIONS)
def test_layout_equals_tensorflow_slurm_cluster_resolver(monkeypatch, jobs, nodelist, tasks_per_node, port_base):
    """For every rank, TF's resolver (reading the SLURM_* variables) gives the same cluster and task as ours."""
    from tensorflow.python.distribute.cluster_resolver.slurm_cluster_resolver import SlurmClusterResolver

    counts = expand_tasks_per_node(tasks_per_node)
    spec = CountSpec(tuple(jobs.items()), port_base)
    ours = placed(spec, expand_hostlist(nodelist), counts)
    monkeypatch.setenv("SLURM_STEP_NODELIST", nodelist)
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", tasks_per_node)
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", str(sum(counts)))
    for rank in range(sum(counts)):
        monkeypatch.setenv("SLURM_PROCID", str(rank))
        # No GPUs here: one "GPU" slot per task so that TF's zip over GPU offsets keeps every task.
        resolver = SlurmClusterResolver(jobs=dict(jobs), port_base=port_base, gpus_per_node=max(counts),
                                        gpus_per_task=1, auto_set_gpu=False)
        assert resolver.cluster_spec().as_dict() == ours.as_dict()
        assert resolver.get_task_info() == task_of_rank(spec, rank)


def test_layout_orders_hosts_as_strings_and_jobs_by_name():
    cluster = placed(counts({"ps": 1, "worker": 2}), ["node9", "node10"], [2, 1])
    assert cluster.as_dict() == {"ps": ["node10:2222"], "worker": ["node9:2222", "node9:2223"]}


def test_count_spec_of_either_kind_of_spec(tmp_path):
    listed = load_spec(str(Path(__file__).resolve().parent.parent / "cluster_specs" / "local.yaml"))
    assert isinstance(listed, ClusterSpec)
    assert count_spec(listed).counts == (("ps", 1), ("worker", 2)) and count_spec(listed).port == 2222
    assert count_spec(listed, 8888).port == 8888
    assert count_spec(counts({"ps": 2, "worker": 3}, 5000)).port == 5000


def test_layout_rejects_a_task_count_the_allocation_does_not_run():
    with pytest.raises(UsageError, match=r"3 tasks .* allocation runs 4 .*--ntasks=3"):
        placed(counts({"ps": 1, "worker": 2}), ["a", "b"], 2)
    with pytest.raises(UsageError, match="2 nodes but 1 tasks-per-node counts"):
        placed(counts({"ps": 1, "worker": 2}), ["a", "b"], [3])
    with pytest.raises(SpecError, match="port 65536 is out of range"):
        placed(counts({"ps": 1, "worker": 1}, 65535), ["a"], 2)


def test_allocation_from_environ():
    assert allocation_from_environ({"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "2(x2)"}) == (
        ["n1", "n2"], [2, 2])
    step = {"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "2(x2)",
            "SLURM_STEP_NODELIST": "n2", "SLURM_STEP_TASKS_PER_NODE": "1"}
    assert allocation_from_environ(step) == (["n2"], [1])
    with pytest.raises(UsageError, match="not inside a Slurm allocation"):
        allocation_from_environ({})
    with pytest.raises(UsageError, match="2 nodes"):
        allocation_from_environ({"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "2(x3)"})


def test_srun_argv_is_one_step_on_one_node():
    task = plan(placed(counts({"ps": 1, "worker": 2}, 8888), ["node07"], 3), "unread.yaml")[2]
    argv = srun_argv(task, ["/usr/bin/python3", "-m", "psworker", "worker", "--train_dir", "/a b"],
                     extra=("--cpus-per-task=2",))
    assert argv == ["srun", "--nodes=1", "--ntasks=1", "--nodelist=node07", "--overlap",
                    "--job-name=psworker-worker-1", "--export=ALL", "--unbuffered", "--cpus-per-task=2", "--",
                    "/usr/bin/python3", "-m", "psworker", "worker", "--train_dir", "/a b"]
    with pytest.raises(UsageError):
        srun_argv(task, [])


def test_step_lookup_and_signal_argv():
    assert steps_argv("12") == ["squeue", "--steps", "-h", "-o", "%i %j", "-j", "12"]
    listed = "12.batch batch\n12.0 psworker-ps-0\n12.3 psworker-worker-1\n\n12.4 psworker-worker-1\n"
    assert parse_steps(listed) == [("12.batch", "batch"), ("12.0", "psworker-ps-0"),
                                   ("12.3", "psworker-worker-1"), ("12.4", "psworker-worker-1")]
    assert signal_step_argv("12.3") == ["scancel", "--signal=TERM", "12.3"]
    with pytest.raises(UsageError, match="JOB.STEP"):
        signal_step_argv("12")
