"""`psworker status`'s reading of a run dir beyond the step lines: each task's end and process as its launcher
recorded them (`runstate.TaskRecord`), what is left when that launcher is gone, and the rate of the global step
from the timestamped lines of the task logs."""

from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping, Optional

from psworker import events
from psworker.launcher.console.progress import TaskProgress
from psworker.states import TaskState
from psworker.launcher.console.report import describe_returncode
from psworker.launcher.runstate import LauncherState, TaskRecord, pid_alive

__all__ = ["settle_tasks", "steps_per_sec"]

_ENDED = {TaskState.DONE, TaskState.EXITED, TaskState.FAILED, TaskState.STOPPED, TaskState.LEFT, TaskState.PREEMPTED}
_RATE_MIN_SECS = 1.0        # shorter spans give no rate (a step line or two apart)


def _exit(record: TaskRecord) -> Optional[str]:
    if record.returncode is None:
        return None
    said = describe_returncode(record.returncode) + (f": {record.cause}" if record.cause else "")
    return f"stopped by the launcher ({said})" if record.stopped else said


def _ended_state(t: TaskProgress, record: Optional[TaskRecord]) -> TaskState:
    """The state of a task whose run is over (ended, or its launcher gone) and whose process has exited."""
    if record is not None and record.returncode is not None:
        if TaskState(record.state) in _ENDED:
            return TaskState(record.state)
        return (TaskState.STOPPED if record.stopped else TaskState.DONE if record.returncode == 0
                else TaskState.FAILED)
    return t.state if t.state in _ENDED else TaskState.GONE


def _settle(t: TaskProgress, record: Optional[TaskRecord], over: bool, gone: bool) -> TaskProgress:
    """`t` (read from its log) with its launcher's record; with the run `over`, never a state that says a process
    is there, unless (its launcher `gone`) its pid still runs on this host."""
    if record is not None:
        t = dataclasses.replace(t, pid=record.pid, host=record.host, exit=_exit(record))
        if record.returncode is not None and TaskState(record.state) in _ENDED:
            t = dataclasses.replace(t, state=TaskState(record.state))
    if not over or t.state in _ENDED or t.state in (TaskState.NOT_STARTED, TaskState.RESERVED):
        return t
    if gone and record is not None and record.returncode is None and pid_alive(record.pid, record.host) is not False:
        return t                # still there without its launcher, or on another host (no telling from here)
    return dataclasses.replace(t, state=_ended_state(t, record))


def settle_tasks(tasks: Mapping[str, TaskProgress], records: Mapping[str, TaskRecord], ended: bool,
                 launcher: Optional[LauncherState]) -> dict[str, TaskProgress]:
    """Every task as `psworker status` shows it: its process and end from `records`; once the run has `ended` or
    its launcher is gone, no task left "running" that has no process."""
    gone = not ended and launcher is not None and bool(launcher.gone)
    return {name: _settle(t, records.get(name), ended or gone, gone) for name, t in tasks.items()}


def _points(log: str, mtime: float) -> list[tuple[float, int]]:
    """(time, global step) of the current attempt's timestamped step-telling lines, and of the last step it told
    (a step line has no time) at the log's last write."""
    found, last = [], None
    for line in events.current_attempt(log).splitlines():
        event = events.parse_line(line)
        if isinstance(event, (events.FirstStep, events.CheckpointSaved, events.WorkerDone)):
            at = events.log_time(line)
            if at is not None:
                found.append((at, event.step))
        if isinstance(event, (events.Step, events.FirstStep, events.CheckpointSaved, events.WorkerDone)):
            last = event.step
    if last is not None:
        found.append((mtime, last))
    return found


def steps_per_sec(logs: Iterable[tuple[str, float]]) -> Optional[float]:
    """Global steps per second over the workers' logs (`(text, modification time)`): from the first point after the
    step last went back (a restore: below nine tenths of the highest before it; the workers' lines lag each other a
    little) to the latest; None under `_RATE_MIN_SECS` or without progress."""
    points = sorted(p for text, mtime in logs for p in _points(text, mtime))
    first, highest = 0, None
    for i, (_, step) in enumerate(points):
        if highest is not None and step < 0.9 * highest:
            first, highest = i, None
        highest = step if highest is None else max(highest, step)
    if len(points) - first < 2:
        return None
    (t0, s0), (t1, s1) = points[first], points[-1]
    if t1 - t0 < _RATE_MIN_SECS or s1 <= s0:
        return None
    return (s1 - s0) / (t1 - t0)
