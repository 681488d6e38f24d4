"""A sync job's chief restarted on live ps tasks: the reset it runs before its first step, so that the ps's sync state
(accumulators, token queue) is what it is between two steps (`SyncRestartReset`)."""

from __future__ import annotations

__all__ = ["SYNC_RESET_RUN_SECS", "SyncRestartReset"]

SYNC_RESET_RUN_SECS = 10.0   # one run of the sync reset (a take of what an accumulator holds cannot wait long)


class SyncRestartReset:
    """What a chief restarted on live ps tasks runs before its first sync step (`run(session)`).

    `SyncReplicasOptimizer` keeps its state on the ps tasks: one `ConditionalAccumulator` per variable, each with
    its own step counter, and the token queue. The chief's aggregation step (one `take_grad` per accumulator, the
    update, then one token per replica) is not atomic across accumulators: a take completes as soon as its own
    accumulator holds `replicas_to_aggregate` gradients, and gradients arrive one variable at a time during
    backprop. A chief killed inside that step leaves some accumulators taken (their counter one step ahead, the
    gradients lost) and others still holding gradients, with the global step not advanced and no tokens queued.
    The non-chief workers have pushed their gradients and wait for a token; TF's chief init only sets every
    counter to the global step, so the taken accumulators can never fill again and every worker waits forever.

    The reset makes the state what it is between two steps, at the current global step G: every accumulator is
    emptied (`take_grad` of what it holds; those gradients are dropped, never applied) and set to G, stale tokens
    are dequeued, and one token carrying G is queued per non-chief replica, so that a worker waiting for a token
    computes a fresh gradient for G. A worker that was not waiting gets a spare token: it may push twice for one
    step (as a backup worker would), which delays nobody. In an elastic job (`demand`, tokens on demand) the tokens
    queued are the stale ones dropped plus the non-chief demands not served yet (the old chief's own are dropped).
    With push `slots` (`sync_slots`), the step's N slots are opened anew (`slots.reset`); a chief that restores or
    initialises opens them unless a claim has (`run_slots`).
    """

    def __init__(self, sync_optimizer, demand=None, slots=None):
        import tensorflow as tf

        v1 = tf.compat.v1
        opt = sync_optimizer
        global_step = opt._global_step                       # pylint: disable=protected-access
        self._accumulators = []                              # (num_accumulated, take op, set op, count feed)
        for i, (accum, device) in enumerate(opt._accumulator_list):   # pylint: disable=protected-access
            with v1.device(device), tf.name_scope(f"psworker_sync_reset/accum_{i}"):
                count = v1.placeholder(tf.int32, [], name="count")
                if isinstance(accum, v1.SparseConditionalAccumulator):
                    take = accum.take_indexed_slices_grad(count)
                    take = tf.group(take.indices, take.values)
                else:
                    take = tf.group(accum.take_grad(count))
                self._accumulators.append((accum.num_accumulated(), take, accum.set_global_step(global_step),
                                           count))
        queue = opt._sync_token_queue                        # pylint: disable=protected-access
        self.num_tokens = max(0, opt._total_num_replicas - 1)   # pylint: disable=protected-access
        self._demands = demand.drain() if demand is not None else None
        self._slots = slots
        with v1.device(global_step.device), tf.name_scope("psworker_sync_reset/tokens"):
            self._queue_size = queue.size()
            self._dequeue = queue.dequeue()
            self._num_queued = v1.placeholder(tf.int32, [], name="num_tokens")
            self._enqueue = queue.enqueue_many((tf.fill([self._num_queued], global_step),))
            self._global_step = tf.identity(global_step)

    def run(self, session) -> dict:
        """Runs the reset in `session`; returns what it did: `global_step`, `gradients_held` (per accumulator, what it
        held and dropped: unequal counts mean the previous chief died inside a step), `tokens_dropped`,
        `tokens_queued`.

        Raises:
            tf.errors.DeadlineExceededError: a run took longer than `SYNC_RESET_RUN_SECS` (the ps is unreachable).
        """
        import tensorflow as tf

        options = tf.compat.v1.RunOptions(timeout_in_ms=int(SYNC_RESET_RUN_SECS * 1000))
        held = []
        for num_accumulated, take, _, count in self._accumulators:
            n = int(session.run(num_accumulated, options=options))
            if n > 0:   # pushes only add to the count (the old chief's takes died with it): this take cannot wait
                session.run(take, {count: n}, options=options)
            held.append(n)
        for _, _, set_step, _ in self._accumulators:
            session.run(set_step, options=options)
        tokens_dropped = 0
        while int(session.run(self._queue_size, options=options)) > 0:
            try:   # a waiting worker may take the last one first: then this dequeue would wait
                session.run(self._dequeue, options=tf.compat.v1.RunOptions(timeout_in_ms=1000))
            except tf.errors.DeadlineExceededError:
                break
            tokens_dropped += 1
        queued = self.num_tokens
        if self._demands is not None:
            queued = tokens_dropped + sum(1 for i in session.run(self._demands, options=options) if i != 0)
        slots = self._slots.reset(session) if self._slots is not None else {}   # open before a token wakes a step
        session.run(self._enqueue, {self._num_queued: queued}, options=options)
        return {"global_step": int(session.run(self._global_step, options=options)), "gradients_held": held,
                "tokens_dropped": tokens_dropped, "tokens_queued": queued, **slots}

    def run_slots(self, session) -> dict:
        """A chief that restores or initialises: the push slots' start (`sync_slots.PushSlots.start`)."""
        return self._slots.start(session) if self._slots is not None else {}
