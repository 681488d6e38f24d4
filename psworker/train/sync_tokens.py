"""Sync tokens on demand, for elastic sync jobs.

`SyncReplicasOptimizer`'s chief queues a fixed `total_num_replicas` tokens after every step, and each worker takes
one per step. When fewer workers run than the spec reserves (an elastic job below `max`), the spare tokens pile up
at the front of the FIFO queue: a worker then takes an old token, its next gradient is stale and dropped, and with
2 of 4 workers running half of all worker steps were wasted (measured: 100 local steps of worker:0 moved the global
step by ~48 instead of 100).

Here every worker step registers a demand in a queue beside the token queue (an enqueue of its index, with no
dependency on anything else in the step), and the chief's step queues one token per demand registered since its
last step. Tokens handed out equal demands, so none pile up and no worker waits for a token it asked for. Queues
live on the ps (shared by name) and need no initialisation or checkpoint. A worker killed inside a step leaves at
most one spare token behind; a worker that leaves on a signal finishes its step, so it leaves none.

The step that reaches the last step also queues one spare token per reserved replica: a worker whose demand came
just after that step's count would otherwise wait for a step that never comes (the others have stopped).
"""

from __future__ import annotations

DEMAND_QUEUE = "psworker_sync_demand"


class TokensOnDemand:
    """Wires demand-driven tokens into one worker's `SyncReplicasOptimizer` graph.

    Build it before `apply_gradients` (it sets the optimizer's tokens per step to the demands taken), call
    `after_apply()` once that has built the chief's token op, and add `register(index)` to the worker's train op.
    """

    def __init__(self, sync_optimizer, global_step, last_step: int):
        import tensorflow as tf

        v1 = tf.compat.v1
        spares = sync_optimizer._total_num_replicas   # pylint: disable=protected-access
        with v1.device(global_step.device), tf.name_scope("psworker_sync_demand"):
            self.queue = v1.FIFOQueue(-1, [tf.int32], shapes=[[]], shared_name=DEMAND_QUEUE, name="queue")
            self._size = self.queue.size()
            self._step = tf.raw_ops.ReadVariableOp(resource=global_step.handle, dtype=global_step.dtype)
            taken = self.queue.dequeue_many(self._size)   # only the chief takes: the size can only have grown
            at_end = tf.cast(self._step >= last_step, tf.int32) * spares
            with tf.control_dependencies([taken]):
                self._count = tf.add(self._size, at_end, name="tokens_per_step")
        sync_optimizer._tokens_per_step = self._count   # pylint: disable=protected-access

    def after_apply(self) -> None:
        """Orders the count (and the global step it reads) after the step's update: TF builds its token fill under
        that dependency, so the fill's shape (the count, packed into a list) carries it."""
        updates = {c for op in self._count.consumers() for c in op.control_inputs}
        if len(updates) != 1:
            raise RuntimeError(f"expected the sync token fill to depend on one update op, found {len(updates)}: "
                               "this TensorFlow builds SyncReplicasOptimizer differently")
        update = updates.pop()
        for op in (self._size.op, self._step.op):
            op._add_control_input(update)   # pylint: disable=protected-access

    def register(self, task_index: int):
        """The op that registers one demand of worker `task_index` (run once per step, in its train op)."""
        import tensorflow as tf

        with tf.compat.v1.device(self.queue.queue_ref.device):
            return self.queue.enqueue(tf.constant(task_index, tf.int32), name=f"demand_{task_index}")

    def drain(self):
        """The demands registered and not served yet (indices); for the chief's restart reset."""
        import tensorflow as tf

        with tf.compat.v1.device(self.queue.queue_ref.device), tf.name_scope("psworker_sync_reset/demand"):
            return self.queue.dequeue_many(self.queue.size())


__all__ = ["DEMAND_QUEUE", "TokensOnDemand"]
