"""Async updates bounded by `max_steps`: each step claims its global step before it updates (issue 37).

Without a claim, an async update checks nothing: the global step is added to after the update, and every step in
flight when the global step reaches `max_steps` (a helper's, `task.extra_steps`, or another worker's) adds one
more (a run of max_steps 10 with two steps in flight ended at 11). Here each step first runs a claim on the global
step's ps, in one `tf.CriticalSection` shared by every worker: it adds 1 to the global step only while that is
below `max_steps`, and says whether it did. The update runs only for a claimed step, so the global step never
passes `max_steps` and counts exactly the updates claimed; an unclaimed step's batch is not counted as trained
(`dealer.DealerState.count`), so dealt data stays exactly-once per epoch.

The claim waits for the step's batch (a step whose input ran dry at the end of the epochs claims nothing), then
runs on the ps beside the pulls and the compute, holding the lock only for its read and add; the update waits for
its answer, which came long before the gradients. Moving averages (`finish_train_op`) are still updated by an
unclaimed step (at most one per step in flight, at the very end): they follow the weights, left unchanged.
"""

from __future__ import annotations

from typing import Any, Optional

SCOPE = "psworker_step_claim"


def claim_step(global_step: Any, last_step: int, after: Any = None) -> Any:
    """A bool tensor on the global step's ps: this step claimed a global step below `last_step` (and added 1), once
    `after` (tensors: the step's batch) exists."""
    import tensorflow as tf

    v1 = tf.compat.v1
    with v1.device(None), v1.device(global_step.device), tf.name_scope(SCOPE), \
            tf.control_dependencies(tf.nest.flatten(() if after is None else after, expand_composites=True)):
        lock = tf.CriticalSection(shared_name=f"{SCOPE}_lock", name=f"{SCOPE}_lock")
        last = tf.constant(last_step, global_step.dtype.base_dtype)

        def claim():
            below = tf.less(global_step.read_value(), last, name="below_max_steps")
            add = global_step.assign_add(tf.cast(below, global_step.dtype.base_dtype), read_value=False)
            with tf.control_dependencies([add]):
                return tf.identity(below, name="claimed")

        return lock.execute(claim, exclusive_resource_access=False)


def apply_update(optimizer: Any, grads_and_vars: Any, global_step: Any, config: Any,
                 batch: Any) -> tuple[Any, Optional[Any]]:
    """`(update op, claimed)`: async with steps in flight, `optimizer`'s update of `grads_and_vars` runs only when
    `claim_step` claimed a global step below `config.max_steps` once `batch` was read (`claimed`, the bool tensor);
    else the plain update that adds to `global_step` after it (sync: capped by `graph.CappedOptimizer`), None."""
    import tensorflow as tf

    from psworker.spec.fast_path import fast_path

    # One step in flight needs no claim: its cond's switches of the gradients land on the worker (a test of packed
    # transfers counts 2 crossings per ps more), not measured yet; with steps in flight an exact end comes first.
    if config.mode == "sync" or fast_path(config).steps_in_flight == 1:
        return optimizer.apply_gradients(grads_and_vars, global_step=global_step), None
    grads_and_vars = list(grads_and_vars)
    claimed = claim_step(global_step, config.max_steps, batch)

    def update():
        with tf.control_dependencies([optimizer.apply_gradients(grads_and_vars)]):
            return tf.constant(True)

    op = tf.compat.v1.cond(claimed, update, lambda: tf.constant(False), name="claimed_update").op
    return op, claimed


__all__ = ["claim_step", "apply_update"]
