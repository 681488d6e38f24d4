"""How a run ended, as data, from the supervisor's slots: the root cause's `TaskFailure` (its error record, else
its log's last lines and error line) and every task's `TaskExit` (`launcher.console.report` renders both)."""

from __future__ import annotations

from typing import Iterable, Optional

from psworker import events, stackdump
from psworker.launcher.console.logtail import innermost_frames, tail_without_stacks
from psworker.launcher.console.report import TaskExit, TaskFailure
from psworker.launcher.supervise.slot import Slot

__all__ = ["task_exits", "task_failure"]


def task_failure(slot: Slot, reason: str) -> TaskFailure:
    """The failure of `slot`'s ended attempt, once its reader has copied the last lines (EOF follows the exit)."""
    slot.reader.join(2.0)
    record = slot.error_record()        # its failure as data; without one (a user's program, a signal): the log
    if record is not None:
        return TaskFailure(slot.name, slot.returncode, (), slot.ended_at, reason, error=record.message,
                           record=record, error_file=str(slot.error_path))
    tail = tuple(slot.tail)
    if any(stackdump.is_dump_line(line) for line in tail):     # a dump fills it: the lines around the dump
        tail = tail_without_stacks(slot.log_path, len(tail))
    said = events.last(events.TaskError, list(slot.tail))     # its own error line, for the report's first
    return TaskFailure(slot.name, slot.returncode, tail, slot.ended_at, reason, error=said.message if said else "")


def task_exits(slots: Iterable[Slot], failed: Optional[str]) -> dict[str, TaskExit]:
    """Each started task's exit; the stopped ones and the failed one with their innermost frames."""
    return {s.name: TaskExit(s.name, s.returncode, s.started_at, s.ended_at, str(s.log_path), s.restarts,
                             s.stopped, tuple(s.causes),
                             innermost_frames(s.log_path) if s.stopped or s.name == failed else ())
            for s in slots if s.popen is not None}
