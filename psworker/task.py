"""The two task processes: a ps that serves variables until the workers are done, and a training worker."""

from __future__ import annotations

import logging
import os
import sys
import time

from psworker.errors import PsworkerError, StartupTimeout, UsageError
from psworker.spec import ClusterSpec, TrainConfig

log = logging.getLogger(__name__)

CHIEF_NEEDS_TRAIN_DIR = ("worker 0 (the chief) needs --train_dir (or train.train_dir in the spec): where it writes "
                         "checkpoints, and where a restarted chief resumes from")


def _quiet_tensorflow() -> None:
    # TF's C++ INFO lines (oneDNN, CPU features) drown the training log; warnings and errors still show.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")


def _exit_now(code: int) -> None:
    """Flushes what must be flushed and leaves without TF's slow interpreter teardown (~1 s, sometimes a hang)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_ps(spec: ClusterSpec, index: int, *, keep_running: bool = False, workers_gone_timeout_secs: float = 300.0,
           allow_public_bind: bool = False) -> int:
    """Starts ps `index` and serves; exits once every worker is done, unless `keep_running`.

    Exits 1 when every worker has gone away without saying it is done for `workers_gone_timeout_secs`.
    """
    from psworker import server as srv

    srv.check_bind_safety(spec.ps[index], allow_public=allow_public_bind)
    _quiet_tensorflow()
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    name = f"ps:{index}"
    server = srv.start_server(spec, "ps", index)

    def serve() -> None:
        if keep_running:
            log.info("%s: --keep_ps_running: serving until stopped", name)
            while True:   # drain each run's done tokens so that the queue never fills
                srv.serve_until_workers_done(server, spec, index, wait_for_exit=False, gone_timeout_secs=None)
                log.info("%s: every worker is done; still serving (--keep_ps_running)", name)
        srv.serve_until_workers_done(server, spec, index, gone_timeout_secs=workers_gone_timeout_secs)
        log.info("%s: every worker is done; exiting", name)

    _run_and_exit(name, serve)
    return 0  # not reached


def run_worker(spec: ClusterSpec, index: int, config: TrainConfig, *, allow_public_bind: bool = False) -> int:
    """Starts worker `index`'s server, trains, and (chief) evaluates; exits as soon as it is done.

    Errors are printed as `psworker: error: ...` (as the CLI does) and the process leaves at once with the error's
    exit code: a normal interpreter exit could wait on TensorFlow threads blocked on a dead peer.
    """
    from psworker import server as srv

    name = f"worker:{index}"
    srv.check_bind_safety(spec.worker[index], allow_public=allow_public_bind)
    if index == 0 and config.train_dir is None:
        raise UsageError(CHIEF_NEEDS_TRAIN_DIR)
    _quiet_tensorflow()
    import_started = time.time()
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    log.info("%s: TensorFlow imported in %.3f s", name, time.time() - import_started)
    _run_and_exit(name, lambda: _work(spec, index, config, name))
    return 0  # not reached


def _work(spec: ClusterSpec, index: int, config: TrainConfig, name: str) -> None:
    """Starts this worker's server (with one CPU device per tower), then trains in the configured replication."""
    from psworker import server as srv

    server_config = None
    if config.num_devices > 1:
        from psworker import towers

        server_config = towers.session_config_for_towers(config.num_devices)
    server = srv.start_server(spec, "worker", index, config=server_config)
    if config.replication == "in-graph":
        from psworker import ingraph

        ingraph.run_in_graph(server, spec, index, config)
    else:
        _train_and_signal(server, spec, index, config, name)


def _run_and_exit(name: str, work) -> None:
    """Runs `work()`, reports any failure, and leaves the process at once (TF threads can keep it alive)."""
    try:
        work()
    except PsworkerError as exc:
        print(f"psworker: error: {exc}", file=sys.stderr, flush=True)
        _exit_now(exc.exit_code)
    except KeyboardInterrupt:
        print("psworker: interrupted", file=sys.stderr, flush=True)
        _exit_now(130)
    except Exception:  # noqa: BLE001 - reported with its traceback, then the same prompt exit
        log.exception("%s failed", name)
        _exit_now(1)
    _exit_now(0)


def _train_and_signal(server, spec: ClusterSpec, index: int, config: TrainConfig, name: str) -> None:
    import tensorflow as tf

    from psworker import evaluate, models
    from psworker import server as srv
    from psworker.trainer import StepTimeout, StoppedEarly, train

    is_chief = index == 0
    if is_chief:
        os.makedirs(config.train_dir, exist_ok=True)
    model = models.get(config.model)
    ps_tasks = srv.task_addresses(spec, ("ps",))

    def wait_for_ps() -> None:
        srv.wait_for_tasks(ps_tasks, timeout_secs=config.startup_timeout_secs, who=name)

    session_config = srv.session_config("worker", index)
    try:
        result = train(server.target, spec, index, config, model, session_config=session_config,
                       before_session=wait_for_ps)
    except tf.errors.DeadlineExceededError as exc:
        raise StartupTimeout(f"{name}: timed out: {exc.message.splitlines()[0]}") from None
    except (StepTimeout, StoppedEarly):
        # Training cannot go on, and this worker will not come back by itself: let the ps tasks count it as done.
        srv.signal_done(server.target, index, len(spec.ps), len(spec.worker), timeout_secs=2.0)
        raise
    log.info("%s: done at global step %d after %d local steps in %.1f s", name, result.global_step,
             result.local_steps, result.seconds)
    if is_chief:
        checkpoint = evaluate.latest_checkpoint(config.train_dir)
        if checkpoint:
            print(evaluate.format_result(evaluate.evaluate_checkpoint(
                model, checkpoint, data_dir=config.data_dir)), flush=True)
    srv.signal_done(server.target, index, len(spec.ps), len(spec.worker))
