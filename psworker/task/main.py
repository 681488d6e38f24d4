"""The entry of one task process: a ps that serves until the workers are done, or a training worker.

Both return an exit code (see `psworker.errors`) or raise a `PsworkerError`; the CLI prints the error and leaves
the process through `hard_exit.exit_now`, the one hard exit (TensorFlow's gRPC threads can hang interpreter
teardown).
"""

from __future__ import annotations

from typing import Optional

import contextlib
import gc
import logging
import os
import sys
import time

from psworker import events, stackdump
from psworker.errors import EXIT_OK, LeftJob, UsageError
from psworker.spec import ClusterSpec, TrainConfig, fast_path
from psworker.tf_import import import_tensorflow

log = logging.getLogger(__name__)

CHIEF_NEEDS_TRAIN_DIR = ("worker 0 (the chief) needs --train_dir (or train.train_dir in the spec): where it writes "
                         "checkpoints, and where a restarted chief resumes from")


def dump_stacks_on_signal() -> None:
    """From now on `stackdump.SIGNAL` (SIGUSR1) writes every thread's Python stack into this task's log (stderr)
    and the task goes on: the launcher asks for it before it stops a stalled or remaining task; by hand, `kill
    -USR1 PID`. Called before the task prints anything; its first line (`events.StacksReady`) tells the launcher.
    Nothing when stderr is no file or this is not the main thread (a task run in-process, e.g. by a test)."""
    try:
        stackdump.dump_on_signal(sys.stderr)
    except (AttributeError, ValueError, OSError) as err:     # io.UnsupportedOperation is both of the last two
        log.debug("no stack dump on %s: %s", stackdump.SIGNAL.name, err)
        return
    print(events.StacksReady(os.getpid()).render(), file=sys.stderr, flush=True)


def _import_tensorflow(name: str):
    # TF's C++ INFO lines (oneDNN, CPU features) drown the training log; warnings and errors still show.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    started = time.time()
    tf = import_tensorflow()   # without Keras and scikit-learn (psworker/tf_import.py)
    tf.compat.v1.disable_eager_execution()
    log.info("%s", events.TfImported(name, time.time() - started).render())
    # What is alive now lives as long as the process: out of the garbage collector's reach with it. A task holds
    # ~340,000 objects once TensorFlow is imported and its graph built; each full collection walked them all, ~0.2 s
    # each time one came due during start-up (issue #9). The runner freezes again once the graph is built.
    gc.freeze()
    return tf


def run_ps(spec: ClusterSpec, index: int, *, keep_running: bool = False, workers_gone_timeout_secs: float = 300.0,
           rejoin_grace_secs: Optional[float] = None, allow_public_bind: bool = False) -> int:
    """Starts ps `index` and serves until every worker is done (forever with `keep_running`), or until a SIGINT or
    SIGTERM and then the chief's exit (`task.stop`: 128 + the signal's number).

    Returns:
        EXIT_OK: every worker said it was done, or none has been up for `workers_gone_timeout_secs` and the
        spec's train_dir holds a checkpoint at `max_steps` (e.g. this ps was restarted after training ended).

    Raises:
        PeerGone: every worker has been down (gone, or never seen) for `workers_gone_timeout_secs` without saying
            it was done, and training is not known to be complete.
    """
    from psworker.task.stop import StopOnSignal, StoppedBySignal, ps_wait_secs

    dump_stacks_on_signal()
    name = f"ps:{index}"
    StopOnSignal(name, f"serving until worker:0 (the chief) has exited, its checkpoint written (at most "
                       f"{ps_wait_secs(spec.train.step_timeout_secs):g} s)").install()
    try:
        return _ps(spec, index, name, keep_running, workers_gone_timeout_secs, rejoin_grace_secs, allow_public_bind)
    except StoppedBySignal as stopped:
        log.warning("%s", stopped)
        return stopped.exit_code


def _ps(spec: ClusterSpec, index: int, name: str, keep_running: bool, workers_gone_timeout_secs: float,
        rejoin_grace_secs: Optional[float], allow_public_bind: bool) -> int:
    from psworker.task import server as srv
    from psworker.task import done_queue, shutdown

    srv.check_bind_safety(spec.ps[index], allow_public=allow_public_bind)
    _import_tensorflow(name)
    from psworker.train import devices

    threads = devices.log_threads(name, devices.thread_budget(spec, "ps", index))
    server = srv.start_server(spec, "ps", index, config=devices.ps_server_config(threads))
    reader = done_queue.DoneReader(server.target, "ps", index, len(spec.worker))
    if keep_running:
        log.info("%s: --keep_ps_running: serving until stopped", name)
        while True:   # drain each run's done tokens so that the queue never fills
            shutdown.serve_ps_until_workers_done(server.target, spec, index, wait_for_exit=False, reader=reader)
            log.info("%s", events.PsDone(name, still_serving=True).render())
    grace = shutdown.VANISHED_GRACE_SECS if rejoin_grace_secs is None else rejoin_grace_secs
    how = shutdown.serve_ps_until_workers_done(server.target, spec, index, gone_timeout_secs=workers_gone_timeout_secs,
                                               reader=reader, rejoin_grace_secs=grace)
    log.info("%s", events.PsDone(name, training_complete=how == shutdown.PS_COMPLETE, peak_rss=_peak_rss()).render())
    return EXIT_OK


def _peak_rss() -> Optional[int]:
    """This process's peak resident memory in bytes (Linux counts ru_maxrss in KiB); None elsewhere."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 if sys.platform.startswith("linux") else None


def run_worker(spec: ClusterSpec, index: int, config: TrainConfig, *, allow_public_bind: bool = False) -> int:
    """Starts worker `index`'s server (one CPU device per tower), then trains in the configured replication: every
    between-graph worker and the in-graph client through `runner.run`; other in-graph workers serve until the client
    is done.

    Returns:
        EXIT_OK once training (and, for the chief, the final evaluation) is done and the ps tasks were told; an
        elastic job's worker that left on a signal: `LeftJob`'s code (0 scaled away, `EXIT_PREEMPTED` preempted).
    """
    from psworker.task.stop import StopOnSignal, StoppedBySignal

    dump_stacks_on_signal()
    membership = None
    if spec.elastic is not None and index != 0:   # from the start: a leave signal must never kill it
        from psworker.task.leave import Member
        membership = Member(spec, index)
        membership.signals.install()
    else:    # SIGINT, SIGTERM: after the running step (the chief then writes a checkpoint)
        StopOnSignal(f"worker:{index}", "stopping after the running step" + (
            "; then writing a checkpoint" if index == 0 else "")).install()
    try:
        with _chief_lock(index, config):
            return _worker(spec, index, config, allow_public_bind, membership)
    except LeftJob as left:   # an elastic job's worker, scaled away or preempted: not an error
        log.info("%s", left)
        return left.exit_code
    except StoppedBySignal as stopped:
        log.warning("%s", stopped)
        return stopped.exit_code


def _chief_lock(index: int, config: TrainConfig):
    """The chief holds its train dir's lock (`traindir_lock`), unless the launcher that started it does; refused
    (UsageError) at once while another run holds it."""
    from psworker import traindir_lock

    if index != 0 or config.train_dir is None:
        return contextlib.nullcontext()
    return traindir_lock.chief_lock(config.train_dir)


def _worker(spec: ClusterSpec, index: int, config: TrainConfig, allow_public_bind: bool, membership) -> int:
    from psworker.task import server as srv

    name = f"worker:{index}"
    srv.check_bind_safety(spec.worker[index], allow_public=allow_public_bind)
    if index == 0 and config.train_dir is None:
        raise UsageError(CHIEF_NEEDS_TRAIN_DIR)
    _import_tensorflow(name)
    from psworker.train import devices

    threads = devices.log_threads(name, devices.thread_budget(spec, "worker", index))
    config, server_config = devices.for_worker(config, name, threads)   # --num_devices auto: every visible GPU
    config = fast_path.resolve(config)   # pack_transfers, concurrent_steps auto: decided by the plan's rule
    server = srv.start_server(spec, "worker", index, config=server_config)
    from psworker.task import done_queue, replication, runner, shutdown
    from psworker.train.ingraph import CLIENT_INDEX

    if config.replication != "in-graph":
        runner.run(server, spec, index, config, replication.between_graph(spec, index, config, membership))
    elif index == CLIENT_INDEX:
        if config.mode == "sync" or config.replicas_to_aggregate:
            log.warning("%s: in-graph replication is synchronous by construction; mode=%s and replicas_to_aggregate "
                        "are ignored", name, config.mode)
        runner.run(server, spec, index, config, replication.in_graph(spec, config))
    else:
        log.info("%s: in-graph replication: serving for the client worker:%d", name, CLIENT_INDEX)
        shutdown.serve_until_client_done(server.target, spec, index, CLIENT_INDEX,
                                         client_gone_secs=config.startup_timeout_secs)
        log.info("%s: the client is done; exiting", name)
        done_queue.signal_done(server.target, spec, index)
    return EXIT_OK


__all__ = ["run_ps", "run_worker", "dump_stacks_on_signal", "CHIEF_NEEDS_TRAIN_DIR"]
