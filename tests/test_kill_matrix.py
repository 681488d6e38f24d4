"""The kill matrix: `psworker local --inject kill:... --max_restarts 2` over {ps, chief, non-chief} x {async, sync}
x {before the first periodic checkpoint, after it}. Every run must finish (sync: exactly at max_steps; async: at
least), every task must exit 0, and the global step may roll back by at most the checkpoint interval after a
ps kill (more if the chief lagged: `ps_kill_bound`) and not at all after a worker kill.

Rollback is read from the console: per worker, the most its step lines fell below the highest one it had printed
(a chief restoring a checkpoint shows up there; the run's console is in `console.txt` beside the train dir).
"""

from __future__ import annotations

import re
import time

import pytest

from psworker.testing import assert_processes_gone as assert_no_processes, checkpoint_step, console_steps, write_spec
from tests.cluster_utils import run_launcher

pytestmark = pytest.mark.slow

MAX_STEPS, CHECKPOINT_EVERY = 300, 100
KILL_AT = {"before": 50, "after": 150}          # global steps; the first periodic checkpoint is at step 100
TARGETS = {"ps": "ps:0", "chief": "worker:0", "non-chief": "worker:1"}
INJECTED = re.compile(r"^psworker: warning: injecting kill:\S+ at global step (\d+)", re.MULTILINE)
RESTARTING = re.compile(r"^psworker: warning: restarting \S+ \(restart 1: ", re.MULTILINE)
SAVED = re.compile(r"checkpoint of global step (\d+) saved")
RESTORED = re.compile(r"restoring the checkpoint model\.ckpt-(\d+)")
TASK_ROW = re.compile(r"^  ((?:ps|worker):\d+)\s+(.+?)  \[", re.MULTILINE)

XFAIL: dict[tuple[str, str, str], str] = {}   # every cell must pass


def rollback(output: str) -> int:
    """How far the global step went back: per worker, the most its step lines fell below the highest one it had
    printed before (each task's lines keep their order on the console; the console may hold them back past the
    launcher's own restart lines, so the order across tasks says nothing)."""
    assert INJECTED.search(output) and RESTARTING.search(output), output[-3000:]
    back: dict[str, int] = {}
    highest: dict[str, int] = {}
    for task, step in console_steps(output):
        back[task] = max(back.get(task, 0), highest.get(task, step) - step)
        highest[task] = max(highest.get(task, step), step)
    return max(back.values(), default=0)


CELLS = [pytest.param(target, mode, when, id=f"{target}-{mode}-{when}",
                      marks=[pytest.mark.xfail(strict=True, reason=XFAIL[(target, mode, when)])]
                      if (target, mode, when) in XFAIL else [])
         for target in TARGETS for mode in ("async", "sync") for when in KILL_AT]


def ps_kill_bound(train_dir, at: int) -> int:
    """How far a ps kill may roll the global step back: to the newest checkpoint the chief had saved when the ps
    died, which must be the one it restores. That is the checkpoint interval, or more when the chief lagged: it
    saves on its own steps, and under load the other worker can run well past the interval between two of them."""
    log = (train_dir / "logs" / "worker-0.log").read_text()
    restored = RESTORED.search(log)
    assert restored, log[-3000:]
    newest = max(int(step) for step in SAVED.findall(log[:restored.start()]))
    assert int(restored.group(1)) == newest, log[-3000:]
    return max(CHECKPOINT_EVERY, at - newest)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("target, mode, when", CELLS)
def test_kill_matrix(tmp_path, target, mode, when, record_property):
    train_dir = tmp_path / "train"
    spec = write_spec(tmp_path / "cluster.yaml", mode=mode, max_steps=MAX_STEPS, batch_size=32, log_every_steps=10,
                      save_checkpoint_steps=CHECKPOINT_EVERY, train_dir=str(train_dir), step_timeout_secs=120.0)
    fault = f"kill:{TARGETS[target]}@step={KILL_AT[when]}"
    started = time.monotonic()
    run = run_launcher([str(spec), "--max_restarts", "2", "--restart_backoff_secs", "0.5", "--inject", fault,
                        "--no_live"], cwd=tmp_path, timeout=360)
    wall = time.monotonic() - started
    out = run.output
    (tmp_path / "console.txt").write_text(out)
    assert run.returncode == 0, out[-4000:]
    rows = dict(TASK_ROW.findall(out))
    assert set(rows) == {"ps:0", "worker:0", "worker:1"}, out[-3000:]
    assert all(status.startswith("exit code 0") for status in rows.values()), rows
    assert f"restart 1: injected {fault}" in out
    final = checkpoint_step(train_dir)
    assert final == MAX_STEPS if mode == "sync" else final >= MAX_STEPS, final
    back = rollback(out)
    assert back <= (ps_kill_bound(train_dir, int(INJECTED.search(out).group(1))) if target == "ps" else 0), back
    assert_no_processes(run.pids)
    record_property("kill_matrix", {"cell": f"{target}-{mode}-{when}", "rollback": back, "wall_s": round(wall, 1),
                                    "final_step": final, "exits": rows})
    print(f"KILL-MATRIX {target}-{mode}-{when}: rollback {back}, wall {wall:.1f} s, final step {final}, "
          f"exits {rows}")
