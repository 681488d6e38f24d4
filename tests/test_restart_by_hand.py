"""Tasks restarted by hand (the start scripts, no launcher: as a pod's controller or Slurm restarts them) lose no
training: a ps waits for a chief that vanished without its final checkpoint, a non-chief that vanished gets a rejoin
grace by default, and a worker that starts after training ended exits 0 and says so."""

from __future__ import annotations

import re

import pytest

from psworker.testing import STEP_LINE, LocalCluster, assert_processes_gone, checkpoint_step
from tests.cluster_utils import launch_script

pytestmark = pytest.mark.slow

ON_THE_PS = r"training is already complete: the global step on the ps tasks is (\d+) \(--max_steps {}\)"
ON_DISK = (r"training is already complete: the ps tasks are not up and the newest checkpoint in \S+ is at global "
           r"step (\d+) \(--max_steps {}\); nothing to do")


def by_hand(make_cluster, **train) -> LocalCluster:
    return make_cluster(train=dict(batch_size=32, log_every_steps=25, step_timeout_secs=120.0, **train),
                        argv=launch_script)


def assert_exit_0(cluster: LocalCluster, names: list[str], timeout: float = 240) -> None:
    codes = cluster.wait_exits(timeout, names)
    assert all(code == 0 for code in codes.values()), (codes, cluster.tails(names))


def test_async_a_chief_killed_while_the_others_finish_is_waited_for(make_cluster):
    """The chief is killed mid-run; worker:1 trains on to max_steps and leaves. The ps holds the model until the chief
    is started again, which takes the live step, writes the final checkpoint, evaluates, exports and exits 0. Workers
    started again after the ps has gone read the train_dir, find training complete and exit 0 (the chief evaluates)."""
    max_steps = 600
    cluster = by_hand(make_cluster, max_steps=max_steps, save_checkpoint_steps=200)
    cluster.wait_for_log("worker:1", STEP_LINE, 180, count=2)
    cluster.kill("worker:0")
    assert_exit_0(cluster, ["worker:1"])
    cluster.wait_for_log("ps:0", "its final checkpoint is outstanding; waiting 300 s for it to come back", 60)
    assert "ps:0" not in cluster.exit_codes(), cluster.tail("ps:0")   # it holds the only copy of the last steps
    cluster.restart("worker:0")
    assert_exit_0(cluster, ["worker:0", "ps:0"])
    chief = cluster.log("worker:0", current=True)
    final = int(re.search(ON_THE_PS.format(max_steps), chief).group(1))
    assert final >= max_steps, chief[-3000:]
    assert "precision @ 1 = " in chief
    assert checkpoint_step(cluster.train_dir) == final   # nothing lost: the final checkpoint holds every step

    cluster.restart("worker:0")
    cluster.restart("worker:1")
    assert_exit_0(cluster, ["worker:0", "worker:1"])
    for name in ("worker:0", "worker:1"):
        log = cluster.log(name, current=True)
        assert int(re.search(ON_DISK.format(max_steps), log).group(1)) == final, log[-3000:]
    again = cluster.log("worker:0", current=True)
    assert "precision @ 1 = " in again
    # the export of that step exists already: the chief names it (a run's report reads the SavedModel's path here)
    assert re.search(rf"exported \S+ \(global step {final}\) to \S+/export/{final}$", again, re.MULTILINE), \
        again[-3000:]
    assert_processes_gone(cluster.pids)


def test_async_a_worker_restarted_after_the_end_exits_0(make_cluster):
    """worker:1 is killed mid-run and started again only once the chief has finished: the ps, still in its default
    rejoin grace, holds the model at max_steps, so the new worker runs no step, says so and exits 0."""
    max_steps = 400
    cluster = by_hand(make_cluster, max_steps=max_steps, save_checkpoint_steps=200)
    cluster.wait_for_log("worker:1", STEP_LINE, 180, count=2)
    cluster.kill("worker:1")
    assert_exit_0(cluster, ["worker:0"])
    assert "ps:0" not in cluster.exit_codes(), cluster.tail("ps:0")
    cluster.restart("worker:1")
    assert_exit_0(cluster, ["worker:1", "ps:0"])
    log = cluster.log("worker:1", current=True)
    on_ps = re.search(ON_THE_PS.format(max_steps), log) or re.search(ON_DISK.format(max_steps), log)
    assert on_ps and int(on_ps.group(1)) >= max_steps, log[-3000:]
    assert not cluster.steps("worker:1", current=True)
    assert "ps:0: every worker is done; exiting" in cluster.log("ps:0")
    assert_processes_gone(cluster.pids)


def test_sync_the_chief_and_then_a_worker_restarted_by_hand(make_cluster):
    """Sync, no backup: the chief is killed and started again (worker:1 waits for its tokens; the new chief resets
    the sync state on the live ps), then worker:1. While worker:1 is down the chief either waits for its gradients or
    takes both tokens and goes on alone (SyncReplicasOptimizer counts gradients, not workers: by chance, see
    docs/lifecycle.md), so the new worker:1 either rejoins or finds training complete. Either way training ends at
    max_steps exactly and every task exits 0."""
    max_steps = 300
    cluster = by_hand(make_cluster, mode="sync", max_steps=max_steps, save_checkpoint_steps=100)
    cluster.wait_for_log("worker:1", STEP_LINE, 180, count=1)
    cluster.kill("worker:0")
    cluster.restart("worker:0")
    cluster.wait_for_log("worker:0", STEP_LINE, 180, count=2, current=True)
    cluster.kill("worker:1")
    cluster.restart("worker:1")
    assert_exit_0(cluster, ["worker:0", "worker:1", "ps:0"])
    assert checkpoint_step(cluster.train_dir) == max_steps
    chief = cluster.log("worker:0", current=True)
    assert "the ps tasks already hold a model; continuing from it" in chief, chief[-3000:]
    assert f"done at global step {max_steps} after" in chief, chief[-3000:]
    rejoined = cluster.log("worker:1", current=True)
    assert (f"done at global step {max_steps} after" in rejoined
            or re.search(ON_THE_PS.format(max_steps), rejoined) or re.search(ON_DISK.format(max_steps), rejoined)), \
        rejoined[-3000:]
    assert_processes_gone(cluster.pids)
