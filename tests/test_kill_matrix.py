"""The kill matrix: `psworker local --inject kill:... --max_restarts 2` over {ps, chief, non-chief} x {async, sync}
x {before the first periodic checkpoint, after it}. Every run must finish (sync: exactly at max_steps; async: at
least), every task must exit 0, and the global step may not roll back at all after a worker kill; after a ps kill
only to the newest checkpoint the chief had saved when the ps died, which it must restore (`restored_newest`).

Rollback is read from the console: per worker, the most its step lines fell below the highest one it had printed
(a chief restoring a checkpoint shows up there; the run's console is in `console.txt` beside the train dir).
"""

from __future__ import annotations

import re
import time
from typing import Optional

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


def drops(output: str) -> tuple[int, Optional[int]]:
    """How far the global step went back, and the lowest step printed after it had: per worker, the most its step
    lines fell below the highest one it had printed before, and the lowest such line (each task's lines keep their
    order on the console; the console may hold them back past the launcher's own restart lines, so the order across
    tasks says nothing). `(0, None)` when no line fell back."""
    assert INJECTED.search(output) and RESTARTING.search(output), output[-3000:]
    back, lowest = 0, None
    highest: dict[str, int] = {}
    for task, step in console_steps(output):
        if step < highest.get(task, step):
            back = max(back, highest[task] - step)
            lowest = step if lowest is None else min(lowest, step)
        highest[task] = max(highest.get(task, step), step)
    return back, lowest


CELLS = [pytest.param(target, mode, when, id=f"{target}-{mode}-{when}",
                      marks=[pytest.mark.xfail(strict=True, reason=XFAIL[(target, mode, when)])]
                      if (target, mode, when) in XFAIL else [])
         for target in TARGETS for mode in ("async", "sync") for when in KILL_AT]


def restored_newest(train_dir) -> int:
    """The checkpoint the chief restored after a ps kill, checked to be the newest it had saved before: the most a
    ps kill may cost is the steps since then (the checkpoint interval, or more when the chief lagged: it saves on its
    own steps, and under load the other worker can run well past the interval between two of them)."""
    log = (train_dir / "logs" / "worker-0.log").read_text()
    restored = RESTORED.search(log)
    assert restored, log[-3000:]
    newest = max(int(step) for step in SAVED.findall(log[:restored.start()]))
    assert int(restored.group(1)) == newest, log[-3000:]
    return newest


@pytest.mark.timeout(420)
@pytest.mark.parametrize("target, mode, when", CELLS)
def test_kill_matrix(tmp_path, target, mode, when, record_property):
    train_dir = tmp_path / "train"
    spec = write_spec(tmp_path / "cluster.yaml", mode=mode, max_steps=MAX_STEPS, batch_size=32, log_every_steps=10,
                      save_checkpoint_steps=CHECKPOINT_EVERY, train_dir=str(train_dir), step_timeout_secs=120.0)
    fault = f"kill:{TARGETS[target]}@step={KILL_AT[when]}"
    started = time.monotonic()
    run = run_launcher([str(spec), "--max_restarts", "2", "--restart_backoff_secs", "0.5", "--inject", fault,
                        "--console", "plain"], cwd=tmp_path, timeout=360)
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
    back, lowest = drops(out)
    if target == "ps":   # the step went back to the restored checkpoint, not below it
        restored = restored_newest(train_dir)
        assert lowest is None or lowest >= restored, (back, lowest, restored)
    else:
        assert back == 0, back
    assert_no_processes(run.pids)
    record_property("kill_matrix", {"cell": f"{target}-{mode}-{when}", "rollback": back, "wall_s": round(wall, 1),
                                    "final_step": final, "exits": rows})
    print(f"KILL-MATRIX {target}-{mode}-{when}: rollback {back} (lowest step after it {lowest}), wall {wall:.1f} s, "
          f"final step {final}, exits {rows}")
