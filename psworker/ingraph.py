"""In-graph replication: worker 0 is the only client; it builds a tower on every worker task and drives them all.

One update is applied per step from the gradients averaged over every tower of every worker, so in-graph training
is synchronous by construction (`mode` and `replicas_to_aggregate` do not apply). The other workers only start
their servers and serve until the client puts a token in a queue on their own task; then each tells the ps tasks
that it is done (`server.signal_done`, as a between-graph worker does) and exits.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Optional

from psworker.errors import StartupTimeout
from psworker.models.base import InputSpec, Model
from psworker.spec import ClusterSpec, TrainConfig

log = logging.getLogger(__name__)

CLIENT_INDEX = 0
WORKER_DONE_QUEUE_PREFIX = "psworker_done_worker"
POLL_SECS = 0.5


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
        A `psworker.trainer.TrainGraph` (`sync_optimizer` is None).
    """
    import tensorflow as tf

    from psworker import towers
    from psworker.placement import GreedyByteStrategy
    from psworker.trainer import TrainGraph, finish_train_op

    v1 = tf.compat.v1
    num_workers = len(cluster["worker"])
    per_worker_batch = config.batch_size * config.num_devices
    client_device = f"/job:worker/task:{CLIENT_INDEX}"
    setter = v1.train.replica_device_setter(
        cluster=cluster, worker_device=client_device, ps_strategy=GreedyByteStrategy(len(cluster["ps"]))
    )
    with v1.device(setter):
        global_step = v1.train.get_or_create_global_step()
        base_lr = config.learning_rate if config.learning_rate is not None else model.default_learning_rate
        lr = model.learning_rate(global_step, base_lr, per_worker_batch * num_workers, config.data_dir)
        optimizer = model.optimizer(lr)
        worker_grads, worker_losses = [], []
        for i in range(num_workers):
            worker_device = f"/job:worker/task:{i}"
            with tf.name_scope(f"worker_{i}"):
                with tf.device(f"{worker_device}/device:CPU:0"):
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
        ema = None
        if model.moving_average_decay:
            ema = v1.train.ExponentialMovingAverage(model.moving_average_decay, global_step)
        train_op = finish_train_op(apply_op, ema, loss, lr)
    return TrainGraph(train_op=train_op, loss=loss, global_step=global_step, learning_rate=lr, sync_optimizer=None)


# ---------------------------------------------------------------------------------------------- done tokens


def worker_done_queue(worker_index: int):
    """The FIFO queue on worker `worker_index` into which the client puts a token when training is over."""
    import tensorflow as tf

    with tf.device(f"/job:worker/task:{worker_index}"):
        return tf.queue.FIFOQueue(
            capacity=4, dtypes=[tf.int32], shapes=[[]],
            shared_name=f"{WORKER_DONE_QUEUE_PREFIX}{worker_index}", name=f"done_queue_worker{worker_index}",
        )


def release_workers(target: str, spec: ClusterSpec, *, timeout_secs: float = 5.0) -> None:
    """From the client: puts a token on every serving worker's queue so that it exits. Unreachable ones are logged."""
    import tensorflow as tf

    from psworker import server as srv

    for i in range(len(spec.worker)):
        if i == CLIENT_INDEX:
            continue
        if not srv.is_reachable(str(spec.worker[i]), timeout=1.0):
            log.warning("worker:%d is not reachable; not telling it that training is over", i)
            continue
        graph = tf.Graph()
        with graph.as_default():
            enqueue = worker_done_queue(i).enqueue(tf.constant(CLIENT_INDEX, tf.int32))
        config = tf.compat.v1.ConfigProto(
            device_filters=[f"/job:worker/task:{CLIENT_INDEX}", f"/job:worker/task:{i}"])
        options = tf.compat.v1.RunOptions(timeout_in_ms=int(timeout_secs * 1000))
        with tf.compat.v1.Session(target, graph=graph, config=config) as sess:
            try:
                sess.run(enqueue, options=options)
            except tf.errors.OpError as exc:
                log.warning("could not tell worker:%d that training is over: %s", i, exc.message.splitlines()[0])


def serve_until_client_done(server, spec: ClusterSpec, index: int, *, client_gone_secs: float,
                            clock=time.monotonic) -> None:
    """A serving worker's loop: returns when the client's token arrives on this worker's queue.

    Raises:
        StartupTimeout: the client (worker 0) was unreachable for `client_gone_secs` in a row (never started,
            or went away without saying that training is over).
    """
    import tensorflow as tf

    from psworker import server as srv

    graph = tf.Graph()
    with graph.as_default():
        queue = worker_done_queue(index)
        size, dequeue = queue.size(), queue.dequeue()
    config = tf.compat.v1.ConfigProto(device_filters=[f"/job:worker/task:{index}"])
    client = str(spec.worker[CLIENT_INDEX])
    gone_since: Optional[float] = clock()
    with tf.compat.v1.Session(server.target, graph=graph, config=config) as sess:
        while True:
            # Poll the size rather than dequeue with a timeout: a timed-out dequeue logs a warning every time.
            if sess.run(size) > 0:
                sess.run(dequeue)
                return
            if srv.is_reachable(client, timeout=0.2):
                gone_since = None
            else:
                now = clock()
                gone_since = now if gone_since is None else gone_since
                if now - gone_since >= client_gone_secs:
                    raise StartupTimeout(
                        f"worker:{index}: the in-graph client worker:{CLIENT_INDEX} at {client} has been "
                        f"unreachable for {client_gone_secs:g} s (--startup_timeout_secs) without saying that "
                        "training is over"
                    )
            time.sleep(POLL_SECS)


# ---------------------------------------------------------------------------------------------- the processes


def run_in_graph(server, spec: ClusterSpec, index: int, config: TrainConfig) -> None:
    """Worker 0 trains the whole cluster in one graph; any other worker serves until the client says it is done.

    `server` is this worker's started server (see `task.run_worker`, which also makes the process exit after).

    Raises:
        StartupTimeout: the cluster did not come up, or (serving worker) the client went away.
    """
    from psworker import server as srv

    if index != CLIENT_INDEX:
        log.info("worker:%d: in-graph replication: serving for the client worker:%d", index, CLIENT_INDEX)
        serve_until_client_done(server, spec, index, client_gone_secs=config.startup_timeout_secs)
        log.info("worker:%d: the client is done; exiting", index)
        srv.signal_done(server.target, index, len(spec.ps), len(spec.worker))
        return
    _run_client(server, spec, config)


def _run_client(server, spec: ClusterSpec, config: TrainConfig, *, emit=print) -> None:
    import tensorflow as tf

    from psworker import evaluate, models
    from psworker import server as srv
    from psworker.hooks import ProgressHook
    from psworker.session import FastSessionCreator
    from psworker.trainer import chief_hooks, run_steps

    v1 = tf.compat.v1
    name = f"worker:{CLIENT_INDEX}"
    if config.mode == "sync" or config.replicas_to_aggregate:
        log.warning("%s: in-graph replication is synchronous by construction; mode=%s and replicas_to_aggregate "
                     "are ignored", name, config.mode)
    os.makedirs(config.train_dir, exist_ok=True)
    model = models.get(config.model)
    num_workers = len(spec.worker)
    everyone = srv.task_addresses(spec, ("ps", "worker"))

    def wait_for_cluster() -> None:
        srv.wait_for_tasks(everyone, timeout_secs=config.startup_timeout_secs, who=name)

    graph = tf.Graph()
    with graph.as_default():
        if config.seed is not None:
            v1.set_random_seed(config.seed)
        tg = build_in_graph_train_graph(model, config, cluster=spec.as_dict())
        scaffold = v1.train.Scaffold(saver=v1.train.Saver(sharded=True, max_to_keep=5, save_relative_paths=True))
        examples_per_step = config.batch_size * config.num_devices * num_workers
        progress = ProgressHook(tg.loss, tg.global_step, every_steps=config.log_every_steps,
                                examples_per_step=examples_per_step, emit=emit)
        hooks = [v1.train.StopAtStepHook(last_step=config.max_steps), v1.train.NanTensorHook(tg.loss), progress,
                 *chief_hooks(config, scaffold)]
        # No device filters: this client places ops on every worker task.
        creator = FastSessionCreator(
            scaffold, master=server.target, config=srv.session_config("worker", CLIENT_INDEX, filter_devices=False),
            is_chief=True, checkpoint_dir=config.train_dir, max_wait_secs=config.startup_timeout_secs, name=name,
            before_create=wait_for_cluster,
        )
        started = time.monotonic()
        log.info("%s: in-graph client for %d workers x %d towers, %d examples per step", name, num_workers,
                 config.num_devices, examples_per_step)
        try:
            with v1.train.MonitoredSession(session_creator=creator, hooks=hooks, stop_grace_period_secs=0) as sess:
                run_steps(sess, tg, config, creator, name, "each step needs every worker: is one down or slow? "
                          f"(gives up after --step_timeout_secs {config.step_timeout_secs:g})", sync=False)
        except tf.errors.DeadlineExceededError as exc:
            raise StartupTimeout(f"{name}: timed out: {exc.message.splitlines()[0]}") from None
    log.info("%s: done after %d steps in %.1f s", name, progress.local_steps, time.monotonic() - started)
    # The serving workers can go now: each tells the ps tasks itself that it is done (`server.signal_done`, as a
    # between-graph worker does), then exits.
    release_workers(server.target, spec)
    checkpoint = evaluate.latest_checkpoint(config.train_dir)
    if checkpoint:
        emit(evaluate.format_result(evaluate.evaluate_checkpoint(model, checkpoint, data_dir=config.data_dir)),
             flush=True)
    # Last: the ps tasks wait for every worker's process to be gone before exiting, so this cannot race them.
    srv.signal_done(server.target, CLIENT_INDEX, len(spec.ps), num_workers)


__all__ = [
    "build_in_graph_train_graph",
    "run_in_graph",
    "serve_until_client_done",
    "release_workers",
    "worker_done_queue",
]
