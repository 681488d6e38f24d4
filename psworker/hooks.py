"""Session-run hooks of the trainer: the tutorial's progress line with the global step."""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)


def _hook_base():
    import tensorflow as tf

    return tf.compat.v1.train.SessionRunHook


class ProgressHook(_hook_base()):
    """Every `every_steps` local steps prints `step 120, loss = 0.42 (1830.2 examples/sec; 0.035 sec/batch)`.

    The step shown is the global step; the rates are this worker's own over the interval.
    """

    def __init__(self, loss, global_step, *, every_steps: int, examples_per_step: int, prefix: str = "",
                 emit=print):
        self._loss = loss
        self._global_step = global_step
        self._every = every_steps
        self._examples = examples_per_step
        self._prefix = prefix
        self._emit = emit
        self.local_steps = 0
        self.last_global_step = 0
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
        if self.local_steps % self._every:
            return
        now = time.monotonic()
        duration = max(now - self._t0, 1e-9)
        self._t0 = now
        self._emit(
            f"{self._prefix}step {int(step)}, loss = {float(loss):.2f} "
            f"({self._every * self._examples / duration:.1f} examples/sec; {duration / self._every:.3f} sec/batch)",
            flush=True,
        )
