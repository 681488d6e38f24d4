"""The dealer's state (`psworker.train.dealer`): its variables on the global step's ps, in the `psworker_data` scope,
so the chief's Saver writes the data cursor into every checkpoint with the weights."""

from __future__ import annotations

from typing import Optional

from psworker.train.shard_plan import RING

SCOPE = "psworker_data"


class DealerState:
    """The dealer's variables, created in the current graph on `device` (the global step's ps)."""

    def __init__(self, num_workers: int, device: str, seed: Optional[int]):
        import tensorflow as tf

        v1 = tf.compat.v1
        w, pool = num_workers, num_workers * RING
        i64 = tf.int64

        def var(name, shape, value):
            init = v1.constant_initializer(value) if not callable(value) else value
            return v1.get_variable(name, shape, i64, initializer=init, trainable=False, use_resource=True)

        seed_init = (v1.constant_initializer(seed) if seed is not None
                     else (lambda shape, dtype=None, partition_info=None:
                           tf.random.uniform(shape, 0, 2 ** 31 - 1, dtype=i64)))
        # device(None): not through the model's placement (the greedy strategy would count these bytes)
        with v1.device(None), v1.device(device), v1.variable_scope(SCOPE, reuse=v1.AUTO_REUSE):
            self.seed = v1.get_variable("seed", [], i64, initializer=seed_init, trainable=False, use_resource=True)
            self.next_shard = var("next_shard", [], 0)
            self.ring_shard = var("ring_shard", [w, RING], -1)
            self.ring_start = var("ring_start", [w, RING], 0)
            self.ring_head = var("ring_head", [w], 0)
            self.ring_count = var("ring_count", [w], 0)
            self.trained = var("trained", [w], 0)
            self.pool_shard = var("pool_shard", [pool], -1)
            self.pool_start = var("pool_start", [pool], 0)
            self.examples_trained = var("examples_trained", [], 0)
            self.ring_end = var("ring_end", [w, RING], 0)     # 0: the shard's end (`dealer_ops`)
            self.pool_end = var("pool_end", [pool], 0)
            self.dropped = var("dropped", [], 0)              # sync: batches dropped (stale) and computed again
        self.variables = [self.seed, self.next_shard, self.ring_shard, self.ring_start, self.ring_head,
                          self.ring_count, self.trained, self.pool_shard, self.pool_start, self.examples_trained,
                          self.ring_end, self.pool_end, self.dropped]
        self.num_workers = num_workers

    def count(self, index: int, batch_size, train_op, claimed=None, applied=None):
        """`train_op`, then the record of `batch_size` examples trained by worker `index` (none
        unless `claimed`, when given: `step_claim`; none unless `applied`, when given: sync mode, where a dropped
        batch counts in `dropped` instead): the new train op. Every op of it is on the dealer's ps: a group on the
        worker would cost the step a round trip per control edge (measured: the MLP at about half the steps/s)."""
        import tensorflow as tf

        n = tf.cast(batch_size, tf.int64)
        for flag in (claimed, applied):
            n = n if flag is None else n * tf.cast(flag, tf.int64)
        n = tf.reshape(n, [1])
        with tf.compat.v1.device(None), tf.compat.v1.device(self.trained.device), \
                tf.control_dependencies([train_op]), tf.name_scope(f"{SCOPE}/count"):
            ops = [self.trained.scatter_add(tf.IndexedSlices(n, tf.constant([index]))),
                   self.examples_trained.assign_add(n[0], read_value=False)]
            if applied is not None:
                ops.append(self.dropped.assign_add(1 - tf.cast(applied, tf.int64), read_value=False))
            return tf.group(*ops, name="train_op_and_count")


__all__ = ["SCOPE", "DealerState"]
