"""The one launch skeleton every backend shares: the run dir chosen once, the tasks placed by the backend,
cluster.yaml and logs/ written once, the plan made once (with the ps tasks' rejoin grace), the run supervised,
the report printed. A backend (`psworker.launcher.backends`) supplies only what differs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, TextIO

from psworker import events
from psworker.launcher import backends
from psworker.launcher.backends.base import Backend
from psworker.launcher.command import command_tasks
from psworker.launcher.config import LaunchConfig
from psworker.launcher.inject import check_fault_tasks
from psworker.launcher.policy import with_rejoin_grace
from psworker.launcher.report import RunResult, exit_status, format_report, success_line
from psworker.launcher.rundir import LOG_SUBDIR, choose_run_dir, task_log_name, write_run_dir
from psworker.launcher.supervisor import Supervisor
from psworker.plan import Task, plan
from psworker.spec import ClusterSpec

__all__ = ["LaunchConfig", "SignalCatcher", "launch", "plan_tasks", "run_local", "stop_on_signals", "supervise"]


class SignalCatcher:
    """Filled in by `stop_on_signals`: the first signal received, or None."""

    signum: Optional[int] = None


@contextlib.contextmanager
def stop_on_signals(sup: Supervisor, signals: Sequence[int] = (signal.SIGINT, signal.SIGTERM)
                    ) -> Iterator[SignalCatcher]:
    """While inside, `signals` make `sup.wait()` stop every task and return; the old handlers return after.

    Outside the main thread (where Python cannot install handlers) it installs nothing.
    """
    caught = SignalCatcher()
    if threading.current_thread() is not threading.main_thread():
        yield caught
        return

    def handler(signum: int, frame: Any) -> None:
        if caught.signum is None:
            caught.signum = signum
        sup.request_stop(f"launcher received {signal.Signals(signum).name}")

    previous = {}
    try:
        for sig in signals:
            previous[sig] = signal.signal(sig, handler)
        yield caught
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def plan_tasks(spec: ClusterSpec, config: LaunchConfig, python: str, spec_path: str) -> list[Task]:
    """The run's tasks, once: the user's command per task, or psworker's own tasks (each ps with the rejoin grace
    that `config.policy`'s restarts need)."""
    if config.command:
        return command_tasks(spec, config.command)
    return with_rejoin_grace(plan(spec, spec_path, python=python), config.policy)


def supervise(tasks: Sequence[Task], processes: Backend, config: LaunchConfig, log_dir: Path, *,
              console: TextIO, install_signal_handlers: bool = True) -> tuple[RunResult, Optional[int]]:
    """Runs `tasks` under one `Supervisor` until the run ends.

    Returns:
        The result, and the signal that stopped the launcher (None if none did).
    """
    from psworker.launcher import stacks
    from psworker.launcher.console import for_console
    from psworker.launcher.output import GROUP_WINDOW_SECS
    from psworker.launcher.scale_inbox import ScaleInbox
    from psworker.launcher.status import live_view

    # A worker being restarted near the end gets as long to come back as the ps wait for it (`with_rejoin_grace`).
    success = dataclasses.replace(config.success, worker_exit_grace_secs=config.success.worker_exit_grace_secs
                                  + config.policy.rejoin_secs())
    elastic = getattr(config.spec, "elastic", None)
    with live_view(config, tasks, console) as (view_console, attach):
        sup = Supervisor(tasks, log_dir, console=view_console, console_filter=None if config.verbose else for_console,
                         console_window_secs=0.0 if config.verbose else GROUP_WINDOW_SECS,
                         grace_period_secs=config.grace_period_secs, ps_exit_grace_secs=config.ps_exit_grace_secs,
                         backend=processes, restart_policy=config.policy, faults=config.faults,
                         stall_timeout_secs=config.stall_timeout_secs, done_jobs=config.done_jobs, success=success,
                         stacks=stacks.for_run(own_tasks=not config.command, local=processes.LOCAL_PIDS),
                         elastic=elastic, scale_inbox=ScaleInbox(log_dir.parent) if elastic else None)
        attach(sup.progress)
        signals = stop_on_signals(sup) if install_signal_handlers else contextlib.nullcontext(SignalCatcher())
        with signals as caught, sup:
            result = sup.wait()
    return result, caught.signum


def report_success(config: LaunchConfig, result: RunResult, seconds: float, outputs: Path, log_dir: Path,
                   console: TextIO) -> None:
    """What a person reads after a successful run: time, outputs, restarts, and the chief's evaluation."""
    print(success_line(result, config.done_jobs, seconds), file=console, flush=True)
    if any(e.restarts or e.stopped for e in result.exits.values()):
        print(format_report(result), file=console, flush=True)
    print(f"psworker: checkpoints and summaries in {outputs}/, task logs in {log_dir}/", file=console, flush=True)
    try:
        chief_log = (log_dir / task_log_name("worker:0")).read_text(encoding="utf-8", errors="replace")
    except OSError:
        chief_log = ""
    exported, precision = events.last(events.Exported, chief_log), events.last(events.Precision, chief_log)
    if exported:
        print(f"psworker: SavedModel in {exported.path}/ (psworker export, tf.saved_model.load)", file=console,
              flush=True)
    if precision:
        print(f"psworker: {precision.summary}", file=console, flush=True)


def _report(config: LaunchConfig, result: RunResult, signum: Optional[int], seconds: float, outputs: Path,
            log_dir: Path, console: TextIO) -> int:
    """Prints how the run ended and returns the launcher's exit status."""
    if signum is not None and not result.ok:
        stopped = [name for name, e in result.exits.items() if e.stopped]
        print(f"psworker: {result.reason}; stopped {', '.join(stopped) or 'nothing (all had exited)'}",
              file=sys.stderr, flush=True)
        print(format_report(result), file=sys.stderr, flush=True)
        again = "" if config.command else " (the same command goes on from the latest checkpoint)"
        print(f"psworker: task logs in {log_dir}/, checkpoints and summaries in {outputs}/{again}", file=sys.stderr,
              flush=True)
        return 128 + signum
    if result.ok:
        report_success(config, result, seconds, outputs, log_dir, console)
        return 0
    print(format_report(result), file=sys.stderr, flush=True)
    return exit_status(result.failure.returncode) if result.failure is not None else 1


def _run(config: LaunchConfig, backend: Backend, run_dir: Path, console: TextIO,
         install_signal_handlers: bool) -> int:
    """Inside the backend's session: place, write, plan, supervise, report."""
    spec = backend.place(config.spec, run_dir)
    text = write_run_dir(run_dir, spec)
    config = dataclasses.replace(config, spec=spec, run_dir=str(run_dir))
    tasks = plan_tasks(spec, config, backend.python, backend.spec_path(run_dir))
    check_fault_tasks(config.faults, [t.name for t in tasks])
    backend.prepare(spec, text)
    log_dir = run_dir / LOG_SUBDIR
    print(f"psworker: {backend.banner(tasks, log_dir)}"
          + ("" if config.command else " (TensorFlow's import takes a few seconds)"), file=console, flush=True)
    if getattr(spec, "elastic", None) is not None:
        e = spec.elastic
        print(f"psworker: elastic workers ({e.describe()}): worker:0-{e.start - 1} start now, the others are reserved; "
              f"psworker scale {run_dir} --workers N changes the count", file=console, flush=True)
    started = time.monotonic()
    result, signum = supervise(tasks, backend, config, log_dir, console=console,
                               install_signal_handlers=install_signal_handlers)
    return _report(config, result, signum, time.monotonic() - started, backend.outputs_dir(spec, run_dir), log_dir,
                   console)


def launch(config: LaunchConfig, *, console: Optional[TextIO] = None, install_signal_handlers: bool = True) -> int:
    """Runs `config.spec` on `config.backend` and reports.

    Returns:
        0 on success; 130/143 after SIGINT/SIGTERM; else the failing task's exit status (128+N for signal N), or 1.

    Raises:
        SpecError, UsageError: the spec cannot run on this backend, or an injection names no task.
    """
    console = console if console is not None else sys.stdout
    backend = backends.create(config.backend, config.python)
    run_dir = choose_run_dir(config.run_dir, config.spec, console)
    with backend.session(run_dir, console):
        return _run(config, backend, run_dir, console, install_signal_handlers)


def run_local(spec: ClusterSpec, *, console: Optional[TextIO] = None, python: str = sys.executable,
              install_signal_handlers: bool = True, **options: Any) -> int:
    """Runs the whole cluster on this machine (`psworker local` as a library call) and returns its exit status.

    Args:
        spec: the cluster; `spec.train.train_dir` None means a fresh `runs/<stem>-<time>` here.
        console: where task output and progress go; None: sys.stdout.
        python: the interpreter that runs the tasks.
        install_signal_handlers: SIGINT/SIGTERM stop every task (handlers restored after).
        **options: other `LaunchConfig` fields (grace_period_secs, policy, faults, verbose, ...).
    """
    options.setdefault("live", False)
    config = LaunchConfig(spec=spec, python=python, **options)
    return launch(config, console=console, install_signal_handlers=install_signal_handlers)
