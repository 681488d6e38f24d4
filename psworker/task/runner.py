"""The one training runner of a worker, for both replications: the graph and its scaffold, the session (its hooks
and creator: `psworker.task.session_setup`), the step loop, the final evaluation, and telling the other tasks that
it is done.

What differs between replications comes in a `Replication` (`psworker.task.replication`: `between_graph`,
`in_graph`).
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
from typing import Callable, Optional

from psworker import environment, errorfile, events
from psworker.deadline import poll_until
from psworker.errors import (AlreadyComplete, LeftJob, StartupTimeout, StepTimeout, StoppedEarly, TrainingFailed,
                             op_error_line)
from psworker.models.base import Model
from psworker.spec import ClusterSpec, TrainConfig
from psworker.task import server as srv
from psworker.task import done_queue, probe, stop
from psworker.task.peers import SyncPeerWatch
from psworker.task.extra_steps import ExtraSteps
from psworker.task.hard_exit import exit_now
from psworker.task.replication import Replication
from psworker.task.session_setup import MAX_CHECKPOINTS, first_choice, hooks_of, session_creator
from psworker.task.sync_stop import token_release
from psworker.train.graph import TrainGraph

log = logging.getLogger(__name__)

WATCHDOG_AFTER_SECS = 10.0
GIVE_UP_GRACE_SECS = 5.0   # a step past its deadline that TensorFlow did not end: the watchdog ends the process


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
    others = {n: a for n, a in srv.task_addresses(spec, ("worker",)).items() if n != name}
    try:
        result = _train(server.target, config, model, replication, index, name, emit, others)
    except LeftJob:
        replication.membership.tell_left(server.target)
        raise
    except AlreadyComplete as exc:   # the ps tasks are gone and the train_dir says training ended
        log.info("%s", exc)
        if replication.is_chief:
            _evaluate_and_export(model, config, name, emit)
        return TrainResult(global_step=exc.global_step, local_steps=0, seconds=0.0)
    except tf.errors.DeadlineExceededError as exc:
        raise StartupTimeout(f"{name}: timed out: {op_error_line(exc)}") from None
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


def _train(target: str, config: TrainConfig, model: Model, replication: Replication, index: int, name: str,
           emit, others: dict) -> TrainResult:
    """The session and its step loop; the sessions are left open at the end (the process leaves soon after). On a
    stop (`task.stop`), `_saved_on_stop`; `others`: the other workers' addresses."""
    import tensorflow as tf

    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        if config.seed is not None:
            v1.set_random_seed(config.seed)
        dealing = replication.dealing(target, model, config) if replication.dealing is not None else None
        tg = replication.build(model, config, dealing)
        scaffold = _scaffold(tg)
        choice = first_choice(config) if replication.is_chief else None   # before a hook writes to train_dir
        grace = environment.seconds(environment.GIVE_UP_ENV, GIVE_UP_GRACE_SECS)   # past a step's deadline
        extra = ExtraSteps(config.concurrent_steps - 1, tg.train_op, _step_options(config)[1], name,
                           join_secs=config.step_timeout_secs + grace, global_step=tg.global_step,
                           last_step=config.max_steps, claimed=tg.claimed)
        progress, hooks = hooks_of(config, tg, scaffold, replication, index, name, emit, choice.kept if choice else (),
                                   extra_steps=lambda: extra.steps)
        watchdog = _watchdog(config, replication, name, grace)
        creator = session_creator(target, config, tg, scaffold, replication, name, watchdog, choice)
        release = token_release(name, replication.is_chief, tg.sync_optimizer, lambda: creator.current,
                                watchdog.running_for)
        gc.freeze()   # the graph lives as long as the process (see task.main._import_tensorflow)
        started = time.monotonic()
        # stop_grace_period_secs=0: TF waits 120 s for the sync queue-runner thread otherwise.
        with _saved_on_stop(replication, config, name, progress), \
                v1.train.MonitoredSession(session_creator=creator, hooks=hooks, stop_grace_period_secs=0) as sess:
            if replication.membership is not None and not sess.should_stop():   # stopping: training is complete
                replication.membership.join(target)
            try:
                with watchdog, _peer_watch(replication, config, name) as peers, extra, release:
                    _run_steps(sess, tg, config, creator, watchdog, name, replication.timeout_message, peers,
                               leave=replication.membership.signals if replication.membership else None,
                               tasks=replication.wait_for, extra=extra)
            except v1.train.NanLossDuringTrainingError:
                raise TrainingFailed(f"{name}: the loss became NaN (lower --learning_rate?)") from None
            finally:
                creator.abandon_on_close()
                errorfile.note_step(progress.last_global_step)    # for a failure's record, if one follows
            log.info("%s: last step done (%d local steps%s)", name, progress.local_steps + extra.steps,
                     f", {extra.steps} of them by the helpers" if config.concurrent_steps > 1 else "")
            _wait_for_others_to_stop(others if replication.is_chief and tg.sync_optimizer is None else {}, name)
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
    return TrainResult(global_step=final, local_steps=progress.local_steps + extra.steps,
                       seconds=time.monotonic() - started)


def _scaffold(tg: TrainGraph):
    """The scaffold: `saving.saver`, and with dealt shards an input each new session starts from the ps's position."""
    import tensorflow as tf

    from psworker.train import saving

    v1 = tf.compat.v1
    registered = v1.get_collection(v1.GraphKeys.LOCAL_INIT_OP)
    local_init = (None if tg.input_init is None
                  else tf.group(registered[0] if registered else v1.train.Scaffold.default_local_init_op(),
                                tg.input_init))
    return v1.train.Scaffold(saver=saving.saver(max_to_keep=MAX_CHECKPOINTS, save_relative_paths=True),
                             local_init_op=local_init)


@contextlib.contextmanager
def _saved_on_stop(replication: Replication, config: TrainConfig, name: str, progress):
    """Around the session: once a SIGINT or SIGTERM has ended the step loop after its running step, `StoppedBySignal`
    naming the checkpoint the chief's saver wrote as the session closed (or the error that kept it from writing one)."""
    stopper = stop.current()
    try:
        yield
    except stop.StoppedBySignal:
        raise
    except Exception as exc:   # noqa: BLE001 - the stop's line says why nothing was saved; the task exits anyway
        if not stopper.stopping:
            raise
        what = "no checkpoint written" if replication.is_chief else "its step was not finished"
        raise stopper.stopped(f"{what}: {op_error_line(exc)}") from exc
    if not stopper.stopping:
        return
    step = progress.final_global_step if progress.final_global_step is not None else progress.last_global_step
    if not replication.is_chief:
        raise stopper.stopped(f"after its running step (global step {step})")
    from psworker.train import checkpoints

    saved = next((f for f in checkpoints.find(config.train_dir) if f"{f.name}.index" in f.files), None)
    if saved is None or saved.step < step:
        newest = f"the newest is of step {saved.step}" if saved else "there is none"
        raise stopper.stopped(f"no checkpoint of step {step} written ({newest} in {config.train_dir})")
    log.info("%s", events.StopSaved(name, stopper.signal_name, saved.step, config.train_dir).render())
    raise stopper.stopped(f"checkpoint of global step {saved.step} written")


def _wait_for_others_to_stop(others: dict, name: str) -> None:
    """The async chief, stopping (else nothing): waits (at most `stop.peers_stop_secs()`) for the other workers that
    are up to stop too (their ports closed), so that their last steps are in its checkpoint."""
    from psworker.task import shutdown

    if not stop.current().stopping:
        return
    up = {n: a for n, a in others.items() if shutdown.port_open(a)}
    if not up:
        return
    wait_secs, started = stop.peers_stop_secs(), time.monotonic()
    log.info("%s: waiting up to %g s for %s to stop before writing the checkpoint", name, wait_secs, ", ".join(up))

    def all_closed() -> bool:
        for n in [n for n, a in up.items() if not shutdown.port_open(a)]:
            up.pop(n)
        return not up

    if poll_until(all_closed, wait_secs, interval=0.1):
        log.info("%s: the other workers stopped in %.1f s", name, time.monotonic() - started)
    else:
        log.warning("%s: %s still up after %g s; writing the checkpoint now (their later steps are not in it)", name,
                    ", ".join(up), wait_secs)


def _report_data(client, name: str) -> None:
    """The chief's line of what was dealt: examples trained, trained again, epochs, sync batches dropped."""
    from psworker.train import shard_plan

    plan, state = client.dealing.plan, client.state()
    log.info("%s", events.DataDealt(name, *shard_plan.report(plan, state), plan.num_epochs, plan.num_examples,
                                    int(state["dropped"])).render())


def _watchdog(config: TrainConfig, replication: Replication, name: str, grace: float):
    """The step loop's watchdog: its warnings name the peers that do not answer a probe (probed in its thread), and
    it ends the process (`_give_up`) when a step outlives its deadline by `grace` (GIVE_UP_GRACE_SECS by default)."""
    from psworker.train.hooks import StepWatchdog

    tasks = replication.wait_for
    watch_secs = min(environment.seconds(environment.SLOW_STEP_ENV, WATCHDOG_AFTER_SECS), config.step_timeout_secs / 2)
    return StepWatchdog(name, replication.hint, after_secs=watch_secs, every_secs=watch_secs,
                        diagnose=lambda secs: probe.describe(probe.probe_all(tasks), secs),
                        give_up=lambda secs: _give_up(replication.timeout_message, tasks, secs),
                        grace_secs=grace)


def _give_up(base: str, tasks: dict, running_secs: float) -> None:
    """From the watchdog's thread, for a step that TensorFlow left running past its deadline (a session closed or
    made on a peer that does not answer has no deadline): the error, as a step timeout's, then exit 170. The main
    thread is inside TensorFlow; ending the process is what a `kill` would do. No ps is told that this worker is
    done: it is to be restarted."""
    log.error("the step has run %.0f s, past its deadline; TensorFlow did not end it: ending the process",
              running_secs)
    error = _step_timeout(_timeout_message(base, probe.probe_all(tasks), running_secs))
    exit_now(errorfile.report(error, error.exit_code))


def _timeout_message(base: str, probed: list, running_secs: float) -> str:
    """A step timeout's message with what the probes of its peers found."""
    found = probe.describe(probed, running_secs)
    return f"{base} ({found})" if found else base


def _peer_watch(replication: Replication, config: TrainConfig, name: str):
    if replication.peers is None:
        return contextlib.nullcontext()
    return SyncPeerWatch(name, replication.peers, needed=replication.needed, down_secs=config.step_timeout_secs,
                         never_seen_secs=config.step_timeout_secs + config.startup_timeout_secs)


def _step_options(config: TrainConfig) -> tuple:
    """(the first step's RunOptions, every other step's): each bounded by `--step_timeout_secs`; the first step of
    a (re-created) session may wait for other workers to start, and is allowed for that as well."""
    import tensorflow as tf

    v1 = tf.compat.v1
    return (v1.RunOptions(timeout_in_ms=int((config.step_timeout_secs + config.startup_timeout_secs) * 1000)),
            v1.RunOptions(timeout_in_ms=int(config.step_timeout_secs * 1000)))


def _run_steps(sess, tg: TrainGraph, config: TrainConfig, creator, watchdog, name: str, timeout_message: str,
               peers: Optional[SyncPeerWatch] = None, leave=None, tasks: Optional[dict] = None,
               extra: Optional[ExtraSteps] = None) -> None:
    """One `train_op` per step, each bounded by `--step_timeout_secs` (TensorFlow's deadline, and the watchdog's
    behind it), and (sync) while enough workers are up; returns when the session says stop, or after the step in
    which a leave signal came (`leave.reason`). A timed-out step's error names the `tasks` that did not answer a
    probe. After each step, `extra`'s helpers are told the session it ran on."""
    import tensorflow as tf

    first, steady = _step_options(config)
    seen_session = -1
    stopper = stop.current()
    while not sess.should_stop() and (leave is None or leave.reason is None) and not stopper.stopping:
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
            # A dealt input's deal is over, or (sync) the chief closed the token queue; the final step tells more.
            log.info("%s: %s", name, "the input ran out: the deal is over" if tg.dealer is not None and
                     tg.dealer.exhausted else "the sync token queue was closed: the chief has stopped"
                     if tg.sync_optimizer is not None else "the input ran out (OutOfRangeError)")
            return
        finally:
            watchdog.step_finished()
        seen_session = creator.sessions_created
        if extra is not None:
            extra.stepped(creator.current)
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


__all__ = ["TrainResult", "run"]
