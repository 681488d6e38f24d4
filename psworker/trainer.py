"""Between-graph replication: one worker's training graph, placed on the ps tasks, and its training loop."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

from psworker.models.base import InputSpec, Model
from psworker.spec import ClusterSpec, TrainConfig

log = logging.getLogger(__name__)

DEFAULT_SAVE_CHECKPOINT_SECS = 60.0


@dataclass(frozen=True)
class TrainResult:
    """What one worker did: the last global step it saw and how many steps it ran itself."""

    global_step: int
    local_steps: int
    seconds: float
    first_step_at: Optional[float]   # time.time() of this worker's first finished step


@dataclass(frozen=True)
class TrainGraph:
    train_op: object
    loss: object
    global_step: object
    learning_rate: object
    sync_optimizer: object   # None in async mode


def build_train_graph(model: Model, config: TrainConfig, *, cluster: dict, task_index: int) -> TrainGraph:
    """Builds one worker's replica of the training graph in the current default graph.

    Variables go to the ps tasks (greedy by bytes: every worker builds the same graph in the same order, so all
    compute the same placement); compute and input ops stay on this worker.
    """
    import tensorflow as tf

    from psworker.placement import GreedyByteStrategy

    v1 = tf.compat.v1
    num_workers = len(cluster["worker"])
    worker_device = f"/job:worker/task:{task_index}"
    setter = v1.train.replica_device_setter(
        cluster=cluster, worker_device=worker_device, ps_strategy=GreedyByteStrategy(len(cluster["ps"]))
    )
    with tf.compat.v1.device(setter):
        global_step = v1.train.get_or_create_global_step()
        with tf.device(f"{worker_device}/device:CPU:0"):
            images, labels = model.train_inputs(InputSpec(
                data_dir=config.data_dir, batch_size=config.batch_size * config.num_devices,
                shard_index=task_index, num_shards=num_workers, seed=config.seed,
            ))
        base_lr = config.learning_rate if config.learning_rate is not None else model.default_learning_rate
        lr = model.learning_rate(global_step, base_lr, config.batch_size * config.num_devices, config.data_dir)
        optimizer = model.optimizer(lr)
        if config.num_devices > 1:
            from psworker import towers

            grads, loss = towers.build_tower_gradients(
                model, optimizer, images, labels, config.num_devices, device_prefix=worker_device
            )
        else:
            logits = model.inference(images, training=True)
            loss = model.loss(logits, labels)
            grads = optimizer.compute_gradients(loss)
        ema = None
        if model.moving_average_decay:
            ema = v1.train.ExponentialMovingAverage(model.moving_average_decay, global_step)
        sync = None
        if config.mode == "sync":
            # Gradients of `replicas_to_aggregate` replicas are averaged and applied once per global step;
            # fewer than the number of workers makes the rest backup workers whose stale gradients are dropped.
            sync = v1.train.SyncReplicasOptimizer(
                optimizer,
                replicas_to_aggregate=config.replicas_to_aggregate or num_workers,
                total_num_replicas=num_workers,
                variable_averages=ema,
                variables_to_average=v1.trainable_variables() if ema else None,
            )
            optimizer = sync
        apply_op = optimizer.apply_gradients(grads, global_step=global_step)
        if ema is not None and sync is None:
            with tf.control_dependencies([apply_op]):
                train_op = tf.group(apply_op, ema.apply(v1.trainable_variables()), name="train_op")
        else:
            train_op = apply_op
        v1.summary.scalar("loss", loss)
        v1.summary.scalar("learning_rate", lr)
    return TrainGraph(train_op=train_op, loss=loss, global_step=global_step, learning_rate=lr, sync_optimizer=sync)


def train(target: str, spec: ClusterSpec, task_index: int, config: TrainConfig, model: Model, *,
          session_config=None, before_session=None, emit=print) -> TrainResult:
    """Runs this worker's training loop against the cluster until the global step reaches `config.max_steps`.

    Worker 0 is the chief: it initialises or restores the model, and writes checkpoints and summaries into
    `config.train_dir`.
    """
    import tensorflow as tf

    from psworker.hooks import ProgressHook
    from psworker.session import FastSessionCreator

    v1 = tf.compat.v1
    is_chief = task_index == 0
    name = f"worker:{task_index}"
    graph = tf.Graph()
    with graph.as_default():
        if config.seed is not None:
            v1.set_random_seed(config.seed)
        tg = build_train_graph(model, config, cluster=spec.as_dict(), task_index=task_index)
        scaffold = v1.train.Scaffold(saver=v1.train.Saver(sharded=True, max_to_keep=5, save_relative_paths=True))
        progress = ProgressHook(tg.loss, tg.global_step, every_steps=config.log_every_steps,
                                examples_per_step=config.batch_size * config.num_devices, emit=emit)
        hooks = [v1.train.StopAtStepHook(last_step=config.max_steps), v1.train.NanTensorHook(tg.loss), progress]
        if tg.sync_optimizer is not None:
            hooks.append(tg.sync_optimizer.make_session_run_hook(is_chief))
        if is_chief:
            hooks.extend(_chief_hooks(config, scaffold))
        creator = FastSessionCreator(
            scaffold, master=target, config=session_config, is_chief=is_chief,
            checkpoint_dir=config.train_dir if is_chief else None,
            max_wait_secs=config.startup_timeout_secs, name=name, before_create=before_session,
        )
        started = time.monotonic()
        first_step_at = None
        # stop_grace_period_secs=0: TF waits 120 s for the sync queue-runner thread otherwise.
        with v1.train.MonitoredSession(session_creator=creator, hooks=hooks, stop_grace_period_secs=0) as sess:
            while not sess.should_stop():
                sess.run(tg.train_op)
                if first_step_at is None:
                    first_step_at = time.time()
                    log.info("%s: first step done", name)
    return TrainResult(global_step=progress.last_global_step, local_steps=progress.local_steps,
                       seconds=time.monotonic() - started, first_step_at=first_step_at)


def _chief_hooks(config: TrainConfig, scaffold) -> list:
    import tensorflow as tf

    v1 = tf.compat.v1
    if config.save_checkpoint_steps:
        saver = v1.train.CheckpointSaverHook(config.train_dir, save_steps=config.save_checkpoint_steps,
                                             scaffold=scaffold)
    else:
        saver = v1.train.CheckpointSaverHook(
            config.train_dir, save_secs=config.save_checkpoint_secs or DEFAULT_SAVE_CHECKPOINT_SECS, scaffold=scaffold
        )
    summaries = v1.train.SummarySaverHook(save_steps=max(1, config.log_every_steps), output_dir=config.train_dir,
                                          scaffold=scaffold)
    return [saver, summaries]
