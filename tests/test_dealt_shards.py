"""Dealt shards on real clusters (issue 25): a model whose examples carry their position logs each position it
trains on (`psworker.models.positions`), and the tests count how often each position was read, with and without faults."""

from __future__ import annotations

import collections
import re
import signal
import time

import pytest
import yaml

from psworker import events
from psworker.testing import LocalCluster, assert_processes_gone, checkpoint_step
from psworker.models import positions as dealt_model
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
    monkeypatch.setenv("PSWORKER_MODELS", "psworker.models.positions")
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
    # `pytest -rP` shows it: the coverage table of the closing note of issue 25
    print(f"positions read n times, {{n: positions}}: {coverage(read)}")
    return read


def coverage(read: collections.Counter) -> dict[int, int]:
    """How many positions were read 0, 1, 2, ... times."""
    return dict(sorted(collections.Counter(read.get(p, 0) for p in range(N)).items()))


def trained_by(folder, task: str) -> int:
    return sum(len(step) for step in dealt_model.read_positions(folder).get(task, []))


def wait_for(check, timeout: float, what: str, cluster: LocalCluster) -> None:
    """Polls `check()` (reads of the positions files) until true; fails after `timeout` s with the logs' tails."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {timeout:g} s\n{cluster.tails()}")
        time.sleep(0.02)


def assert_all_exit_0(cluster: LocalCluster, timeout: float = 300) -> None:
    codes = cluster.wait_exits(timeout)
    assert set(codes.values()) == {0}, (codes, cluster.tails())


def test_two_epochs_read_every_position_exactly_twice(make_cluster, positions_dir, monkeypatch):
    """1 ps + 2 workers, async, 2 epochs, no faults: every position is trained on exactly twice, both workers take
    shards, the run ends by itself below max_steps, and the chief reports 600 examples, none again. The chief's
    first step waits until worker:1 has trained a batch (`WAIT_FOR_ENV`): on a loaded host worker:1 came up once
    after the chief had dealt every shard."""
    monkeypatch.setenv(dealt_model.WAIT_FOR_ENV, "worker1")
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
    # two steps into one of its shards (shards hold 3 batches): its lease is then 10 or 20 examples in
    wait_for(lambda: (lambda n: n >= 2 * SHARD and n % SHARD == 2 * BATCH)(trained_by(positions_dir, "worker1")),
             120, "worker:1 two batches into a shard", cluster)
    cluster.kill("worker:1")
    cluster.restart("worker:1")
    assert_all_exit_0(cluster)
    read = counts(positions_dir)
    assert min(read.get(p, 0) for p in range(N)) >= 3, coverage(read)
    extra = sum(read.values()) - 3 * N
    assert 0 <= extra <= SHARD, (extra, coverage(read))
    resumed = re.search(r"worker:1: resuming its lease: shard \d+ from (\d+)", cluster.log("worker:1", current=True))
    assert resumed and int(resumed.group(1)) in (BATCH, 2 * BATCH), cluster.tail("worker:1", 40)
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
    assert epochs and epochs[0] >= (restored - 2) * BATCH / N, (epochs[:3], restored)
    dealt = events.last(events.DataDealt, log)
    assert dealt is not None and dealt.trained >= 2 * N and dealt.epochs >= 2.0, dealt
    assert_processes_gone(cluster.pids)


def test_sync_with_a_backup_worker_ends_at_max_steps_and_reads_again_only_dropped_batches(make_cluster, positions_dir):
    """Sync, 3 workers, 2 gradients per step (one backup): with both num_epochs and max_steps set, max_steps comes
    first here and the final global step is exactly it; a position is read twice only when its batch's gradient was
    dropped (stale: computed again, issue 40), so the second reads are within the chief's count of dropped batches.
    Shards of one batch and 5 steps keep the run inside the first epoch whatever the readers take ahead: at most 6
    steps x 3 workers computed, plus 3 shards ahead of each worker's prefetch, is 270 of the 300 positions."""
    cluster = make_cluster(num_workers=3, train=train(mode="sync", replicas_to_aggregate=2, num_epochs=2,
                                                      max_steps=5, log_every_steps=1, shard_examples=BATCH))
    assert_all_exit_0(cluster)
    assert checkpoint_step(cluster.train_dir) == 5
    read = counts(positions_dir)
    dealt = events.last(events.DataDealt, cluster.log("worker:0"))
    assert dealt is not None and dealt.trained == 5 * 2 * BATCH, dealt
    again = sum(n - 1 for n in read.values())
    assert max(read.values()) <= 1 + dealt.dropped and again % BATCH == 0 and again <= BATCH * dealt.dropped, (
        coverage(read), dealt)
    assert sum(read.values()) >= 5 * 2 * BATCH
    assert_processes_gone(cluster.pids)


def test_a_stopped_straggler_loses_nothing_and_the_fast_worker_reads_most(make_cluster, positions_dir, monkeypatch):
    """worker:1 is held with SIGSTOP from its first step until worker:0 has trained most of the first epoch, then
    continued: every position is still read exactly twice in 2 epochs, and worker:0 read most of them."""
    monkeypatch.setenv(dealt_model.STEP_SECS_ENV, "0.02")
    cluster = make_cluster(train=train(num_epochs=2))
    wait_for(lambda: trained_by(positions_dir, "worker1") > 0, 180, "step of worker:1", cluster)
    cluster.send_signal("worker:1", signal.SIGSTOP)
    try:
        wait_for(lambda: trained_by(positions_dir, "worker0") >= N, 180, "epoch's worth from worker:0", cluster)
    finally:
        cluster.send_signal("worker:1", signal.SIGCONT)
    assert_all_exit_0(cluster)
    read = counts(positions_dir)
    assert coverage(read) == {2: N}, coverage(read)
    fast, slow = trained_by(positions_dir, "worker0"), trained_by(positions_dir, "worker1")
    assert fast + slow == 2 * N and fast > 2 * slow, (fast, slow)
    assert_processes_gone(cluster.pids)


def test_in_graph_replication_deals_every_position_once_per_epoch(make_cluster, positions_dir):
    """In-graph, 1 ps + 2 workers, 2 epochs, no faults: the client reads each step's global batch (2 x 10) from the
    positions it deals and splits it over both workers; every position is trained on exactly twice, the run ends by
    itself at the 30 steps the epochs take, and the client reports 600 examples, none again."""
    cluster = make_cluster(train=train(replication="in-graph", num_epochs=2))
    assert_all_exit_0(cluster)
    read = counts(positions_dir)
    assert coverage(read) == {2: N}, coverage(read)
    steps = dealt_model.read_positions(positions_dir)
    # the client logs each worker's half of a step where it read the batch: 2 lines per step
    assert set(steps) == {"worker0"} and {len(s) for s in steps["worker0"]} == {BATCH}, {k: len(v) for k, v in
                                                                                         steps.items()}
    assert checkpoint_step(cluster.train_dir) == 2 * N // (2 * BATCH)
    log = cluster.log("worker:0")
    assert "read by the in-graph client for 2 workers" in log, cluster.tail("worker:0")
    dealt = events.last(events.DataDealt, log)
    assert dealt is not None and (dealt.trained, dealt.again, dealt.num_epochs) == (2 * N, 0, 2), dealt
    assert "serving for the client" in cluster.log("worker:1")
    assert_processes_gone(cluster.pids)


def test_an_elastic_job_scaled_2_to_4_to_1_reads_every_position_each_epoch(tmp_path, positions_dir, monkeypatch):
    """Elastic `{min 1, start 2}` of 4 workers under `psworker local`, scaled 2 -> 4 -> 1 in the first epoch: the
    workers scaled away give back the untrained rest of their leases, and every position is still read at least
    once per epoch, the extra reads within the shards in flight."""
    from tests.test_elastic_launcher import Launcher, finish, scale, signal_tasks

    monkeypatch.setenv(dealt_model.STEP_SECS_ENV, "0.05")
    spec = tmp_path / "elastic.yaml"
    spec.write_text(yaml.safe_dump({
        "cluster": {"ps": ["127.0.0.1:auto"], "worker": {"addresses": ["127.0.0.1:auto"] * 4, "min": 1, "start": 2}},
        "train": train(num_epochs=2)}, sort_keys=False))
    train_dir = tmp_path / "train"
    run = Launcher([str(spec), "--train_dir", str(train_dir)], tmp_path)
    try:
        for w in (0, 1, "scale", 2, 3):           # each held once it trains: the deal cannot end meanwhile
            if w == "scale":
                assert scale(train_dir, 4)[0] == 0
                continue
            run.wait_until(lambda: trained_by(positions_dir, f"worker{w}") > 0, f"a step of worker:{w}")
            signal_tasks(run, signal.SIGSTOP, f"worker:{w}")
        assert scale(train_dir, 1)[0] == 0
        signal_tasks(run, signal.SIGCONT, "worker:1", "worker:2", "worker:3")   # each ends its step and leaves
        for w in ("worker:1", "worker:2", "worker:3"):
            run.wait_for(rf"^psworker: {w} left \(scaled away\)$", f"{w} leaving")
        signal_tasks(run, signal.SIGCONT, "worker:0")
        finish(run, ["ps:0", "worker:0", "worker:1", "worker:2", "worker:3"])
    finally:
        run.close()
    read = counts(positions_dir)
    assert min(read.get(p, 0) for p in range(N)) >= 2, coverage(read)
    assert sum(read.values()) - 2 * N <= 4 * SHARD, coverage(read)
    logs = train_dir / "logs"
    for w in (1, 2, 3):
        assert "gave back the untrained rest of its lease" in (logs / f"worker-{w}.log").read_text(), w
    assert set(dealt_model.read_positions(positions_dir)) == {"worker0", "worker1", "worker2", "worker3"}


def test_a_checkpoint_without_a_cursor_restores_and_the_data_position_starts_fresh(tmp_path, positions_dir):
    """A checkpoint written with static slices holds no data position: a dealt run in the same train dir restores
    its weights, says the data position starts fresh, and reads one whole epoch; its checkpoints then hold one."""
    import tensorflow as tf

    from psworker.train import dealer

    train_dir = tmp_path / "train"
    with LocalCluster(tmp_path / "static", num_workers=1,
                      train=train(data_dealing="static", max_steps=10, train_dir=str(train_dir))) as cluster:
        assert_all_exit_0(cluster)
    old = tf.train.latest_checkpoint(str(train_dir))
    assert old.endswith("-10") and not dealer.has_cursor(old)
    for path in positions_dir.iterdir():
        path.unlink()
    with LocalCluster(tmp_path / "dealt", num_workers=1,
                      train=train(num_epochs=1, train_dir=str(train_dir))) as cluster:
        assert_all_exit_0(cluster)
        log = cluster.log("worker:0")
    assert "restoring the checkpoint model.ckpt-10" in log
    assert "the checkpoint holds no data position (written before dealt shards): the data position starts fresh" \
        in log
    assert coverage(counts(positions_dir)) == {1: N}
    new = tf.train.latest_checkpoint(str(train_dir))
    assert dealer.has_cursor(new) and checkpoint_step(train_dir) == 10 + N // BATCH
