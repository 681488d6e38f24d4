"""Benchmark-only prototype: psworker's moving-average update computed on the ps instead of the worker.

`psworker.train.graph.finish_train_op` builds `ema.apply(...)` under the
worker's `replica_device_setter`, so the update's arithmetic (`(shadow - var) * (1 - decay)`) is placed on the
worker: every step reads each variable *and* its shadow from the ps and sends the product back (3x the model's
bytes on top of the step's own 2x). `finish_train_op_on_ps` builds the same update with each variable's ops on that
variable's ps. `install()` swaps it into psworker's trainer in this process (benchmarks/peers.py does that in every
task process through a `sitecustomize.py`); nothing in psworker changes.
"""

from __future__ import annotations


def finish_train_op_on_ps(apply_op, ema, loss, learning_rate):
    """`finish_train_op` with the moving-average update of each variable placed on that variable's device."""
    import tensorflow as tf

    v1 = tf.compat.v1
    v1.summary.scalar("loss", loss)
    v1.summary.scalar("learning_rate", learning_rate)
    if ema is None:
        return apply_op
    updates = []
    with tf.control_dependencies([apply_op]):
        for var in v1.trainable_variables():
            with v1.device(var.device):
                updates.append(ema.apply([var]))
    return tf.group(apply_op, *updates, name="train_op")


def install() -> None:
    """Makes psworker's trainer build the moving averages with `finish_train_op_on_ps`."""
    from psworker.train import graph

    graph.finish_train_op = finish_train_op_on_ps
