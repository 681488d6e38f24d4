"""Every line that crosses a process boundary, its formatter (`render`) beside its parser (`parse`): the grammar
and log records in `base`, a task's training lines in `training`, the lines about its process in `process`.

A task tells the launcher (and `psworker status`, the report, the tests) what happened by printing or logging one
of these lines; the launcher tells a task's log where an attempt starts the same way. The producers call `render()`
and every reader calls `parse_line` (or a kind's `parse`/`finditer`), so a reworded line changes both sides at once.

A line is recognised behind any of the prefixes it gets on its way: the console's `[worker:0] `, and a log record's
(psworker's `LOG_FORMAT`, Python logging's default `INFO:root:`, absl's `I1201 12:00:00.123456 42 file.py:7] `).
The step line is the one a user's script prints itself, so its parser takes what such a script plausibly prints:
`step 120, loss = 0.42 (1830.2 examples/sec; 0.035 sec/batch)` (the tutorial's form), `step 120, loss = 0.4213`,
`Step 120: loss=0.42`, `step 120`, and TF Estimator's `loss = 0.42, step = 120`.
"""

from __future__ import annotations

from typing import Optional, Union

from psworker.events.base import E, LOG_FORMAT, Event, LogRecord, log_time
from psworker.events.process import (NewRun, RemotePid, Restart, StacksReady, StacksRequested, TaskError, Traceback,
                                     current_attempt)
from psworker.events.training import (AucResult, CheckpointSaved, DataDealt, Exported, FirstStep, FoundComplete,
                                      ModelStart, PsDone, Precision, Step, StopSaved, TfImported, WorkerDone)
from psworker.events.steps import StepRecord, parse_step, rates_by_task, steady_rates, step_records

__all__ = ["LOG_FORMAT", "Event", "Step", "FirstStep", "WorkerDone", "FoundComplete", "PsDone", "TfImported",
           "Precision", "AucResult", "Exported", "StopSaved", "Restart", "DataDealt", "NewRun", "RemotePid",
           "TaskError", "Traceback", "KINDS", "CheckpointSaved", "ModelStart",
           "parse_line", "last", "current_attempt", "LogRecord", "log_time", "StacksReady", "StacksRequested",
           "StepRecord", "parse_step", "step_records", "rates_by_task", "steady_rates"]

KINDS: tuple[type[Event], ...] = (Step, FirstStep, WorkerDone, FoundComplete, PsDone, TfImported, Precision,
                                  AucResult, Exported, Restart, NewRun, RemotePid, TaskError, Traceback, DataDealt,
                                  CheckpointSaved, ModelStart, StopSaved)
AnyEvent = Union[Step, FirstStep, WorkerDone, FoundComplete, PsDone, TfImported, Precision, AucResult, Exported,
                 Restart, NewRun, RemotePid, TaskError, Traceback, DataDealt, CheckpointSaved, ModelStart, StopSaved]


def parse_line(line: str) -> Optional[AnyEvent]:
    """The event that one line is (prefixes allowed, trailing newline ignored), or None for any other line."""
    line = line.rstrip("\r\n")
    for kind in KINDS:
        event = kind.parse(line)
        if event is not None:
            return event
    return None


def last(kind: type[E], lines: Union[str, list[str]]) -> Optional[E]:
    """The last event of `kind` in a text or a list of lines, or None."""
    found = None
    for found in kind.finditer(lines if isinstance(lines, str) else "\n".join(lines)):
        pass
    return found
