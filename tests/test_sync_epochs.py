"""Sync mode with a backup worker and dealt shards (issue 40): `--num_epochs N` applies every example's gradient
exactly N times. The positions model counts the positions of each APPLIED gradient in a variable (`applied_counts`,
`psworker.models.positions`), pushed and averaged by the same accumulators as the weights; the checkpoint holds it."""

from __future__ import annotations

import signal

import numpy as np
import pytest

from psworker import events
from psworker.models import positions as dealt_model
from psworker.testing import assert_processes_gone, checkpoint_step
from tests.test_dealt_shards import assert_all_exit_0, positions_dir, train, trained_by, wait_for  # noqa: F401

pytestmark = pytest.mark.slow

N, BATCH, EPOCHS, AGGREGATE = 600, 10, 3, 2


def last_step(aggregate: int) -> int:
    return EPOCHS * N // (aggregate * BATCH)   # 90 at 2 gradients per step


@pytest.fixture
def applied_dir(positions_dir, monkeypatch):  # noqa: F811
    """Every task's positions model has 600 examples and counts the positions of each applied gradient (of 2 per
    step, unless a test sets it again)."""
    monkeypatch.setenv("PSWORKER_POSITIONS_EXAMPLES", str(N))
    monkeypatch.setenv(dealt_model.APPLIED_ENV, str(AGGREGATE))
    return positions_dir


def sync_cluster(make_cluster, workers: int = 3, aggregate: int = AGGREGATE):
    return make_cluster(num_workers=workers, train=train(mode="sync", replicas_to_aggregate=aggregate,
                                                         num_epochs=EPOCHS, log_every_steps=10))


def applied_counts(train_dir) -> np.ndarray:
    import tensorflow as tf

    return tf.train.load_checkpoint(tf.train.latest_checkpoint(str(train_dir))).get_tensor(dealt_model.COUNTS)


def assert_each_applied_exactly_epochs_times(cluster, folder, aggregate: int = AGGREGATE) -> events.DataDealt:
    """Every position's gradient applied exactly EPOCHS times, the run ends at the step that covers them, and every
    batch computed and not applied was dropped and computed again."""
    assert_all_exit_0(cluster)
    counts = applied_counts(cluster.train_dir)
    hist = dict(zip(*np.unique(counts, return_counts=True)))
    print(f"positions applied n times, {{n: positions}}: {hist}")
    assert counts.shape == (N,) and np.array_equal(counts, np.full(N, float(EPOCHS))), hist
    assert checkpoint_step(cluster.train_dir) == last_step(aggregate)
    dealt = events.last(events.DataDealt, cluster.log("worker:0"))
    assert dealt is not None and (dealt.trained, dealt.again, dealt.num_epochs) == (EPOCHS * N, 0, EPOCHS), dealt
    computed = sum(len(step) for steps in dealt_model.read_positions(folder).values() for step in steps)
    print(f"computed {computed} examples, applied {EPOCHS * N}, {dealt.dropped} batches dropped and computed again")
    assert computed == EPOCHS * N + BATCH * dealt.dropped, (computed, dealt)
    assert_processes_gone(cluster.pids)
    return dealt


@pytest.mark.parametrize("workers,aggregate", [(3, 2), (2, 1)])
def test_sync_with_a_backup_worker_applies_every_example_exactly_num_epochs_times(make_cluster, applied_dir,
                                                                                  monkeypatch, workers, aggregate):
    """1 ps + 3 workers, 2 gradients per step, 3 epochs of 600 examples in batches of 10: each step computes up to
    3 batches and applies 2; the dropped ones are computed again; every position is applied exactly 3 times and the
    run ends at global step 90. And 2 workers at 1 gradient per step (180 steps), where about every other batch is
    dropped: the case where batches given back to the dealer's pool split the leases into pieces until a worker's
    read-ahead could not hold a batch (`psworker local` hung in 2 of 4 runs of 60 epochs)."""
    monkeypatch.setenv(dealt_model.APPLIED_ENV, str(aggregate))
    cluster = sync_cluster(make_cluster, workers, aggregate)
    dealt = assert_each_applied_exactly_epochs_times(cluster, applied_dir, aggregate)
    assert dealt.dropped > 0, dealt


def test_sync_with_a_worker_stopped_for_a_while_still_applies_every_example_exactly(make_cluster, applied_dir):
    """A non-chief worker is held with SIGSTOP after its first step while the other two carry the steps (an epoch's
    worth), then continued: its stale batch is dropped and computed again; every position is still applied exactly 3
    times. The worker held is the first non-chief seen training (worker:2 if both): a worker that starts late (load)
    is not waited for, as the other two may carry the whole run without it."""
    cluster = sync_cluster(make_cluster)
    workers = ("worker1", "worker2")
    wait_for(lambda: any(trained_by(applied_dir, w) > 0 for w in workers), 180, "step of a non-chief worker", cluster)
    held = "worker2" if trained_by(applied_dir, "worker2") > 0 else "worker1"
    carry = ("worker0", "worker1" if held == "worker2" else "worker2")
    cluster.send_signal(f"worker:{held[-1]}", signal.SIGSTOP)
    try:
        before = sum(trained_by(applied_dir, w) for w in carry)
        wait_for(lambda: sum(trained_by(applied_dir, w) for w in carry) >= before + N, 240,
                 f"an epoch's worth from {' and '.join(carry)} while {held} is stopped", cluster)
    finally:
        cluster.send_signal(f"worker:{held[-1]}", signal.SIGCONT)
    dealt = assert_each_applied_exactly_epochs_times(cluster, applied_dir)
    assert dealt.dropped > 0, dealt
