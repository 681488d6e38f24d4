"""The launcher's last line after a stop by SIGINT or SIGTERM: the checkpoint the chief wrote on the stop
(`events.StopSaved` in its log), or, when it wrote none, the newest one on disk, from which the same command goes on.
"""

from __future__ import annotations

import re
from pathlib import Path

from psworker import events
from psworker.launcher.console.report import RunResult, describe_returncode
from psworker.spec.plan import chief_name

__all__ = ["newest_checkpoint_step", "stop_line"]

_INDEX = re.compile(r"^model\.ckpt-(\d+)\.index$")


def newest_checkpoint_step(train_dir: Path) -> int | None:
    """The step of the newest `model.ckpt-N` whose `.index` is in `train_dir` (None: none, or not readable here)."""
    try:
        steps = [int(m.group(1)) for m in map(_INDEX.match, (p.name for p in train_dir.iterdir())) if m]
    except OSError:
        return None
    return max(steps, default=None)


def stop_line(result: RunResult, train_dir: Path) -> str:
    """`stopped; checkpoint of step 4,042 saved in DIR; the same command goes on from it`, or why the chief saved
    nothing and what the same command goes on from."""
    chief = chief_name(result.exits) or "worker:0"
    exit_ = result.exits.get(chief)
    text = ""
    if exit_ is not None:
        try:
            text = events.current_attempt(Path(exit_.log_path).read_text(encoding="utf-8", errors="replace"))
        except OSError:
            pass
    saved = events.last(events.StopSaved, text)
    if saved is not None:
        return (f"stopped; checkpoint of step {saved.step:,} saved in {saved.train_dir}; the same command goes on "
                f"from it")
    how = ("it had exited before the stop" if exit_ is None or not exit_.stopped
           else f"it was {describe_returncode(exit_.returncode)}" if exit_.returncode < 0
           else f"it exited with {describe_returncode(exit_.returncode)}, see its log")
    step = newest_checkpoint_step(train_dir)
    then = (f"the newest checkpoint in {train_dir} is of step {step:,}: the same command goes on from it"
            if step is not None else f"no checkpoint in {train_dir}: the same command starts afresh")
    return f"stopped; {chief} wrote no checkpoint on the stop ({how}); {then}"
