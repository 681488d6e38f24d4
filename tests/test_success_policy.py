"""When a run has succeeded (`--success_policy`, Kubeflow TFJob's rule) and what happens to the tasks left then
(`--worker_exit_grace_secs`): `psworker run` over fake tasks (tests/fake_tasks/roles.py), the flags' checks, and
the regression of issue 17: a classic TF1 script whose non-chief cannot start once the chief has left
(tests/user_scripts/classic_tf1.py --no_device_filters) ends with exit 0."""

from __future__ import annotations

import logging
import re
import shlex
import sys
from pathlib import Path

import pytest

from psworker.cli import main
from psworker.launcher.policy import ALL_WORKERS, CHIEF_OR_WORKER0, RestartPolicy, SuccessPolicy
from psworker.launcher.console.report import format_report
from psworker.launcher.supervise.supervisor import Supervisor
from psworker.testing import assert_processes_gone, checkpoint_step
from tests.cluster_utils import REPO, run_launcher
from tests.fake_tasks.fakes import fake, drive_until, task_state

ROLES = REPO / "tests" / "fake_tasks" / "roles.py"
CLASSIC = REPO / "tests" / "user_scripts" / "classic_tf1.py"
SPEC = "cluster:\n  ps: ['localhost:auto']\n  worker: ['localhost:auto', 'localhost:auto']\n"
TASK_ROW = re.compile(r"^  ((?:ps|worker):\d+)\s+(.+?)  \[", re.MULTILINE)
CHIEF_EXITED = "psworker: worker:0 (pid "


def spec_file(tmp_path: Path) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(SPEC)
    return path


def roles_run(tmp_path: Path, flags: list[str], on_line=None, wait_for: Path | None = None):
    """`psworker run` of the fake roles: ps:0 serves until stopped, worker:0 exits 0, worker:1 never ends (or, with
    `wait_for`, exits 0 once that file exists)."""
    extra = ["--others-wait-for", str(wait_for)] if wait_for else []
    return run_launcher([str(spec_file(tmp_path)), "--train_dir", str(tmp_path / "run"), "--console", "plain", *flags, "--",
                         sys.executable, str(ROLES), "{job_name}", "{task_index}", *extra],
                        cwd=tmp_path, timeout=120, on_line=on_line, command="run")


def create_when(marker: str, path: Path):
    """An `on_line` callback: creates `path` once a console line contains `marker`."""
    def check(lines, proc) -> bool:
        if any(marker in line for line in lines):
            path.touch()
            return True
        return False
    return check


def test_the_deciding_task_is_the_chief_else_worker_0():
    tasks = ["ps:0", "worker:0", "worker:1"]
    assert SuccessPolicy().deciding_task(tasks) == "worker:0"
    assert SuccessPolicy().deciding_task(["chief:0", *tasks]) == "chief:0"
    assert SuccessPolicy(ALL_WORKERS).deciding_task(["chief:0", *tasks]) is None
    with pytest.raises(ValueError, match="success policy must be one of chief-or-worker0, all-workers"):
        SuccessPolicy("any-worker")
    with pytest.raises(ValueError, match="worker_exit_grace_secs must be >= 0"):
        SuccessPolicy(worker_exit_grace_secs=-1.0)


def test_default_policy_stops_a_worker_that_never_ends_after_the_grace(tmp_path):
    run = roles_run(tmp_path, ["--worker_exit_grace_secs", "2"])
    assert run.returncode == 0, run.output
    assert ("worker:0 exited 0: the run has succeeded; the other workers (worker:1) get 2 s to exit by themselves"
            in run.output)
    assert "worker:1 still running 2 s after the run succeeded (worker:0 exited 0)" in run.output
    assert "run succeeded in " in run.output and "(worker:0 exited 0); the launcher stopped ps:0, worker:1" \
        in run.output
    rows = dict(TASK_ROW.findall(run.output))
    assert rows["worker:0"] == "exit code 0", rows
    assert rows["worker:1"].startswith("stopped by launcher") and rows["ps:0"].startswith("stopped by launcher"), rows
    assert "run failed" not in run.output
    assert_processes_gone(run.pids)


def test_default_policy_lets_a_worker_finish_by_itself_within_the_grace(tmp_path):
    """worker:1 exits only once the launcher has said that the run succeeded: it was waited for, not stopped."""
    go = tmp_path / "go"
    run = roles_run(tmp_path, ["--worker_exit_grace_secs", "120"], wait_for=go,
                    on_line=create_when("the other workers (worker:1) get 120 s", go))
    assert run.returncode == 0, run.output
    assert "psworker: all 2 workers finished in " in run.output
    rows = dict(TASK_ROW.findall(run.output))
    assert rows["worker:0"] == rows["worker:1"] == "exit code 0", rows     # only the ps was stopped
    assert rows["ps:0"].startswith("stopped by launcher"), rows
    # the console may fold it with worker:0's (`[worker:0-1] <task> done`): its own log says it ended by itself
    assert "worker:1 done" in (tmp_path / "run" / "logs" / "worker-1.log").read_text()
    assert_processes_gone(run.pids)


def test_all_workers_waits_for_every_worker(tmp_path):
    """No worker grace at all: under the default policy worker:1 would be stopped as soon as worker:0's exit is
    seen; under all-workers it is waited for, and exits 0 only once the launcher has seen worker:0 exit."""
    go = tmp_path / "go"
    run = roles_run(tmp_path, ["--success_policy", "all-workers", "--worker_exit_grace_secs", "0"], wait_for=go,
                    on_line=create_when(CHIEF_EXITED, go))
    assert run.returncode == 0, run.output
    assert "psworker: all 2 workers finished in " in run.output
    assert "the run has succeeded" not in run.output
    rows = dict(TASK_ROW.findall(run.output))
    assert rows["worker:1"] == "exit code 0" and rows["ps:0"].startswith("stopped by launcher"), rows
    assert_processes_gone(run.pids)


@pytest.mark.parametrize("flags, message", [
    (["--worker_exit_grace_secs", "-1"], "argument --worker_exit_grace_secs: must be a number >= 0, got -1"),
    (["--worker_exit_grace_secs", "nan"], "argument --worker_exit_grace_secs: must be a number >= 0, got nan"),
    (["--worker_exit_grace_secs", "soon"], "argument --worker_exit_grace_secs: expected a number, got 'soon'"),
    (["--success_policy", "any-worker"],
     "argument --success_policy: 'any-worker' is not one of chief-or-worker0, all-workers"),
])
@pytest.mark.parametrize("command", ["run", "local", "ssh", "slurm launch"])
def test_bad_values_are_usage_errors_naming_the_flag(tmp_path, capsys, command, flags, message):
    tail = ["--", "true"] if command == "run" else []
    assert main([*command.split(), str(spec_file(tmp_path)), *flags, *tail]) == 2
    assert message in capsys.readouterr().err


def test_slurm_submit_passes_the_flags_to_slurm_launch(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["slurm", "submit", str(spec_file(tmp_path)), "--run_dir", str(run_dir), "--set",
                 "success_policy=all-workers", "--set", "worker_exit_grace_secs=7", "--dry_run"]) == 0
    [exec_line] = [line for line in (run_dir / "psworker.sbatch").read_text().splitlines() if line.startswith("exec ")]
    argv = shlex.split(exec_line)
    assert "success_policy=all-workers" in argv and "worker_exit_grace_secs=7.0" in argv, argv
    assert main(["slurm", "submit", str(spec_file(tmp_path)), "--run_dir", str(tmp_path / "r"),
                 "--worker_exit_grace_secs", "-2", "--dry_run"]) == 2
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_classic_script_whose_non_chief_cannot_start_ends_with_exit_0(tmp_path):
    """Issue 17: tutorial-style TF1 (no device filters), 1 ps + 2 workers, 300 steps. The chief ends at step 300; a
    non-chief still creating its session then waits forever for it, and the ps serves forever: both are stopped
    after the grace (2 s, as in the fake-task tests above: how long it is changes nothing here), listed as stopped,
    and the launcher exits 0 with nothing left."""
    train_dir = tmp_path / "ckpt"
    run = run_launcher([str(spec_file(tmp_path)), "--train_dir", str(tmp_path / "run"), "--console", "plain",
                        "--worker_exit_grace_secs", "2", "--",
                        sys.executable, str(CLASSIC), "--ps_hosts={ps_hosts}", "--worker_hosts={worker_hosts}",
                        "--job_name={job_name}", "--task_index={task_index}", "--train_dir", str(train_dir),
                        "--max_steps", "300", "--no_device_filters"], cwd=tmp_path, timeout=360, command="run")
    assert run.returncode == 0, run.output[-4000:]
    assert re.search(r"^\[worker:0\] step \d+, loss = ", run.output, re.MULTILINE), run.output[-4000:]
    assert "[worker:0] worker 0 done" in run.output
    assert checkpoint_step(train_dir) >= 300
    rows = dict(TASK_ROW.findall(run.output))
    assert rows["worker:0"] == "exit code 0", rows
    assert rows["ps:0"].startswith("stopped by launcher"), rows
    # worker:1 is stuck in session creation unless it got the chief's model before the chief left (then it trained
    # and ended by itself within the grace); either way the report says which.
    if "[worker:1] worker 1 done" in run.output:
        assert rows["worker:1"] == "exit code 0", rows
    else:
        assert rows["worker:1"].startswith("stopped by launcher"), rows
        assert "worker:1 still running 2 s after the run succeeded (worker:0 exited 0)" in run.output
        assert "the launcher stopped ps:0, worker:1" in run.output
    print(f"CLASSIC worker:1 {rows['worker:1']}")
    assert_processes_gone(run.pids)


# -- the supervisor's drain, driven step by step over fake tasks ------------------------------------------------------

@pytest.fixture
def supervise(make_supervisor, caplog):
    """Starts fake tasks under a chief-or-worker0 supervisor (stopped at teardown); the test drives its loop."""
    caplog.set_level(logging.INFO, logger="psworker.launcher.supervise.supervisor")

    def start(tasks, grace: float = 60.0, **kwargs) -> Supervisor:
        return make_supervisor(tasks, start=True, ps_exit_grace_secs=0.2,
                               success=SuccessPolicy(CHIEF_OR_WORKER0, grace), **kwargs)

    return start


def test_a_worker_waiting_for_its_restart_is_restarted_within_the_grace(tmp_path, supervise, caplog):
    """psworker's own runs with --max_restarts: a worker killed near the end, whose restart is due only after the
    chief has exited 0, still comes back (and finishes) instead of being dropped."""
    go = tmp_path / "go"
    backoff = 4.0    # what follows the kill until worker:0's exit is seen takes well under a second: a handshake
    sup = supervise([fake("ps", 0, "sleep_forever"), fake("worker", 0, "echo_exit", 0, "--wait-for", go),
                     fake("worker", 1, "stepper", "--state", tmp_path / "w1.state", "--hang-at", "0", "--to", "30")],
                    restart_policy=RestartPolicy(max_restarts=1, backoff_secs=backoff, jitter=0.0),
                    grace=120.0)
    drive_until(sup, lambda: sup.progress.snapshot()["worker:1"].step == 0, 60, "worker:1 at step 0 (where it hangs)")
    sup.kill_task("worker:1")
    drive_until(sup, lambda: task_state(sup, "worker:1") == "restarting 1", 30, "worker:1 waiting for its restart")
    go.touch()
    assert sup.wait_task("worker:0", 60) == 0
    assert sup.poll() is None
    assert sup.restarts("worker:1") == 0, f"worker:1 was restarted before worker:0's exit was seen ({backoff} s)"
    assert "worker:0 exited 0: the run has succeeded; the other workers (worker:1) get 120 s" in caplog.text
    result = sup.wait(timeout=120)
    assert result.ok, format_report(result)
    w1 = result.exits["worker:1"]
    assert (w1.returncode, w1.stopped, w1.restarts) == (0, False, 1), format_report(result)
    assert result.exits["ps:0"].stopped


def test_a_worker_that_fails_within_the_grace_fails_the_run(tmp_path, supervise, caplog):
    go = tmp_path / "go"
    sup = supervise([fake("worker", 0, "echo_exit", 0), fake("worker", 1, "echo_exit", 3, "--wait-for", go)])
    drive_until(sup, lambda: "the run has succeeded" in caplog.text, 60, "worker:0's exit seen")
    go.touch()
    result = sup.wait(timeout=60)
    assert not result.ok and result.failure.name == "worker:1" and result.failure.returncode == 3, \
        format_report(result)
