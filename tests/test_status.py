"""Live status and `psworker status RUN_DIR`: over fake tasks and hand-written run directories (no TensorFlow)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import threading
import time

from psworker.launcher.console.lines import by_task
from psworker.launcher.launch import run_local
from psworker.launcher.console.status import read_run_dir
from psworker.spec import TrainConfig, build_cluster
from tests.cluster_utils import task_env
from tests.fake_tasks.fakes import wait_for

STEP = "step {}, loss = 0.{} (1000.0 examples/sec; 0.030 sec/batch)"


def make_run_dir(tmp_path, old: float):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "cluster.yaml").write_text("cluster: {ps: ['127.0.0.1:2221'], worker: ['127.0.0.1:2222', "
                                      "'127.0.0.1:2223', '127.0.0.1:2224']}\ntrain: {max_steps: 500}\n")
    (run / "logs" / "ps-0.log").write_text("ps:0 serving\n--- restart 1 (killed by SIGKILL) at x ---\nps:0 serving\n")
    (run / "logs" / "worker-0.log").write_text("\n".join(STEP.format(s, s % 7) for s in (100, 200, 300)) + "\n")
    (run / "logs" / "worker-1.log").write_text(STEP.format(120, 5) + "\nworker:1: done at global step 500 x\n")
    for name in ("ps-0", "worker-0"):
        os.utime(run / "logs" / f"{name}.log", (old, old))
    return run


def test_status_of_a_run_dir_reads_steps_restarts_and_silence(tmp_path):
    now = time.time()
    run = make_run_dir(tmp_path, now - 120)
    status = read_run_dir(run, now=now)
    assert status.global_step == 500 and status.max_steps == 500      # worker:1: "done at global step 500"
    t = status.tasks
    assert (t["ps:0"].restarts, t["ps:0"].state) == (1, "running")
    assert (t["worker:0"].step, t["worker:0"].state, t["worker:0"].loss) == (300, "training", 0.6)
    assert t["worker:1"].state == "done" and t["worker:2"].state == "not started"
    out = subprocess.run([sys.executable, "-m", "psworker", "status", str(run), "--silent_secs", "60"],
                         capture_output=True, text=True, env=task_env(), timeout=60)
    assert out.returncode == 0, out.stderr
    assert "step 500/500" in out.stdout and "silent: worker:0 since" in out.stdout
    assert "silent: ps:0 since" in out.stdout and "silent: worker:1" not in out.stdout
    out = subprocess.run([sys.executable, "-m", "psworker", "status", str(run), "--json"], capture_output=True,
                         text=True, env=task_env(), timeout=60)
    doc = json.loads(out.stdout)
    assert doc["silent"] == ["ps:0", "worker:0"] and doc["tasks"]["worker:0"]["step"] == 300
    assert doc["tasks"]["worker:0"]["silent_secs"] >= 119


def test_status_without_a_run_dir_is_an_error(tmp_path):
    out = subprocess.run([sys.executable, "-m", "psworker", "status", str(tmp_path)], capture_output=True,
                         text=True, env=task_env(), timeout=60)
    assert out.returncode == 2 and "cluster.yaml: no such file" in out.stderr


def spec(train_dir):
    return build_cluster(["h:auto"], ["h:auto", "h:auto"], "s.yaml", train=TrainConfig(max_steps=7,
                                                                                       train_dir=str(train_dir)))


def test_off_a_terminal_plain_status_lines_are_printed(tmp_path, fake_python, monkeypatch):
    """The workers finish only once a status line was printed (a handshake, not a sleep against the interval)."""
    release = tmp_path / "release-workers"
    monkeypatch.setenv("PSWORKER_FAKE_PS_SECS", "60")
    monkeypatch.setenv("PSWORKER_FAKE_WORKER_WAIT_FOR", str(release))
    console = io.StringIO()

    def release_after_a_status_line() -> None:
        with contextlib.suppress(AssertionError):    # on a timeout the workers give up and the asserts say why
            wait_for(lambda: done.is_set() or "psworker: status: step " in console.getvalue(), 60, "a status line")
        release.touch()

    done = threading.Event()
    releaser = threading.Thread(target=release_after_a_status_line)
    releaser.start()
    try:
        assert run_local(spec(tmp_path / "t"), console=console, python=fake_python, grace_period_secs=2.0,
                         ps_exit_grace_secs=0.2, live=None, status_every_secs=0.2) == 0, console.getvalue()
    finally:
        done.set()
        releaser.join(70)
    lines = [line for line in console.getvalue().splitlines() if line.startswith("psworker: status: step ")]
    assert lines and "/7, " in lines[0] and "worker:1 " in lines[-1], console.getvalue()


def test_the_live_view_shows_task_output_and_the_task_table(tmp_path, fake_python, monkeypatch):
    monkeypatch.setenv("PSWORKER_FAKE_PS_SECS", "60")
    console = io.StringIO()
    assert run_local(spec(tmp_path / "t"), console=console, python=fake_python, grace_period_secs=2.0,
                     ps_exit_grace_secs=0.2, live=True) == 0
    out = console.getvalue()
    assert {"worker:1 step 24", "<task> step 24"} & set(by_task(out)["worker:1"]), out[-2000:]   # maybe grouped
    assert "task" in out and "worker:1" in out and "done" in out and "state" in out, out[-2000:]


def _status(run) -> str:
    out = subprocess.run([sys.executable, "-m", "psworker", "status", str(run)], capture_output=True, text=True,
                         env=task_env(), timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_status_of_a_finished_run_says_how_it_ended_and_its_final_precision(tmp_path, fake_python, monkeypatch):
    from psworker import events
    from psworker.launcher.rundir import read_end

    run = tmp_path / "t"
    monkeypatch.setenv("PSWORKER_FAKE_PS_SECS", "60")
    monkeypatch.setenv("PSWORKER_FAKE_EXIT", "worker:1=3")
    assert run_local(spec(run), console=io.StringIO(), python=fake_python, grace_period_secs=2.0,
                     ps_exit_grace_secs=0.2) == 3
    end = read_end(run)
    assert (end.outcome, end.exit_status, end.first_failure) == ("failed", 3, "worker:1"), end
    out = _status(run)
    assert (f"ended: the run failed after {end.seconds:.1f} s (exit 3) at {end.ended_at}: worker:1 exited with "
            "exit code 3\n") in out
    assert "final evaluation" not in out

    monkeypatch.delenv("PSWORKER_FAKE_EXIT")      # the same run dir goes on, and succeeds: a new record
    assert run_local(spec(run), console=io.StringIO(), python=fake_python, grace_period_secs=2.0,
                     ps_exit_grace_secs=0.2) == 0
    with open(run / "logs" / "worker-0.log", "a") as log:     # the chief's last line, as it prints it
        print(events.Precision(0.972, 359, 7, at="2026-12-02 12:00:00").render(), file=log)
    end = read_end(run)
    assert (end.outcome, end.exit_status, end.first_failure) == ("succeeded", 0, None), end
    out = _status(run)
    assert f"ended: the run succeeded after {end.seconds:.1f} s (exit 0) at {end.ended_at}\n" in out
    assert "final evaluation: precision @ 1 = 0.972 (359 examples, global step 7)\n" in out
    doc = json.loads(subprocess.run([sys.executable, "-m", "psworker", "status", str(run), "--json"],
                                    capture_output=True, text=True, env=task_env(), timeout=60).stdout)
    assert doc["ended"]["outcome"] == "succeeded" and doc["precision"] == {"precision": 0.972, "examples": 359,
                                                                           "global_step": 7}
    with open(run / "logs" / "worker-0.log", "a") as log:     # a click-through model's last line instead
        print(events.AucResult(0.8561, 0.4628, 4000, 9, at="2026-12-02 12:00:01").render(), file=log)
    assert "final evaluation: auc = 0.8561, logloss = 0.4628 (4000 examples, global step 9)\n" in _status(run)
    doc = json.loads(subprocess.run([sys.executable, "-m", "psworker", "status", str(run), "--json"],
                                    capture_output=True, text=True, env=task_env(), timeout=60).stdout)
    assert doc["precision"] == {"auc": 0.8561, "logloss": 0.4628, "examples": 4000, "global_step": 9}


def test_a_run_in_progress_has_no_ending(tmp_path):
    now = time.time()
    run = make_run_dir(tmp_path, now - 120)
    assert read_run_dir(run, now=now).ended is None
    assert "ended:" not in _status(run)


def test_a_run_stopped_by_a_signal_is_recorded_as_stopped():
    from psworker.launcher.launch import run_end
    from psworker.launcher.console.report import RunResult

    end = run_end(RunResult(ok=False, exits={}, failure=None, reason="launcher received SIGINT"), 2, 130, 12.34)
    assert (end.outcome, end.exit_status, end.seconds) == ("stopped", 130, 12.3)
    assert end.describe() == f"was stopped after 12.3 s (exit 130) at {end.ended_at}: launcher received SIGINT"


def test_the_step_is_never_shown_past_max_steps():
    """Async workers finishing the steps they had begun push the global step past max_steps (6001 of 6000)."""
    from rich.console import Console

    from psworker.launcher.console.progress import Progress
    from psworker.launcher.console.status import RunStatus, plain_line, render

    progress = Progress(["worker:0"])
    for max_steps, shown in ((6000, "step 6000/6000"), (7000, "step 6001/7000"), (None, "step 6001")):
        s = RunStatus(progress.snapshot(), 6001, max_steps, None, time.time())
        assert plain_line(s).startswith(f"psworker: status: {shown}, "), plain_line(s)
        out = io.StringIO()
        Console(file=out, width=200).print(render(s))
        assert out.getvalue().startswith(shown + " "), out.getvalue()


def test_only_psworker_status_has_a_silent_column(tmp_path):
    """The live view has no "silent" column (empty in a short run; a serving ps prints nothing); status fills it."""
    from rich.console import Console

    from psworker.launcher.console.status import render

    now = time.time()
    status = read_run_dir(make_run_dir(tmp_path, now - 120), now=now)
    for silent_after, header, cell in ((None, False, False), (60.0, True, True)):
        out = io.StringIO()
        Console(file=out, width=200).print(render(status, silent_after))
        table = out.getvalue().splitlines()
        assert ("silent" in table[1]) is header and (" 120 s" in table[3]) is cell, out.getvalue()  # worker:0's row


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_launchers_own_lines_print_above_the_live_view():
    """The launcher's events (scale, join, leave, restarts) are log records: on a terminal they go above the live
    view, not to the raw stream that the view's next refresh overwrites (rich's Live replaces sys.stderr while it
    runs, so the handlers must be found by the streams they had before)."""
    import logging
    from types import SimpleNamespace

    from psworker.launcher.console.status import live_view

    handler = logging.StreamHandler(sys.stderr)      # as `psworker.cli` configures the launcher's logging
    root = logging.getLogger()
    root.addHandler(handler)
    terminal = _Terminal()
    config = SimpleNamespace(command=("x",), live=True, status_every_secs=60.0)
    try:
        with live_view(config, [], terminal):
            logging.getLogger("psworker.launcher.elastic.workers").warning("scale 2 -> 4 workers (request 1)")
    finally:
        root.removeHandler(handler)
    assert "scale 2 -> 4 workers (request 1)" in terminal.getvalue(), terminal.getvalue()
    assert handler.stream is sys.stderr


# -- the truth of `psworker status` once a run is over, from hand-written run dirs --------------------------------

def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_an_ended_run_without_task_records_shows_no_task_running(tmp_path):
    """An ended run whose launcher left no tasks.json (an older psworker): a task its log leaves running is shown
    `gone`, never running or training."""
    from psworker.launcher.rundir import RunEnd, write_end

    now = time.time()
    run = make_run_dir(tmp_path, now - 120)
    write_end(run, RunEnd("failed", 3, "worker:1 exited with exit code 3", 12.0, "2026-12-05 08:00:00", "worker:1"))
    s = read_run_dir(run, now=now)
    assert {n: t.state for n, t in s.tasks.items()} == {"ps:0": "gone", "worker:0": "gone", "worker:1": "done",
                                                        "worker:2": "not started"}
    out = _status(run)
    assert "running" not in out and "training" not in out and "silent" not in out, out


def test_a_launcher_whose_pid_is_dead_is_gone_and_its_tasks_with_it(tmp_path):
    """The lock file names a launcher pid that no longer runs here; tasks.json names its tasks, one still alive
    (this test's own process): that one keeps its state and is named, the others are gone."""
    import socket

    from psworker.launcher.runstate import TASKS_FILE, TaskRecord
    from psworker.traindir_lock import LOCK_FILE, Holder

    now = time.time()
    run = make_run_dir(tmp_path, now - 120)
    host = socket.gethostname()
    (run / LOCK_FILE).write_text(Holder(_dead_pid(), host, now - 200, "launcher").render())
    records = {"ps:0": TaskRecord("ps:0", os.getpid(), host, "running", 1),
               "worker:0": TaskRecord("worker:0", _dead_pid(), host, "training"),
               "worker:1": TaskRecord("worker:1", _dead_pid(), host, "done", 0, 0)}
    (run / TASKS_FILE).write_text(json.dumps({"launcher": {"pid": 1, "host": host, "since": now - 200},
                                              "tasks": {n: r.__dict__ for n, r in records.items()}}))
    (run / "checkpoint").write_text('model_checkpoint_path: "model.ckpt-5060"\n')
    s = read_run_dir(run, now=now)
    assert {n: t.state for n, t in s.tasks.items()} == {"ps:0": "running", "worker:0": "gone", "worker:1": "done",
                                                        "worker:2": "not started"}
    assert s.tasks["worker:1"].exit == "exit code 0" and s.tasks["ps:0"].pid == os.getpid()
    assert s.global_step == 5060, "the step lines stop at 500; the checkpoint saved after them is the step"
    out = _status(run)
    assert (f"is gone; the run did not end cleanly; the last checkpoint is step 5,060; still running without it: "
            f"ps:0 (pid {os.getpid()})") in out, out
    assert "eta -" in out and "silent" not in out, out

    records["worker:0"] = TaskRecord("worker:0", 4242, "another-host", "training")    # no telling from here
    (run / TASKS_FILE).write_text(json.dumps({"launcher": {"pid": 1, "host": host, "since": now - 200},
                                              "tasks": {n: r.__dict__ for n, r in records.items()}}))
    assert read_run_dir(run, now=now).tasks["worker:0"].state == "training"
    assert "on other hosts, maybe still running: worker:0 (pid 4242 on another-host)" in _status(run)


def test_a_foreign_launcher_is_gone_once_its_lock_is_not_refreshed(tmp_path):
    from psworker.traindir_lock import FOREIGN_STALE_SECS, LOCK_FILE, Holder

    now = time.time()
    run = make_run_dir(tmp_path, now - 120)
    lock = run / LOCK_FILE
    lock.write_text(Holder(4242, "another-host", now - 500, "launcher").render())
    os.utime(lock, (now - 5, now - 5))
    assert read_run_dir(run, now=now).launcher.gone == ""
    os.utime(lock, (now - FOREIGN_STALE_SECS - 15, now - FOREIGN_STALE_SECS - 15))
    s = read_run_dir(run, now=now)
    assert s.launcher.gone == "its lock file was last refreshed 75 s ago" and s.over, s.launcher
    assert {t.state for t in s.tasks.values()} == {"gone", "done", "not started"}


def test_steps_per_sec_comes_from_the_timestamped_lines_since_the_step_last_went_back():
    from psworker import events
    from psworker.launcher.console.runread import steps_per_sec

    def record(t: float, event) -> str:
        return events.LogRecord(t, "INFO", "psworker.train.hooks", None, event.render()).render()

    t0 = 1_800_000_000.0
    chief = "\n".join([record(t0, events.FirstStep("worker:0", 0)),
                       record(t0 + 10, events.CheckpointSaved("worker:0", 1000)),      # then the ps went away
                       record(t0 + 20, events.CheckpointSaved("worker:0", 500)),       # ... restored at 500
                       record(t0 + 30, events.CheckpointSaved("worker:0", 800)), "step 900"])
    assert steps_per_sec([(chief, t0 + 40)]) == 20.0       # (900 - 500) / (40 - 20)
    assert steps_per_sec([(chief.replace("step 900", ""), t0 + 40)]) == 300 / 20     # its last point: step 800
    assert steps_per_sec([("step 3", t0)]) is None


def test_a_rollback_is_one_line_with_the_steps_given_up():
    from psworker import events
    from psworker.launcher.supervise.rollback import Rollbacks, rollback_line

    assert (rollback_line(["ps:1"], 5060, events.ModelStart("worker:0", "model.ckpt-4016"))
            == "ps:1 restarted: the model goes back from step 5,060 to the checkpoint of step 4,016 (1,044 steps "
               "given up)")
    rollbacks = Rollbacks()
    assert rollbacks.seen("worker:0", events.ModelStart("worker:0", "model.ckpt-7")) is None   # a resumed run
    rollbacks.ps_restarted("ps:0", 40)
    rollbacks.ps_restarted("ps:1", 41)
    assert rollbacks.seen("worker:0", events.Step(41)) is None
    assert (rollbacks.seen("worker:0", events.ModelStart("worker:0", None))
            == "ps:0-1 restarted: the model goes back from step 41 to step 0 (no checkpoint had been saved) (41 steps "
               "given up)")
    assert rollbacks.seen("worker:0", events.ModelStart("worker:0", "model.ckpt-7")) is None     # said once


def test_the_restart_hint_names_max_restarts_where_a_restart_would_have_helped():
    from psworker.launcher.console.report import RunResult, TaskExit, TaskFailure, restart_hint

    def failed(name: str, code: int, restarts: int = 0) -> RunResult:
        exits = {name: TaskExit(name, code, 0.0, 1.0, "x.log", restarts)}
        return RunResult(False, exits, TaskFailure(name, code, (), 1.0, f"exited with code {code}"))

    hint = restart_hint(failed("worker:1", -9), 0, "worker:0")
    assert hint.startswith("hint: worker:1 exited with code -9: an exit the launcher retries with --max_restarts N "
                           "(default 0), e.g. --max_restarts 3: ") and "rejoins at the ps tasks' global step" in hint
    assert "restores the last checkpoint" in restart_hint(failed("ps:0", 137), 0, "worker:0")
    assert "goes on from the model the ps tasks hold" in restart_hint(failed("worker:0", 170), 0, "worker:0")
    assert restart_hint(failed("worker:1", -9, restarts=2), 2, "worker:0") == (
        "hint: worker:1 exited with code -9 after its 2 restarts (--max_restarts 2): a larger --max_restarts lets "
        "it come back again")
    assert restart_hint(failed("worker:1", 3), 0, "worker:0") is None          # a permanent exit: no restart helps
    assert restart_hint(RunResult(True, {}, None), 0, "worker:0") is None


class _ConsoleGone(io.StringIO):
    """A console whose reader went away before the report (`psworker local ... | tee log` and Ctrl-C)."""

    def write(self, text: str) -> int:
        if "finished in" in text or "run succeeded" in text:
            raise BrokenPipeError(32, "Broken pipe")
        return super().write(text)


def test_the_end_is_recorded_when_the_report_cannot_be_printed(tmp_path, fake_python, monkeypatch):
    from psworker.launcher.rundir import read_end

    monkeypatch.setenv("PSWORKER_FAKE_PS_SECS", "60")
    run = tmp_path / "t"
    try:
        run_local(spec(run), console=_ConsoleGone(), python=fake_python, grace_period_secs=2.0, ps_exit_grace_secs=0.2)
    except BrokenPipeError:
        pass
    end = read_end(run)
    assert end is not None and (end.outcome, end.exit_status) == ("succeeded", 0), end
    assert "ended: the run succeeded" in _status(run)


def test_the_epoch_shown_at_the_end_is_the_chiefs_data_line_not_the_last_step_line():
    """A short sync run's last step line said epoch 27.37 of 30, and `psworker status` showed that after the run had
    ended at 30.09 (the chief's data line)."""
    from psworker import events
    from psworker.launcher.console.progress import Progress
    from psworker.launcher.console.status import RunStatus, plain_line

    progress = Progress(["worker:0"])
    step = "step 338, loss = 0.05, epoch 27.37 of 30 (5000.0 examples/sec; 0.010 sec/batch)"
    progress.record("worker:0", events.parse_line(step))
    s = RunStatus(progress.snapshot(), 338, 1000, None, time.time())
    assert "epoch 27.37 of 30" in plain_line(s), plain_line(s)
    progress.record("worker:0", events.parse_line("worker:0: data: 43264 examples trained, 0 of them again; epoch 30.09 "
                                                  "(1438 examples each); 337 batches dropped (stale) and computed again"))
    s = RunStatus(progress.snapshot(), 338, 1000, None, time.time())
    assert "epoch 30.09 of 30" in plain_line(s), plain_line(s)
