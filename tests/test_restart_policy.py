"""Restart policy, fault injection and stall detection in the supervisor, over fake tasks (no TensorFlow)."""

from __future__ import annotations

import dataclasses
import functools
import signal
import time

import pytest

from psworker.errors import UsageError
from psworker.launcher.inject import check_fault_tasks, parse_fault
from psworker.launcher.policy import RestartPolicy, is_retryable
from psworker.launcher.console.report import exit_status, format_report
from tests.fake_tasks.fakes import fake, drive_until, task_state, wait_for


@pytest.fixture
def start(make_supervisor):
    """Starts fake tasks under a supervisor and returns it (stopped at teardown); the test drives it."""
    return functools.partial(make_supervisor, start=True, ps_exit_grace_secs=0.2)


@pytest.fixture
def run(start):
    """Runs fake tasks under a supervisor to the end (60 s at most); returns (result, supervisor)."""

    def go(tasks, **kwargs):
        sup = start(tasks, **kwargs)
        return sup.wait(timeout=60), sup

    return go


def stepper(tmp_path, index=0, *args):
    return fake("worker", index, "stepper", "--state", tmp_path / f"w{index}.state", *args)


def test_exit_codes_decide_what_is_retried():
    assert all(is_retryable(c) for c in (-9, -15, 130, 137, 143, 170))
    assert not any(is_retryable(c) for c in (0, 1, 2, 3, 127))
    policy = RestartPolicy(max_restarts=2)
    assert policy("worker:0", -9, 0) and policy("worker:0", 170, 1)
    assert not policy("worker:0", -9, 2) and not policy("worker:0", 2, 0) and not policy("worker:0", 3, 0)


def test_backoff_doubles_up_to_its_bound_with_jitter():
    policy = RestartPolicy(max_restarts=9, backoff_secs=1.0, max_backoff_secs=5.0, jitter=0.2, seed=7)
    assert 0.8 <= policy.delay(0) <= 1.2 and 1.6 <= policy.delay(1) <= 2.4 and 4.0 <= policy.delay(6) <= 6.0
    a, b = RestartPolicy(max_restarts=9, seed=7), RestartPolicy(max_restarts=9, seed=7)
    assert [a.delay(i) for i in range(3)] == [b.delay(i) for i in range(3)]     # a seed makes it repeatable


def test_an_injected_kill_restarts_the_task_and_marks_its_log(tmp_path, run):
    fault = parse_fault("kill:worker:0@step=30")
    # The first attempt stops at step 30 until killed: the fault cannot miss it; the second one goes on to 100.
    result, sup = run([fake("ps", 0, "sleep_forever"), stepper(tmp_path, 0, "--hang-at", "30")], faults=[fault],
                      restart_policy=RestartPolicy(max_restarts=1, backoff_secs=0.1))
    assert result.ok, format_report(result)
    assert result.exits["worker:0"].restarts == 1
    assert result.exits["worker:0"].restart_causes == ("injected kill:worker:0@step=30",)
    log = sup.log_path("worker:0").read_text()
    assert "--- restart 1 (injected kill:worker:0@step=30) at " in log
    assert log.rindex("step 100,") > log.index("--- restart 1")            # the attempt after it finished
    assert "restart 1: injected kill:worker:0@step=30" in format_report(result)


def test_a_permanent_exit_fails_the_run_at_once(run):
    result, _ = run([fake("ps", 0, "sleep_forever"), fake("worker", 0, "echo_exit", 2)],
                    restart_policy=RestartPolicy(max_restarts=3, backoff_secs=0.0))
    assert not result.ok and result.failure.name == "worker:0" and result.failure.returncode == 2
    assert result.exits["worker:0"].restarts == 0


@pytest.mark.parametrize("code, restarted", [(3, False), (143, True)])
def test_an_injected_exit_code_goes_through_the_policy(tmp_path, run, code, restarted):
    fault = parse_fault(f"exit:worker:0@step=20,code={code}")
    result, _ = run([stepper(tmp_path, 0, "--hang-at", "20")], faults=[fault],
                    restart_policy=RestartPolicy(max_restarts=1, backoff_secs=0))
    assert result.ok is restarted, format_report(result)
    if not restarted:
        assert result.failure.returncode == 3 and exit_status(result.failure.returncode) == 3
        assert "worker:0 ended (injected exit:worker:0@step=20,code=3)" in format_report(result)


def test_without_restarts_an_injected_kill_fails_the_run_with_137(tmp_path, run):
    # The stepper stops at step 0 until killed: it is still running whenever the time trigger fires.
    result, _ = run([stepper(tmp_path, 0, "--hang-at", "0")], faults=[parse_fault("kill:worker:0@time=0.5")])
    assert not result.ok and exit_status(result.failure.returncode) == 137
    assert result.failure.returncode == -signal.SIGKILL


def test_a_stalled_worker_is_killed_and_restarted(tmp_path, start):
    """The stall clock also runs from an attempt's start to its first step line (the interpreter's start-up): the
    supervisor's loop runs only while the stepper hangs at step 20, so start-up on a busy machine is never seen as
    a stall."""
    sup = start([stepper(tmp_path, 0, "--hang-at", "20", "--to", "30")], stall_timeout_secs=1.5,
                restart_policy=RestartPolicy(max_restarts=1, backoff_secs=0))
    progress = sup.progress.snapshot
    wait_for(lambda: progress()["worker:0"].step == 20, 60, "worker:0 at step 20 (where it hangs)")
    drive_until(sup, lambda: sup.restarts("worker:0") == 1, 60, "worker:0 killed as stalled and restarted")
    assert sup.wait_task("worker:0", timeout=60) == 0     # the second attempt: steps 20 and 30, then exit 0
    result = sup.wait(timeout=30)
    assert result.ok, format_report(result)
    (cause,) = result.exits["worker:0"].restart_causes
    assert cause.startswith("stalled: step 20 unchanged for"), cause


def test_a_stop_fault_pauses_the_task_then_resumes_it(tmp_path, run):
    started = time.monotonic()
    # The stepper waits after step 10 for the SIGCONT that ends the stop: it cannot finish before the fault fires.
    result, sup = run([stepper(tmp_path, 0, "--to", "40", "--pause-at", "10")],
                      faults=[parse_fault("stop:worker:0@step=10,for=1.5")])
    assert result.ok and result.exits["worker:0"].restarts == 0, format_report(result)
    assert time.monotonic() - started >= 1.5
    log = sup.log_path("worker:0").read_text()
    assert log.index("resumed after step 10") < log.index("step 40,")


def test_a_stop_longer_than_the_stall_timeout_is_not_a_stall_once_it_is_over(tmp_path, start):
    """The stopped time does not count: right after the SIGCONT (in the same tick of the supervisor's watch) the
    task's step is as old as the stop, and it used to be killed as stalled at once. The watch runs only from step 10
    on (`sup.wait`), so start-up on a busy machine is never seen as a stall."""
    sup = start([stepper(tmp_path, 0, "--to", "40", "--pause-at", "10")], stall_timeout_secs=1.5,
                faults=[parse_fault("stop:worker:0@step=10,for=3")])
    wait_for(lambda: sup.progress.snapshot()["worker:0"].step == 10, 60, "worker:0 at step 10 (where it pauses)")
    result = sup.wait(timeout=60)
    assert result.ok and result.exits["worker:0"].restarts == 0, format_report(result)
    assert "resumed after step 10" in sup.log_path("worker:0").read_text()


@pytest.mark.parametrize("text, message", [
    ("kill:worker:1", "missing '@'"),
    ("smash:worker:1@step=3", "action 'smash'"),
    ("kill:worker:x@step=3", "task index 'x'"),
    ("kill:worker@step=3", "ACTION:JOB:INDEX"),
    ("kill:worker:1@step=3,time=4", "exactly one trigger"),
    ("kill:worker:1@steps=3", "unknown option 'steps'"),
    ("kill:worker:1@step=-3", "step='-3'"),
    ("stop:worker:1@step=3", "stop needs for=SECS"),
    ("exit:worker:1@step=3", "exit needs code=N"),
    ("exit:worker:1@step=3,code=300", "code=300 must be in 1-255"),
    ("kill:worker:1@step=3,code=1", "code=N applies to exit only"),
])
def test_malformed_faults_name_the_bad_part(text, message):
    with pytest.raises(UsageError, match=message) as err:
        parse_fault(text)
    assert err.value.exit_code == 2 and repr(text) in str(err.value)


def test_a_fault_must_name_a_task_of_the_run():
    with pytest.raises(UsageError, match=r"no task worker:5 in this run \(tasks: ps:0, worker:0\)"):
        check_fault_tasks([parse_fault("kill:worker:5@step=1")], ["ps:0", "worker:0"])


def test_once_the_chief_and_every_ps_exited_0_late_workers_are_stopped(tmp_path, start):
    """A ps exits by itself only when training is over; a worker still (re)starting then has nothing to do."""
    chief = fake("worker", 0, "echo_exit", 0)
    release = tmp_path / "release-ps"
    sup = start([fake("ps", 0, "echo_exit", 0, "--wait-for", release), dataclasses.replace(chief, is_chief=True),
                 fake("worker", 1, "sleep_forever")])
    drive_until(sup, lambda: task_state(sup, "worker:0") == "done", 30, "the chief seen to exit 0")
    release.touch()              # the ps exits after the chief, as a real one does
    result = sup.wait(timeout=60)
    assert result.ok and result.reason == "the chief and every ps exited 0: training is over"
    assert result.exits["worker:1"].stopped


@pytest.mark.parametrize("args, message", [
    (["--inject", "kill:worker:x@step=3"], "--inject 'kill:worker:x@step=3': task index 'x'"),
    (["--inject", "kill:worker:7@step=3"], "no task worker:7 in this run"),
    (["--max_restarts", "-1"], "argument --max_restarts: must be >= 0, got -1"),
    (["--stall_timeout_secs", "0"], "argument --stall_timeout_secs: must be a number > 0, got 0"),
])
def test_bad_launch_flags_are_usage_errors(tmp_path, args, message):
    import subprocess
    import sys

    from tests.cluster_utils import REPO, task_env

    out = subprocess.run([sys.executable, "-m", "psworker", "local", str(REPO / "cluster_specs" / "local.yaml"),
                          "--train_dir", str(tmp_path / "t"), "--network", "host", *args],
                         capture_output=True, text=True, env=task_env(), timeout=60)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
