"""In-graph replication: worker 0 is the only client; it builds a tower on every worker task and drives them all.

One update is applied per step from the gradients averaged over every tower of every worker, so in-graph training
is synchronous by construction (`mode` and `replicas_to_aggregate` do not apply). This module builds the graph;
the client trains through the same runner as a between-graph worker (`task.runner`), and the other workers only
serve until the client puts a done token on their own task (`task.shutdown`).
"""

from __future__ import annotations

import logging

from psworker.models.base import InputSpec, Model
from psworker.spec import TrainConfig

log = logging.getLogger(__name__)

CLIENT_INDEX = 0


# ---------------------------------------------------------------------------------------------- the graph


def build_in_graph_train_graph(model: Model, config: TrainConfig, *, cluster: dict):
    """Builds the whole cluster's training graph in the current default graph.

    Variables go to the ps tasks (greedy by bytes); worker task `i` gets its own input shard
    (`shard_index=i`, read on `/job:worker/task:i`) and `config.num_devices` towers; the gradients of every tower
    of every worker are averaged and applied once per step, with the model's moving averages updated after.

    Args:
        model: the workload.
        config: training settings; `batch_size` is per tower, so one step consumes
            `batch_size * num_devices * num_workers` examples.
        cluster: `{"ps": [...], "worker": [...]}`.

    Returns:
        A `TrainGraph` (`sync_optimizer` is None).
    """
    import tensorflow as tf

    from psworker.train import devices, towers
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
        worker_grads, worker_losses = [], []
        for i in range(num_workers):
            worker_device = f"/job:worker/task:{i}"
            with tf.name_scope(f"worker_{i}"):
                # A Python input (`Model.python_input`) runs only in this process: read there, sent to the worker.
                with tf.device(f"{client_device if model.python_input else worker_device}/device:CPU:0"):
                    images, labels = model.train_inputs(InputSpec(
                        data_dir=config.data_dir, batch_size=per_worker_batch, shard_index=i,
                        num_shards=num_workers, seed=None if config.seed is None else config.seed + i,
                    ))
                grads, loss = towers.build_tower_gradients(
                    model, optimizer, images, labels, config.num_devices, device_prefix=worker_device
                )
            worker_grads.append(grads)
            worker_losses.append(loss)
        with tf.name_scope("worker_average"):
            # Every worker has the same number of towers, so the mean of the per-worker means is the mean
            # over all towers.
            grads = towers.average_gradients(worker_grads)
            loss = tf.math.divide(tf.add_n(worker_losses), float(num_workers), name="mean_loss")
        apply_op = optimizer.apply_gradients(grads, global_step=global_step)
        train_op = finish_train_op(apply_op, opt.ema)
    return TrainGraph(train_op=train_op, loss=loss, global_step=global_step, learning_rate=opt.learning_rate,
                      sync_optimizer=None)


__all__ = ["build_in_graph_train_graph", "CLIENT_INDEX"]
