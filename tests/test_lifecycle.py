"""Tasks started by hand (the start scripts) start in any order, end on their own, and say why, in both modes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
import yaml

from psworker.errors import EXIT_PEER_GONE
from psworker.launcher.console.folds import exited_0
from psworker.testing import STEP_LINE, assert_processes_gone, checkpoint_step
from tests.cluster_utils import REPO, launch_script, run_launcher

# How promptly tasks exit (goal: under 1 s from a worker's last step) is measured by benchmarks/lifecycle.py; these
# tests check that each task says why it ends and exits by itself with the right code.


def test_port_open_and_wait_until_closed():
    """What the ps uses to see that a worker process has exited: a closed port answers at once."""
    import socket

    from psworker.task.shutdown import port_open, wait_until_closed

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    assert port_open(address)
    started = time.monotonic()
    assert not wait_until_closed({"worker:0": address}, timeout_secs=0.3, who="ps:0")
    assert time.monotonic() - started >= 0.3
    listener.close()
    assert not port_open(address)
    assert wait_until_closed({"worker:0": address}, timeout_secs=5, who="ps:0")


def test_is_reachable_answers_and_sees_a_server_that_just_came_up():
    """The readiness probe a worker runs before its session: a TF gRPC server answers, a closed port or a non-gRPC
    listener does not; a server started right after a refused probe is seen by the next probe. How soon (gRPC's
    shared subchannel of a refused address backs off for 1 s: issue #9 measured that as most of a worker's time to
    its first step) and how fast a probe answers: benchmarks/response_times.py, not here (no time bound in tests)."""
    import socket

    import tensorflow as tf

    from psworker.launcher.ports import pick_free_ports
    from psworker.task.server import is_reachable

    address = f"127.0.0.1:{pick_free_ports(1)[0]}"
    assert not is_reachable(address, timeout=10)    # refused: nothing listens yet (fails at once, whatever the timeout)
    tf.distribute.Server({"ps": [address]}, job_name="ps", task_index=0, protocol="grpc", start=True)
    assert all(is_reachable(address, timeout=10) for _ in range(5))

    plain = socket.socket()   # accepts TCP but speaks no gRPC
    plain.bind(("127.0.0.1", 0))
    plain.listen()
    try:
        assert not is_reachable(f"127.0.0.1:{plain.getsockname()[1]}", timeout=0.3)
    finally:
        plain.close()


class _SilentReader:
    """A `DoneReader` stand-in: no token ever comes; `stalled` says whether its runs stopped answering."""

    def __init__(self, stalled: bool = False):
        self.stalled = stalled
        self.stopped = False

    def get(self, timeout):
        time.sleep(min(timeout, 0.01))
        return None

    def stalled_for(self):
        return 1e6 if self.stalled else 0.0

    def stop(self):
        self.stopped = True


def _closed_ports_spec(tmp_path, n_workers: int, **train):
    from psworker.spec import load_spec
    from psworker.testing import write_spec

    return load_spec(write_spec(tmp_path / "c.yaml", num_ps=1, num_workers=n_workers, **train))


def test_a_ps_whose_workers_never_come_exits_complete_when_the_train_dir_says_so(tmp_path, caplog):
    """A ps restarted after training ended: no worker is ever up. After the larger of --workers_gone_timeout_secs
    and the spec's startup_timeout_secs it asks the train_dir: complete -> returns PS_COMPLETE (exit 0)."""
    from psworker.task import shutdown

    caplog.set_level("INFO")
    spec = _closed_ports_spec(tmp_path, 2, startup_timeout_secs=0.6, max_steps=150, train_dir=str(tmp_path))
    started = time.monotonic()
    how = shutdown.serve_ps_until_workers_done("unused", spec, 0, gone_timeout_secs=0.3, reader=_SilentReader(),
                                               complete=lambda s: 150)
    assert how == shutdown.PS_COMPLETE
    assert time.monotonic() - started >= 0.6
    assert re.search(r"ps:0: no worker for 0\.6 s, and the latest checkpoint in \S+ is at global step 150 "
                     r"\(max_steps 150\): training is complete", caplog.text), caplog.text


def test_a_ps_whose_workers_never_come_and_training_is_not_complete_exits_peer_gone(tmp_path):
    from psworker.errors import PeerGone
    from psworker.task import shutdown

    spec = _closed_ports_spec(tmp_path, 2, startup_timeout_secs=0.3, train_dir=str(tmp_path))
    with pytest.raises(PeerGone, match=r"ps:0: worker:0, worker:1 never came up within 0\.5 s \(the larger of "
                                       r"--workers_gone_timeout_secs and the spec's startup_timeout_secs\)"):
        shutdown.serve_ps_until_workers_done("unused", spec, 0, gone_timeout_secs=0.5, reader=_SilentReader(),
                                             complete=shutdown.training_complete)   # no checkpoint there


def test_a_ps_whose_done_queue_stalls_still_watches_the_workers(tmp_path, caplog):
    """The flaky exit of issue #7: the ps's only loop sat in a run on its own queue. Now the reads run in their own
    thread; the waiting loop sees the stall, says so, and still gives up on workers that are gone."""
    from psworker.errors import PeerGone
    from psworker.task import shutdown

    spec = _closed_ports_spec(tmp_path, 1, startup_timeout_secs=0.2)
    with pytest.raises(PeerGone, match="never came up"):
        shutdown.serve_ps_until_workers_done("unused", spec, 0, gone_timeout_secs=0.2,
                                             reader=_SilentReader(stalled=True), complete=lambda s: None)
    assert "ps:0: its done queue has not answered for" in caplog.text


def test_training_complete_reads_the_latest_checkpoint(tmp_path):
    import tensorflow as tf

    from psworker.task.shutdown import training_complete

    assert training_complete(_closed_ports_spec(tmp_path, 1, max_steps=5, train_dir=str(tmp_path / "t"))) is None
    with tf.Graph().as_default():
        step = tf.compat.v1.train.get_or_create_global_step()
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(step.assign(5))
            tf.compat.v1.train.Saver().save(sess, str(tmp_path / "t" / "model.ckpt"), global_step=step)
    assert training_complete(_closed_ports_spec(tmp_path, 1, max_steps=5, train_dir=str(tmp_path / "t"))) == 5
    assert training_complete(_closed_ports_spec(tmp_path, 1, max_steps=6, train_dir=str(tmp_path / "t"))) is None


def test_step_timeout_is_a_validated_train_setting():
    from psworker.errors import SpecError
    from psworker.spec import TrainConfig, merge_train

    assert TrainConfig().step_timeout_secs == 300.0
    assert merge_train(TrainConfig(), {"step_timeout_secs": "7.5"}).step_timeout_secs == 7.5
    with pytest.raises(SpecError, match=r"--step_timeout_secs: must be > 0, got 0"):
        merge_train(TrainConfig(), {"step_timeout_secs": "0"})


@pytest.mark.slow
def test_async_workers_started_before_the_ps_wait_then_everything_exits(tmp_path, make_cluster):
    cluster = make_cluster(train=dict(max_steps=300, batch_size=32, log_every_steps=100, save_checkpoint_steps=150),
                           argv=launch_script, start=False)
    cluster.start("worker:0", "worker:1")
    for name in ("worker:0", "worker:1"):
        cluster.wait_for_log(name, r"waiting for ps:0 at 127\.0\.0\.1:\d+", 120)
    cluster.start("ps:0")
    assert cluster.wait_exits(180) == {"worker:0": 0, "worker:1": 0, "ps:0": 0}, cluster.tails()
    for name in ("worker:0", "worker:1"):
        assert re.search(rf"{name}: done at global step \d+ after \d+ local steps", cluster.log(name))
    assert "ps:0: every worker is done; exiting" in cluster.log("ps:0")
    assert checkpoint_step(cluster.train_dir) >= 300
    assert_processes_gone(cluster.pids)


@pytest.mark.slow
def test_sync_with_two_ps_one_kept_running(tmp_path, make_cluster):
    """Sync, 2 ps: every worker ends at max_steps exactly; ps:0 exits by itself, ps:1 (started with
    --keep_ps_running) keeps serving."""
    from psworker.task.shutdown import port_open

    max_steps = 150
    cluster = make_cluster(num_ps=2, train=dict(mode="sync", max_steps=max_steps, batch_size=32, log_every_steps=50,
                                                save_checkpoint_steps=100),
                           args={"ps:1": ["--keep_ps_running"]}, argv=launch_script)
    assert cluster.wait_exits(180, ["worker:0", "worker:1", "ps:0"]) == {"worker:0": 0, "worker:1": 0, "ps:0": 0}, \
        cluster.tails()
    assert checkpoint_step(cluster.train_dir) == max_steps
    for i in range(2):
        assert f"done at global step {max_steps} after" in cluster.log(f"worker:{i}")
    assert "ps:0: every worker is done; exiting" in cluster.log("ps:0")
    cluster.wait_for_log("ps:1", r"ps:1: every worker is done; still serving \(--keep_ps_running\)", 30)
    assert cluster.exit_codes().get("ps:1") is None and port_open(str(cluster.spec.ps[1]))


@pytest.mark.slow
def test_a_worker_without_its_ps_gives_up_after_the_startup_timeout(tmp_path, make_cluster):
    cluster = make_cluster(args={"worker:1": ["--startup_timeout_secs", "3"]}, argv=launch_script, start=False)
    cluster.start("worker:1")
    assert cluster.wait_exit("worker:1", 120) == EXIT_PEER_GONE, cluster.tail("worker:1")
    log = cluster.log("worker:1")
    assert re.search(r"worker:1: waiting for ps:0 at 127\.0\.0\.1:\d+", log), log[-2000:]
    assert re.search(r"psworker: error: worker:1 gave up after 3 s \(--startup_timeout_secs\) waiting for ps:0 "
                     r"at 127\.0\.0\.1:\d+: is that task started, and is the address in the spec right\?", log), \
        log[-2000:]
    assert_processes_gone(cluster.pids)


@pytest.mark.slow
def test_a_worker_whose_ps_is_lost_mid_run_gives_up_saying_so_not_with_the_startup_hint(tmp_path, make_cluster):
    cluster = make_cluster(num_workers=1, train=dict(max_steps=1_000_000, batch_size=32, log_every_steps=10),
                           args={"worker:0": ["--startup_timeout_secs", "3"]}, argv=launch_script)
    cluster.wait_for_log("worker:0", STEP_LINE, 120)
    cluster.kill("ps:0")
    assert cluster.wait_exit("worker:0", 120) == EXIT_PEER_GONE, cluster.tail("worker:0")
    log = cluster.log("worker:0")
    assert re.search(r"psworker: error: worker:0 gave up after 3 s \(--startup_timeout_secs\) waiting for ps:0 at "
                     r"127\.0\.0\.1:\d+: it answered before and stopped in the middle of the run: was it "
                     r"killed", log), \
        log[-2000:]
    assert "is that task started" not in log, log[-2000:]
    assert_processes_gone(cluster.pids)


@pytest.mark.slow
def test_local_launcher_sync_run_the_ps_exits_by_itself(tmp_path):
    run = run_launcher([str(REPO / "cluster_specs" / "local-sync.yaml"), "--train_dir", str(tmp_path / "t"),
                        "--max_steps", "150", "--batch_size", "32", "--log_every_steps", "50"],
                       cwd=tmp_path, timeout=240)
    assert run.returncode == 0, run.output[-4000:]
    assert any("ps:0" in exited_0(line) for line in run.output.splitlines()), run.output[-3000:]
    assert not re.search(r"stopping [^\n]*ps:0", run.output), run.output[-3000:]
    assert "psworker: all 2 workers finished" in run.output
    assert checkpoint_step(tmp_path / "t") == 150
    assert_processes_gone(run.pids)


@pytest.mark.slow
def test_a_ps_whose_workers_all_crashed_exits_with_an_error(tmp_path, make_cluster):
    """Workers killed with -9 never say they are done: the ps gives up after --workers_gone_timeout_secs."""
    cluster = make_cluster(num_workers=1, train=dict(max_steps=1_000_000, log_every_steps=50),
                           args={"ps:0": ["--workers_gone_timeout_secs", "3"]}, argv=launch_script)
    cluster.wait_for_log("worker:0", STEP_LINE, 180)
    cluster.kill("worker:0")
    assert cluster.wait_exit("ps:0", 60) == EXIT_PEER_GONE, cluster.tail("ps:0")
    log = cluster.log("ps:0")
    assert "ps:0: every worker has gone away without saying it is done; waiting 3 s for them to come back" in log
    assert re.search(r"psworker: error: ps:0: every worker went away without saying it was done and none came back "
                     r"within 3 s \(--workers_gone_timeout_secs\)", log), cluster.tail("ps:0")
    assert_processes_gone(cluster.pids)


def test_a_task_started_by_itself_needs_fixed_ports(tmp_path):
    """`auto` ports are for `psworker local` only: a hand-started task cannot learn the port another one picked."""
    r = subprocess.run([str(REPO / "launch" / "start_ps.sh"), "--spec", str(REPO / "cluster_specs" / "local.yaml"),
                        "--task_index", "0"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PSWORKER_PYTHON": sys.executable})
    assert r.returncode == 2
    assert "cluster.ps[0]: automatic port 'localhost:auto' cannot go into a ps task started by itself" in r.stderr


@pytest.mark.slow
def test_a_ps_restarted_after_training_ended_exits_0(tmp_path, make_cluster):
    """Issue #7: a ps started again after every worker had finished used to serve forever (empty done queue, workers
    never seen). It gives the workers the spec's startup_timeout_secs to come, finds the train_dir's checkpoint at
    max_steps, and exits 0. (The spec it restarts with waits 4 s, not the 15 s the first run gave its workers.)"""
    max_steps, restart_wait = 60, 4
    cluster = make_cluster(train=dict(max_steps=max_steps, batch_size=32, log_every_steps=20, startup_timeout_secs=15.0),
                           args={"ps:0": ["--workers_gone_timeout_secs", "3"]}, argv=launch_script)
    assert cluster.wait_exits(180) == {"ps:0": 0, "worker:0": 0, "worker:1": 0}, cluster.tails()
    assert checkpoint_step(cluster.train_dir) >= max_steps
    spec = yaml.safe_load(cluster.spec_path.read_text())
    spec["train"]["startup_timeout_secs"] = float(restart_wait)
    cluster.spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
    cluster.restart("ps:0")
    assert cluster.wait_exit("ps:0", 120) == 0, cluster.tail("ps:0")
    log = cluster.log("ps:0", current=True)
    assert re.search(rf"ps:0: no worker for {restart_wait} s, and the latest checkpoint in \S+ is at global step \d+ "
                     rf"\(max_steps {max_steps}\): training is complete", log), log[-2000:]
    assert "ps:0: training is complete; exiting" in log
    assert_processes_gone(cluster.pids)
