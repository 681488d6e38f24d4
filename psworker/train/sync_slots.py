"""Push slots: which workers' gradients a sync step applies, decided exactly (issue 40).

`SyncReplicasOptimizer` keeps one `ConditionalAccumulator` per variable; each takes the first
`replicas_to_aggregate` (N) gradients pushed for the step and drops later ones as stale. Gradients arrive one
variable at a time, so with backup workers one worker's push can land in some accumulators before their take and in
others after: no worker knows whether its batch was applied. Here a worker, once its gradients are on the ps tasks,
claims a slot in the same run: one atomic step in a `tf.CriticalSection` on the global step's ps, on two numbers
(the step the slots are for, the slots left). A claim for a newer step than the slots' opens that step's N slots (no
worker's step is newer than the global step: its local step comes from a token); a claim for the slots' step takes
one if any is left. With a slot it pushes its gradients for its step; without (the N slots went to faster workers,
or its step is stale) it pushes them tagged stale (-1, dropped by every accumulator, as TF drops a late gradient)
and its run says `applied` False. Exactly the N slot holders' gradients reach every accumulator, so the batches a
step applies are exactly those whose runs say so. A claim never waits: a killed worker's run leaves nothing pending
on the ps (a waiting dequeue would take a slot refilled after its client died, and hold the step). The numbers are
in no collection (not saved, not initialised with the model): a claim reads unset numbers as none; a chief that
restores or initialises opens the global step's slots unless a claim has (`start`); a chief started again on a live
ps opens them anew, as its reset drops the gradients the accumulators held (`reset`). From the last step on no slot
is open: nothing more is applied.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

SCOPE = "psworker_sync_slots"
STALE = -1                  # the step of a stale push: whoever pushes with it pushes nothing that is applied
RESET_RUN_SECS = 10.0       # one run of a reset (the ps answers at once, or is unreachable)

__all__ = ["PushSlots", "SCOPE", "STALE", "RESET_RUN_SECS"]


class PushSlots:
    """Wires push slots into one worker's `SyncReplicasOptimizer` graph, after its `apply_gradients`.

    Attributes:
        train_op: the worker's train op in place of TF's: claim a slot, push (for the step or stale), take a token.
        applied: a bool tensor of that run: whether its gradients are among the step's N.
    """

    def __init__(self, sync_optimizer, grads_and_vars, last_step: int):
        import tensorflow as tf

        v1 = tf.compat.v1
        opt = sync_optimizer
        global_step = opt._global_step                                # pylint: disable=protected-access
        self._num, self._last = int(opt._replicas_to_aggregate), int(last_step)   # pylint: disable=protected-access
        grads = [g for g, _ in grads_and_vars if g is not None]
        accumulators = opt._accumulator_list                         # pylint: disable=protected-access
        if len(grads) != len(accumulators):
            raise RuntimeError(f"{len(grads)} gradients but {len(accumulators)} sync accumulators: this TensorFlow "
                               "builds SyncReplicasOptimizer differently")
        local = opt._local_step                                       # pylint: disable=protected-access
        # Every input of the claim and of the pushes is on the ps tasks before the claim: a slot taken is then
        # pushed by the ps alone, even if the worker stops right after (SIGSTOP, a slow host). A ps pulls a
        # worker's tensors, so a claim made before the gradients had arrived waited on a stopped worker while
        # holding a slot, and the step with it (seen: 60 s, until gRPC gave up on the worker).
        arrived = [_on(grad, device) for grad, (_, device) in zip(grads, accumulators)]
        here = []
        for device in dict.fromkeys(d for _, d in accumulators):   # one edge from each ps to the claim
            with v1.device(None), v1.device(device):
                here.append(tf.group(*_flat([g for g, (_, d) in zip(arrived, accumulators) if d == device]),
                                     name=f"{SCOPE}/arrived"))
        with v1.device(None), v1.device(global_step.device), tf.name_scope(f"{SCOPE}/"):
            self._state = v1.get_variable(f"{SCOPE}/state", [2], tf.int64, trainable=False, use_resource=True,
                                          collections=[], initializer=v1.constant_initializer([STALE, 0]))
            lock = tf.CriticalSection(shared_name=f"{SCOPE}_lock", name="lock")
            step = tf.cast(tf.identity(global_step), tf.int64)
            claimed_for = tf.cast(tf.identity(local), tf.int64)
            with tf.control_dependencies(here):   # the lock only once the gradients are on the ps tasks
                self.applied = lock.execute(lambda: self._open_and_take(claimed_for, take=True),
                                            exclusive_resource_access=False)
            self._start = lock.execute(lambda: self._open_and_take(step, take=False), exclusive_resource_access=False)
            self._reset = lock.execute(lambda: self._set(step), exclusive_resource_access=False)
            push_step = tf.where(self.applied, tf.cast(claimed_for, local.dtype.base_dtype),
                                 tf.constant(STALE, local.dtype.base_dtype))
        pushes = []
        for grad, (accum, device) in zip(arrived, accumulators):
            with v1.device(device):
                if isinstance(grad, tf.IndexedSlices):
                    pushes.append(accum.apply_indexed_slices_grad(grad, local_step=push_step))
                else:
                    pushes.append(accum.apply_grad(grad, local_step=push_step))
        with v1.device(global_step.device), tf.name_scope(SCOPE):
            with tf.control_dependencies(pushes):
                token = opt._sync_token_queue.dequeue()               # pylint: disable=protected-access
            self.train_op = v1.assign(local, token)

    def _read(self):
        """`[step, slots left]`; `[STALE, 0]` while unset (a ps started afresh, before the chief's `start`)."""
        import tensorflow as tf

        unset = tf.constant([STALE, 0], tf.int64)
        return tf.cond(self._state.is_initialized(), self._state.read_value, lambda: unset)

    def _open_and_take(self, step, take: bool):
        """Opens `step`'s N slots if it is newer than the slots' (and before the last step); with `take`, takes one
        for `step` and returns whether it got it, else returns the numbers before."""
        import tensorflow as tf

        before = self._read()
        live = step < self._last
        newer = live & (step > before[0])
        at, left = tf.where(newer, step, before[0]), tf.where(newer, tf.constant(self._num, tf.int64), before[1])
        got = live & tf.equal(at, step) & (left > 0) & tf.constant(take)
        write = self._state.assign(tf.stack([at, left - tf.cast(got, tf.int64)]), read_value=False)
        with tf.control_dependencies([write]):
            return tf.identity(got) if take else tf.identity(before)

    def _set(self, step):
        """Opens `step`'s N slots whatever was open before (none from the last step on); returns the numbers before."""
        import tensorflow as tf

        before = self._read()
        left = tf.where(step < self._last, tf.constant(self._num, tf.int64), tf.constant(0, tf.int64))
        with tf.control_dependencies([self._state.assign(tf.stack([step, left]), read_value=False)]):
            return tf.identity(before)

    def start(self, session) -> dict:
        """What a chief that restores or initialises runs: opens the global step's slots unless a claim already
        has. Returns `slots_before` (`[step, left]`), `slots_queued` (N)."""
        return self._run(session, self._start)

    def reset(self, session) -> dict:
        """What a chief started again on a live ps runs, after its reset dropped the gradients the accumulators
        held: opens the global step's N slots anew. Returns `slots_before`, `slots_queued`."""
        return self._run(session, self._reset)

    def _run(self, session, op) -> dict:
        import tensorflow as tf

        options = tf.compat.v1.RunOptions(timeout_in_ms=int(RESET_RUN_SECS * 1000))
        before = session.run(op, options=options)
        return {"slots_before": [int(x) for x in before], "slots_queued": self._num}


def _on(grad, device: str):
    """`grad` (a tensor or `IndexedSlices`) received on `device`."""
    import tensorflow as tf

    with tf.compat.v1.device(None), tf.compat.v1.device(device):
        if isinstance(grad, tf.IndexedSlices):
            return tf.IndexedSlices(tf.identity(grad.values), tf.identity(grad.indices),
                                    None if grad.dense_shape is None else tf.identity(grad.dense_shape))
        return tf.identity(grad)


def _flat(grads) -> list:
    import tensorflow as tf

    out = []
    for g in grads:
        out.extend([g.values, g.indices] if isinstance(g, tf.IndexedSlices) else [g])
    return out
