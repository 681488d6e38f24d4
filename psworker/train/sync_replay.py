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

__all__ = ["ReplayDropped", "replayable"]


def replayable(element_spec) -> bool:
    """Whether every component of a dataset's `element_spec` is a dense tensor (what `ReplayDropped` can keep)."""
    import tensorflow as tf

    return all(isinstance(s, tf.TensorSpec) for s in tf.nest.flatten(element_spec))


class ReplayDropped:
    """Wraps an iterator's `get_next` (built on `device`, the worker's input device).

    Attributes:
        batch: the run's batch (the structure of `iterator.element_spec`): the last one again after a drop, else
            the iterator's next.
    """

    def __init__(self, iterator, device: str):
        import tensorflow as tf

        v1 = tf.compat.v1
        spec = iterator.element_spec
        flat = tf.nest.flatten(spec)
        local = [v1.GraphKeys.LOCAL_VARIABLES]
        with v1.device(None), v1.device(device), tf.name_scope(f"{SCOPE}/"):
            self._again = v1.Variable(False, trainable=False, collections=local, use_resource=True, name="again")
            self._kept = [v1.Variable(tf.zeros([0 if d is None else d for d in s.shape.as_list()], s.dtype)
                                      if s.shape.rank is not None else tf.zeros([0], s.dtype),
                                      trainable=False, collections=local, use_resource=True, validate_shape=False,
                                      shape=tf.TensorShape(None), name=f"kept_{i}") for i, s in enumerate(flat)]
            out = tf.cond(self._again.read_value(), lambda: [v.read_value() for v in self._kept],
                          lambda: tf.nest.flatten(iterator.get_next()), name="batch")
        for t, s in zip(out, flat):
            t.set_shape(s.shape)
        self._flat, self._device = out, device
        self.batch = tf.nest.pack_sequence_as(spec, out)

    def after(self, applied):
        """The op that keeps this run's batch for the next run when `applied` (a bool tensor) is False."""
        import tensorflow as tf

        v1 = tf.compat.v1

        def keep():
            with tf.control_dependencies([v.assign(t, read_value=False) for v, t in zip(self._kept, self._flat)]):
                return tf.constant(False)

        with v1.device(None), v1.device(self._device), tf.name_scope(f"{SCOPE}/after"):
            applied = tf.identity(applied)
            kept = tf.cond(applied, lambda: tf.constant(True), keep)
            return tf.group(kept, self._again.assign(tf.logical_not(applied), read_value=False))
