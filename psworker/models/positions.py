"""A model for tests and benchmarks whose training examples carry their position, and which logs each position it
trains on (not a built-in: `tests/test_dealt_shards.py` and `benchmarks/dealt_straggler.py` count the reads).

Registered as `positions` when imported (name this module, `psworker.models.positions`, in `PSWORKER_MODELS`).
Every training step appends the batch's positions to `$PSWORKER_POSITIONS_DIR/<task>-<pid>.txt`, one line per
step, before its update: a line written by a step that never updated (a kill in between) is read again later, so the
lines count every position trained at least once, and each position read again at most once too often. With
`$PSWORKER_POSITIONS_WAIT_FOR=worker1`, the other tasks' first step waits for that task's first line: it is then
surely in the deal.
The log runs where the batch was read (`images.device`): a Python function runs only in the process that built
the graph, which for in-graph replication is the client, not the worker that computes the tower.

With `$PSWORKER_POSITIONS_APPLIED=N` (sync mode's `replicas_to_aggregate`), the model also counts the positions of
every gradient APPLIED, not only computed: a variable `applied_counts` (one float per position) whose gradient is
`-N x` the batch's one-hot counts, averaged over the N gradients of a step by the same accumulators as the weights,
and applied with rate 1 (`_CountingDescent`): each applied batch adds exactly 1 at each of its positions.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

from psworker.deadline import poll_until
from psworker.models import registry
from psworker.models.base import InputSpec, Model

NUM_EXAMPLES = int(os.environ.get("PSWORKER_POSITIONS_EXAMPLES", "300"))
POSITIONS_DIR_ENV = "PSWORKER_POSITIONS_DIR"
STEP_SECS_ENV = "PSWORKER_POSITIONS_STEP_SECS"
WAIT_FOR_ENV = "PSWORKER_POSITIONS_WAIT_FOR"    # a task (`worker1`) the others' first step waits for (`_wait_for_peer`)
WAIT_FOR_SECS = 120.0
APPLIED_ENV = "PSWORKER_POSITIONS_APPLIED"      # N: count the positions of each applied gradient (`applied_counts`)
COUNTS = "applied_counts"
_waited: list[str] = []


def _task_name() -> str:
    argv = sys.argv
    job = next((a for a in argv if a in ("worker", "ps")), "worker")
    index = argv[argv.index("--task_index") + 1] if "--task_index" in argv else "0"
    return f"{job}{index}"


def _wait_for_peer(folder: str, me: str) -> None:
    """`WAIT_FOR_ENV` names another task (`worker1`): this task's first step waits until that one has logged a step
    of its own, so that it is surely in the deal (it took a shard) before this one reads on."""
    peer = os.environ.get(WAIT_FOR_ENV)
    if not peer or peer == me or _waited:
        return
    if not poll_until(lambda: any(Path(folder).glob(f"{peer}-*.txt")), WAIT_FOR_SECS):
        raise RuntimeError(f"{me}: {peer} logged no step within {WAIT_FOR_SECS:g} s ({WAIT_FOR_ENV})")
    _waited.append(peer)


def _log_positions(positions: np.ndarray) -> np.ndarray:
    time.sleep(float(os.environ.get(STEP_SECS_ENV, "0")))   # a slower step: room to kill a worker mid-shard
    folder = os.environ.get(POSITIONS_DIR_ENV)
    if folder:
        _wait_for_peer(folder, _task_name())
        path = Path(folder) / f"{_task_name()}-{os.getpid()}.txt"
        with open(path, "a") as f:
            f.write(" ".join(str(int(p)) for p in positions) + "\n")
    return np.int64(len(positions))


def _examples(positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x = np.stack([positions.astype(np.float32), np.ones(len(positions), np.float32)], axis=1)
    return x, (positions % 10).astype(np.int32)


class PositionsModel(Model):
    """Linear softmax on `[position / N, 1]`; label `position % 10`."""

    name = "positions"
    default_learning_rate = 0.1
    image_shape = (2,)

    def train_inputs(self, spec: InputSpec):
        import tensorflow as tf

        return tf.compat.v1.data.make_one_shot_iterator(self.train_dataset(spec)).get_next()

    def train_dataset(self, spec: InputSpec):
        import tensorflow as tf

        if spec.positions is not None:
            positions = spec.positions()
        else:
            positions = tf.data.Dataset.range(spec.shard_index, NUM_EXAMPLES, spec.num_shards).repeat()
        x, y = _examples(np.arange(NUM_EXAMPLES))
        x, y = tf.constant(x), tf.constant(y)
        gather = tf.autograph.experimental.do_not_convert(lambda p: (tf.gather(x, p), tf.gather(y, p)))
        return positions.batch(spec.batch_size).map(gather).prefetch(2)

    def eval_dataset(self, data_dir: Optional[str], batch_size: int):
        import tensorflow as tf

        return tf.data.Dataset.from_tensor_slices(_examples(np.arange(NUM_EXAMPLES))).batch(batch_size)

    def num_train_examples(self, data_dir: Optional[str]) -> int:
        return NUM_EXAMPLES

    def loss(self, logits, labels):
        loss = super().loss(logits, labels)
        term = getattr(self, "_applied_term", None)
        return loss if term is None else loss + term

    def optimizer(self, learning_rate):
        return _counting_descent(learning_rate) if os.environ.get(APPLIED_ENV) else super().optimizer(learning_rate)

    def inference(self, images, *, training: bool):
        import tensorflow as tf

        v1 = tf.compat.v1
        if training and os.environ.get(APPLIED_ENV):
            counts = v1.get_variable(COUNTS, [NUM_EXAMPLES], tf.float32, v1.zeros_initializer())
            hits = tf.math.bincount(tf.cast(images[:, 0], tf.int32), minlength=NUM_EXAMPLES, maxlength=NUM_EXAMPLES,
                                    dtype=tf.float32)
            self._applied_term = -float(os.environ[APPLIED_ENV]) * tf.reduce_sum(counts * tf.stop_gradient(hits))
        x = images * tf.constant([1.0 / NUM_EXAMPLES, 1.0])
        if training:
            with tf.compat.v1.device(None), tf.compat.v1.device(images.device):
                logged = tf.numpy_function(_log_positions, [tf.cast(images[:, 0], tf.int64)], tf.int64)
            with tf.control_dependencies([logged]):
                x = tf.identity(x)
        w = v1.get_variable("weights", [2, self.num_classes], tf.float32, v1.zeros_initializer())
        b = v1.get_variable("biases", [self.num_classes], tf.float32, v1.zeros_initializer())
        return tf.add(tf.matmul(x, w), b, name="logits")


def _counting_descent(learning_rate):
    """Gradient descent at `learning_rate`, but `applied_counts` at rate 1: minus its (averaged) gradient."""
    import tensorflow as tf

    class _CountingDescent(tf.compat.v1.train.GradientDescentOptimizer):
        def _resource_apply_dense(self, grad, handle):
            if handle.name.split(":")[0].endswith(COUNTS):
                return tf.raw_ops.AssignSubVariableOp(resource=handle.handle, value=grad)
            return super()._resource_apply_dense(grad, handle)

    return _CountingDescent(learning_rate)


def read_positions(folder: Path) -> dict[str, list[list[int]]]:
    """Every position trained, per task (`worker0`), one list per step, from the files of every process."""
    out: dict[str, list[list[int]]] = {}
    for path in sorted(Path(folder).glob("*.txt")):
        task = path.stem.rsplit("-", 1)[0]
        steps = [[int(p) for p in line.split()] for line in path.read_text().splitlines() if line.strip()]
        out.setdefault(task, []).extend(steps)
    return out


try:
    registry.register("positions", PositionsModel)
except ValueError:   # registered already (by an older copy under another module name)
    pass
