"""Restarts keep progress: a task is killed with SIGKILL mid-run and started again; training completes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.cluster_utils import Cluster, TaskProcess, assert_no_processes, checkpoint_step, write_spec

pytestmark = pytest.mark.slow

STEP_LINE = r"^step (\d+), loss"


def spec_args(spec: Path, index: int) -> list[str]:
    return ["--spec", str(spec), "--task_index", str(index)]


def steps(task: TaskProcess) -> list[int]:
    return [int(m.group(1)) for m in re.finditer(STEP_LINE, task.log(), re.MULTILINE)]


def before(log: str, marker: str) -> str:
    """The part of `log` before the first line containing `marker` (all of it when there is none)."""
    at = log.find(marker)
    return log if at < 0 else log[:at]


def start(cluster: Cluster, spec: Path, num_workers: int = 2) -> None:
    cluster.start("ps", 0, spec_args(spec, 0))
    for i in range(num_workers):
        cluster.start("worker", i, spec_args(spec, i))


def assert_all_exited_0(cluster: Cluster, names: list[str], timeout: float = 240) -> None:
    exits = cluster.wait_exits(timeout, names)
    assert all(code == 0 for code, _ in exits.values()), (
        {n: c for n, (c, _) in exits.items()}, "\n".join(f"--- {n}\n{cluster.tasks[n].tail()}" for n in names))


def test_a_restarted_chief_continues_from_the_live_ps(tmp_path, cluster):
    """Sync: the chief is killed at step >= 75 and restarted while the ps lives. The only checkpoint on disk is
    step 0, so restoring it would send the global step back to 0; instead the new chief takes the ps's variables."""
    max_steps, train_dir = 300, tmp_path / "train"
    spec = write_spec(tmp_path / "cluster.yaml", mode="sync", max_steps=max_steps, batch_size=32, log_every_steps=25,
                      save_checkpoint_steps=10000, train_dir=str(train_dir), step_timeout_secs=120.0)
    start(cluster, spec)
    chief, other = cluster.tasks["worker:0"], cluster.tasks["worker:1"]
    chief.wait_for(STEP_LINE, 180, count=3)
    cluster.kill("worker:0")
    reached = max(steps(chief) + steps(other))
    chief2 = cluster.start("worker", 0, spec_args(spec, 0), name="worker:0#2")
    assert_all_exited_0(cluster, ["worker:0#2", "worker:1", "ps:0"])

    training = before(chief2.log(), "last step done")
    assert "the ps tasks already hold a model; continuing from it (no checkpoint restore)" in training, \
        training[-3000:]
    assert "Restoring parameters from" not in training
    resumed_at = int(re.search(r"Saving checkpoints for (\d+) into", training).group(1))
    assert resumed_at >= reached, (resumed_at, reached)
    assert other.log().count("waiting for the chief") == 1   # the other worker never lost its session
    assert steps(other) == sorted(steps(other)), steps(other)
    assert steps(chief2) and min(steps(chief2)) >= reached
    assert checkpoint_step(train_dir) == max_steps
    assert_no_processes(cluster.all_pids)


def test_a_restarted_ps_workers_recover_and_the_chief_restores_the_latest_checkpoint(tmp_path, cluster):
    """Async: the ps is killed after the checkpoint of step >= 100 and restarted; the workers re-create their
    sessions, the chief restores that checkpoint, training completes, and the new ps exits by itself."""
    max_steps, train_dir = 600, tmp_path / "train"
    spec = write_spec(tmp_path / "cluster.yaml", max_steps=max_steps, batch_size=32, log_every_steps=50,
                      save_checkpoint_steps=100, train_dir=str(train_dir), step_timeout_secs=120.0)
    start(cluster, spec)
    chief = cluster.tasks["worker:0"]
    # "after saving": the checkpoint is complete (killing the ps during a save leaves only ckpt-N_temp)
    saved = int(chief.wait_for(r"Calling checkpoint listeners after saving checkpoint (\d+)", 180, count=2).group(1))
    cluster.kill("ps:0")
    ps2 = cluster.start("ps", 0, spec_args(spec, 0), name="ps:0#2")
    assert_all_exited_0(cluster, ["worker:0", "worker:1", "ps:0#2"])

    restored = re.search(r"Restoring parameters from \S*model\.ckpt-(\d+)", before(chief.log(), "last step done"))
    assert restored, chief.tail(60)
    assert int(restored.group(1)) >= saved >= 100
    assert "ps:0: every worker is done; exiting" in ps2.log()
    assert checkpoint_step(train_dir) >= max_steps
    assert_no_processes(cluster.all_pids)


def test_a_restarted_non_chief_rejoins_and_training_completes(tmp_path, cluster):
    """Sync, no backup: worker:1 is killed at step >= 50, so the chief waits; worker:1 is started again, rejoins at
    the current global step, and both finish at max_steps exactly."""
    max_steps, train_dir = 250, tmp_path / "train"
    spec = write_spec(tmp_path / "cluster.yaml", mode="sync", max_steps=max_steps, batch_size=32, log_every_steps=25,
                      save_checkpoint_steps=100, train_dir=str(train_dir), step_timeout_secs=120.0)
    start(cluster, spec)
    chief, other = cluster.tasks["worker:0"], cluster.tasks["worker:1"]
    other.wait_for(STEP_LINE, 180, count=2)
    cluster.kill("worker:1")
    reached = max(steps(chief) + steps(other))
    other2 = cluster.start("worker", 1, spec_args(spec, 1), name="worker:1#2")
    assert_all_exited_0(cluster, ["worker:0", "worker:1#2", "ps:0"])

    rejoined = int(re.search(r"worker:1: first step done at global step (\d+)", other2.log()).group(1))
    assert rejoined >= reached, (rejoined, reached)
    assert steps(chief) == sorted(steps(chief))
    assert f"done at global step {max_steps} after" in other2.log()
    assert checkpoint_step(train_dir) == max_steps
    assert_no_processes(cluster.all_pids)
