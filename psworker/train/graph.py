"""One worker's training graph (between-graph replication) and the pieces every training graph shares.

Async mode: each worker applies its own gradients (with steps in flight, once it claimed a global step: `step_claim`).
Sync mode: `SyncReplicasOptimizer` averages `replicas_to_aggregate` gradients per global step (fewer than the number
of workers makes the rest backup workers whose stale gradients are dropped), with two changes: its inner update is
capped at `max_steps` (`CappedOptimizer`, so the global step ends exactly there), and no tokens are queued up front
(`SYNC_INIT_TOKENS`), so that each worker's first gradient belongs to the first step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Optional

from psworker.models.base import InputSpec, Model
from psworker.spec import TrainConfig
from psworker.train.placement import log_tables
from psworker.train.sync_reset import SyncRestartReset
from psworker.train.sync_slots import PushSlots
from psworker.train.sync_tokens import TokensOnDemand

# TF queues `replicas_to_aggregate` tokens when the chief starts, so a fast worker can push two gradients for the
# first step before a slow one pushes any. With none, every worker's first gradient waits for the first update.
SYNC_INIT_TOKENS = 0

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainGraph:
    """The tensors the runner needs from a training graph."""

    train_op: object
    loss: object
    global_step: object
    learning_rate: object
    sync_optimizer: object   # None unless between-graph sync mode
    sync_reset: object = None   # a SyncRestartReset in sync mode (the chief runs it when it restarts on a live ps)
    inputs: object = None       # this worker's input batch (the session's input warm-up fetches one)
    pulls: object = None        # a transfer.Pulls when staged variables or a transfer dtype are on
    dealer: object = None       # dealt shards: this worker's dealer.DealerClient
    dealer_state: object = None  # dealt shards: the dealer.DealerState (its variables)
    input_init: object = None   # dealt shards: the input iterator's initializer (run with each new session)
    claimed: object = None      # steps in flight: this step claimed a global step (`step_claim`), a bool tensor
    replay: object = None       # dealt sync: the `sync_replay.ReplayDropped` (its hook computes a dropped batch again)


@dataclass(frozen=True)
class Optimization:
    """What every training graph builds the same way: the learning rate, the optimizer and the moving averages."""

    learning_rate: object
    optimizer: object
    ema: object              # an ExponentialMovingAverage, or None when the model keeps none


def optimization(model: Model, config: TrainConfig, global_step, examples_per_step: int,
                 num_workers: int = 1) -> Optimization:
    """The model's learning rate, optimizer and moving averages, built in the current graph and device scope.

    The rate is `--learning_rate` or the model's default, scaled to the global batch (`scaling.learning_rate`, logged)
    and decayed by the model's schedule counting `examples_per_step` per step.
    """
    import tensorflow as tf

    from psworker.train import scaling

    rate = scaling.learning_rate(model, config, num_workers)
    log.info("%s", rate.describe())
    lr = model.learning_rate(global_step, rate.value, examples_per_step, config.data_dir)
    ema = None
    if model.moving_average_decay:
        ema = tf.compat.v1.train.ExponentialMovingAverage(model.moving_average_decay, global_step)
    return Optimization(lr, model.optimizer(lr), ema)


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


def build_train_graph(model: Model, config: TrainConfig, *, cluster: Optional[dict], task_index: int,
                      elastic: bool = False, dealing: Optional[Any] = None) -> TrainGraph:
    """Builds one worker's replica of the training graph in the current default graph.

    Variables go to the ps tasks, large ones (`placement.min_partition_bytes`) split into a shard per ps, placed
    greedily by bytes (every worker builds the same graph in the same order, so all compute the same placement);
    compute and input ops stay on this worker. `cluster=None` builds the same graph for one process without servers
    (no placement, no shards; async updates only). `elastic`: an elastic job's sync tokens are handed out on demand
    (`sync_tokens`). `dealing` (a `dealer.Dealing`): the input reads shards dealt on demand (`train.dealer`), and
    the train op records the examples it trained; None: the static slice `task_index` of the workers.
    """
    import tensorflow as tf

    from psworker.train import devices, packing, step_claim, sync_replay, transfer
    from psworker.train.placement import GreedyByteStrategy, min_partition_bytes, partitioned_variables

    v1 = tf.compat.v1
    config = devices.resolve(config, devices.visible_gpus())   # --num_devices auto
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
    num_ps, transfers = len(cluster["ps"]) if cluster else 1, transfer.options_of(config, servers=bool(cluster))
    with v1.device(placement), partitioned_variables(num_ps, min_partition_bytes(transfers.packed)):
        global_step = v1.train.get_or_create_global_step()
        inputs = _inputs(model, config, dealing, global_step, input_device, task_index, num_workers)
        images, labels = inputs.batch
        opt = optimization(model, config, global_step, config.batch_size * config.num_devices, num_workers)
        lr, optimizer, ema = opt.learning_rate, opt.optimizer, opt.ema
        pulls = transfer.Pulls(transfers, worker_device)
        grads, loss = _gradients(model, optimizer, pulls, images, labels, config, worker_device)
        log_tables(opt.ema)
        sync = _sync_optimizer(optimizer, config, num_workers, ema) if config.mode == "sync" else None
        demand = TokensOnDemand(sync, global_step, config.max_steps) if sync is not None and elastic else None
        pushed = pulls.push(grads)
        apply_op, claim = step_claim.apply_update(sync or optimizer, pushed, global_step, config, images)
        slots = PushSlots(sync, pushed, config.max_steps) if sync is not None else None
        apply_op = slots.train_op if slots is not None else apply_op   # the worker's: see `sync_slots`
        if demand is not None:
            demand.after_apply()
            apply_op = tf.group(apply_op, demand.register(task_index))
        # In sync mode the SyncReplicasOptimizer's chief updates the averages once per step itself.
        train_op = _with_next_pull(finish_train_op(apply_op, None if sync else ema), pulls, grads, opt)
        if inputs.state is not None:   # after the update: a checkpoint never counts an example not trained on
            train_op = sync_replay.counted(inputs, train_op, tf.shape(images)[0], task_index, claim, slots)
        reset = SyncRestartReset(sync, demand, slots) if sync is not None else None
        if cluster:   # the learning rate and other small constants: a copy on each ps that takes one
            packing.local_constants(tf.compat.v1.get_default_graph())
    return TrainGraph(train_op=train_op, loss=loss, global_step=global_step, learning_rate=lr, sync_optimizer=sync,
                      sync_reset=reset, inputs=None if inputs.state is not None else (images, labels),
                      pulls=pulls if pulls.options.active else None, dealer=inputs.client,
                      dealer_state=inputs.state, input_init=inputs.init, claimed=claim,
                      replay=inputs.replay)


@dataclass(frozen=True)
class DealtInputs:
    """The input of a dealt reader: its batch, the dealer's state and client, and the iterator's initializer."""

    batch: tuple            # (images, labels)
    state: Any = None       # dealt: the DealerState
    client: Any = None      # dealt: the DealerClient
    init: Any = None        # dealt: the iterator's initializer, when the model gives its dataset
    replay: Any = None      # dealt sync: the `sync_replay.ReplayDropped` the batch comes through


def _inputs(model: Model, config: TrainConfig, dealing: Any, global_step, input_device: str, task_index: int,
            num_workers: int) -> DealtInputs:
    """This worker's input batch: a static slice, or positions dealt by `dealing` (`dealt_inputs`)."""
    import tensorflow as tf

    batch = config.batch_size * config.num_devices
    if dealing is None:
        with tf.device(input_device):
            return DealtInputs(model.train_inputs(InputSpec(data_dir=config.data_dir, batch_size=batch,
                                                            shard_index=task_index, num_shards=num_workers,
                                                            seed=config.seed)))
    return dealt_inputs(model, config, dealing, global_step, input_device, batch, replay=config.mode == "sync")


def dealt_inputs(model: Model, config: TrainConfig, dealing: Any, global_step, input_device: str,
                 batch: int, replay: bool = False) -> DealtInputs:
    """Batches of `batch` examples at the positions `dealing` deals, read on `input_device` (the process that
    builds the graph: the positions come from a Python generator), with the dealer's variables beside the global
    step, its client, and an initializable iterator when the model gives its dataset. `replay`: a between-graph
    sync worker's, whose dropped batch is computed again (`sync_replay`; in-graph replication drops none)."""
    import tensorflow as tf

    from psworker.train import dealer, sync_replay

    state = dealer.DealerState(dealing.num_workers, global_step.device, config.seed)
    client = dealer.DealerClient(dealing, global_step.device)
    spec = InputSpec(data_dir=config.data_dir, batch_size=batch, shard_index=dealing.index,
                     num_shards=dealing.num_workers, seed=config.seed,
                     positions=lambda: dealer.positions_dataset(client))
    with tf.device(input_device):
        ds = model.train_dataset(spec)
        if ds is None:
            return DealtInputs(model.train_inputs(spec), state, client)
        iterator = tf.compat.v1.data.make_initializable_iterator(ds)
        if replay and sync_replay.replayable(iterator.element_spec):
            replay = sync_replay.ReplayDropped(iterator, input_device)
            return DealtInputs(replay.batch, state, client, iterator.initializer, replay)
        return DealtInputs(iterator.get_next(), state, client, iterator.initializer)


def _gradients(model: Model, optimizer: Any, pulls: Any, images, labels, config: TrainConfig, worker_device: str):
    """`(grads_and_vars, loss)` of one worker's batch: through `pulls` (the worker-side copies of the variables) when
    staged variables or a transfer dtype are on, else straight from the variables."""
    import contextlib

    active = pulls.options.active
    if active and config.mode == "sync" and pulls.options.staged:
        raise ValueError("staged variables are for async mode only")
    source = pulls if active else optimizer
    with pulls.scope() if active else contextlib.nullcontext():
        if config.num_devices > 1:
            from psworker.train import towers

            grads, loss = towers.build_tower_gradients(model, source, images, labels, config.num_devices,
                                                       device_prefix=worker_device)
        else:
            logits = model.inference(images, training=True)
            loss = model.loss(logits, labels)
            grads = source.compute_gradients(loss)
    if active:
        pulls.finish()
        log.info("variables pulled %s%s", "staged (one step ahead), " if pulls.options.staged else "",
                 f"as {pulls.options.dtype} on the wire" if pulls.options.dtype != "float32" else "in float32")
    return grads, loss


def _with_next_pull(train_op, pulls: Any, grads, opt: Optimization):
    """`train_op`, and with staged variables also the put of the next step's values (and the first fill)."""
    import tensorflow as tf

    from psworker.train import transfer

    fill = pulls.fill_op()
    if fill is None:
        return train_op
    rate = _own_update_rate(opt)
    if rate is None:
        log.warning("staged variables with %s: only plain gradient descent's own update can be added to the staged "
                    "copy, so each step computes on weights one update stale (stable at about half the learning "
                    "rate plain training takes; docs/performance.md)", type(opt.optimizer).__name__)
    pulls.stage_next(grads, rate)
    transfer.register_fill(fill)
    return tf.group(train_op, *pulls.step_ops, name="train_op_and_next_pull")


def _own_update_rate(opt: Optimization):
    """The learning rate of `opt`'s update when it is plain gradient descent at `opt.learning_rate` (its update,
    `-rate * gradient`, is then known on the worker), else None."""
    import tensorflow as tf

    optimizer = opt.optimizer
    plain = type(optimizer) is tf.compat.v1.train.GradientDescentOptimizer   # pylint: disable=unidiomatic-typecheck
    rate = getattr(optimizer, "_learning_rate", None)
    return opt.learning_rate if plain and rate is opt.learning_rate else None


def _sync_optimizer(optimizer: Any, config: TrainConfig, num_workers: int, ema: Any) -> Any:
    """Sync mode's `SyncReplicasOptimizer` around `optimizer` (capped at `max_steps`; with moving averages, each
    variable's average updated on its device)."""
    import tensorflow as tf

    v1 = tf.compat.v1
    return v1.train.SyncReplicasOptimizer(
        CappedOptimizer(optimizer, config.max_steps),
        replicas_to_aggregate=config.replicas_to_aggregate or num_workers,
        total_num_replicas=num_workers,
        variable_averages=ColocatedAverages(ema) if ema else None,
        variables_to_average=dense_trainables() if ema else None,
    )


class ColocatedAverages:
    """An `ExponentialMovingAverage` whose `apply` builds each variable's update on that variable's device.

    Under `replica_device_setter` a plain `ema.apply(vars)` places only the shadow variables on the ps; the update's
    arithmetic lands on the worker, which then reads every variable and its shadow from the ps and sends the update
    back each step (3x the model's bytes; +17% CPU per CNN step, docs/performance.md). Built here, the update runs
    where its variable lives and only the decay (a scalar) crosses. Shadow names are unchanged. Everything else is
    delegated to the wrapped average (`SyncReplicasOptimizer(variable_averages=...)` calls only `apply`).
    """

    def __init__(self, ema):
        self._ema = ema

    def apply(self, var_list):
        import tensorflow as tf

        updates = []
        for var in var_list:
            self._create_shadow(var)
            with tf.compat.v1.device(var.device):
                updates.append(self._ema.apply([var]))
        return tf.group(*updates, name="moving_averages")

    def _create_shadow(self, var) -> None:
        """Creates `var`'s shadow as `ExponentialMovingAverage.apply` would (same name, device, collection), but
        initialised from `var.initial_value` directly instead of through a `cond` on whether `var` is initialised:
        the init op runs both initialisers in one run, so the shadow starts equal to the variable (a test checks),
        and the ten conds were ~20% of the CIFAR-10 graph build (0.26 -> 0.21 s, docs/performance.md). Every
        psworker graph is initialised or restored whole, never extended after its variables were initialised."""
        import tensorflow as tf
        from tensorflow.python.training import slot_creator   # what apply uses; no public equivalent

        averages = self._ema._averages   # pylint: disable=protected-access  (apply skips variables found here)
        if var.ref() in averages:
            return
        with tf.init_scope(), tf.compat.v1.device(var.device):
            averages[var.ref()] = slot_creator.create_slot(var, var.initial_value, self._ema.name,
                                                           colocate_with_primary=True)
        tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.MOVING_AVERAGE_VARIABLES, var)

    def __getattr__(self, attr):
        return getattr(self._ema, attr)


def dense_trainables() -> list:
    """The trainable variables of the default graph but the sparse tables (`models.base.SPARSE_TABLES`): what moving
    averages keep (an average of a table would read and write the whole table every step)."""
    import tensorflow as tf

    from psworker.models.base import SPARSE_TABLES

    tables = {id(v) for v in tf.compat.v1.get_collection(SPARSE_TABLES)}
    return [v for v in tf.compat.v1.trainable_variables() if id(v) not in tables]


def finish_train_op(apply_op, ema):
    """The train op: `apply_op`, then the moving averages of the trainable variables when `ema` is given (each
    computed on its variable's device, see `ColocatedAverages`). No summary ops: each worker writes its own scalars
    (`train.summaries.WorkerSummaryHook`).
    """
    import tensorflow as tf

    if ema is None:
        return apply_op
    with tf.control_dependencies([apply_op]):
        return tf.group(apply_op, ColocatedAverages(ema).apply(dense_trainables()), name="train_op")


WARMUP_STEPS = 20   # `train_in_process`'s untimed first steps


def train_in_process(model: Model, config: TrainConfig, *, steps: int, warmup_steps: int = WARMUP_STEPS,
                     checkpoint_dir: Optional[str] = None) -> tuple[float, int]:
    """Trains `model` for `warmup_steps` + `steps` steps in this process, without servers (the benchmarks'
    baseline); with `checkpoint_dir`, saves the model there at the end (for `evaluate_checkpoint`).

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
        hooks = [v1.train.CheckpointSaverHook(checkpoint_dir, save_steps=10 ** 9)] if checkpoint_dir else []
        with v1.train.MonitoredSession(session_creator=v1.train.ChiefSessionCreator(), hooks=hooks) as sess:
            for _ in range(warmup_steps):
                sess.run(tg.train_op)
            start = time.perf_counter()
            for _ in range(steps):
                sess.run(tg.train_op)
            return time.perf_counter() - start, steps


__all__ = ["TrainGraph", "Optimization", "optimization", "CappedOptimizer", "ColocatedAverages",
           "build_train_graph", "finish_train_op", "dense_trainables", "log_tables", "train_in_process", "WARMUP_STEPS",
           "SYNC_INIT_TOKENS"]
