"""TensorBoard summaries: each worker's loss, learning rate and speed, and the evaluator's precision@1.

Layout under the train dir (each directory is one TensorBoard run):
- `worker_<i>/`: worker i's scalars, tagged `worker_<i>/loss`, `worker_<i>/learning_rate`,
  `worker_<i>/examples_per_sec`, `worker_<i>/global_steps_per_sec`, at the global step. One directory per worker
  because every worker is its own process with its own event file, and TensorBoard reads a run's event files one
  after another (it stops reading an older file once a newer one appears), so concurrent writers must not share a
  directory.
- `eval/`: `precision@1` at the evaluated checkpoint's global step (what `psworker eval` writes).
- the train dir itself (TensorBoard's run `.`): the chief's checkpoint saver writes the graph there (the Graphs
  dashboard), and no scalars: they would repeat worker 0's.

The values are written as `Summary` protos from Python: the training graph has no summary ops.
"""

from __future__ import annotations

import os
import time
from typing import Optional

EVAL_DIR = "eval"
PRECISION_TAG = "precision@1"
METRICS = ("loss", "learning_rate", "examples_per_sec", "global_steps_per_sec")


def worker_dir(train_dir: str, task_index: int) -> str:
    """Where worker `task_index` writes its summaries: `<train_dir>/worker_<i>`."""
    return os.path.join(train_dir, f"worker_{task_index}")


def worker_tags(task_index: int) -> dict[str, str]:
    """Metric name -> tag for worker `task_index`, e.g. `{"loss": "worker_1/loss", ...}`."""
    return {metric: f"worker_{task_index}/{metric}" for metric in METRICS}


def scalar_summary(values: dict[str, float]):
    """A `tf.compat.v1.Summary` holding one simple value per tag."""
    import tensorflow as tf

    return tf.compat.v1.Summary(value=[tf.compat.v1.Summary.Value(tag=tag, simple_value=float(value))
                                       for tag, value in values.items()])


def make_writer(logdir: str):
    """A `FileWriter` on a new event file in `logdir` (made inside a graph: TF refuses one in eager mode).

    The file name gets the time in nanoseconds and this process's id: TF names event files by the second and the
    host only, so two writers opened in the same second would otherwise share (and clobber) one file; TensorBoard
    reads a run's files in name order, so the nanoseconds also keep them in the order they were written.
    """
    import tensorflow as tf

    with tf.Graph().as_default():
        return tf.compat.v1.summary.FileWriter(logdir, filename_suffix=f".{time.time_ns():020d}.{os.getpid()}")


def write_eval_summary(train_dir: str, precision: float, global_step: int) -> str:
    """Writes `precision@1` at `global_step` into `<train_dir>/eval` (where `psworker eval` writes it).

    Returns:
        The directory written to.
    """
    logdir = os.path.join(train_dir, EVAL_DIR)
    writer = make_writer(logdir)
    try:
        writer.add_summary(scalar_summary({PRECISION_TAG: precision}), int(global_step))
    finally:
        writer.close()
    return logdir


def _hook_base():
    import tensorflow as tf

    return tf.compat.v1.train.SessionRunHook


class WorkerSummaryHook(_hook_base()):
    """Every `every_steps` local steps writes this worker's scalars (see `worker_tags`) at the global step; at its
    first step the loss and learning rate alone (TensorBoard lists the run from then on).

    `examples_per_sec` is this worker's own rate over the interval; `global_steps_per_sec` is how fast the global
    step (every worker together) moved over the same interval. The event file is flushed at each write and closed at
    the end of the session.

    Args:
        task_index: the worker's index (its tag prefix and directory).
        loss, learning_rate, global_step: the training graph's tensors.
        logdir: the directory to write to (usually `worker_dir(train_dir, task_index)`).
        every_steps: write every this many local steps.
        examples_per_step: examples in one local step (batch size times towers).
        clock: monotonic clock (tests may pass their own).
    """

    def __init__(self, task_index: int, *, loss, learning_rate, global_step, logdir: str, every_steps: int,
                 examples_per_step: int, clock=time.monotonic):
        if every_steps < 1:
            raise ValueError(f"every_steps must be >= 1, got {every_steps}")
        self._tags = worker_tags(task_index)
        self._fetches = [loss, learning_rate, global_step]
        self._logdir = logdir
        self._every = every_steps
        self._examples = examples_per_step
        self._clock = clock
        self._writer = None
        self._local_steps = 0
        self._mark: Optional[tuple[float, int]] = None   # (time, global step) at the start of the interval
        self.writes = 0

    def begin(self):
        if self._writer is None:
            self._writer = make_writer(self._logdir)

    def before_run(self, run_context):
        # Fetches only on the steps that start or end an interval: most steps add no fetch.
        if self._mark is not None and (self._local_steps + 1) % self._every:
            return None
        import tensorflow as tf

        return tf.compat.v1.train.SessionRunArgs(self._fetches)

    def after_run(self, run_context, run_values):
        if self._mark is not None:
            self._local_steps += 1
            if self._local_steps % self._every:
                return
        loss, lr, step = run_values.results
        now = self._clock()
        step = int(step)
        if self._mark is None:   # the first step starts the first interval (it includes start-up): no rates yet,
            self._mark = (now, step)     # but the loss and learning rate, so that TensorBoard has the run from now on
            self._write({"loss": loss, "learning_rate": lr}, step)
            return
        then, then_step = self._mark
        seconds = max(now - then, 1e-9)
        self._mark = (now, step)
        values = {"loss": loss, "learning_rate": lr, "examples_per_sec": self._every * self._examples / seconds,
                  "global_steps_per_sec": (step - then_step) / seconds}
        self._write(values, step)

    def _write(self, values: dict, step: int) -> None:
        self._writer.add_summary(scalar_summary({self._tags[k]: v for k, v in values.items()}), step)
        self._writer.flush()
        self.writes += 1

    def end(self, session):
        self.close()

    def close(self) -> None:
        """Flushes and closes the event file (also called by `end`); idempotent."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


__all__ = ["WorkerSummaryHook", "worker_dir", "worker_tags", "scalar_summary", "make_writer", "write_eval_summary",
           "EVAL_DIR", "PRECISION_TAG", "METRICS"]
