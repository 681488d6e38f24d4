"""What a person sees is true, over real `psworker local` runs of the tiny MLP: `psworker status` of a finished, a
failed and an abandoned run (its launcher SIGKILLed), the ETA of a running one, `--watch` ending with the run; a ps
killed and restored is one rollback line and no gRPC text on the console; a failure a restart would have survived
names `--max_restarts`."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from psworker.testing import assert_processes_gone, checkpoint_step, write_spec
from tests.cluster_utils import Background, Launcher, run_launcher, task_env

pytestmark = pytest.mark.slow

ROLLBACK = re.compile(r"^psworker: warning: ps:0 restarted: the model goes back from step ([\d,]+) to the "
                      r"checkpoint of step ([\d,]+) \(([\d,]+) steps? given up\)$", re.MULTILINE)
LOST = re.compile(r"^\[(worker:[^\]]+)\] lost ps:0 \(TensorFlow's gRPC errors are in the task logs\)$", re.MULTILINE)
# TensorFlow's text as it reached the console before: a gRPC error block, an op's node, absl lines, tracebacks
TF_TEXT = re.compile(r"GRPC|grpc_|\[\[\{\{node|^\[[^\]]+\] =====|recvmsg|UNAVAILABLE|Instructions for updating|"
                     r"Traceback|^\[[^\]]+\]\s+File \"|\] [IWE]\d{4} ", re.MULTILINE)
ROW = re.compile(r"^  ((?:ps|worker):\d+)\s+(.*)$", re.MULTILINE)


def status(run_dir: Path, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "psworker", "status", str(run_dir), *args], capture_output=True,
                         text=True, env=task_env(), timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def rows(table: str) -> dict[str, str]:
    """Each task's row of `psworker status`'s table, without its name."""
    return dict(ROW.findall(table))


def spec(tmp_path: Path, **train) -> Path:
    settings = dict(max_steps=300, batch_size=32, log_every_steps=10, save_checkpoint_steps=100,
                    train_dir=str(tmp_path / "train"), step_timeout_secs=120.0)
    return write_spec(tmp_path / "cluster.yaml", **{**settings, **train})


@pytest.mark.timeout(420)
def test_a_ps_killed_and_restored_is_one_rollback_line_and_status_shows_each_tasks_end(tmp_path):
    """kill -9 of the only ps at step >= 150, restarted: the chief restores its newest checkpoint (under load it may
    lag the other worker, so the checkpoint of step 0 is possible). The
    console says what that cost in one line, each worker's gRPC errors are one `lost ps:0` line, and TensorFlow's
    text stays in the logs. `psworker status --watch`, started once training runs, ends with the run; `psworker
    status` then shows every task done with its exit code, pid and host."""
    train = tmp_path / "train"
    watcher: list[Background] = []

    def watch_once_training(lines, proc) -> bool:
        if not any(re.match(r"\[worker:\d\] step \d+", line) for line in lines):
            return False
        watcher.append(Background([sys.executable, "-m", "psworker", "status", str(train), "--watch", "0.3"],
                                  tmp_path))
        return True

    try:
        run = run_launcher([str(spec(tmp_path)), "--max_restarts", "2", "--restart_backoff_secs", "0.5",
                            "--inject", "kill:ps:0@step=150", "--console", "plain"], cwd=tmp_path, timeout=360,
                           on_line=watch_once_training)
        out = run.output
        assert run.returncode == 0, out[-4000:]
        rollbacks = ROLLBACK.findall(out)
        assert len(rollbacks) == 1, out[-4000:]
        before, to, lost = (int(n.replace(",", "")) for n in rollbacks[0])
        chief_log = (train / "logs" / "worker-0.log").read_text()
        restored = chief_log.index(f"restoring the checkpoint model.ckpt-{to}\n")    # the newest saved before it
        assert to == max(int(n) for n in re.findall(r"checkpoint of global step (\d+) saved", chief_log[:restored]))
        assert before >= 150 and lost == before - to, rollbacks
        assert not TF_TEXT.search(out), TF_TEXT.search(out).group(0) + "\n" + out[-4000:]
        worker_logs = "".join((train / "logs" / f"worker-{i}.log").read_text() for i in (0, 1))
        assert "/job:ps/replica:0/task:0" in worker_logs      # what the console left out is in the logs
        lost_lines = LOST.findall(out)
        assert lost_lines, out[-4000:]
        for worker in ("worker:0", "worker:1"):       # once per worker at most (a range names several)
            assert sum(worker in names or names == "worker:0-1" for names in lost_lines) <= 1, lost_lines
        assert_processes_gone(run.pids)

        assert watcher, "no step line on the console"
        watcher[0].proc.wait(60)        # --watch ends by itself once the run has ended
        assert watcher[0].proc.returncode == 0, watcher[0].output
        watcher[0]._reader.join(5)
        assert "psworker: status: step " in watcher[0].output, watcher[0].output[-3000:]
        assert "ended: the run succeeded" in watcher[0].output, watcher[0].output[-3000:]
    finally:
        for w in watcher:
            if w.proc.poll() is None:
                w.proc.kill()

    table = status(train)
    shown = rows(table)
    assert set(shown) == {"ps:0", "worker:0", "worker:1"}, table
    for name, row in shown.items():
        assert re.match(r"done\s+(\d+|-)\s+\d+\s+exit code 0\s+\d+\s+\S+", row), (name, table)
        assert "running" not in row and "training" not in row, table
    assert "ended: the run succeeded" in table
    doc = json.loads(status(train, "--json"))
    assert {t["state"] for t in doc["tasks"].values()} == {"done"}, doc["tasks"]
    assert all(isinstance(t["pid"], int) and t["host"] for t in doc["tasks"].values()), doc["tasks"]
    assert doc["tasks"]["ps:0"]["restarts"] == 1 and doc["eta_secs"] is None and doc["gone"] is None, doc


@pytest.mark.timeout(300)
def test_a_failed_run_shows_each_tasks_end_and_names_max_restarts(tmp_path):
    """A non-chief killed without --max_restarts ends the run: the report says how to survive it (with the flag)
    and quotes no TensorFlow line; status shows the failed worker's end and the others stopped by the launcher."""
    train = tmp_path / "train"
    run = run_launcher([str(spec(tmp_path)), "--inject", "kill:worker:1@step=30", "--console", "plain"], cwd=tmp_path,
                       timeout=240)
    out = run.output
    assert run.returncode == 137, out[-4000:]
    assert re.search(r"^psworker: hint: worker:1 ended \(injected kill:worker:1@step=30\): an exit the launcher "
                     r"retries with --max_restarts N \(default 0\), e.g. --max_restarts 3: .* rejoins at the ps "
                     r"tasks' global step", out, re.MULTILINE), out[-3000:]
    report = out[out.index("psworker: run failed:"):]
    assert not re.search(r"^  [IWE]\d{4} ", report, re.MULTILINE), report
    assert_processes_gone(run.pids)

    table = status(train)
    shown = rows(table)
    assert re.match(r"failed\s+\d+\s+0\s+killed by SIGKILL: injected kill:worker:1@step=30\s+\d+", shown["worker:1"]), \
        table
    for name in ("ps:0", "worker:0"):
        assert re.match(r"stopped\s+.*stopped by the launcher \(", shown[name]), table
    assert not re.search(r"running|training", table), table
    assert "ended: the run failed after" in table and "(exit 137)" in table, table


@pytest.mark.timeout(420)
def test_a_launcher_killed_leaves_a_run_that_status_calls_abandoned(tmp_path):
    """While the run trains, status gives steps/s and an ETA and names the launcher's and each task's pid. Then
    SIGKILL to the launcher: its tasks die with it (PR_SET_PDEATHSIG), and status says the launcher is gone, the
    run did not end cleanly, and the last checkpoint's step; `--watch` on it ends at once."""
    train = tmp_path / "train"
    launcher = Launcher([str(spec(tmp_path, max_steps=1_000_000, save_checkpoint_steps=50)), "--console", "plain"], tmp_path)
    try:
        launcher.wait_for(r"^\[worker:0\] checkpoint of global step [1-9]\d{2,} saved", "a checkpoint after step 100")
        launcher.wait_for(r"^\[worker:\d\] step \d+", "a step line")
        tasks = launcher.task_pids()
        assert set(tasks) == {"ps:0", "worker:0", "worker:1"}, tasks
        doc = json.loads(status(train, "--json"))
        assert doc["launcher"]["pid"] == launcher.proc.pid and doc["launcher"]["gone"] is None, doc["launcher"]
        assert {n: t["pid"] for n, t in doc["tasks"].items()} == tasks, doc["tasks"]
        assert doc["steps_per_sec"] and doc["steps_per_sec"] > 0 and doc["eta_secs"] > 0, doc
        assert re.search(r"eta \d+:\d\d", status(train)), status(train)

        launcher.proc.send_signal(signal.SIGKILL)
        launcher.proc.wait(30)
        assert_processes_gone(tasks.values(), timeout=30)    # the tasks die with their launcher
    finally:
        launcher.close()
    table = status(train)
    step = checkpoint_step(train)
    assert (f"the launcher (pid {launcher.proc.pid} on " in table and f") is gone; the run did not end cleanly; the "
            f"last checkpoint is step {step:,}; none of its tasks runs" in table), table
    shown = rows(table)
    assert all(row.startswith("gone ") for row in shown.values()), table
    assert "silent" not in table and "eta -" in table, table
    doc = json.loads(status(train, "--json"))
    assert doc["launcher"]["gone"] and doc["checkpoint_step"] == step and doc["eta_secs"] is None, doc
    watch = subprocess.run([sys.executable, "-m", "psworker", "status", str(train), "--watch", "0.2"],
                           capture_output=True, text=True, env=task_env(), timeout=60)
    assert watch.returncode == 0 and "is gone; the run did not end cleanly" in watch.stdout, watch.stdout
