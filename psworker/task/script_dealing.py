"""Dealt shards for your own TF1 between-graph script under `psworker run` (issue 25): the dealing psworker's trainer
does (`train.dealer`), in a few calls of your graph code. The task and cluster come from `TF_CONFIG`, which
`psworker run` sets for every task; worker 0 is the chief.

    dealing = ScriptDealing(num_examples=50000, batch_size=64, target=server.target, num_epochs=3)
    with tf1.device(tf1.train.replica_device_setter(...)):
        images, labels = dealing.iterator(dealing.positions().batch(64).map(read_by_position))
        ...
        train_op = dealing.count(optimizer.minimize(loss, global_step=global_step), tf.shape(images)[0])
    with tf1.train.MonitoredTrainingSession(master=server.target, ..., config=dealing.session_config) as sess:
        while not sess.should_stop():   # each worker's input ends with the deal (OutOfRange stops the session)
            sess.run(train_op)
    if dealing.is_chief:
        print(dealing.report())

The cursor's variables are global variables on ps 0, so your chief's Saver writes them into every checkpoint with
the weights. `iterator` makes an initializable iterator that `MonitoredTrainingSession` starts again with each new
session (a local resource), so that after a ps restart the input goes on from the cursor on the ps.
"""

from __future__ import annotations

import os
from typing import Optional

from psworker.spec import interop
from psworker.errors import UsageError
from psworker.task import server as srv
from psworker.task import shutdown
from psworker.train import dealer, shard_plan

STATE_DEVICE = "/job:ps/task:0"


class ScriptDealing:
    """This worker's side of the dealer, built in the current graph.

    Args:
        num_examples: positions `0..num_examples-1` of your training split.
        batch_size: your batch (a shard holds at least one).
        target: your server's target (`server.target`): the dealer's own small session runs through it.
        num_epochs: the deal ends after this many passes (None: never).
        shard_examples: examples per shard (None: `train.dealer`'s default).
        seed: the permutations' seed (None: the chief draws one, kept on the ps and in the checkpoint).
        tf_config: the TF_CONFIG JSON (default: the environment's).

    Raises:
        UsageError: no TF_CONFIG, or this task is not a worker.
    """

    def __init__(self, num_examples: int, batch_size: int, *, target: str, num_epochs: Optional[int] = None,
                 shard_examples: Optional[int] = None, seed: Optional[int] = None,
                 tf_config: Optional[str] = None):
        text = tf_config if tf_config is not None else os.environ.get(interop.TF_CONFIG_ENV)
        if not text:
            raise UsageError("ScriptDealing: no TF_CONFIG (psworker run sets it for every task)")
        spec, job, index = interop.from_tf_config(text)
        if job != "worker" or index is None:
            raise UsageError(f"ScriptDealing: TF_CONFIG's task is {job}:{index}; only workers read data")
        others = {i: str(a) for i, a in enumerate(spec.worker) if i != index}
        watch = shutdown.GoneWatch(others) if index == 0 else None
        self.is_chief = index == 0
        self.session_config = srv.session_config("worker", index)
        self._dealing = dealer.Dealing(
            plan=shard_plan.make_plan(num_examples, shard_examples, num_epochs, batch_size), index=index,
            num_workers=len(spec.worker), target=target, session_config=self.session_config,
            is_chief=self.is_chief, seed=seed, gone=None if watch is None else lambda j: _gone(watch, j),
            ps_addresses=tuple(str(a) for a in spec.ps))
        self.state = dealer.DealerState(len(spec.worker), STATE_DEVICE, seed)
        self.client = dealer.DealerClient(self._dealing, STATE_DEVICE)

    def positions(self):
        """This worker's positions: a finite `tf.data.Dataset` of int64, in reading order."""
        return dealer.positions_dataset(self.client)

    def iterator(self, dataset):
        """`get_next()` of an initializable iterator over `dataset`, started again with each new session."""
        import tensorflow as tf
        from tensorflow.python.ops import resources   # the local resources that Scaffold's local init starts

        iterator = tf.compat.v1.data.make_initializable_iterator(dataset)
        resources.register_resource(iterator._iterator_resource, iterator.initializer,   # noqa: SLF001
                                    tf.constant(True), is_shared=False)
        return iterator.get_next()

    def count(self, train_op, batch_size):
        """`train_op`, then the record of the `batch_size` examples it trained (the cursor moves only after it)."""
        return self.state.count(self._dealing.index, batch_size, train_op)

    @property
    def exhausted(self) -> bool:
        """The deal is over for this worker: its input ran out for good."""
        return self.client.exhausted

    def report(self) -> str:
        """One line: examples trained, trained again, and epochs, from the state on the ps."""
        plan = self._dealing.plan
        trained, again, epochs = shard_plan.report(plan, self.client.state())
        of = "" if plan.num_epochs is None else f" of {plan.num_epochs}"
        return f"data: {trained} examples trained, {again} of them again; epoch {epochs:.2f}{of}"


def _gone(watch: "shutdown.GoneWatch", index: int) -> bool:
    watch.update()
    return watch.gone_for(index) >= shutdown.VANISHED_GRACE_SECS


__all__ = ["ScriptDealing"]
