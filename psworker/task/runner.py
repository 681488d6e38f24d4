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
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from psworker import events
from psworker.errors import AlreadyComplete, LeftJob, StartupTimeout, StepTimeout, StoppedEarly, TrainingFailed
from psworker.models.base import Model
from psworker.spec import ClusterSpec, TrainConfig
from psworker.task import server as srv
from psworker.task import done_queue, probe, shutdown
from psworker.task.leave import Member
from psworker.task.peers import SyncPeerWatch
from psworker.train import graph
from psworker.train.graph import SYNC_INIT_TOKENS, TrainGraph
from psworker.train.ingraph import CLIENT_INDEX, build_in_graph_train_graph

log = logging.getLogger(__name__)

DEFAULT_SAVE_CHECKPOINT_SECS = 60.0
MAX_CHECKPOINTS = 5
WATCHDOG_AFTER_SECS = 10.0
GIVE_UP_GRACE_SECS = 5.0   # a step past its deadline that TensorFlow did not end: the watchdog ends the process


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
        dealing: makes what the graph needs to deal shards to this worker (`train.dealer`); None: static slices.
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
    # dealt shards: `(target, model, config) -> train.dealer.Dealing` (None: the static slices)
    dealing: Optional[Callable[[str, Model, TrainConfig], Any]] = None


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
    config = _epochs_as_steps(config, model, replication, name)
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
        _tell_done_after_failure(server.target, spec, index, name)
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


def _tell_done_after_failure(target: str, spec: ClusterSpec, index: int, name: str) -> None:
    """A worker that failed tells the ps tasks it is done (so that they do not wait for it), unless one of them does
    not answer: then the cluster is broken (a partition, a ps down) and this worker is to be restarted, so no ps may
    take it for finished. Bounded: the tokens' session is made in a thread given a few seconds."""
    at_fault = probe.at_fault(probe.probe_all(srv.task_addresses(spec, ("ps",))))
    if at_fault:
        log.warning("%s: not telling the ps tasks that it is done (it is to be restarted): %s", name,
                    probe.describe(at_fault))
        return
    _within(done_queue.SEND_DONE_AFTER_FAILURE_SECS + 3.0, f"{name}: telling the ps tasks that it is done",
            lambda: done_queue.signal_done(target, spec, index, timeout_secs=done_queue.SEND_DONE_AFTER_FAILURE_SECS))


def _within(secs: float, what: str, fn: Callable[[], None]) -> None:
    """Runs `fn` in a daemon thread and waits for it at most `secs` (a session made on a peer that stopped
    answering waits without a deadline; the process leaves soon after, through `os._exit`)."""
    thread = threading.Thread(target=fn, name="psworker-bounded", daemon=True)
    thread.start()
    thread.join(secs)
    if thread.is_alive():
        log.warning("%s did not end within %g s; going on without it", what, secs)


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
           emit, kept: tuple = ()) -> tuple[Any, list]:
    """The step loop's hooks: (the one per-step hook, every hook)."""
    from psworker.train.hooks import TrainLoopHook

    # One hook per step: the chief's savers run inside it, on its check steps only (docs/performance.md).
    progress = TrainLoopHook(tg.loss, tg.global_step, last_step=config.max_steps,
                             every_steps=config.log_every_steps, examples_per_step=replication.examples_per_step,
                             gated=chief_hooks(config, scaffold, name, kept) if replication.is_chief else (),
                             align_steps=(config.log_every_steps, config.save_checkpoint_steps),
                             stride=replication.workers, emit=emit, name=name,
                             epochs=None if tg.dealer is None else (tg.dealer_state.examples_trained,
                                                                    tg.dealer.dealing.plan.num_examples,
                                                                    config.num_epochs))
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


def _epochs_as_steps(config: TrainConfig, model: Model, replication: Replication, name: str) -> TrainConfig:
    """Sync mode with dealt shards and `num_epochs`: the global step that covers the epochs (each step applies
    `replicas_to_aggregate` batches), if below `max_steps`, becomes the last step; the deal itself never ends, so
    that no worker runs dry while a step still needs its gradient."""
    import dataclasses

    if config.mode != "sync" or config.num_epochs is None or replication.dealing is None \
            or config.replication == "in-graph":   # in-graph: the client's deal ends with the epochs
        return config
    per_step = (config.replicas_to_aggregate or replication.workers) * config.batch_size * config.num_devices
    steps = -(-config.num_epochs * model.num_train_examples(config.data_dir) // per_step)
    if steps >= config.max_steps:
        return config
    log.info("%s: sync mode: %d epochs of %d examples end at global step %d (%d examples per step)", name,
             config.num_epochs, model.num_train_examples(config.data_dir), steps, per_step)
    return dataclasses.replace(config, max_steps=steps)


def _session_creator(target: str, config: TrainConfig, tg: Any, scaffold: Any, replication: Replication,
                     name: str, watchdog, first_choice=None) -> Any:
    """The session creator: waits for the peers (or finds training complete on disk), then restores or starts. A
    session re-created inside a step (after a ps failure) gives that step time for the waits that follow."""
    from psworker.train.session import FastSessionCreator

    def wait_for_peers() -> None:
        watchdog.extend(2 * config.startup_timeout_secs + config.step_timeout_secs)
        srv.wait_for_tasks(replication.wait_for, timeout_secs=config.startup_timeout_secs, who=name,
                           meanwhile=_CompleteOnDisk(config, name))

    on_live_model = (_sync_reset_on_restart(tg.sync_reset, name)
                     if replication.is_chief and tg.sync_reset is not None else None)
    restore = None
    if tg.dealer_state is not None:
        from psworker.train import dealer

        def restore(sess, checkpoint: str) -> None:
            dealer.restore(scaffold.saver, sess, checkpoint, tg.dealer_state, name)

    return FastSessionCreator(
        scaffold, master=target, config=replication.session_config, is_chief=replication.is_chief,
        checkpoint_dir=config.train_dir if replication.is_chief else None,
        max_wait_secs=config.startup_timeout_secs, name=name, before_create=wait_for_peers,
        on_live_model=on_live_model, warm_up=tg.inputs, restore=restore, first_choice=first_choice,
        allow_fresh_start=config.allow_fresh_start,
    )


def _train(target: str, config: TrainConfig, model: Model, replication: Replication, index: int, name: str,
           emit) -> TrainResult:
    """The session and its step loop; the sessions are left open at the end (the process leaves soon after)."""
    import tensorflow as tf

    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        if config.seed is not None:
            v1.set_random_seed(config.seed)
        dealing = replication.dealing(target, model, config) if replication.dealing is not None else None
        tg = replication.build(model, config, dealing)
        # dealt shards: each new session starts the input again, from the data position on the ps
        local_init = (None if tg.input_init is None
                      else tf.group(v1.train.Scaffold.default_local_init_op(), tg.input_init))
        scaffold = v1.train.Scaffold(saver=v1.train.Saver(sharded=True, max_to_keep=MAX_CHECKPOINTS,
                                                          save_relative_paths=True), local_init_op=local_init)
        choice = _first_choice(config) if replication.is_chief else None   # before a hook writes to train_dir
        progress, hooks = _hooks(config, tg, scaffold, replication, index, name, emit, choice.kept if choice else ())
        watchdog = _watchdog(config, replication, name)
        creator = _session_creator(target, config, tg, scaffold, replication, name, watchdog, choice)
        gc.freeze()   # the graph lives as long as the process (see task.main._import_tensorflow)
        started = time.monotonic()
        # stop_grace_period_secs=0: TF waits 120 s for the sync queue-runner thread otherwise.
        with v1.train.MonitoredSession(session_creator=creator, hooks=hooks, stop_grace_period_secs=0) as sess:
            if replication.membership is not None and not sess.should_stop():   # stopping: training is complete
                replication.membership.join(target)
            try:
                with watchdog, _peer_watch(replication, config, name) as peers:
                    _run_steps(sess, tg, config, creator, watchdog, name, replication.timeout_message, peers,
                               leave=replication.membership.signals if replication.membership else None,
                               tasks=replication.wait_for)
            except v1.train.NanLossDuringTrainingError:
                raise TrainingFailed(f"{name}: the loss became NaN (lower --learning_rate?)") from None
            finally:
                creator.abandon_on_close()
            log.info("%s: last step done (%d local steps)", name, progress.local_steps)
    if replication.membership is not None and replication.membership.signals.reason is not None:
        if tg.dealer is not None:
            tg.dealer.give_back()
        raise replication.membership.signals.left()
    final = progress.final_global_step if progress.final_global_step is not None else progress.last_global_step
    if replication.is_chief and tg.dealer is not None:
        _report_data(tg.dealer, name)
    if final < config.max_steps and not (tg.dealer is not None and tg.dealer.exhausted):
        why = ("the chief closed the sync token queue (did it fail or stop early?)" if tg.sync_optimizer is not None
               else "the input ran out")
        raise StoppedEarly(f"{name}: training stopped at global step {final}, before --max_steps {config.max_steps}: "
                           f"{why}")
    return TrainResult(global_step=final, local_steps=progress.local_steps, seconds=time.monotonic() - started)


def _first_choice(config: TrainConfig):
    """The chief's checkpoint to restore (`train.checkpoints.choose`), chosen before anything is written to the
    train dir: checkpoint files there, none usable, and no `allow_fresh_start` raise `TrainingFailed` (exit 3)."""
    from psworker.train import checkpoints

    if not config.train_dir:
        return None
    choice = checkpoints.choose(config.train_dir, checkpoints.expected_variables())
    if choice.refused and not config.allow_fresh_start:
        raise checkpoints.refusal(config.train_dir, choice)
    return choice


def _report_data(client, name: str) -> None:
    """The chief's line of what was dealt: examples trained, trained again, epochs."""
    from psworker.train import dealer

    plan = client.dealing.plan
    trained, again, epochs = dealer.report(plan, client.state())
    log.info("%s", events.DataDealt(name, trained, again, epochs, plan.num_epochs, plan.num_examples).render())


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


def _watchdog(config: TrainConfig, replication: Replication, name: str):
    """The step loop's watchdog: its warnings name the peers that do not answer a probe (probed in its thread), and
    it ends the process (`_give_up`) when a step outlives its deadline by `GIVE_UP_GRACE_SECS`."""
    from psworker.train.hooks import StepWatchdog

    tasks = replication.wait_for
    watch_secs = min(WATCHDOG_AFTER_SECS, config.step_timeout_secs / 2)
    return StepWatchdog(name, replication.hint, after_secs=watch_secs, every_secs=watch_secs,
                        diagnose=lambda secs: probe.describe(probe.probe_all(tasks), secs),
                        give_up=lambda secs: _give_up(replication.timeout_message, tasks, secs),
                        grace_secs=GIVE_UP_GRACE_SECS)


def _give_up(base: str, tasks: dict, running_secs: float) -> None:
    """From the watchdog's thread, for a step that TensorFlow left running past its deadline (a session closed or
    made on a peer that does not answer has no deadline): the error, as a step timeout's, then exit 170. The main
    thread is inside TensorFlow; ending the process is what a `kill` would do. No ps is told that this worker is
    done: it is to be restarted."""
    from psworker.task.main import exit_now

    log.error("the step has run %.0f s, past its deadline; TensorFlow did not end it: ending the process",
              running_secs)
    error = _step_timeout(_timeout_message(base, probe.probe_all(tasks), running_secs))
    print(events.TaskError(str(error)).render(), file=sys.stderr, flush=True)
    exit_now(error.exit_code)


def _timeout_message(base: str, probed: list, running_secs: float) -> str:
    """A step timeout's message with what the probes of its peers found."""
    found = probe.describe(probed, running_secs)
    return f"{base} ({found})" if found else base


def _peer_watch(replication: Replication, config: TrainConfig, name: str):
    if replication.peers is None:
        return contextlib.nullcontext()
    return SyncPeerWatch(name, replication.peers, needed=replication.needed, down_secs=config.step_timeout_secs,
                         never_seen_secs=config.step_timeout_secs + config.startup_timeout_secs)


def _run_steps(sess, tg: TrainGraph, config: TrainConfig, creator, watchdog, name: str, timeout_message: str,
               peers: Optional[SyncPeerWatch] = None, leave=None, tasks: Optional[dict] = None) -> None:
    """One `train_op` per step, each bounded by `--step_timeout_secs` (TensorFlow's deadline, and the watchdog's
    behind it), and (sync) while enough workers are up; returns when the session says stop, or after the step in
    which a leave signal came (`leave.reason`). A timed-out step's error names the `tasks` that did not answer a
    probe."""
    import tensorflow as tf

    steady = tf.compat.v1.RunOptions(timeout_in_ms=int(config.step_timeout_secs * 1000))
    # The first step of a (re-created) session may wait for other workers to start: allow for that as well.
    first = tf.compat.v1.RunOptions(
        timeout_in_ms=int((config.step_timeout_secs + config.startup_timeout_secs) * 1000))
    seen_session = -1
    while not sess.should_stop() and (leave is None or leave.reason is None):
        options = first if creator.sessions_created != seen_session else steady
        watchdog.step_started(limit_secs=options.timeout_in_ms / 1000)
        try:
            sess.run(tg.train_op, options=options)
        except tf.errors.DeadlineExceededError:
            running = watchdog.running_for() or 0.0
            watchdog.step_finished()
            down = peers.describe_down() if peers is not None else ""
            message = timeout_message + (f" (down now: {down})" if down else "")
            raise _step_timeout(_timeout_message(message, probe.probe_all(tasks or {}), running)) from None
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


def chief_hooks(config: TrainConfig, scaffold, name: str, kept: tuple = ()) -> list:
    """The chief's checkpoint saver, writing into `config.train_dir` (with the graph, for TensorBoard's Graphs
    dashboard: the train dir's own events file holds no scalars; they are the workers', see `train.summaries`);
    `kept`: the checkpoints there, oldest first, that its rotation goes on from (`checkpoints.Choice.kept`)."""
    import tensorflow as tf

    from psworker.train.checkpoints import CheckpointKeeper
    from psworker.train.hooks import CheckpointLogger, ChiefCheckpointSaverHook

    v1 = tf.compat.v1
    every = ({"save_steps": config.save_checkpoint_steps} if config.save_checkpoint_steps
             else {"save_secs": config.save_checkpoint_secs or DEFAULT_SAVE_CHECKPOINT_SECS})
    keeper = CheckpointKeeper(config.train_dir, keep=MAX_CHECKPOINTS, kept=kept)
    return [ChiefCheckpointSaverHook(config.train_dir, scaffold=scaffold, keeper=keeper,
                                     listeners=[CheckpointLogger(name)], **every)]


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
        build=lambda model, cfg, dealing=None: graph.build_train_graph(model, cfg, cluster=cluster, task_index=index,
                                                                       elastic=spec.elastic is not None,
                                                                       dealing=dealing),
        is_chief=index == 0, examples_per_step=config.batch_size * config.num_devices,
        session_config=srv.session_config("worker", index), wait_for=srv.task_addresses(spec, ("ps",)),
        hint=hint, timeout_message=timeout, workers=len(spec.worker),
        peers=peers, needed=config.replicas_to_aggregate or len(spec.worker),
        membership=membership,
        dealing=(lambda target, model, cfg: _dealing(spec, index, cfg, model, target))
        if config.data_dealing == "dealt" else None,
    )


def _dealing(spec: ClusterSpec, index: int, config: TrainConfig, model: Model, target: str):
    """What worker `index`'s graph needs to take dealt shards. Sync mode: the deal never runs dry (the epochs end
    at a global step, `_epochs_as_steps`). The chief gives back the lease of a worker whose port has been closed
    for `shutdown.VANISHED_GRACE_SECS` when it waits for the last shards."""
    from psworker.train import dealer

    batch = config.batch_size * config.num_devices
    plan = dealer.make_plan(model.num_train_examples(config.data_dir), config.shard_examples,
                            None if config.mode == "sync" else config.num_epochs, batch)
    gone = None
    if index == 0:
        watch = shutdown.GoneWatch({i: str(a) for i, a in enumerate(spec.worker) if i != index})

        def gone(j: int) -> bool:
            watch.update()
            return watch.gone_for(j) >= shutdown.VANISHED_GRACE_SECS

    log.info("worker:%d: dealt shards of %d examples (%d per epoch of %d)%s", index, plan.shard_examples,
             plan.shards_per_epoch, plan.num_examples,
             f", {plan.num_epochs} epochs" if plan.num_epochs else "")
    return dealer.Dealing(plan=plan, index=index, num_workers=len(spec.worker), target=target,
                          session_config=srv.session_config("worker", index), is_chief=index == 0, seed=config.seed,
                          pad_to=batch if config.num_devices > 1 else 1, gone=gone)


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
        build=lambda model, cfg, dealing=None: build_in_graph_train_graph(model, cfg, cluster=cluster,
                                                                          dealing=dealing),
        is_chief=True, examples_per_step=examples_per_step,
        # No device filters: this client places ops on every worker task.
        session_config=srv.session_config("worker", CLIENT_INDEX, filter_devices=False),
        wait_for=srv.task_addresses(spec, ("ps", "worker")), hint=hint,
        timeout_message=(f"{name}: an in-graph training step did not finish within {config.step_timeout_secs:g} s "
                         "(--step_timeout_secs): each step needs every worker; is one down?"),
        release=release,
        dealing=(lambda target, model, cfg: _in_graph_dealing(cfg, model, target, num_workers))
        if config.data_dealing == "dealt" else None,
    )


def _in_graph_dealing(config: TrainConfig, model: Model, target: str, num_workers: int):
    """What the in-graph client needs to deal shards to itself, the one reader of every worker's batch
    (`train.ingraph`): the deal ends with the epochs; the last global batch is filled up to a whole one."""
    from psworker.train import dealer

    batch = config.batch_size * config.num_devices * num_workers
    plan = dealer.make_plan(model.num_train_examples(config.data_dir), config.shard_examples, config.num_epochs,
                            batch)
    log.info("worker:%d: dealt shards of %d examples (%d per epoch of %d)%s, read by the in-graph client for %d "
             "workers", CLIENT_INDEX, plan.shard_examples, plan.shards_per_epoch, plan.num_examples,
             f", {plan.num_epochs} epochs" if plan.num_epochs else "", num_workers)
    return dealer.Dealing(plan=plan, index=CLIENT_INDEX, num_workers=1, target=target,
                          session_config=srv.session_config("worker", CLIENT_INDEX, filter_devices=False),
                          is_chief=True, seed=config.seed, pad_to=batch if batch > config.batch_size else 1)


__all__ = ["Replication", "TrainResult", "run", "chief_hooks", "between_graph", "in_graph"]
