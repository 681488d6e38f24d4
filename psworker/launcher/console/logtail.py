"""What a task's log says at its end, for the report: its current attempt, the innermost frames of its last stack
dump, and its last lines without the dump's."""

from __future__ import annotations

from pathlib import Path

from psworker import events, stackdump

__all__ = ["STACK_FRAMES", "innermost_frames", "tail_without_stacks"]

STACK_FRAMES = 5                  # the report shows this many innermost frames of a stuck task's main thread


def _current_attempt(log_path: Path) -> str:
    try:
        return events.current_attempt(log_path.read_text(errors="replace"))
    except OSError:
        return ""


def innermost_frames(log_path: Path) -> tuple[str, ...]:
    """The innermost frames of the main thread in the last stack dump of the task's current attempt, if any."""
    dump = stackdump.last_dump(_current_attempt(log_path))
    return () if dump is None else dump.innermost(STACK_FRAMES)


def tail_without_stacks(log_path: Path, count: int) -> tuple[str, ...]:
    """The last `count` non-blank lines of the task's current attempt that are no stack dump's."""
    lines = [line for line in _current_attempt(log_path).splitlines()
             if line.strip() and not stackdump.is_dump_line(line)]
    return tuple(lines[-count:])
