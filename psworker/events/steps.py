"""Step lines read back in bulk, for the benchmarks, the tests and the launcher: each line's task (the console's
`[worker:0] ` prefix), its `Step` and its log time, and the examples/s each task reported."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Iterable, Optional, Union

from psworker.events.base import log_time
from psworker.events.training import Step

__all__ = ["StepRecord", "parse_step", "step_records", "rates_by_task", "steady_rates"]


@dataclass(frozen=True)
class StepRecord:
    """One step line: the task whose console prefix it carries (None: a task's own log), its `Step`, and the
    `time.time()` of its log record (None: a printed line, without a log record's time)."""

    task: Optional[str]
    step: Step
    time: Optional[float] = None


def parse_step(line: str) -> Optional[StepRecord]:
    """The step line that `line` is (any prefix the events grammar allows), or None."""
    line = line.rstrip("\r\n")
    m = Step.regex.match(line)
    if m is None:
        return None
    return StepRecord(m.group("console_task"), Step._from(m), log_time(line))


def step_records(lines: Union[str, Iterable[str]], task: Optional[str] = None) -> list[StepRecord]:
    """Every step line of a text or of lines, in order (`task`: only that task's, by its console prefix)."""
    if isinstance(lines, str):
        lines = lines.splitlines()
    found = (parse_step(line) for line in lines)
    return [r for r in found if r is not None and (task is None or r.task == task)]


def rates_by_task(records: Iterable[StepRecord], skip: int = 0) -> dict[Optional[str], list[float]]:
    """Each task's reported examples/s, in order, leaving out its first `skip` rates (session start, warm-up)."""
    rates: dict[Optional[str], list[float]] = {}
    for r in records:
        if r.step.examples_per_sec is not None:
            rates.setdefault(r.task, []).append(r.step.examples_per_sec)
    return {task: found[skip:] for task, found in rates.items() if found[skip:]}


def steady_rates(records: Iterable[StepRecord], skip: int = 1) -> dict[Optional[str], float]:
    """Each task's mean examples/s after its first `skip` rates; a task with no rate left is left out."""
    return {task: statistics.mean(found) for task, found in rates_by_task(records, skip).items()}
