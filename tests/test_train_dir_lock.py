"""One run per train dir (issue 24, section 4): `psworker.traindir_lock` on real files and processes, and two real
`psworker local` launchers on one train dir: the second is refused (exit 2, naming the holder) while the first runs,
a chief started by hand is refused too, and after `kill -9` of the first launcher and its tasks the next one takes
the stale lock over with a line saying so."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from psworker import traindir_lock
from psworker.errors import EXIT_USAGE, UsageError
from psworker.testing import assert_processes_gone, processes_naming
from psworker.traindir_lock import HOLDER_ENV, LOCK_FILE, Holder
from tests.cluster_utils import Background, run_launcher, task_env

RUN_SECS = 300
STEP = re.compile(r"\[worker:0\] step (\d+)")


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _write_holder(tmp_path, holder: Holder, age_secs: float = 0.0) -> None:
    path = tmp_path / LOCK_FILE
    path.write_text(holder.render())
    if age_secs:
        then = time.time() - age_secs
        os.utime(path, (then, then))


def test_a_second_holder_is_refused_naming_the_first(tmp_path):
    with traindir_lock.hold(tmp_path) as first:
        assert Holder.parse((tmp_path / LOCK_FILE).read_text()) == first.holder
        with pytest.raises(UsageError) as refused:
            with traindir_lock.hold(tmp_path):
                pass
        assert refused.value.exit_code == EXIT_USAGE
        assert f"launcher pid {os.getpid()} on {socket.gethostname()} since" in str(refused.value)
        with pytest.raises(UsageError, match="in use by psworker launcher"):
            with traindir_lock.chief_lock(tmp_path, env={}):
                pass
    assert (tmp_path / LOCK_FILE).read_text() == ""        # released: emptied and unlocked
    with traindir_lock.hold(tmp_path):
        pass


def test_the_chief_of_the_launcher_that_holds_the_lock_goes_on(tmp_path):
    with traindir_lock.hold(tmp_path) as launcher:
        with traindir_lock.chief_lock(tmp_path, env={HOLDER_ENV: launcher.holder.token}) as chief:
            assert chief is None
        with pytest.raises(UsageError, match=r"this chief's launcher: 1@elsewhere"):
            with traindir_lock.chief_lock(tmp_path, env={HOLDER_ENV: "1@elsewhere"}):
                pass
    with traindir_lock.chief_lock(tmp_path, env={HOLDER_ENV: launcher.holder.token}) as chief:   # launcher gone
        assert chief is not None and chief.holder.role == "chief"


def test_a_stale_lock_of_a_dead_process_is_taken_over_with_a_line(tmp_path, caplog):
    dead = Holder(_dead_pid(), socket.gethostname(), time.time() - 5, "launcher")
    _write_holder(tmp_path, dead)
    with caplog.at_level(logging.WARNING, logger="psworker.traindir_lock"):
        with traindir_lock.hold(tmp_path) as lock:
            assert lock.holder.pid == os.getpid()
    assert any(f"taking over the lock of psworker launcher pid {dead.pid}" in r.getMessage()
               and "that process is gone" in r.getMessage() for r in caplog.records), caplog.text


def test_without_flock_a_live_holder_named_in_the_file_is_respected(tmp_path):
    """flock let us in (as on NFS mounted nolock), but the file names a live process here: refused."""
    _write_holder(tmp_path, Holder(os.getppid(), socket.gethostname(), time.time(), "chief"))
    with pytest.raises(UsageError, match=rf"psworker chief pid {os.getppid()} on"):
        with traindir_lock.hold(tmp_path):
            pass


def test_another_hosts_lock_is_respected_while_fresh_and_taken_over_when_stale(tmp_path, caplog):
    other = Holder(4242, "some-other-host", time.time() - 3600, "launcher")
    _write_holder(tmp_path, other)
    with pytest.raises(UsageError, match="pid 4242 on some-other-host"):
        with traindir_lock.hold(tmp_path):
            pass
    _write_holder(tmp_path, other, age_secs=traindir_lock.FOREIGN_STALE_SECS + 30)
    with caplog.at_level(logging.WARNING, logger="psworker.traindir_lock"):
        with traindir_lock.hold(tmp_path):
            pass
    assert "last refreshed" in caplog.text and "some-other-host" in caplog.text


def _spec(path):
    path.write_text("cluster:\n  ps: [\"localhost:auto\"]\n  worker: [\"localhost:auto\"]\n"
                    "train:\n  model: mlp\n  mode: async\n  batch_size: 32\n  log_every_steps: 10\n"
                    "  save_checkpoint_steps: 20\n")
    return path


def test_second_launcher_refused_and_after_kill_9_the_next_takes_over(tmp_path):
    spec, train = _spec(tmp_path / "spec.yaml"), tmp_path / "train"
    args = [str(spec), "--train_dir", str(train), "--network", "host", "--console", "plain"]
    first = Background([sys.executable, "-m", "psworker", "local", *args, "--max_steps", "1000000"], tmp_path)
    try:
        first.wait_for(STEP, RUN_SECS, at_least=20)          # its chief was not refused: it trains
        second = run_launcher([*args, "--max_steps", "100"], tmp_path, 120)
        assert second.returncode == EXIT_USAGE, second.output[-3000:]
        holder = f"psworker launcher pid {first.proc.pid} on {socket.gethostname()} since"
        assert f"psworker: error: train dir {train} is in use by {holder}" in second.output, second.output[-3000:]
        assert "starting" not in second.output                # refused before anything was written or started
        by_hand = subprocess.run([sys.executable, "-m", "psworker", "worker", "--spec", str(train / "cluster.yaml"),
                                  "--task_index", "0", "--train_dir", str(train)], env=task_env(),
                                 capture_output=True, text=True, timeout=120)
        assert by_hand.returncode == EXIT_USAGE and holder in by_hand.stderr, by_hand.stderr[-3000:]
        first.pids.update([first.proc.pid])
        os.killpg(first.proc.pid, signal.SIGKILL)             # the launcher and its tasks, at once
        first.wait(30)
        assert_processes_gone(first.pids)
    finally:
        first.close()
    third = run_launcher([*args, "--max_steps", "60"], tmp_path, RUN_SECS)
    assert third.returncode == 0, third.output[-3000:]
    assert (f"taking over the lock of psworker launcher pid {first.proc.pid} on {socket.gethostname()}"
            in third.output), third.output[-3000:]
    assert "that process is gone" in third.output
    print(next(line for line in second.output.splitlines() if "in use by" in line))
    print(next(line for line in third.output.splitlines() if "taking over" in line))
    assert not processes_naming(train)


def test_the_launchers_chief_is_not_refused_when_restarted(tmp_path):
    spec, train = _spec(tmp_path / "spec.yaml"), tmp_path / "train"
    run = run_launcher([str(spec), "--train_dir", str(train), "--network", "host", "--console", "plain", "--max_steps", "100",
                        "--max_restarts", "1", "--inject", "kill:worker:0@step=40"], tmp_path, RUN_SECS)
    assert run.returncode == 0, run.output[-3000:]
    log = (train / "logs" / "worker-0.log").read_text(errors="replace")
    restarted = log[log.index("--- restart 1 (injected kill:worker:0@step=40)"):]
    assert "locked by this task's launcher (psworker launcher pid" in restarted, restarted[-3000:]
    assert re.search(r"worker:0: done at global step 1\d\d after", restarted), restarted[-3000:]   # it trained on
    assert (train / LOCK_FILE).read_text() == ""          # the launcher released it at the end
