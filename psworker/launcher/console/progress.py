"""Progress the launcher reads from the tasks' own output: `step N, loss = L (E examples/sec; ...)` lines.

One mechanism serves stall detection, step-triggered fault injection and the live view: the supervisor feeds
every output line of every task to `Progress.feed`. Workers print a step line every `log_every_steps` local
steps (the global step), so the step seen lags the true one by at most that many steps per worker. A script
under `psworker run` opts in by printing lines that start with `step N` (a loss and rate are optional; the forms
taken are `psworker.events.Step`'s).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass
from typing import Optional

from psworker import events
from psworker.states import TaskState

__all__ = ["Progress", "TaskProgress", "step_of"]


def step_of(event: Optional[events.Event]) -> Optional[tuple[int, Optional[float], Optional[float]]]:
    """`(global step, loss, examples/sec)` from an event that tells a global step (a step line, or psworker's
    first-step, done and already-complete lines), None for any other event."""
    if isinstance(event, events.Step):
        return event.step, event.loss, event.examples_per_sec
    if isinstance(event, (events.FirstStep, events.WorkerDone, events.FoundComplete)):
        return event.step, None, None
    return None


@dataclass(frozen=True)
class TaskProgress:
    """What the launcher last saw of one task."""

    name: str
    state: TaskState = TaskState.STARTING
    step: Optional[int] = None       # the last global step this task reported
    loss: Optional[float] = None
    examples_per_sec: Optional[float] = None
    epoch: Optional[float] = None    # dealt shards: the epoch its last step line showed (examples / epoch)
    num_epochs: Optional[int] = None
    started_at: float = 0.0          # time.time() of the current attempt's start
    step_moved_at: float = 0.0       # time.time() when `step` last changed (or the attempt started)
    last_output_at: float = 0.0      # time.time() of its last output line
    restarts: int = 0
    pid: Optional[int] = None        # `psworker status`, from the launcher's tasks.json: the current attempt's
    host: Optional[str] = None       # process and where it runs
    exit: Optional[str] = None       # ... and how it ended (`exit code 0`, `killed by SIGKILL`, `stopped by ...`)

    @property
    def label(self) -> str:
        """The state as shown: `restarting N` names the restart to come."""
        return f"{self.state} {self.restarts + 1}" if self.state == TaskState.RESTARTING else str(self.state)


class Progress:
    """Thread-safe per-task progress; the global step is the largest step any task reported."""

    def __init__(self, names: list[str]) -> None:
        self._lock = threading.Lock()
        self._tasks = {n: TaskProgress(n) for n in names}
        self._workers: Optional[tuple[int, int]] = None

    def set_workers(self, running: int, target: int) -> None:
        """An elastic job's worker count: how many run, and how many should."""
        with self._lock:
            self._workers = (running, target)

    def workers(self) -> Optional[tuple[int, int]]:
        """(running, target) of an elastic job's workers; None for a fixed job."""
        with self._lock:
            return self._workers

    def feed(self, name: str, line: str, now: Optional[float] = None) -> Optional[int]:
        """Records one output line of task `name`; returns its step if it tells one."""
        return self.record(name, events.parse_line(line), now)

    def record(self, name: str, event: Optional[events.Event], now: Optional[float] = None) -> Optional[int]:
        """Records one output line of task `name` that is `event` (None: no event); returns its step if any."""
        now = time.time() if now is None else now
        parsed = step_of(event)
        with self._lock:
            t = self._tasks[name]
            if parsed is None:
                if isinstance(event, events.DataDealt):   # the chief's last word on the epochs trained
                    t = _replace(t, epoch=event.epochs, num_epochs=event.num_epochs or t.num_epochs)
                self._tasks[name] = _replace(t, last_output_at=now,
                                             state=TaskState.RUNNING if t.state == TaskState.STARTING else t.state)
                return None
            step, loss, rate = parsed
            moved = t.step is None or step != t.step
            if isinstance(event, events.Step) and event.epoch is not None:
                t = _replace(t, epoch=event.epoch, num_epochs=event.num_epochs)
            self._tasks[name] = _replace(
                t, step=step, loss=loss if loss is not None else t.loss,
                examples_per_sec=rate if rate is not None else t.examples_per_sec,
                step_moved_at=now if moved else t.step_moved_at, last_output_at=now,
                state=TaskState.TRAINING if t.state in (TaskState.STARTING, TaskState.RUNNING) else t.state)
            return step

    def started(self, name: str, restarts: int, now: Optional[float] = None) -> None:
        now = time.time() if now is None else now
        with self._lock:
            t = self._tasks[name]
            self._tasks[name] = _replace(t, state=TaskState.STARTING, started_at=now, step_moved_at=now,
                                         last_output_at=now, restarts=restarts)

    def resumed(self, name: str, now: float) -> None:
        """Task `name` goes on after an injected stop: training again, its stall clock restarted (the stop's
        time is not a stall)."""
        with self._lock:
            self._tasks[name] = _replace(self._tasks[name], state=TaskState.TRAINING, step_moved_at=now)

    def set_state(self, name: str, state: TaskState) -> None:
        with self._lock:
            self._tasks[name] = _replace(self._tasks[name], state=TaskState(state))

    def snapshot(self) -> dict[str, TaskProgress]:
        with self._lock:
            return dict(self._tasks)

    def global_step(self) -> int:
        with self._lock:
            return max((t.step for t in self._tasks.values() if t.step is not None), default=0)


def _replace(t: TaskProgress, **changes) -> TaskProgress:
    return dataclasses.replace(t, **changes)
