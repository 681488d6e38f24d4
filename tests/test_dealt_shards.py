"""Dealt shards on real clusters (issue 25): a model whose examples carry their position logs each position it
trains on (`tests.dealt_model`), and the tests count how often each position was read, with and without faults."""

from __future__ import annotations

import collections
import re
import signal

import pytest

from psworker import events
from psworker.testing import LocalCluster, assert_processes_gone, checkpoint_step
from tests import dealt_model
from tests.cluster_utils import REPO

pytestmark = pytest.mark.slow

N = dealt_model.NUM_EXAMPLES   # 300
SHARD = 30
BATCH = 10


@pytest.fixture
def positions_dir(tmp_path, monkeypatch):
    """Every task imports the positions model and logs what it trains into the returned folder."""
    folder = tmp_path / "positions"
    folder.mkdir()
    monkeypatch.setenv("PSWORKER_MODELS", "tests.dealt_model")
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.setenv(dealt_model.POSITIONS_DIR_ENV, str(folder))
    return folder


def train(**more) -> dict:
    return {"model": "positions", "batch_size": BATCH, "shard_examples": SHARD, "max_steps": 100000,
            "log_every_steps": 5, "learning_rate": 0.1, "step_timeout_secs": 120.0, **more}


def counts(folder) -> collections.Counter:
    read = collections.Counter()
    for steps in dealt_model.read_positions(folder).values():
        for step in steps:
            read.update(step)
    return read


def coverage(read: collections.Counter) -> dict[int, int]:
    """How many positions were read 0, 1, 2, ... times."""
    return dict(sorted(collections.Counter(read.get(p, 0) for p in range(N)).items()))


def assert_all_exit_0(cluster: LocalCluster, timeout: float = 300) -> None:
    codes = cluster.wait_exits(timeout)
    assert set(codes.values()) == {0}, (codes, cluster.tails())


def test_two_epochs_read_every_position_exactly_twice(make_cluster, positions_dir):
    """1 ps + 2 workers, async, 2 epochs, no faults: every position is trained on exactly twice, both workers take
    shards, the run ends by itself below max_steps, and the chief reports 600 examples, none again."""
    cluster = make_cluster(train=train(num_epochs=2))
    assert_all_exit_0(cluster)
    read = counts(positions_dir)
    assert coverage(read) == {2: N}, coverage(read)
    per_worker = {task: sum(len(s) for s in steps) for task, steps in dealt_model.read_positions(positions_dir).items()}
    assert set(per_worker) == {"worker0", "worker1"} and sum(per_worker.values()) == 2 * N, per_worker
    dealt = events.last(events.DataDealt, cluster.log("worker:0"))
    assert dealt is not None and (dealt.trained, dealt.again, dealt.num_epochs) == (2 * N, 0, 2), dealt
    assert dealt.epochs == pytest.approx(2.0)
    epochs = [e.epoch for e in events.Step.finditer(cluster.log("worker:0") + cluster.log("worker:1"))]
    assert epochs and all(0 < e <= 2 for e in epochs), epochs
    assert checkpoint_step(cluster.train_dir) < 100000
    assert "precision @ 1" in cluster.log("worker:0")
    assert_processes_gone(cluster.pids)


def test_a_worker_killed_mid_shard_resumes_its_lease(make_cluster, positions_dir, monkeypatch):
    """worker:1 is killed with SIGKILL mid-shard and started again at its index: it resumes its own lease where its
    trained count says; every position is read at least 3 times in 3 epochs, and the extra reads are within one
    shard (the batch of the killed step at most)."""
    monkeypatch.setenv(dealt_model.STEP_SECS_ENV, "0.05")
    cluster = make_cluster(train=train(num_epochs=3))
    cluster.wait_for_log("worker:1", events.Step, 180, count=3)
    cluster.kill("worker:1")
    cluster.restart("worker:1")
    assert_all_exit_0(cluster)
    read = counts(positions_dir)
    assert min(read.get(p, 0) for p in range(N)) >= 3, coverage(read)
    extra = sum(read.values()) - 3 * N
    assert 0 <= extra <= SHARD, (extra, coverage(read))
    assert re.search(r"worker:1: resuming its lease: shard \d+ from \d+", cluster.log("worker:1", current=True)), \
        cluster.tail("worker:1", 40)
    assert_processes_gone(cluster.pids)


def test_every_task_killed_then_restored_reads_again_what_came_after_the_checkpoint(make_cluster, positions_dir,
                                                                                     monkeypatch):
    """Every task is killed with SIGKILL after a checkpoint, then started again: the chief restores the checkpoint
    with the data position, the examples trained after it are read again, none is skipped, and the epoch count
    goes on from the checkpoint's."""
    monkeypatch.setenv(dealt_model.STEP_SECS_ENV, "0.05")
    cluster = make_cluster(train=train(num_epochs=2, save_checkpoint_steps=15))
    saved = int(cluster.wait_for_log("worker:0", r"worker:0: checkpoint of global step (\d+) saved", 180,
                                     count=3).group(1))
    names = ["worker:0", "worker:1", "ps:0"]
    for name in names:
        cluster.kill(name)
    before = counts(positions_dir)
    for name in ["ps:0", "worker:0", "worker:1"]:
        cluster.restart(name)
    assert_all_exit_0(cluster)
    log = cluster.log("worker:0", current=True)
    restored = int(re.search(r"restoring the checkpoint model\.ckpt-(\d+)", log).group(1))
    assert restored >= saved >= 15
    read = counts(positions_dir)
    assert min(read.get(p, 0) for p in range(N)) >= 2, coverage(read)
    assert sum(read.values()) > 2 * N, "the examples after the checkpoint were not read again"
    assert sum(read.values()) - 2 * N <= sum(before.values()), coverage(read)
    epochs = [e.epoch for e in events.Step.finditer(log)]
    assert epochs and epochs[0] >= restored * BATCH / N * 0.5, (epochs[:3], restored)
    dealt = events.last(events.DataDealt, log)
    assert dealt is not None and dealt.trained >= 2 * N and dealt.epochs >= 2.0, dealt
    assert_processes_gone(cluster.pids)
