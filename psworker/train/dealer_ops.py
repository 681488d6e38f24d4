"""The dealer's atomic operations on its state (`psworker.train.dealer`): take, retire and give back, built in
a side graph and run one at a time in one `tf.CriticalSection` on the state's ps.

A lease entry or pool piece is `(shard, start, end)`: the shard's examples from `start` to `end`, where an end of 0
means the shard's end (whole shards' rests, and every entry of a state written before pieces had ends)."""

from __future__ import annotations

from psworker.train.dealer_state import SCOPE, DealerState
from psworker.train.shard_plan import RING, ShardPlan

FULL, EXHAUSTED = -2, -1          # what `take` returns instead of a shard


def _piece_end(plan: ShardPlan, shard, end):
    """Where a piece ends: `end`, or its shard's length when `end` is 0."""
    import tensorflow as tf

    j = tf.math.floormod(tf.maximum(shard, 0), plan.shards_per_epoch)
    length = tf.minimum(tf.constant(plan.shard_examples, tf.int64), plan.num_examples - j * plan.shard_examples)
    return tf.where(end > 0, end, length)


def _token_ops(token):
    """Sync mode (`DealerClient.pass_turn`): a read of the global step and whether `SyncReplicasOptimizer`'s token
    queue is closed (the chief stopped), and an enqueue of `token` into it (the same variable and queue by name, on
    this same ps)."""
    import tensorflow as tf

    global_step = tf.compat.v1.train.get_or_create_global_step()
    queue = tf.queue.FIFOQueue(-1, global_step.dtype.base_dtype, shapes=(), name="sync_token_q",
                               shared_name="sync_token_q")
    turn = {"step": global_step.read_value(), "closed": queue.is_closed()}
    return turn, queue.enqueue(tf.cast(token, global_step.dtype.base_dtype))


class DealerOps:
    """The atomic operations, built in a side graph (same variables by name, same device, one critical section).
    Feed: `who` (a worker index)."""

    def __init__(self, plan: ShardPlan, num_workers: int, device: str):
        import tensorflow as tf

        v1 = tf.compat.v1
        self.graph = tf.Graph()
        with self.graph.as_default(), v1.device(device):
            self.state = s = DealerState(num_workers, device, None)
            self.who = v1.placeholder(tf.int32, [], name="who")
            lock = tf.CriticalSection(shared_name=f"{SCOPE}_lock", name=f"{SCOPE}_lock")
            self.take = lock.execute(lambda: self._take(plan, s), exclusive_resource_access=False)
            self.retire = lock.execute(lambda: self._retire(plan, s), exclusive_resource_access=False)
            self.give_back = lock.execute(lambda: self._give_back(plan, s), exclusive_resource_access=False)
            self.read = {v.op.name.split("/")[-1]: v.read_value() for v in s.variables}
            self.token = v1.placeholder_with_default(tf.constant(0, tf.int64), [], name="token")
            self.turn, self.pass_turn = _token_ops(self.token)
        self.graph.finalize()

    def _take(self, plan: ShardPlan, s):
        """Retires the first entry of the ring of `who` if it is wholly trained, then appends a piece from the pool,
        else a fresh shard: `(shard, start, end)`; `(FULL, 0, 0)` when the ring is full, `(EXHAUSTED, 0, 0)` when
        nothing is left. One call per piece: a worker's only round trip for its data."""
        import tensorflow as tf

        who, i64 = self.who, tf.int64
        pool, pool_start, pool_end = s.pool_shard.read_value(), s.pool_start.read_value(), s.pool_end.read_value()
        fresh, trained = s.next_shard.read_value(), s.trained.read_value()[who]
        done, left, head, count = self._head_done(plan, s)
        retired = tf.cast(done, i64)
        head, count = head + retired, count - retired
        full = count >= RING
        has = tf.reduce_any(pool >= 0)
        j = tf.argmax(tf.cast(pool >= 0, tf.int32), output_type=tf.int32)
        use_pool = has & ~full
        use_fresh = ~has & ~full & (fresh < plan.limit)
        nothing = tf.where(full, tf.constant(FULL, i64), tf.constant(EXHAUSTED, i64))
        shard = tf.where(use_pool, pool[j], tf.where(use_fresh, fresh, nothing))
        start = tf.where(use_pool, pool_start[j], tf.constant(0, i64))
        end = tf.where(use_pool, pool_end[j], tf.constant(0, i64))
        got = use_pool | use_fresh
        slot = tf.stack([who, tf.cast(tf.math.floormod(head + count, RING), tf.int32)])[None]
        old = s.ring_shard.read_value()[who, slot[0, 1]]
        old_start = s.ring_start.read_value()[who, slot[0, 1]]
        old_end = s.ring_end.read_value()[who, slot[0, 1]]
        # An empty ring has nothing in flight: what `trained` holds beyond it (a padded last batch) is void.
        # Subtractions, never writes: the train op adds to `trained` outside the critical section.
        void = tf.where(got & tf.equal(count, 0), trained - retired * left, tf.constant(0, i64))
        updates = [
            s.pool_shard.scatter_update(tf.IndexedSlices(tf.where(use_pool, tf.constant(-1, i64), pool[j])[None],
                                                         j[None])),
            s.next_shard.assign_add(tf.cast(use_fresh, i64), read_value=False),
            tf.compat.v1.scatter_nd_update(s.ring_shard, slot, tf.where(got, shard, old)[None]),
            tf.compat.v1.scatter_nd_update(s.ring_start, slot, tf.where(got, start, old_start)[None]),
            tf.compat.v1.scatter_nd_update(s.ring_end, slot, tf.where(got, end, old_end)[None]),
            s.ring_head.scatter_add(tf.IndexedSlices(retired[None], who[None])),
            s.ring_count.scatter_add(tf.IndexedSlices((tf.cast(got, i64) - retired)[None], who[None])),
            s.trained.scatter_sub(tf.IndexedSlices((retired * left + void)[None], who[None])),
        ]
        with tf.control_dependencies(updates):
            return tf.identity(shard), tf.identity(start), tf.identity(end)

    def _head_done(self, plan: ShardPlan, s):
        """`(done, left, head, count)` of the ring of `who`: whether its first entry is wholly trained, and the
        examples that entry holds."""
        import tensorflow as tf

        who = self.who
        count, head = s.ring_count.read_value()[who], s.ring_head.read_value()[who]
        at = tf.cast(tf.math.floormod(head, RING), tf.int32)
        shard, start = s.ring_shard.read_value()[who, at], s.ring_start.read_value()[who, at]
        left = _piece_end(plan, shard, s.ring_end.read_value()[who, at]) - start
        return (count > 0) & (s.trained.read_value()[who] >= left), left, head, count

    def _retire(self, plan: ShardPlan, s):
        """Drops the first entry of the ring of `who` once it is wholly trained; True if it did."""
        import tensorflow as tf

        who = self.who
        done, left, _, _ = self._head_done(plan, s)
        one = tf.cast(done, tf.int64)
        updates = [s.trained.scatter_sub(tf.IndexedSlices((one * left)[None], who[None])),
                   s.ring_head.scatter_add(tf.IndexedSlices(one[None], who[None])),
                   s.ring_count.scatter_sub(tf.IndexedSlices(one[None], who[None]))]
        with tf.control_dependencies(updates):
            return tf.identity(done)

    def _ring(self, plan: ShardPlan, s):
        """The ring of `who` in reading order: `(k, shards, starts, ends, live)`, `live` where `k < count`."""
        import tensorflow as tf

        who = self.who
        count, head = s.ring_count.read_value()[who], s.ring_head.read_value()[who]
        k = tf.range(RING, dtype=tf.int64)
        at = tf.cast(tf.math.floormod(head + k, RING), tf.int32)
        shards = tf.gather(s.ring_shard.read_value()[who], at)
        starts = tf.gather(s.ring_start.read_value()[who], at)
        ends = _piece_end(plan, shards, tf.gather(s.ring_end.read_value()[who], at))
        return k, shards, starts, ends, k < count

    def _to_pool(self, s, shards, starts, ends):
        """The updates that put the pieces `(shards, starts, ends)` into free pool slots (too few: the run fails)."""
        import tensorflow as tf

        free = tf.cast(tf.where(s.pool_shard.read_value() < 0)[:, 0], tf.int32)[:tf.size(shards)]
        with tf.control_dependencies([tf.debugging.assert_equal(tf.size(free), tf.size(shards),
                                                                message="the dealer's pool is full")]):
            return [s.pool_shard.scatter_update(tf.IndexedSlices(shards, free)),
                    s.pool_start.scatter_update(tf.IndexedSlices(starts, free)),
                    s.pool_end.scatter_update(tf.IndexedSlices(ends, free))]

    def _give_back(self, plan: ShardPlan, s):
        """Moves the untrained rest of the lease of `who` into the pool and empties its ring; returns the examples
        given back."""
        import tensorflow as tf

        who = self.who
        k, shards, starts, ends, live = self._ring(plan, s)
        starts += tf.where(tf.equal(k, 0), s.trained.read_value()[who], 0)
        live &= starts < ends
        back_shard, back_start = tf.boolean_mask(shards, live), tf.boolean_mask(starts, live)
        back_end = tf.boolean_mask(ends, live)
        updates = self._to_pool(s, back_shard, back_start, back_end)
        zero = tf.constant(0, tf.int64)[None]
        with tf.control_dependencies([back_shard, back_start, back_end]):   # the ring is read before it is emptied
            updates += [s.ring_count.scatter_update(tf.IndexedSlices(zero, who[None])),
                        s.trained.scatter_update(tf.IndexedSlices(zero, who[None]))]
        with tf.control_dependencies(updates):
            return tf.reduce_sum(back_end - back_start)


__all__ = ["DealerOps", "EXHAUSTED", "FULL"]
