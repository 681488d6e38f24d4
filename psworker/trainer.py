"""Between-graph replication: one worker's training graph, placed on the ps tasks, and its training loop.

Async mode: each worker applies its own gradients. Sync mode: `SyncReplicasOptimizer` averages
`replicas_to_aggregate` gradients per global step (fewer than the number of workers makes the rest backup workers
whose stale gradients are dropped), with two changes: its inner update is capped at `max_steps` (`CappedOptimizer`,
so the global step ends exactly there), and no tokens are queued up front (`SYNC_INIT_TOKENS`), so that each
worker's first gradient belongs to the first step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

from psworker.errors import PsworkerError
from psworker.models.base import InputSpec, Model
from psworker.spec import ClusterSpec, TrainConfig

log = logging.getLogger(__name__)

DEFAULT_SAVE_CHECKPOINT_SECS = 60.0
# TF queues `replicas_to_aggregate` tokens when the chief starts, so a fast worker can push two gradients for the
# first step before a slow one pushes any. With none, every worker's first gradient waits for the first update.
SYNC_INIT_TOKENS = 0
WATCHDOG_AFTER_SECS = 10.0


class StepTimeout(PsworkerError):
    """One training step did not finish within `--step_timeout_secs`."""


class StoppedEarly(PsworkerError):
    """The training loop ended before the global step reached `--max_steps` (the chief closed the sync queue)."""


@dataclass(frozen=True)
class TrainResult:
    """What one worker did: the global step at its end and how many steps it ran itself."""

    global_step: int
    local_steps: int
    seconds: float
    first_step_at: Optional[float]   # time.time() of this worker's first finished step
    last_step_at: Optional[float]    # time.time() when its last step finished


@dataclass(frozen=True)
class TrainGraph:
    train_op: object
    loss: object
    global_step: object
    learning_rate: object
    sync_optimizer: object   # None in async mode


class CappedOptimizer:
    """Wraps a `tf.compat.v1.train.Optimizer` so that `apply_gradients` updates nothing, and leaves the global step
    alone, once the global step has reached `last_step`.

    Under `SyncReplicasOptimizer` only the chief's aggregation thread applies updates, one at a time, so the check
    and the increment cannot race and the global step ends at `last_step` exactly, whatever gradients workers that
    have not yet seen the end still push. Everything else is delegated to the wrapped optimizer.
    """

    def __init__(self, optimizer, last_step: int):
        self._opt = optimizer
        self._last_step = last_step

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        import tensorflow as tf

        if global_step is None:
            raise ValueError("CappedOptimizer needs the global step")
        grads_and_vars = list(grads_and_vars)
        last = tf.constant(self._last_step, global_step.dtype.base_dtype)
        below = tf.less(global_step, last, name="below_max_steps")

        def apply():
            with tf.control_dependencies([self._opt.apply_gradients(grads_and_vars, global_step, name)]):
                return tf.constant(True)

        return tf.compat.v1.cond(below, apply, lambda: tf.constant(False), name="capped_update").op

    def __getattr__(self, attr):
        return getattr(self._opt, attr)


def build_train_graph(model: Model, config: TrainConfig, *, cluster: Optional[dict], task_index: int) -> TrainGraph:
    """Builds one worker's replica of the training graph in the current default graph.

    Variables go to the ps tasks (greedy by bytes: every worker builds the same graph in the same order, so all
    compute the same placement); compute and input ops stay on this worker. `cluster=None` builds the same graph
    for one process without servers (no placement; async updates only).
    """
    import tensorflow as tf

    from psworker.placement import GreedyByteStrategy

    v1 = tf.compat.v1
    num_workers = len(cluster["worker"]) if cluster else 1
    if cluster:
        worker_device = f"/job:worker/task:{task_index}"
        placement = v1.train.replica_device_setter(
            cluster=cluster, worker_device=worker_device, ps_strategy=GreedyByteStrategy(len(cluster["ps"]))
        )
        input_device = f"{worker_device}/device:CPU:0"
    else:
        if config.mode == "sync":
            raise ValueError("sync mode needs a cluster")
        worker_device, placement, input_device = "", None, "/device:CPU:0"
    with tf.compat.v1.device(placement):
        global_step = v1.train.get_or_create_global_step()
        with tf.device(input_device):
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
            sync = v1.train.SyncReplicasOptimizer(
                CappedOptimizer(optimizer, config.max_steps),
                replicas_to_aggregate=config.replicas_to_aggregate or num_workers,
                total_num_replicas=num_workers,
                variable_averages=ema,
                variables_to_average=v1.trainable_variables() if ema else None,
            )
            optimizer = sync
        apply_op = optimizer.apply_gradients(grads, global_step=global_step)
        # In sync mode the SyncReplicasOptimizer's chief updates the averages once per step itself.
        train_op = finish_train_op(apply_op, None if sync else ema, loss, lr)
    return TrainGraph(train_op=train_op, loss=loss, global_step=global_step, learning_rate=lr, sync_optimizer=sync)


def finish_train_op(apply_op, ema, loss, learning_rate):
    """The train op: `apply_op`, then the moving averages of the trainable variables when `ema` is given.

    Also records the loss and learning-rate summaries the chief writes.
    """
    import tensorflow as tf

    v1 = tf.compat.v1
    v1.summary.scalar("loss", loss)
    v1.summary.scalar("learning_rate", learning_rate)
    if ema is None:
        return apply_op
    with tf.control_dependencies([apply_op]):
        return tf.group(apply_op, ema.apply(v1.trainable_variables()), name="train_op")


def train(target: str, spec: ClusterSpec, task_index: int, config: TrainConfig, model: Model, *,
          session_config=None, before_session=None, emit=print) -> TrainResult:
    """Runs this worker's training loop against the cluster until the global step reaches `config.max_steps`.

    Worker 0 is the chief: it initialises or restores the model, and writes checkpoints and summaries into
    `config.train_dir`. The sessions are left open at the end (see `FastSessionCreator.abandon_on_close`): the
    caller is expected to leave the process soon after.

    Raises:
        StepTimeout: a step took longer than `config.step_timeout_secs` (plus `startup_timeout_secs` for the first
            step of a session, which may wait for the other workers to start).
        StoppedEarly: the loop ended below `max_steps` (in sync mode: the chief stopped and closed the token queue).
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
                                examples_per_step=config.batch_size * config.num_devices, emit=emit, name=name)
        hooks = [v1.train.StopAtStepHook(last_step=config.max_steps), v1.train.NanTensorHook(tg.loss), progress]
        if tg.sync_optimizer is not None:
            hooks.append(tg.sync_optimizer.make_session_run_hook(is_chief, num_tokens=SYNC_INIT_TOKENS))
        if is_chief:
            hooks.extend(chief_hooks(config, scaffold))
        creator = FastSessionCreator(
            scaffold, master=target, config=session_config, is_chief=is_chief,
            checkpoint_dir=config.train_dir if is_chief else None,
            max_wait_secs=config.startup_timeout_secs, name=name, before_create=before_session,
        )
        started = time.monotonic()
        # stop_grace_period_secs=0: TF waits 120 s for the sync queue-runner thread otherwise.
        with v1.train.MonitoredSession(session_creator=creator, hooks=hooks, stop_grace_period_secs=0) as sess:
            try:
                run_steps(sess, tg, config, creator, name, _watchdog_hint(config, spec),
                          sync=tg.sync_optimizer is not None)
            finally:
                creator.abandon_on_close()
            last_step_at = time.time()
            log.info("%s: last step done (%d local steps)", name, progress.local_steps)
    final = progress.final_global_step if progress.final_global_step is not None else progress.last_global_step
    if final < config.max_steps:
        why = ("the chief closed the sync token queue (did it fail or stop early?)" if tg.sync_optimizer is not None
               else "the input ran out")
        raise StoppedEarly(f"{name}: training stopped at global step {final}, before --max_steps {config.max_steps}: "
                           f"{why}")
    return TrainResult(global_step=final, local_steps=progress.local_steps, seconds=time.monotonic() - started,
                       first_step_at=progress.first_step_at, last_step_at=last_step_at)


def run_steps(sess, tg: TrainGraph, config: TrainConfig, creator, name: str, hint: str, *, sync: bool) -> None:
    """Runs `tg.train_op` until the session says stop, each step bounded by `--step_timeout_secs`.

    A watchdog logs what a step that takes longer than 10 s (or half the timeout) waits for: `hint`.
    """
    from psworker.hooks import StepWatchdog

    watch_secs = min(WATCHDOG_AFTER_SECS, config.step_timeout_secs / 2)
    with StepWatchdog(name, hint, after_secs=watch_secs, every_secs=watch_secs) as watchdog:
        _run_steps(sess, tg, config, creator, watchdog, name, sync)


def _run_steps(sess, tg: TrainGraph, config: TrainConfig, creator, watchdog, name: str, sync: bool) -> None:
    """The loop: one `train_op` per step, each bounded by a timeout; returns when the session says stop."""
    import tensorflow as tf

    steady = tf.compat.v1.RunOptions(timeout_in_ms=int(config.step_timeout_secs * 1000))
    # The first step of a (re-created) session may wait for other workers to start: allow for that as well.
    first = tf.compat.v1.RunOptions(
        timeout_in_ms=int((config.step_timeout_secs + config.startup_timeout_secs) * 1000))
    seen_session = -1
    while not sess.should_stop():
        session_now = creator.sessions_created
        watchdog.step_started()
        try:
            sess.run(tg.train_op, options=first if session_now != seen_session else steady)
        except tf.errors.DeadlineExceededError:
            raise StepTimeout(_timeout_message(name, config, sync)) from None
        except tf.errors.OutOfRangeError:
            # Sync mode: the chief closes the token queue when it stops (else: a finite input ran out). The global
            # step read at the end tells whether training is complete.
            log.info("%s: %s", name, "the sync token queue was closed: the chief has stopped"
                     if sync else "the input ran out (OutOfRangeError)")
            return
        finally:
            watchdog.step_finished()
        seen_session = creator.sessions_created


def _watchdog_hint(config: TrainConfig, spec: ClusterSpec) -> str:
    if config.mode != "sync":
        return "is a ps task overloaded or unreachable?"
    needed = config.replicas_to_aggregate or len(spec.worker)
    return (f"a sync step waits for gradients from {needed} of {len(spec.worker)} workers: is one down or slow? "
            f"(gives up after --step_timeout_secs {config.step_timeout_secs:g})")


def _timeout_message(name: str, config: TrainConfig, sync: bool) -> str:
    if sync:
        return (f"{name}: a sync training step did not finish within {config.step_timeout_secs:g} s "
                f"(--step_timeout_secs): each step needs gradients from "
                f"{config.replicas_to_aggregate or 'all'} workers; is a worker down? Start it again (it rejoins), or "
                "run with fewer --replicas_to_aggregate than workers so that the others can go on without it")
    return (f"{name}: a training step did not finish within {config.step_timeout_secs:g} s (--step_timeout_secs): "
            "is a ps task overloaded or unreachable?")


def chief_hooks(config: TrainConfig, scaffold) -> list:
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


def train_in_process(model: Model, config: TrainConfig, *, steps: int, warmup_steps: int = 20) -> tuple[float, int]:
    """Trains `model` for `steps` steps in this process, without servers (the benchmark's baseline).

    Returns:
        `(seconds, steps)` for the steps after the first `warmup_steps`.
    """
    import tensorflow as tf

    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        if config.seed is not None:
            v1.set_random_seed(config.seed)
        tg = build_train_graph(model, config, cluster=None, task_index=0)
        with v1.train.MonitoredSession(session_creator=v1.train.ChiefSessionCreator()) as sess:
            for _ in range(warmup_steps):
                sess.run(tg.train_op)
            start = time.perf_counter()
            for _ in range(steps):
                sess.run(tg.train_op)
            return time.perf_counter() - start, steps
