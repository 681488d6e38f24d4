"""Session-run hooks of the trainer (the tutorial's progress line) and a watchdog that reports slow steps."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

log = logging.getLogger(__name__)


def _hook_base():
    import tensorflow as tf

    return tf.compat.v1.train.SessionRunHook


class ProgressHook(_hook_base()):
    """Every `every_steps` local steps prints `step 120, loss = 0.42 (1830.2 examples/sec; 0.035 sec/batch)`.

    The step shown is the global step; the rates are this worker's own over the interval. At the end of a
    session that finished without error, `final_global_step` holds the global step read once more from the ps
    (the value fetched with the last step may predate that step's update).
    """

    def __init__(self, loss, global_step, *, every_steps: int, examples_per_step: int,
                 emit=print, name: str = "worker"):
        self._name = name
        self._loss = loss
        self._global_step = global_step
        self._every = every_steps
        self._examples = examples_per_step
        self._emit = emit
        self.local_steps = 0
        self.last_global_step = 0
        self.final_global_step: Optional[int] = None
        self._t0 = 0.0

    def begin(self):
        self._t0 = time.monotonic()

    def before_run(self, run_context):
        import tensorflow as tf

        return tf.compat.v1.train.SessionRunArgs([self._loss, self._global_step])

    def after_run(self, run_context, run_values):
        loss, step = run_values.results
        self.local_steps += 1
        self.last_global_step = int(step)
        if self.local_steps == 1:
            log.info("%s: first step done at global step %d", self._name, int(step))
        if self.local_steps % self._every:
            return
        now = time.monotonic()
        duration = max(now - self._t0, 1e-9)
        self._t0 = now
        self._emit(
            f"step {int(step)}, loss = {float(loss):.2f} "
            f"({self._every * self._examples / duration:.1f} examples/sec; {duration / self._every:.3f} sec/batch)",
            flush=True,
        )

    def end(self, session):
        self.final_global_step = int(session.run(self._global_step))
        self.last_global_step = max(self.last_global_step, self.final_global_step)


class StepWatchdog:
    """Logs while one training step runs for longer than `after_secs`, every `every_secs`, so that a wait (a sync
    step needs gradients from the other workers) is never silent. A context manager; its thread is joined on exit.

    Args:
        who: the task's name for messages (`worker:0`).
        why: a hint appended to the message (what the step may be waiting for).
        after_secs: how long a step may run before the first message.
        every_secs: interval between messages while the same step still runs.
        clock: monotonic clock (tests pass a fake).
    """

    def __init__(self, who: str, why: str, *, after_secs: float = 10.0, every_secs: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        self._who = who
        self._why = why
        self._after = after_secs
        self._every = every_secs
        self._clock = clock
        self._started: Optional[float] = None
        self._next_report = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="psworker-step-watchdog", daemon=True)

    def __enter__(self) -> "StepWatchdog":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def step_started(self) -> None:
        with self._lock:
            self._started = self._clock()
            self._next_report = self._started + self._after

    def step_finished(self) -> None:
        with self._lock:
            self._started = None

    def check(self) -> Optional[str]:
        """The message to log now, if any (called by the thread; public for tests)."""
        with self._lock:
            if self._started is None:
                return None
            now = self._clock()
            if now < self._next_report:
                return None
            self._next_report = now + self._every
            return f"{self._who}: a training step has been running for {now - self._started:.0f} s; {self._why}"

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self._every / 4)):
            message = self.check()
            if message:
                log.warning("%s", message)


def _listener_base():
    import tensorflow as tf

    return tf.compat.v1.train.CheckpointSaverListener


class CheckpointLogger(_listener_base()):
    """Logs `worker:0: checkpoint of global step N saved` once a checkpoint is complete on disk."""

    def __init__(self, name: str):
        self._name = name

    def after_save(self, session, global_step_value):
        log.info("%s: checkpoint of global step %d saved", self._name, int(global_step_value))
