"""Progress the launcher reads from the tasks' own output: `step N, loss = L (E examples/sec; ...)` lines.

One mechanism serves stall detection, step-triggered fault injection and the live view: the supervisor feeds
every output line of every task to `Progress.feed`. Workers print a step line every `log_every_steps` local
steps (the global step), so the step seen lags the true one by at most that many steps per worker. A script
under `psworker run` opts in by printing lines that start with `step N` (a loss and rate are optional; the forms
taken are `psworker.events.Step`'s).
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import time
from dataclasses import dataclass
from typing import Optional

from psworker import events

__all__ = ["Progress", "TaskProgress", "TaskState", "step_of"]


class TaskState(enum.StrEnum):
    """What the launcher (live) or `psworker status` (from the logs) knows of a task: the one list of states. Their
    text is what the live view, `psworker status` and its JSON show."""

    NOT_STARTED = "not started"     # `psworker status`: no log yet
    RESERVED = "reserved"           # an elastic job's worker that has not joined
    STARTING = "starting"           # started, no output yet
    RUNNING = "running"             # output, no step line yet (a ps serves)
    TRAINING = "training"           # step lines
    PAUSED = "stopped (injected)"   # SIGSTOPped by an injected fault
    RESTARTING = "restarting"       # waiting for its restart's backoff (shown `restarting N`)
    LEAVING = "leaving"             # an elastic job's worker asked to leave
    LEFT = "left"                   # ... that has left
    PREEMPTED = "left (preempted)"  # ... preempted and not restarted
    DONE = "done"                   # exited 0 (its log: training over)
    EXITED = "exited"               # exited non-zero, which did not fail the run
    FAILED = "failed"
    STOPPED = "stopped"             # stopped by the launcher at the end of the run
    GONE = "gone"                   # `psworker status`: no process left, and no word of how it ended (its launcher
                                    # is gone, or the run ended without a record of it)

    @property
    def active(self) -> bool:
        """A process that should be printing: started and not yet seen to end or pause."""
        return self in (TaskState.STARTING, TaskState.RUNNING, TaskState.TRAINING)

    @property
    def live(self) -> bool:
        """A process is there or about to be (its silence may mean it hangs): not ended, not reserved."""
        return self in (TaskState.STARTING, TaskState.RUNNING, TaskState.TRAINING, TaskState.PAUSED,
                        TaskState.RESTARTING, TaskState.LEAVING)


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
