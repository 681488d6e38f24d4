"""Restarts keep progress: a task is killed with SIGKILL mid-run and started again (`LocalCluster.kill`/`restart`,
the supervisor's own `kill_task`/`start_task`); training completes."""

from __future__ import annotations

import random
import re
import signal
import time

import pytest

from psworker.testing import LocalCluster, assert_processes_gone, checkpoint_step

pytestmark = pytest.mark.slow


def before(log: str, marker: str) -> str:
    """The part of `log` before the first line containing `marker` (all of it when there is none)."""
    at = log.find(marker)
    return log if at < 0 else log[:at]


def assert_all_exited_0(cluster: LocalCluster, names: list[str], timeout: float = 240) -> None:
    codes = cluster.wait_exits(timeout, names)
    assert all(code == 0 for code in codes.values()), (codes, cluster.tails(names))


def test_a_restarted_chief_continues_from_the_live_ps(make_cluster):
    """Sync: the chief is killed at step >= 75 and restarted while the ps lives. The only checkpoint on disk is
    step 0, so restoring it would send the global step back to 0; instead the new chief takes the ps's variables."""
    max_steps = 300
    cluster = make_cluster(train=dict(mode="sync", max_steps=max_steps, batch_size=32, log_every_steps=25,
                                      save_checkpoint_steps=10000, step_timeout_secs=120.0))
    cluster.wait_for_log("worker:0", r"^step \d+, loss", 180, count=3)
    cluster.kill("worker:0")
    reached = max(cluster.steps("worker:0") + cluster.steps("worker:1"))
    cluster.restart("worker:0")
    assert_all_exited_0(cluster, ["worker:0", "worker:1", "ps:0"])

    training = before(cluster.log("worker:0", current=True), "last step done")
    assert "the ps tasks already hold a model; continuing from it (no checkpoint restore)" in training, \
        training[-3000:]
    assert "restoring the checkpoint" not in training
    resumed_at = int(re.search(r"worker:0: first step done at global step (\d+)", training).group(1))
    assert resumed_at >= reached, (resumed_at, reached)
    other = cluster.log("worker:1")
    assert other.count("waiting for the chief") == 1   # the other worker never lost its session
    assert cluster.steps("worker:1") == sorted(cluster.steps("worker:1"))
    assert cluster.steps("worker:0", current=True) and min(cluster.steps("worker:0", current=True)) >= reached
    assert checkpoint_step(cluster.train_dir) == max_steps
    assert_processes_gone(cluster.pids)


def test_a_restarted_ps_workers_recover_and_the_chief_restores_the_latest_checkpoint(make_cluster):
    """Async: the ps is killed after the checkpoint of step >= 100 and restarted; the workers re-create their
    sessions, the chief restores that checkpoint, training completes, and the new ps exits by itself."""
    max_steps = 600
    cluster = make_cluster(train=dict(max_steps=max_steps, batch_size=32, log_every_steps=50,
                                      save_checkpoint_steps=100, step_timeout_secs=120.0))
    # psworker logs a checkpoint once it is complete (killing the ps during a save leaves only ckpt-N_temp)
    saved = int(cluster.wait_for_log("worker:0", r"worker:0: checkpoint of global step (\d+) saved", 180,
                                     count=2).group(1))
    cluster.kill("ps:0")
    cluster.restart("ps:0")
    assert_all_exited_0(cluster, ["worker:0", "worker:1", "ps:0"])

    training = before(cluster.log("worker:0"), "last step done")
    restored = re.findall(r"worker:0: restoring the checkpoint model\.ckpt-(\d+)", training)
    assert restored, cluster.tail("worker:0", 60)
    assert int(restored[-1]) >= saved >= 100
    assert "ps:0: every worker is done; exiting" in cluster.log("ps:0", current=True)
    assert checkpoint_step(cluster.train_dir) >= max_steps
    assert_processes_gone(cluster.pids)


def test_a_restarted_non_chief_rejoins_and_training_completes(make_cluster):
    """Sync, no backup: worker:1 is killed at step >= 50 and started again; it rejoins at the current global step, and
    both finish at max_steps exactly. The chief is held (SIGSTOP) until worker:1 is back and waiting for the model:
    a worker killed while it waits for a token lets the chief take both tokens and train on alone (the gradients
    are counted, not the workers), which could end training before worker:1 is back."""
    max_steps = 250
    cluster = make_cluster(train=dict(mode="sync", max_steps=max_steps, batch_size=32, log_every_steps=25,
                                      save_checkpoint_steps=100, step_timeout_secs=120.0))
    cluster.wait_for_log("worker:1", r"^step \d+, loss", 180, count=2)
    cluster.send_signal("worker:0", signal.SIGSTOP)
    cluster.kill("worker:1")
    reached = max(cluster.steps("worker:0") + cluster.steps("worker:1"))
    cluster.restart("worker:1")
    cluster.wait_for_log("worker:1", "worker:1: waiting for the chief's model on the ps tasks", 180, current=True)
    cluster.send_signal("worker:0", signal.SIGCONT)
    assert_all_exited_0(cluster, ["worker:0", "worker:1", "ps:0"])

    rejoined = cluster.log("worker:1", current=True)
    assert int(re.search(r"worker:1: first step done at global step (\d+)", rejoined).group(1)) >= reached
    assert cluster.steps("worker:0") == sorted(cluster.steps("worker:0"))
    assert f"done at global step {max_steps} after" in rejoined
    assert checkpoint_step(cluster.train_dir) == max_steps
    assert_processes_gone(cluster.pids)


SYNC_CHIEF_KILL_STEPS = (12, 40, 75, 110, 150)   # global steps after which the chief is killed (one run)
SKEWED_KILLS = (1, 3)   # after these kills the state of a chief killed inside its aggregation is made by hand


def _skew_accumulators(cluster: LocalCluster, timeout: float = 30.0, settle: float = 0.5) -> list[int]:
    """Leaves the ps as a chief killed inside its aggregation step does: one accumulator taken (emptied, its step one
    ahead) while the others still hold the other worker's gradients. Natural kills rarely land in that window (a few
    ms per step: the chief is usually the straggler), so it is made here, from outside, on the real ps.

    First the counts must settle (worker:1 may still be pushing, the dead chief's pending takes are being
    cancelled). When the dead chief already left them unequal, that is the state wanted and it is left alone (taking
    another accumulator could even make them equal again); when every accumulator holds gradients, the first is
    taken; when all stay empty (the dead chief took every one), there is nothing to skew. Returns the counts as
    left: unequal ones are what the restarted chief's reset must report."""
    import tensorflow as tf

    from psworker import models
    from psworker.train.graph import build_train_graph

    v1 = tf.compat.v1
    config = cluster.spec.train
    with tf.Graph().as_default():   # the model's graph, only to learn the accumulators' shared names and shapes
        tg = build_train_graph(models.get(config.model), config, cluster=cluster.spec.as_dict(), task_index=0)
        found = [(a.accumulator_ref.op.get_attr("shared_name").decode(), a.dtype,
                  a.accumulator_ref.op.get_attr("shape"), device)
                 for a, device in tg.sync_optimizer._accumulator_list]
    with tf.Graph().as_default():
        accums = []
        for name, dtype, shape, device in found:
            with tf.device(device):
                accums.append(v1.ConditionalAccumulator(dtype, shape=tf.TensorShape(shape), shared_name=name))
        counts = [a.num_accumulated() for a in accums]
        take = accums[0].take_grad(1)
        options = v1.RunOptions(timeout_in_ms=10_000)
        with v1.Session(f"grpc://{cluster.spec.ps[0]}", config=v1.ConfigProto(device_filters=["/job:ps"])) as sess:
            deadline = time.monotonic() + timeout
            held, since = None, time.monotonic()
            while True:
                now = [int(n) for n in sess.run(counts, options=options)]
                if now != held:
                    held, since = now, time.monotonic()
                stable = time.monotonic() - since
                if (sum(held) and stable >= settle) or stable >= 10 * settle:
                    break
                assert time.monotonic() < deadline, f"the accumulators' counts did not settle within {timeout:g} s"
                time.sleep(0.05)
            if len(set(held)) == 1 and held[0] > 0:
                sess.run(take, options=options)
                held = [0] + held[1:]
    return held


def test_a_sync_chief_killed_again_and_again_recovers_every_time(make_cluster):
    """Sync, 1 ps + 2 workers, start scripts: the chief is killed with SIGKILL a moment after each global step in
    SYNC_CHIEF_KILL_STEPS and started again with the same command, five times in one run, so the kills land in
    different phases of a sync step (computing, pushing some gradients but not others, aggregating, between
    steps). A chief killed inside its aggregation used to leave the accumulators skewed and both workers waiting
    for a token; natural kills rarely hit that window, so after the kills in SKEWED_KILLS the test makes that state
    on the ps itself (`_skew_accumulators`) before the restart. Every restart must reset the sync state
    and complete its first step, and the run must end at max_steps exactly with every task exiting 0. A deadlock
    fails the test after the restarted chief's first-step timeout (--step_timeout_secs + --startup_timeout_secs),
    with the logs."""
    from tests.cluster_utils import launch_script

    max_steps = 190
    cluster = make_cluster(train=dict(mode="sync", max_steps=max_steps, batch_size=256, log_every_steps=5,
                                      save_checkpoint_steps=200, step_timeout_secs=60.0,
                                      startup_timeout_secs=60.0), argv=launch_script)
    jitter = random.Random(7)   # the kill lands a little after a progress line: at a different phase each time
    skewed = 0
    for n, step in enumerate(SYNC_CHIEF_KILL_STEPS):
        cluster.wait_for_step(step, 120, name="worker:1")
        time.sleep(jitter.uniform(0.0, 0.1))
        cluster.kill("worker:0")
        if n in SKEWED_KILLS:
            left = _skew_accumulators(cluster)
            skewed += len(set(left)) > 1
        cluster.restart("worker:0")
        try:
            cluster.wait_for_log("worker:0", r"worker:0: first step done at global step \d+", 150, current=True)
        except AssertionError as exc:
            raise AssertionError(f"restart {n + 1} (killed after global step {step}): the restarted chief's first "
                                 f"sync step did not complete (deadlock?)\n{cluster.tails()}") from exc
    assert_all_exited_0(cluster, ["worker:0", "worker:1", "ps:0"], timeout=120)
    chief = cluster.log("worker:0")
    assert chief.count("sync state reset on the live ps") == len(SYNC_CHIEF_KILL_STEPS), chief[-3000:]
    # the skewed restarts were seen as such: an empty accumulator beside ones that held worker:1's gradient
    resets = "\n".join(re.findall(r"sync state reset on the live ps.*", chief))
    assert skewed >= 1, resets   # (all empty after both: the dead chief took every accumulator each time)
    assert chief.count("unequal: the previous chief died inside a step") >= skewed, resets
    for i in range(2):
        assert f"done at global step {max_steps} after" in cluster.log(f"worker:{i}", current=True)
    assert cluster.steps("worker:1") == sorted(cluster.steps("worker:1"))
    assert "ps:0: every worker is done; exiting" in cluster.log("ps:0")
    assert checkpoint_step(cluster.train_dir) == max_steps
    assert_processes_gone(cluster.pids)
