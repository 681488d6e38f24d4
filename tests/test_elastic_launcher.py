"""Elastic jobs under the real launcher (`psworker local`) over real TensorFlow tasks (the MLP on digits), scaled
with the real `psworker scale` command: async 2 -> 4 -> 1 workers, and sync scaled down to min and up again with a
preempted worker that comes back (--max_restarts). Each change is driven by the console's lines and the ps's log;
workers are held (SIGSTOP) while others join or leave, so that training cannot end before a change is seen, however
fast or slow the machine is.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import yaml

from psworker.launcher.console.folds import exited_0
from psworker.testing import assert_processes_gone, checkpoint_step, console_steps
from tests.cluster_utils import TIMEOUT_SECS, Launcher, logged_a_step, task_env, terminal_lines

pytestmark = pytest.mark.slow


def write_spec(path: Path, workers: int, elastic: dict, **train) -> str:
    doc = {"cluster": {"ps": ["127.0.0.1:auto"], "worker": {"addresses": ["127.0.0.1:auto"] * workers, **elastic}},
           "train": {"model": "mlp", "batch_size": 32, "log_every_steps": 20, **train}}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(path)


def scale(run_dir: Path, workers: int) -> tuple[int, str]:
    """`psworker scale RUN_DIR --workers N`: (exit status, output)."""
    done = subprocess.run([sys.executable, "-m", "psworker", "scale", str(run_dir), "--workers", str(workers)],
                          capture_output=True, text=True, env=task_env(), timeout=TIMEOUT_SECS)
    return done.returncode, done.stdout + done.stderr


def signal_tasks(run: Launcher, sig: int, *names: str) -> None:
    pids = run.task_pids()
    for name in names:
        psutil.Process(pids[name]).send_signal(sig)


def steps(run: Launcher) -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for task, step in console_steps("\n".join(run.snapshot())):
        found.setdefault(task, []).append(step)
    return found


# Steps enough that the run cannot end before this test has held the first two workers. They are held once their log
# holds a step line (`hold_once_they_train`): ~100 steps here. Read from the console instead, whose lines are grouped
# for seconds, worker:1 ran to step 1,190 before it was held (a loaded 2-core host), and two workers on a loaded CI
# host trained all of 1,500 steps in 4.3 s.
ASYNC_MAX_STEPS = 2000


def hold_once_they_train(run: Launcher, log_dir: Path, names: list[str]) -> None:
    """Holds each task of `names` (SIGSTOP) as soon as its log (written as the task prints) holds a step line; then,
    with all of them held, waits for those lines on the console, where they may come seconds later."""
    for name in names:
        log = log_dir / f"{name.replace(':', '-')}.log"
        run.wait_until(lambda: logged_a_step(log), f"a step line in {name}'s log")
        signal_tasks(run, signal.SIGSTOP, name)
    for name in names:
        run.wait_for(rf"^\[{name}\] step \d+", f"a step line of {name}")


def wait_log(run: Launcher, path: Path, pattern: str, count: int, what: str) -> None:
    run.wait_until(lambda: path.exists() and len(re.findall(pattern, path.read_text(errors="replace"), re.M)) >= count,
                   what)


def joined(ps_log: Path) -> int:
    """How often the ps has logged that worker:2 joined."""
    return len(re.findall(r"worker:2 joined the job", ps_log.read_text(errors="replace")))


def finish(run: Launcher, names: list[str]) -> None:
    """The launcher exits 0 with every task of `names` having exited 0 by itself (none stopped), nothing left."""
    assert run.proc.wait(TIMEOUT_SECS) == 0, run.tail()
    run.pids.update(run._descendants())
    exited = {name for line in run.snapshot() for name in exited_0(line)}
    for name in names:
        assert name in exited, (name, run.tail())
    assert not run.find(r"^psworker: (warning: )?stopping "), run.tail()
    assert_processes_gone(run.pids)


def test_async_job_scaled_2_to_4_to_1(tmp_path):
    max_steps, train_dir = ASYNC_MAX_STEPS, tmp_path / "train"
    spec = write_spec(tmp_path / "async.yaml", 4, {"min": 1, "start": 2}, mode="async", max_steps=max_steps)
    run = Launcher([spec, "--train_dir", str(train_dir)], tmp_path)
    try:
        hold_once_they_train(run, train_dir / "logs", ["worker:0", "worker:1"])    # (the joiners then train alone)
        code, out = scale(train_dir, 5)
        assert code == 2 and "--workers 5 is outside the job's elastic range 1..4 (min..max)" in out, out
        code, out = scale(train_dir, 0)
        assert code == 2 and "--workers 0 is outside the job's elastic range 1..4" in out, out
        before = max(max(s) for s in steps(run).values())
        assert scale(train_dir, 4) == (0, "psworker: scale 2 -> 4 workers (request 1)\n")
        for w in ("worker:2", "worker:3"):
            _, m = run.wait_for(rf"^psworker: {w} joined at global step (\d+)$", f"{w} joining")
            signal_tasks(run, signal.SIGSTOP, w)
            assert int(m.group(1)) >= before, (w, m.group(0), before)  # no rollback: it goes on from the ps

        assert scale(train_dir, 1) == (0, "psworker: scale 4 -> 1 workers (request 2)\n")
        signal_tasks(run, signal.SIGCONT, "worker:1", "worker:2", "worker:3")   # each ends its step and leaves
        for w in ("worker:1", "worker:2", "worker:3"):
            run.wait_for(rf"^psworker: {w} left \(scaled away\)$", f"{w} leaving")
        signal_tasks(run, signal.SIGCONT, "worker:0")
        finish(run, ["ps:0", "worker:0", "worker:1", "worker:2", "worker:3"])
    finally:
        run.close()
    for name, seen in steps(run).items():
        assert seen == sorted(seen), f"{name}'s global step went back: {seen}"
    assert checkpoint_step(train_dir) >= max_steps
    assert "every worker is done; exiting" in (train_dir / "logs" / "ps-0.log").read_text()
    code, out = scale(train_dir, 2)
    assert code == 2 and "cannot scale: the run has finished (succeeded)" in out, out


def test_the_live_view_on_a_terminal_shows_a_scale_up_above_it_and_ends_with_one_frame(tmp_path):
    """`psworker local` on a pseudo-terminal, read back as a terminal shows it (issue 27): the launcher's own lines
    (the scale, the join, the exits) stand above the live view in the order they happened, the view's frames
    overwrite each other (one task table is left at the end), and its step never passes max_steps."""
    max_steps, train_dir = ASYNC_MAX_STEPS, tmp_path / "train"     # as in test_async_job_scaled_2_to_4_to_1
    spec = write_spec(tmp_path / "live.yaml", 3, {"min": 1, "start": 2}, mode="async", max_steps=max_steps)
    run = Launcher([spec, "--train_dir", str(train_dir)], tmp_path, tty=True)
    try:
        # held, so that the run cannot end before worker:2
        hold_once_they_train(run, train_dir / "logs", ["worker:0", "worker:1"])
        assert scale(train_dir, 3) == (0, "psworker: scale 2 -> 3 workers (request 1)\n")
        run.wait_for(r"^psworker: worker:2 joined at global step \d+$", "worker:2 joining")
        signal_tasks(run, signal.SIGCONT, "worker:0", "worker:1")
        finish(run, ["ps:0", "worker:0", "worker:1", "worker:2"])
    finally:
        run.close()
    shown = terminal_lines(bytes(run.raw))
    (tmp_path / "terminal.txt").write_text("\n".join(shown) + "\n")
    print("\n".join(shown))        # `pytest -rP`: the capture of the closing note of issue 27
    at = {what: [i for i, line in enumerate(shown) if re.search(what, line)]
          for what in (r"^psworker: scale 2 -> 3 workers \(request 1\)$", r"^psworker: starting worker:2",
                       r"^psworker: worker:2 joined at global step \d+$", r"^psworker: .*exited: exit code 0",
                       r"^\s*task\s+state\s+last step\s+restarts$", r"^step \d+/\d+ ")}
    for what, rows in at.items():
        assert rows, (what, shown[-80:])
    firsts = [rows[0] for rows in at.values()]
    assert firsts[:4] == sorted(firsts[:4]), (firsts, shown)          # above the view, in the order they happened
    assert len(at[r"^\s*task\s+state\s+last step\s+restarts$"]) == 1, shown   # the frames overwrote each other
    assert all(int(re.match(r"step (\d+)/", shown[i]).group(1)) <= max_steps for i in at[r"^step \d+/\d+ "])
    assert_processes_gone(run.pids)


def test_sync_job_scaled_to_min_and_back_with_a_preempted_worker_restarted(tmp_path):
    max_steps, train_dir = SYNC_MAX_STEPS, tmp_path / "train"
    # worker:3 is reserved and never starts: one replica fewer than the spec's runs throughout
    spec = write_spec(tmp_path / "sync.yaml", 4, {"min": 2, "start": 3}, mode="sync", replicas_to_aggregate=2,
                      max_steps=max_steps)
    ps_log = train_dir / "logs" / "ps-0.log"
    run = Launcher([spec, "--train_dir", str(train_dir), "--inject", "preempt:worker:2@step=40", "--max_restarts", "1",
                    "--restart_backoff_secs", "1"], tmp_path)
    try:
        # Preempted: it ends its step, leaves (exit 171) and comes back at the same address after the backoff.
        # (Under load it may not have joined yet: then it leaves at once.) The others are held while it comes back.
        run.wait_for(r"^psworker: worker:2 \(pid \d+\) exited: injected preempt:worker:2@step=40$", "the preemption")
        signal_tasks(run, signal.SIGSTOP, "worker:0", "worker:1")
        joins = joined(ps_log)
        at, _ = run.wait_for(r"^psworker: warning: restarting worker:2 \(restart 1: injected preempt:worker:2@step=40",
                             "worker:2's restart")
        wait_log(run, ps_log, r"worker:2 joined the job", joins + 1, "worker:2 joining again")

        # Scaled down to min (worker:2 leaves once its step, which needs the others, is over), and up again.
        code, out = scale(train_dir, 1)
        assert code == 2 and "--workers 1 is outside the job's elastic range 2..4 (min..max)" in out, out
        assert scale(train_dir, 2) == (0, "psworker: scale 3 -> 2 workers (request 1)\n")
        signal_tasks(run, signal.SIGCONT, "worker:0", "worker:1")
        run.wait_for(r"^psworker: worker:2 left \(scaled away\)$", "worker:2 leaving", after=at)
        signal_tasks(run, signal.SIGSTOP, "worker:0", "worker:1")
        joins = joined(ps_log)
        assert scale(train_dir, 3) == (0, "psworker: scale 2 -> 3 workers (request 2)\n")
        wait_log(run, ps_log, r"worker:2 joined the job", joins + 1, "worker:2 joining once more")
        signal_tasks(run, signal.SIGCONT, "worker:0", "worker:1")
        run.wait_for(r"^psworker: worker:2 joined at global step \d+$", "worker:2's step after it joined again")
        finish(run, ["ps:0", "worker:0", "worker:1", "worker:2"])
    finally:
        run.close()
    assert checkpoint_step(train_dir) == max_steps
    for name, seen in steps(run).items():
        assert seen == sorted(seen), f"{name}'s global step went back: {seen}"
    # One token per worker step, not one per reserved replica: TF's 4 tokens per step for 3 (or 2) running workers
    # piled up stale tokens, and the chief ran ~4/3 (or 2) local steps per global step, a third (or half) wasted.
    chief_log = (train_dir / "logs" / "worker-0.log").read_text()
    local = re.search(r"worker:0: last step done \((\d+) local steps\)", chief_log)
    assert local and int(local.group(1)) <= 1.15 * max_steps, local and local.group(0)
