"""The one training runner of a worker, for both replications: scaffold and saver, hooks, session, the step loop,
the final evaluation, and telling the other tasks that it is done.

What differs between replications comes in a `Replication` (`between_graph`, `in_graph`).
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from psworker import events
from psworker.errors import AlreadyComplete, LeftJob, StartupTimeout, StepTimeout, StoppedEarly, TrainingFailed
from psworker.models.base import Model
from psworker.spec import ClusterSpec, TrainConfig
from psworker.task import server as srv
from psworker.task import done_queue, shutdown
from psworker.task.leave import Member
from psworker.task.peers import SyncPeerWatch
from psworker.train import graph
from psworker.train.graph import SYNC_INIT_TOKENS, TrainGraph
from psworker.train.ingraph import CLIENT_INDEX, build_in_graph_train_graph

log = logging.getLogger(__name__)

DEFAULT_SAVE_CHECKPOINT_SECS = 60.0
MAX_CHECKPOINTS = 5
WATCHDOG_AFTER_SECS = 10.0


@dataclass(frozen=True)
class Replication:
    """What one replication tells the runner.

    Attributes:
        build: builds the training graph in the default graph: `(model, config) -> TrainGraph`.
        is_chief: initialises or restores the model, writes checkpoints and summaries, evaluates at the end.
        examples_per_step: examples one run of the train op consumes (for the progress line).
        session_config: the `ConfigProto` of the training session.
        wait_for: `{name: "host:port"}` of the tasks that must answer before each session is created.
        hint: what a slow step may be waiting for (the watchdog's message).
        timeout_message: the `StepTimeout` message when a step exceeds `--step_timeout_secs`.
        release: `release(target)` once training is over, before the final evaluation (in-graph: frees the
            serving workers).
        workers: the between-graph workers (each moves the global step); 1 for the in-graph client.
        peers: the sync between-graph chief: `{index: "host:port"}` of the other workers, watched while
            training (`SyncPeerWatch`); None otherwise.
        needed: sync: the workers each step needs gradients from.
        membership: an elastic job's non-chief worker: tells the ps tasks when it joins and leaves.
    """

    build: Callable[[Model, TrainConfig], TrainGraph]
    is_chief: bool
    examples_per_step: int
    session_config: object
    wait_for: dict
    hint: str
    timeout_message: str
    release: Optional[Callable[[str], None]] = None
    workers: int = 1   # the most the global step advances per step of this runner (async: one per worker)
    peers: Optional[dict] = None
    needed: int = 0
    membership: Optional[Member] = None       # an elastic job's non-chief: joins, and leaves on a signal


@dataclass(frozen=True)
class TrainResult:
    """What one worker did: the global step at its end and how many steps it ran itself."""

    global_step: int
    local_steps: int
    seconds: float


def run(server, spec: ClusterSpec, index: int, config: TrainConfig, replication: Replication, *,
        emit=print) -> TrainResult:
    """Trains worker `index` until the global step reaches `max_steps`, evaluates (chief), and tells every ps.

    Also when a step times out or training stops early, the ps tasks are told (this worker will not come back by
    itself), and the error is raised.

    Raises:
        StartupTimeout: the tasks in `replication.wait_for` or the chief's model did not come up in time.
        StepTimeout: a step took longer than `--step_timeout_secs`.
        StoppedEarly: the loop ended below `max_steps`.
        TrainingFailed: the loss became NaN.
    """
    import tensorflow as tf

    from psworker import models

    name = f"worker:{index}"
    model = models.get(config.model)
    if replication.is_chief:
        os.makedirs(config.train_dir, exist_ok=True)
    try:
        result = _train(server.target, config, model, replication, index, name, emit)
    except LeftJob:
        replication.membership.tell_left(server.target)
        raise
    except AlreadyComplete as exc:   # the ps tasks are gone and the train_dir says training ended
        log.info("%s", exc)
        if replication.is_chief:
            _evaluate_and_export(model, config, name, emit)
        return TrainResult(global_step=exc.global_step, local_steps=0, seconds=0.0)
    except tf.errors.DeadlineExceededError as exc:
        raise StartupTimeout(f"{name}: timed out: {exc.message.splitlines()[0]}") from None
    except (StepTimeout, StoppedEarly):
        if replication.release is not None:
            replication.release(server.target)
        done_queue.signal_done(server.target, spec, index, timeout_secs=done_queue.SEND_DONE_AFTER_FAILURE_SECS)
        raise
    if result.local_steps:
        log.info("%s", events.WorkerDone(name, result.global_step, result.local_steps, result.seconds).render())
    else:
        log.info("%s", events.FoundComplete(name, result.global_step, config.max_steps).render())
    if replication.release is not None:
        replication.release(server.target)
    if replication.is_chief:
        _evaluate_and_export(model, config, name, emit)
    # Last: a ps waits for every worker's port to close before it exits, so this cannot race it.
    done_queue.signal_done(server.target, spec, index)
    return result


def _evaluate_and_export(model: Model, config: TrainConfig, name: str, emit) -> None:
    """The chief's end: precision@1 of the last checkpoint (also a summary), then a SavedModel of it."""
    from psworker.train import evaluate, export, summaries

    checkpoint = evaluate.latest_checkpoint(config.train_dir)
    if not checkpoint:
        return
    result = evaluate.evaluate_checkpoint(model, checkpoint, data_dir=config.data_dir)
    summaries.write_eval_summary(config.train_dir, result.precision, result.global_step)
    try:
        export.export_saved_model(model, checkpoint, os.path.join(config.train_dir, export.EXPORT_SUBDIR))
    except export.ExportExistsError as exc:   # a restarted chief that ends at the same step
        log.info("%s: %s", name, exc)
        if exc.path:   # the run's report names the SavedModel from this line
            step = export.checkpoint_global_step(checkpoint)
            log.info("%s", events.Exported(checkpoint, step, exc.path).render())
    emit(evaluate.format_result(result), flush=True)   # last: the run's result line


def _hooks(config: TrainConfig, tg: Any, scaffold: Any, replication: Replication, index: int, name: str,
           emit) -> tuple[Any, list]:
    """The step loop's hooks: (the one per-step hook, every hook)."""
    from psworker.train.hooks import TrainLoopHook

    # One hook per step: the chief's savers run inside it, on its check steps only (docs/performance.md).
    progress = TrainLoopHook(tg.loss, tg.global_step, last_step=config.max_steps,
                             every_steps=config.log_every_steps, examples_per_step=replication.examples_per_step,
                             gated=chief_hooks(config, scaffold, name) if replication.is_chief else (),
                             align_steps=(config.log_every_steps, config.save_checkpoint_steps),
                             stride=replication.workers, emit=emit, name=name)
    hooks = [progress]
    if tg.sync_optimizer is not None:
        hooks.append(tg.sync_optimizer.make_session_run_hook(replication.is_chief, num_tokens=SYNC_INIT_TOKENS))
    if config.train_dir is not None:
        from psworker.train.summaries import WorkerSummaryHook, worker_dir

        hooks.append(WorkerSummaryHook(index, loss=tg.loss, learning_rate=tg.learning_rate,
                                       global_step=tg.global_step, logdir=worker_dir(config.train_dir, index),
                                       every_steps=max(1, config.log_every_steps),
                                       examples_per_step=replication.examples_per_step))
    return progress, hooks


def _session_creator(target: str, config: TrainConfig, tg: Any, scaffold: Any, replication: Replication,
                     name: str) -> Any:
    """The session creator: waits for the peers (or finds training complete on disk), then restores or starts."""
    from psworker.train.session import FastSessionCreator

    def wait_for_peers() -> None:
        srv.wait_for_tasks(replication.wait_for, timeout_secs=config.startup_timeout_secs, who=name,
                           meanwhile=_CompleteOnDisk(config, name))

    on_live_model = (_sync_reset_on_restart(tg.sync_reset, name)
                     if replication.is_chief and tg.sync_reset is not None else None)
    return FastSessionCreator(
        scaffold, master=target, config=replication.session_config, is_chief=replication.is_chief,
        checkpoint_dir=config.train_dir if replication.is_chief else None,
        max_wait_secs=config.startup_timeout_secs, name=name, before_create=wait_for_peers,
        on_live_model=on_live_model, warm_up=tg.inputs,
    )


def _train(target: str, config: TrainConfig, model: Model, replication: Replication, index: int, name: str,
           emit) -> TrainResult:
    """The session and its step loop; the sessions are left open at the end (the process leaves soon after)."""
    import tensorflow as tf

    from psworker.train.hooks import StepWatchdog

    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        if config.seed is not None:
            v1.set_random_seed(config.seed)
        tg = replication.build(model, config)
        scaffold = v1.train.Scaffold(saver=v1.train.Saver(sharded=True, max_to_keep=MAX_CHECKPOINTS,
                                                          save_relative_paths=True))
        progress, hooks = _hooks(config, tg, scaffold, replication, index, name, emit)
        creator = _session_creator(target, config, tg, scaffold, replication, name)
        gc.freeze()   # the graph lives as long as the process (see task.main._import_tensorflow)
        started = time.monotonic()
        watch_secs = min(WATCHDOG_AFTER_SECS, config.step_timeout_secs / 2)
        # stop_grace_period_secs=0: TF waits 120 s for the sync queue-runner thread otherwise.
        with v1.train.MonitoredSession(session_creator=creator, hooks=hooks, stop_grace_period_secs=0) as sess:
            if replication.membership is not None and not sess.should_stop():   # stopping: training is complete
                replication.membership.join(target)
            try:
                with StepWatchdog(name, replication.hint, after_secs=watch_secs, every_secs=watch_secs) as watchdog, \
                        _peer_watch(replication, config, name) as peers:
                    _run_steps(sess, tg, config, creator, watchdog, name, replication.timeout_message, peers,
                               leave=replication.membership.signals if replication.membership else None)
            except v1.train.NanLossDuringTrainingError:
                raise TrainingFailed(f"{name}: the loss became NaN (lower --learning_rate?)") from None
            finally:
                creator.abandon_on_close()
            log.info("%s: last step done (%d local steps)", name, progress.local_steps)
    if replication.membership is not None and replication.membership.signals.reason is not None:
        raise replication.membership.signals.left()
    final = progress.final_global_step if progress.final_global_step is not None else progress.last_global_step
    if final < config.max_steps:
        why = ("the chief closed the sync token queue (did it fail or stop early?)" if tg.sync_optimizer is not None
               else "the input ran out")
        raise StoppedEarly(f"{name}: training stopped at global step {final}, before --max_steps {config.max_steps}: "
                           f"{why}")
    return TrainResult(global_step=final, local_steps=progress.local_steps, seconds=time.monotonic() - started)


class _CompleteOnDisk:
    """While a worker waits for its ps tasks: raises `AlreadyComplete` once the train_dir's newest checkpoint is at
    `--max_steps` (the ps tasks left after training ended). Reads the train_dir at most every `every_secs`."""

    def __init__(self, config: TrainConfig, name: str, *, every_secs: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        self._config, self._name, self._every, self._clock = config, name, every_secs, clock
        self._next = clock()

    def __call__(self) -> None:
        if self._clock() < self._next:
            return
        self._next = self._clock() + self._every
        step = shutdown.checkpoint_at_max_steps(self._config.train_dir, self._config.max_steps)
        if step is not None:
            found = events.FoundComplete(self._name, step, self._config.max_steps, self._config.train_dir)
            raise AlreadyComplete(found.render(), global_step=step)


def _sync_reset_on_restart(sync_reset, name: str):
    """A chief that starts on live ps tasks clears the sync state a dead chief may have left mid-step."""

    def on_live_model(session) -> None:
        done = sync_reset.run(session)
        held = done["gradients_held"]
        log.info("%s: sync state reset on the live ps at global step %d: dropped the gradients the "
                 "accumulators held (%s%s) and %d stale tokens; queued %d tokens for the other workers",
                 name, done["global_step"], " ".join(map(str, held)),
                 "; unequal: the previous chief died inside a step" if len(set(held)) > 1 else "",
                 done["tokens_dropped"], done["tokens_queued"])

    return on_live_model


def _peer_watch(replication: Replication, config: TrainConfig, name: str):
    if replication.peers is None:
        return contextlib.nullcontext()
    return SyncPeerWatch(name, replication.peers, needed=replication.needed, down_secs=config.step_timeout_secs,
                         never_seen_secs=config.step_timeout_secs + config.startup_timeout_secs)


def _run_steps(sess, tg: TrainGraph, config: TrainConfig, creator, watchdog, name: str, timeout_message: str,
               peers: Optional[SyncPeerWatch] = None, leave=None) -> None:
    """One `train_op` per step, each bounded by `--step_timeout_secs`, and (sync) while enough workers are up;
    returns when the session says stop, or after the step in which a leave signal came (`leave.reason`)."""
    import tensorflow as tf

    steady = tf.compat.v1.RunOptions(timeout_in_ms=int(config.step_timeout_secs * 1000))
    # The first step of a (re-created) session may wait for other workers to start: allow for that as well.
    first = tf.compat.v1.RunOptions(
        timeout_in_ms=int((config.step_timeout_secs + config.startup_timeout_secs) * 1000))
    seen_session = -1
    while not sess.should_stop() and (leave is None or leave.reason is None):
        session_now = creator.sessions_created
        watchdog.step_started()
        try:
            sess.run(tg.train_op, options=first if session_now != seen_session else steady)
        except tf.errors.DeadlineExceededError:
            down = peers.describe_down() if peers is not None else ""
            raise _step_timeout(timeout_message + (f" (down now: {down})" if down else "")) from None
        except tf.errors.OutOfRangeError:
            # Sync mode: the chief closes the token queue when it stops (else: a finite input ran out). The global
            # step read at the end tells whether training is complete.
            log.info("%s: %s", name, "the sync token queue was closed: the chief has stopped"
                     if tg.sync_optimizer is not None else "the input ran out (OutOfRangeError)")
            return
        finally:
            watchdog.step_finished()
        seen_session = creator.sessions_created
        failure = peers.failure() if peers is not None else None
        if failure:
            raise _step_timeout(failure)


def _step_timeout(message: str) -> StepTimeout:
    """The error of a step that timed out, once every thread's stack is in the log (faulthandler's format,
    `psworker.stackdump`): the launcher's report shows where the main thread was."""
    log.error("%s; every thread's stack follows", message)
    sys.stderr.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    return StepTimeout(message)


def chief_hooks(config: TrainConfig, scaffold, name: str) -> list:
    """The chief's checkpoint saver, writing into `config.train_dir` (with the graph, for TensorBoard's Graphs
    dashboard: the train dir's own events file holds no scalars; they are the workers', see `train.summaries`)."""
    import tensorflow as tf

    from psworker.train.hooks import CheckpointLogger, ChiefCheckpointSaverHook

    v1 = tf.compat.v1
    every = ({"save_steps": config.save_checkpoint_steps} if config.save_checkpoint_steps
             else {"save_secs": config.save_checkpoint_secs or DEFAULT_SAVE_CHECKPOINT_SECS})
    return [ChiefCheckpointSaverHook(config.train_dir, scaffold=scaffold, listeners=[CheckpointLogger(name)], **every)]


def between_graph(spec: ClusterSpec, index: int, config: TrainConfig, membership: Optional[Member] = None
                  ) -> Replication:
    """What the runner needs to train worker `index` of a between-graph cluster (`membership`: an elastic job's
    non-chief worker's)."""
    name = f"worker:{index}"
    if config.mode == "sync":
        needed = config.replicas_to_aggregate or len(spec.worker)
        hint = (f"a sync step waits for gradients from {needed} of {len(spec.worker)} workers: is one down or slow? "
                f"(gives up after --step_timeout_secs {config.step_timeout_secs:g})")
        timeout = (f"{name}: a sync training step did not finish within {config.step_timeout_secs:g} s "
                   f"(--step_timeout_secs): each step needs gradients from "
                   f"{config.replicas_to_aggregate or 'all'} workers; is a worker down? Start it again (it rejoins), "
                   "or run with fewer --replicas_to_aggregate than workers so that the others can go on without it")
    else:
        hint = "is a ps task overloaded or unreachable?"
        timeout = (f"{name}: a training step did not finish within {config.step_timeout_secs:g} s "
                   "(--step_timeout_secs): is a ps task overloaded or unreachable?")
    cluster = spec.as_dict()
    # Only the chief watches (N-1 probes per interval, not N^2 across the cluster): it makes the tokens, so when it
    # stops the others' next steps time out.
    peers = ({i: str(a) for i, a in enumerate(spec.worker) if i != index}
             if config.mode == "sync" and index == 0 else None)
    return Replication(
        build=lambda model, cfg: graph.build_train_graph(model, cfg, cluster=cluster, task_index=index,
                                                         elastic=spec.elastic is not None),
        is_chief=index == 0, examples_per_step=config.batch_size * config.num_devices,
        session_config=srv.session_config("worker", index), wait_for=srv.task_addresses(spec, ("ps",)),
        hint=hint, timeout_message=timeout, workers=len(spec.worker),
        peers=peers, needed=config.replicas_to_aggregate or len(spec.worker),
        membership=membership,
    )


def in_graph(spec: ClusterSpec, config: TrainConfig) -> Replication:
    """What the runner needs to train the whole cluster from the client ."""
    name = f"worker:{CLIENT_INDEX}"
    num_workers = len(spec.worker)
    cluster = spec.as_dict()
    examples_per_step = config.batch_size * config.num_devices * num_workers
    log.info("%s: in-graph client for %d workers x %d towers, %d examples per step", name, num_workers,
             config.num_devices, examples_per_step)

    def release(target: str) -> None:   # the serving workers can go; each tells the ps tasks itself that it is done
        shutdown.release_workers(target, spec, CLIENT_INDEX)

    hint = ("each step needs every worker: is one down or slow? "
            f"(gives up after --step_timeout_secs {config.step_timeout_secs:g})")
    return Replication(
        build=lambda model, cfg: build_in_graph_train_graph(model, cfg, cluster=cluster),
        is_chief=True, examples_per_step=examples_per_step,
        # No device filters: this client places ops on every worker task.
        session_config=srv.session_config("worker", CLIENT_INDEX, filter_devices=False),
        wait_for=srv.task_addresses(spec, ("ps", "worker")), hint=hint,
        timeout_message=(f"{name}: an in-graph training step did not finish within {config.step_timeout_secs:g} s "
                         "(--step_timeout_secs): each step needs every worker; is one down?"),
        release=release,
    )


__all__ = ["Replication", "TrainResult", "run", "chief_hooks", "between_graph", "in_graph"]
