"""Push slots: which workers' gradients a sync step applies, decided exactly (issue 40).

`SyncReplicasOptimizer` keeps one `ConditionalAccumulator` per variable; each takes the first `replicas_to_aggregate`
(N) gradients pushed for the step and drops later ones as stale. Gradients arrive one variable at a time, so with
backup workers one worker's push can land in some accumulators before their take and in others after: no worker
knows whether its batch was applied. Here the chief's aggregation queues exactly N slots tagged with the step after
each update (`fill`, added to its queue runner; the chief's own train op is a worker's, so it never waits on
itself). A worker, once its gradients are computed, takes a slot in the same run: if the slot is for its step it
pushes its gradients for that step; else (the N slots of its step went to faster workers) it pushes them tagged
stale (-1, dropped by every accumulator, as TF drops a late gradient today), puts the slot back and its run says
`applied` False. Exactly the N slot holders' gradients reach every accumulator, so the batches a step applies
are exactly those whose runs say so. The slot queue lives on the global step's ps, shared by name; a chief that
starts (fresh, restored, or on a live ps) refills it (`reset`); a stopping chief queues stale slots beside its
tokens (`stale_slots`), so a worker waiting for a slot ends its step too. Past the last step the slots are stale.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

SLOT_QUEUE = "psworker_sync_slots"
STALE = -1                  # a slot for no step: whoever takes it pushes nothing that is applied
RESET_RUN_SECS = 10.0       # one run of the refill (the ps answers at once, or is unreachable)

__all__ = ["PushSlots", "SLOT_QUEUE", "STALE", "RESET_RUN_SECS", "DroppedBatches", "slot_queue", "stale_slots"]


def slot_queue(device: str):
    """The slot queue (a handle on the shared queue, made in the current graph on `device`)."""
    import tensorflow as tf

    with tf.compat.v1.device(device):
        return tf.compat.v1.FIFOQueue(-1, [tf.int64], shapes=[[]], shared_name=SLOT_QUEUE, name="sync_slot_q")


def stale_slots(sync_optimizer):
    """The op that queues one stale slot per aggregated gradient (a stopping chief's release)."""
    import tensorflow as tf

    opt = sync_optimizer
    device = opt._global_step.device                                  # pylint: disable=protected-access
    with tf.compat.v1.device(device):
        return slot_queue(device).enqueue_many(
            (tf.fill([int(opt._replicas_to_aggregate)], tf.constant(STALE, tf.int64)),))   # pylint: disable=protected-access


class PushSlots:
    """Wires push slots into one worker's `SyncReplicasOptimizer` graph, after its `apply_gradients`.

    Attributes:
        train_op: the worker's train op in place of TF's: take a slot, push (for the step or stale), take a token.
        applied: a bool tensor of that run: whether its gradients are among the step's N.
    """

    def __init__(self, sync_optimizer, grads_and_vars, last_step: int):
        import tensorflow as tf

        v1 = tf.compat.v1
        opt = sync_optimizer
        global_step = opt._global_step                                # pylint: disable=protected-access
        self._num = int(opt._replicas_to_aggregate)                  # pylint: disable=protected-access
        grads = [g for g, _ in grads_and_vars if g is not None]
        accumulators = opt._accumulator_list                         # pylint: disable=protected-access
        if len(grads) != len(accumulators):
            raise RuntimeError(f"{len(grads)} gradients but {len(accumulators)} sync accumulators: this TensorFlow "
                               "builds SyncReplicasOptimizer differently")
        local = opt._local_step                                       # pylint: disable=protected-access
        with v1.device(global_step.device), tf.name_scope("psworker_sync_slots"):
            self.queue = slot_queue(global_step.device)
            self._size = self.queue.size()
            self._drain = self.queue.dequeue()
            self._refill = self.queue.enqueue_many((_tags(global_step, last_step, self._num),))
            with tf.control_dependencies(_flat(grads)):              # the slot goes to whoever computed first
                slot = self.queue.dequeue()
            self.applied = tf.equal(slot, tf.cast(local, tf.int64), name="applied")
            push_step = tf.where(self.applied, local, tf.constant(STALE, local.dtype.base_dtype))
            back = self.queue.enqueue_many((tf.reshape(slot, [1])[:1 - tf.cast(self.applied, tf.int32)],))
        pushes = [back]
        for grad, (accum, device) in zip(grads, accumulators):
            with v1.device(device):
                if isinstance(grad, tf.IndexedSlices):
                    pushes.append(accum.apply_indexed_slices_grad(grad, local_step=push_step))
                else:
                    pushes.append(accum.apply_grad(grad, local_step=push_step))
        with v1.device(global_step.device), tf.name_scope("psworker_sync_slots"):
            with tf.control_dependencies(pushes):
                token = opt._sync_token_queue.dequeue()               # pylint: disable=protected-access
            self.train_op = v1.assign(local, token)
        self._chain_fill(opt, global_step, last_step)

    def _chain_fill(self, opt, global_step, last_step: int) -> None:
        """The chief's queue runner: after its step's update and tokens, the next step's N slots."""
        import tensorflow as tf

        v1 = tf.compat.v1
        runner = opt._chief_queue_runner                              # pylint: disable=protected-access
        (sync_op,) = runner.enqueue_ops
        with v1.device(global_step.device), tf.name_scope("psworker_sync_slots"), \
                tf.control_dependencies([sync_op]):
            fill = self.queue.enqueue_many((_tags(global_step, last_step, self._num),))
        chained = tf.group(sync_op, fill, name="sync_op_and_slots")
        opt._chief_queue_runner = v1.train.QueueRunner(runner.queue, [chained])   # pylint: disable=protected-access

    def counted(self, examples):
        """`(examples counted as trained, examples dropped)` of a run whose batch holds `examples`: the batch's
        size in one, 0 in the other (a dropped batch is dealt again, `dealer.DealerClient.drop`)."""
        import tensorflow as tf

        n = tf.cast(examples, tf.int64)
        zero = tf.constant(0, tf.int64)
        return tf.where(self.applied, n, zero), tf.where(self.applied, zero, n)

    def reset(self, session) -> dict:
        """Drops the slots queued and queues N for the current step: what a chief runs as it starts. Returns
        `slots_dropped`, `slots_queued`."""
        import tensorflow as tf

        options = tf.compat.v1.RunOptions(timeout_in_ms=int(RESET_RUN_SECS * 1000))
        dropped = 0
        while int(session.run(self._size, options=options)) > 0:
            try:   # a worker may take the last one first: then this dequeue would wait
                session.run(self._drain, options=tf.compat.v1.RunOptions(timeout_in_ms=1000))
            except tf.errors.DeadlineExceededError:
                break
            dropped += 1
        session.run(self._refill, options=options)
        return {"slots_dropped": dropped, "slots_queued": self._num}


def _tags(global_step, last_step: int, num: int):
    """`num` slots for the global step read now (stale from `last_step` on: nothing more is applied)."""
    import tensorflow as tf

    step = tf.cast(tf.identity(global_step), tf.int64)
    tag = tf.where(step >= last_step, tf.constant(STALE, tf.int64), step)
    return tf.fill([num], tag)


def _flat(grads) -> list:
    import tensorflow as tf

    out = []
    for g in grads:
        out.extend([g.values, g.indices] if isinstance(g, tf.IndexedSlices) else [g])
    return out


def _hook_base():
    import tensorflow as tf

    return tf.compat.v1.train.SessionRunHook


class DroppedBatches(_hook_base()):
    """Dealt shards in sync mode: after each run of `train_op`, a batch whose gradient was dropped (`dropped`: its
    examples, else 0) goes back to the dealer's pool (`client.drop`), to be dealt again. Between the run and the
    drop the batch is neither trained nor pooled: a worker killed there reads it again from its own lease."""

    def __init__(self, train_op, dropped, client):
        self._train_op, self._dropped, self._client = train_op, dropped, client
        self.count = 0

    def before_run(self, run_context):
        import tensorflow as tf

        if run_context.original_args.fetches is not self._train_op:
            return None
        return tf.compat.v1.train.SessionRunArgs(self._dropped)

    def after_run(self, run_context, run_values):
        examples = run_values.results
        if examples:
            self._client.drop(int(examples))
            self.count += 1
