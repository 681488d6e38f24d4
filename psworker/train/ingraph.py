"""In-graph replication: worker 0 is the only client; it builds a tower on every worker task and drives them all.

One update is applied per step from the gradients averaged over every tower of every worker, so in-graph training
is synchronous by construction (`mode` and `replicas_to_aggregate` do not apply). This module builds the graph;
the client trains through the same runner as a between-graph worker (`task.runner`), and the other workers only
serve until the client puts a done token on their own task (`task.shutdown`).

With dealt shards the client is the one reader (`dealer.Dealing` of index 0 of 1): every step it reads one global
batch on its own CPU and splits it over the workers, so each step trains exactly the positions dealt next. (The
positions come from a Python generator, which runs only in the process that built the graph; and the workers step
together, so a reader per worker would end the deal unevenly: one out of data while another still holds a lease.)
"""

from __future__ import annotations

import logging

from psworker.models.base import InputSpec, Model
from psworker.spec import TrainConfig

log = logging.getLogger(__name__)

CLIENT_INDEX = 0


# ---------------------------------------------------------------------------------------------- the graph


def build_in_graph_train_graph(model: Model, config: TrainConfig, *, cluster: dict, dealing=None):
    """Builds the whole cluster's training graph in the current default graph.

    Variables go to the ps tasks (greedy by bytes); worker task `i` gets `config.num_devices` towers and, with
    static slices, its own input shard (`shard_index=i`, read on `/job:worker/task:i`); the gradients of every tower
    of every worker are averaged and applied once per step, with the model's moving averages updated after.

    Args:
        model: the workload.
        config: training settings; `batch_size` is per tower, so one step consumes
            `batch_size * num_devices * num_workers` examples.
        cluster: `{"ps": [...], "worker": [...]}`.
        dealing: a `dealer.Dealing` (the client as the one reader): each step's global batch is read on the
            client from the positions it deals and split over the workers, and the train op records the examples
            it trained; None: static slices.

    Returns:
        A `TrainGraph` (`sync_optimizer` is None).
    """
    import tensorflow as tf

    from psworker.train import devices
    from psworker.train.graph import TrainGraph, finish_train_op, optimization
    from psworker.train.placement import GreedyByteStrategy, partitioned_variables

    v1 = tf.compat.v1
    # `auto`: the client's GPUs; every worker is taken to have as many
    config = devices.resolve(config, devices.visible_gpus())
    num_workers = len(cluster["worker"])
    per_worker_batch = config.batch_size * config.num_devices
    client_device = f"/job:worker/task:{CLIENT_INDEX}"
    setter = v1.train.replica_device_setter(
        cluster=cluster, worker_device=client_device, ps_strategy=GreedyByteStrategy(len(cluster["ps"]))
    )
    with v1.device(setter), partitioned_variables(len(cluster["ps"])):
        global_step = v1.train.get_or_create_global_step()
        opt = optimization(model, config, global_step, per_worker_batch * num_workers, num_workers)
        optimizer = opt.optimizer
        batches, dealt = _worker_batches(model, config, num_workers, dealing, global_step)
        grads, loss = _averaged_gradients(model, config, optimizer, batches)
        apply_op = optimizer.apply_gradients(grads, global_step=global_step)
        train_op = finish_train_op(apply_op, opt.ema)
        if dealt is not None:   # after the update: a checkpoint never counts an example not trained on
            train_op = dealt.state.count(CLIENT_INDEX, tf.shape(dealt.batch[0])[0], train_op)
    return TrainGraph(train_op=train_op, loss=loss, global_step=global_step, learning_rate=opt.learning_rate,
                      sync_optimizer=None, dealer=dealt and dealt.client, dealer_state=dealt and dealt.state,
                      input_init=dealt and dealt.init)


def _averaged_gradients(model: Model, config: TrainConfig, optimizer, batches):
    """Worker `i`'s towers on `/job:worker/task:i` over `batches[i]()`; the gradients and loss averaged over all."""
    import tensorflow as tf

    from psworker.train import towers

    worker_grads, worker_losses = [], []
    for i, batch in enumerate(batches):
        with tf.name_scope(f"worker_{i}"):
            images, labels = batch()
            grads, loss = towers.build_tower_gradients(
                model, optimizer, images, labels, config.num_devices, device_prefix=f"/job:worker/task:{i}"
            )
        worker_grads.append(grads)
        worker_losses.append(loss)
    with tf.name_scope("worker_average"):
        # Every worker has the same number of towers, so the mean of the per-worker means is the mean over all.
        grads = towers.average_gradients(worker_grads)
        loss = tf.math.divide(tf.add_n(worker_losses), float(len(batches)), name="mean_loss")
    return grads, loss


def _worker_batches(model: Model, config: TrainConfig, num_workers: int, dealing, global_step):
    """Per worker, a function that builds its batch in the worker's name scope, and the client's `DealtInputs`
    (None with static slices, where worker `i` reads its own slice on its own CPU)."""
    import tensorflow as tf

    from psworker.train.graph import dealt_inputs

    per_worker_batch = config.batch_size * config.num_devices
    if dealing is None:
        def static(i: int):
            # A Python input (`Model.python_input`) runs only in this process: read there, sent to the worker.
            with tf.device(f"/job:worker/task:{CLIENT_INDEX if model.python_input else i}/device:CPU:0"):
                return model.train_inputs(InputSpec(
                    data_dir=config.data_dir, batch_size=per_worker_batch, shard_index=i, num_shards=num_workers,
                    seed=None if config.seed is None else config.seed + i,
                ))
        return [lambda i=i: static(i) for i in range(num_workers)], None
    client_cpu = f"/job:worker/task:{CLIENT_INDEX}/device:CPU:0"
    dealt = dealt_inputs(model, config, dealing, global_step, client_cpu, per_worker_batch * num_workers)
    with tf.device(client_cpu), tf.name_scope("split_batch"):
        images, labels = (tf.split(t, num_workers, axis=0) for t in dealt.batch)
    return [lambda i=i: (images[i], labels[i]) for i in range(num_workers)], dealt


__all__ = ["build_in_graph_train_graph", "CLIENT_INDEX"]
