"""Supervisor tests: real subprocesses running the tiny programs in tests/fake_tasks (no TensorFlow)."""

from __future__ import annotations

import io
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from psworker.testing import ProgramTask
from tests.fake_tasks.fakes import HERE, fake, kill_quietly, drive_until, task_state, wait_for, wait_gone
from psworker.launcher.backends.local import LocalBackend
from psworker.launcher.console.report import exit_status, format_report
from psworker.launcher.supervise.supervisor import Supervisor

REPO = Path(__file__).resolve().parents[1]


def log_text(sup: Supervisor, name: str) -> str:
    return sup.log_path(name).read_text()


def wait_ready(sup: Supervisor, *names: str, timeout: float = 15.0) -> None:
    for name in names:
        path = sup.log_path(name)
        wait_for(lambda: path.exists() and "ready" in path.read_text(), timeout, f"{name} ready")


def test_success_prefixes_console_and_writes_full_logs(make_supervisor):
    console = io.StringIO()
    sup = make_supervisor([
        fake("ps", 0, "sleep_forever"),
        fake("worker", 0, "echo_exit", 0, "--tag", "w0", "--stderr"),
        fake("worker", 1, "echo_exit", 0, "--tag", "w1", "--sleep", "0.3"),
    ], console=console)
    sup.start()
    wait_ready(sup, "ps:0")     # before the first poll: nothing can stop the ps before it said so
    result = sup.wait(timeout=30)

    assert result.ok and result.failure is None
    assert {n: e.returncode for n, e in result.exits.items() if n != "ps:0"} == {"worker:0": 0, "worker:1": 0}
    assert result.exits["ps:0"].stopped and not result.exits["worker:0"].stopped
    lines = console.getvalue().splitlines()
    for expected in ("[worker:0] w0 line 0", "[worker:0] w0 line 2", "[worker:0] w0 to stderr",
                     "[worker:1] w1 line 2", "[ps:0] ready"):
        assert expected in lines
    assert log_text(sup, "worker:0").splitlines() == ["w0 line 0", "w0 line 1", "w0 line 2", "w0 to stderr"]
    assert sup.log_path("worker:1").name == "worker-1.log"
    assert result.exits["worker:1"].log_path == str(sup.log_path("worker:1"))
    report = format_report(result)
    assert "run succeeded" in report and "worker:1" in report and "stopped by launcher" in report


def test_task_env_is_added_to_the_environment(make_supervisor, monkeypatch):
    monkeypatch.setenv("PSWORKER_TEST_INHERITED", "from-parent")
    sup = make_supervisor([
        fake("worker", 0, "echo_exit", 0, "--print-env", "PSWORKER_TEST_TASK",
             env={"PSWORKER_TEST_TASK": "a b"}),
        fake("worker", 1, "echo_exit", 0, "--print-env", "PSWORKER_TEST_INHERITED"),
    ])
    sup.start()
    assert sup.wait(timeout=30).ok
    assert "PSWORKER_TEST_TASK=a b" in log_text(sup, "worker:0")
    assert "PSWORKER_TEST_INHERITED=from-parent" in log_text(sup, "worker:1")


def test_ps_that_exits_by_itself_is_not_stopped(make_supervisor, tmp_path):
    release = tmp_path / "release-ps"
    sup = make_supervisor([fake("ps", 0, "echo_exit", 0, "--wait-for", release), fake("worker", 0, "echo_exit", 0)],
                   ps_exit_grace_secs=20.0)
    sup.start()
    drive_until(sup, lambda: task_state(sup, "worker:0") == "done", 30, "worker:0 seen to exit 0")
    release.touch()              # the ps exits only after the run is done, as a real one does
    result = sup.wait(timeout=30)
    assert result.ok
    assert result.exits["ps:0"].returncode == 0 and not result.exits["ps:0"].stopped


def test_ps_that_does_not_exit_is_stopped_after_workers_succeed(make_supervisor):
    sup = make_supervisor([fake("ps", 0, "sleep_forever"), fake("ps", 1, "sleep_forever"),
                    fake("worker", 0, "echo_exit", 0)],
                   ps_exit_grace_secs=0.5)
    sup.start()
    pids = sup.pids()
    start = time.monotonic()
    result = sup.wait(timeout=30)
    assert result.ok and result.failure is None
    assert result.exits["ps:1"].stopped and result.exits["ps:1"].returncode == -signal.SIGTERM
    assert time.monotonic() - start >= 0.5
    wait_gone(list(pids.values()), 5)


def test_one_failing_task_tears_down_the_others_and_is_reported(make_supervisor):
    sup = make_supervisor([
        fake("ps", 0, "sleep_forever"),
        fake("worker", 0, "sleep_forever"),
        fake("worker", 1, "echo_exit", 3, "--lines", "30", "--tag", "w1"),
    ])
    sup.start()
    pids = sup.pids()
    result = sup.wait(timeout=30)

    assert not result.ok
    assert result.failure.name == "worker:1" and result.failure.returncode == 3
    assert result.failure.log_tail == tuple(f"w1 line {i}" for i in range(10, 30))
    assert result.exits["worker:0"].stopped and result.exits["ps:0"].stopped
    assert not result.exits["worker:1"].stopped
    wait_gone(list(pids.values()), 5)
    report = format_report(result)
    assert report.splitlines()[0].startswith("psworker: run failed: worker:1 exited with exit code 3")
    assert "w1 line 29" in report and "w1 line 9\n" not in report
    assert "first failure" in report and "ps:0" in report
    assert exit_status(result.failure.returncode) == 3


def test_ps_exiting_while_workers_run_fails_the_run(make_supervisor):
    sup = make_supervisor([fake("ps", 0, "echo_exit", 0, "--tag", "ps"), fake("worker", 0, "sleep_forever")])
    sup.start()
    result = sup.wait(timeout=30)
    assert not result.ok
    assert result.failure.name == "ps:0" and "while workers were still running" in result.failure.reason
    assert result.exits["worker:0"].stopped


def test_the_first_failure_by_time_is_the_root_cause(make_supervisor, tmp_path):
    """worker:0 would fail later (exit 5 once a file appears, which only happens after the run): the first failure
    ends the run, and worker:0 is stopped rather than reported."""
    sup = make_supervisor([
        fake("worker", 0, "echo_exit", 5, "--wait-for", tmp_path / "never"),
        fake("worker", 1, "echo_exit", 7),
    ])
    sup.start()
    result = sup.wait(timeout=30)
    assert result.failure.name == "worker:1" and result.failure.returncode == 7
    assert result.exits["worker:0"].stopped and result.exits["worker:0"].returncode == -signal.SIGTERM


def test_term_ignoring_task_is_killed_after_the_grace_period(make_supervisor):
    sup = make_supervisor([fake("worker", 0, "ignore_term"), fake("worker", 1, "sleep_forever")],
                   grace_period_secs=1.0)
    sup.start()
    wait_ready(sup, "worker:0", "worker:1")
    pids = sup.pids()
    start = time.monotonic()
    result = sup.stop("test")
    elapsed = time.monotonic() - start

    assert not result.ok and result.reason == "test" and result.failure is None
    assert result.exits["worker:0"].returncode == -signal.SIGKILL
    assert result.exits["worker:1"].returncode == -signal.SIGTERM
    assert elapsed >= 1.0        # the grace period was given before SIGKILL (a lower bound: load cannot break it)
    wait_gone(list(pids.values()), 5)
    assert "stopped by launcher (killed by SIGKILL)" in format_report(result)


@pytest.mark.parametrize("flags", [["--ignore-term"], ["--setsid"]], ids=["in-group", "own-session"])
def test_stop_kills_grandchildren(make_supervisor, flags):
    sup = make_supervisor([fake("worker", 0, "spawn_grandchild", *flags)], grace_period_secs=1.0)
    sup.start()
    wait_ready(sup, "worker:0")
    grandchild = int(log_text(sup, "worker:0").split("grandchild ")[1].split()[0])
    pids = [sup.pids()["worker:0"], grandchild]
    try:
        sup.stop("test")
        wait_gone(pids, 5)
    finally:
        kill_quietly(pids)


def test_kill_task_without_restart_fails_the_run(make_supervisor):
    sup = make_supervisor([fake("ps", 0, "sleep_forever"), fake("worker", 0, "sleep_forever")])
    sup.start()
    wait_ready(sup, "worker:0")
    sup.kill_task("worker:0")
    result = sup.wait(timeout=30)
    assert result.failure.name == "worker:0" and result.failure.returncode == -signal.SIGKILL
    assert "killed by SIGKILL" in format_report(result)
    assert exit_status(result.failure.returncode) == 137


def test_kill_task_and_start_task_restart_a_task(make_supervisor, tmp_path):
    release = tmp_path / "release-w0"     # each attempt of worker:0 exits 0 only once this exists
    sup = make_supervisor([fake("ps", 0, "sleep_forever"),
                    fake("worker", 0, "echo_exit", 0, "--tag", "w0", "--wait-for", release)])
    sup.start()
    wait_for(lambda: "w0 line 2" in log_text(sup, "worker:0"), 15, "worker:0 output")
    first_pid = sup.pids()["worker:0"]
    sup.kill_task("worker:0")
    assert sup.wait_task("worker:0", timeout=10) == -signal.SIGKILL
    sup.start_task("worker:0")
    assert sup.pids()["worker:0"] != first_pid
    release.touch()
    result = sup.wait(timeout=30)

    assert result.ok
    assert result.exits["worker:0"].returncode == 0 and result.exits["worker:0"].restarts == 1
    log = log_text(sup, "worker:0")
    assert log.count("w0 line 0") == 2
    marker = [line for line in log.splitlines() if line.startswith("--- restart 1 (start_task after killed by SIGKILL)")]
    assert len(marker) == 1 and log.index(marker[0]) < log.rindex("w0 line 0")


def test_start_task_refuses_a_running_task(make_supervisor):
    sup = make_supervisor([fake("worker", 0, "sleep_forever")])
    sup.start()
    with pytest.raises(RuntimeError, match="still running"):
        sup.start_task("worker:0")
    with pytest.raises(KeyError, match="worker:9"):
        sup.kill_task("worker:9")


def test_restart_policy_restarts_a_failed_task(make_supervisor):
    calls = []

    class Policy:
        """Any restart rule: restarts twice whatever the exit (4 is no retryable code)."""

        def __call__(self, name: str, returncode: int, restarts: int) -> bool:
            calls.append((name, returncode, restarts))
            return restarts < 2

        def delay(self, restarts: int) -> float:
            return 0.0

    sup = make_supervisor([fake("worker", 0, "echo_exit", 4)], restart_policy=Policy())
    sup.start()
    result = sup.wait(timeout=30)
    assert calls == [("worker:0", 4, 0), ("worker:0", 4, 1), ("worker:0", 4, 2)]
    assert not result.ok and result.exits["worker:0"].restarts == 2
    assert log_text(sup, "worker:0").count("out line 0") == 3


def test_wait_times_out_and_leaves_tasks_running(make_supervisor):
    sup = make_supervisor([fake("worker", 0, "sleep_forever")])
    sup.start()
    with pytest.raises(TimeoutError, match="worker:0"):
        sup.wait(timeout=0.3)
    assert "worker:0" in sup.pids()


def test_a_second_run_appends_to_the_log_with_a_marker(make_supervisor):
    for _ in range(2):
        sup = make_supervisor([fake("worker", 0, "echo_exit", 0)])
        sup.start()
        assert sup.wait(timeout=30).ok
    log = log_text(sup, "worker:0")
    assert log.count("out line 0") == 2 and "new run of worker:0" in log


def test_a_task_that_cannot_start_stops_those_started(make_supervisor):
    sup = make_supervisor([fake("ps", 0, "sleep_forever"), ProgramTask("worker", 0, ("/nonexistent/psworker-task",))])
    with pytest.raises(FileNotFoundError):
        sup.start()
    assert sup.result is not None and not sup.result.ok
    assert sup.result.exits["ps:0"].stopped and sup.result.exits["ps:0"].returncode == -signal.SIGTERM


def test_the_process_starter_is_injected(make_supervisor):
    started = []

    def popen(argv, **kwargs):
        started.append((argv, kwargs["start_new_session"], kwargs["stdin"]))
        return subprocess.Popen(argv, **kwargs)

    sup = make_supervisor([fake("worker", 0, "echo_exit", 0)], backend=LocalBackend(popen=popen))
    sup.start()
    assert sup.wait(timeout=30).ok
    (argv, new_session, stdin), = started
    assert isinstance(argv, list) and argv[1].endswith("echo_exit.py")
    assert new_session and stdin == subprocess.DEVNULL


def test_a_broken_console_does_not_fail_the_run(make_supervisor, caplog):
    """`psworker local ... | head`: the console copy stops, the full log and the run's result do not."""
    class BrokenConsole(io.StringIO):
        def write(self, s):
            raise OSError("console is gone")

    sup = make_supervisor([fake("worker", 0, "echo_exit", 0)], console=BrokenConsole())
    sup.start()
    assert sup.wait(timeout=30).ok
    assert "out line 2" in log_text(sup, "worker:0")    # the log still gets everything
    sup.close()
    assert not sup.thread_errors
    assert "console copy of worker:0 stopped" in caplog.text


def test_duplicate_task_names_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="worker:0"):
        Supervisor([fake("worker", 0, "echo_exit", 0)] * 2, tmp_path, backend=LocalBackend())


# -- a launcher process: signals and PDEATHSIG ----------------------------------------------------------------

def start_driver(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    out = tmp_path / "driver.out"
    with open(out, "wb") as f:
        argv = [sys.executable, str(HERE / "driver.py"), str(tmp_path / "logs"), "--grace", "1"]
        driver = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
    ready = ["[ps:0] ready", "[worker:0] ready", "[worker:1] ready", "[worker:2] ready"]
    try:
        wait_for(lambda: all(r in out.read_text() for r in ready), 30, "driver tasks ready")
    except BaseException:
        kill_quietly([p.pid for p in psutil.Process(driver.pid).children(recursive=True)] + [driver.pid])
        raise
    return driver, out


def descendants(pid: int) -> list[int]:
    return [p.pid for p in psutil.Process(pid).children(recursive=True)]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_to_the_launcher_stops_every_process(tmp_path, sig):
    driver, out = start_driver(tmp_path)
    pids = descendants(driver.pid)
    try:
        assert len(pids) == 6           # 4 tasks + 2 grandchildren
        driver.send_signal(sig)
        assert driver.wait(timeout=30) == 128 + sig
        assert "STOPPED ps:0,worker:0,worker:1,worker:2" in out.read_text()
        wait_gone(pids, 5)
    finally:
        kill_quietly(pids + [driver.pid])


def test_sigkill_of_the_launcher_kills_its_children(tmp_path):
    driver, _ = start_driver(tmp_path)
    tasks = [p.pid for p in psutil.Process(driver.pid).children()]
    everything = descendants(driver.pid)
    try:
        assert len(tasks) == 4
        driver.kill()
        driver.wait(timeout=10)
        wait_gone(tasks, 10)            # PR_SET_PDEATHSIG; grandchildren are the tasks' own business
    finally:
        kill_quietly(everything)
