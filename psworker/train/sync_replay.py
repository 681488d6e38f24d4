"""A dropped sync batch computed again by the worker that read it (issue 40).

In sync mode with backup workers a worker's gradient may be dropped (no push slot, `sync_slots`): its batch was
computed but not applied. Dealt shards count only applied batches as trained (`DealerState.count`), so the worker
keeps that batch: its next run takes the same batch again (a copy in local variables on the worker) in place of a
fresh one from the iterator, until a run of it is applied. Batches are therefore applied in the order they were
read, `trained` stays the exact prefix of the lease that is applied, and a worker restarted after a drop reads the
dropped batch first from its lease. Nothing goes back to the dealer, so the lease never splits into pieces.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

SCOPE = "psworker_sync_replay"

__all__ = ["ReplayDropped", "replayable", "counted"]


def replayable(element_spec) -> bool:
    """Whether every component of a dataset's `element_spec` is a dense tensor (what `ReplayDropped` can keep)."""
    import tensorflow as tf

    return all(isinstance(s, tf.TensorSpec) for s in tf.nest.flatten(element_spec))


class ReplayDropped:
    """Wraps an iterator's `get_next` (built on `device`, the worker's input device). Each run keeps a copy of its
    batch on the worker (before its gradients leave, so no edge to a ps is added); `hook` feeds whether to take it
    again, from the `applied` the previous run fetched (the worker's session is its own master: one tensor).

    Attributes:
        batch: the run's batch (the structure of `iterator.element_spec`): the kept one when `again` is fed True,
            else the iterator's next.
        applied: set by the graph's builder: the run's `PushSlots.applied`.
    """

    def __init__(self, iterator, device: str):
        import tensorflow as tf

        v1 = tf.compat.v1
        spec = iterator.element_spec
        flat = tf.nest.flatten(spec)
        local = [v1.GraphKeys.LOCAL_VARIABLES]
        with v1.device(None), v1.device(device), tf.name_scope(f"{SCOPE}/"):
            self.again = v1.placeholder_with_default(False, [], name="again")
            kept = [v1.Variable(tf.zeros([0], s.dtype), trainable=False, collections=local, use_resource=True,
                                validate_shape=False, shape=tf.TensorShape(None), name=f"kept_{i}")
                    for i, s in enumerate(flat)]   # any shape: each run assigns its batch
            out = tf.cond(self.again, lambda: [v.read_value() for v in kept],
                          lambda: tf.nest.flatten(iterator.get_next()), name="batch")
            with tf.control_dependencies([v.assign(t, read_value=False) for v, t in zip(kept, out)]):
                out = [tf.identity(t) for t in out]
        for t, s in zip(out, flat):
            t.set_shape(s.shape)
        self.batch = tf.nest.pack_sequence_as(spec, out)
        self.applied = None

    def hook(self, train_op):
        """The session hook that feeds `again` to each run of `train_op`: True after a run whose batch was not
        applied (False in a new session: the iterator starts again from the restored lease)."""
        return _ReplayHook(train_op, self.applied, self.again)


def _hook_base():
    import tensorflow as tf

    return tf.compat.v1.train.SessionRunHook


class _ReplayHook(_hook_base()):
    def __init__(self, train_op, applied, again):
        self._train_op, self._applied, self._again = train_op, applied, again
        self.value = False

    def after_create_session(self, session, coord):
        self.value = False

    def before_run(self, run_context):
        import tensorflow as tf

        if run_context.original_args.fetches is not self._train_op:
            return None
        return tf.compat.v1.train.SessionRunArgs(self._applied, feed_dict={self._again: self.value})

    def after_run(self, run_context, run_values):
        if run_values.results is not None:
            self.value = not bool(run_values.results)


def counted(inputs, train_op, examples, task_index: int, claim, slots):
    """`train_op`, then the dealer's record of the `examples` trained (`inputs`: the graph's `DealtInputs`). Sync
    (`slots`, the `PushSlots`): only an applied batch counts, and a dropped one is computed again."""
    applied = None if slots is None else slots.applied
    if inputs.replay is not None:
        inputs.replay.applied = applied
    elif applied is not None:
        log.warning("sync mode: the model's input is no tf.data.Dataset of dense tensors, so a dropped batch counts "
                    "as trained (its examples are applied once less)")
        applied = None
    return inputs.state.count(task_index, examples, train_op, claim, applied)
