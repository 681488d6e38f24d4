"""The one launch skeleton every backend shares: the run dir chosen once (an earlier run of another model there
refused first), the tasks placed by the backend and planned once (with the ps tasks' rejoin grace), and only then,
every refusal behind, cluster.yaml and logs/ written once, the run supervised, the report printed. A backend
(`psworker.launcher.backends`) supplies only what differs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, TextIO

from psworker import diskspace, events, traindir_lock
from psworker.launcher import backends
from psworker.launcher import metrics as metrics_
from psworker.launcher.backends.base import Backend
from psworker.launcher.command import command_tasks, names_train_dir, worker_warnings
from psworker.launcher.config import LaunchConfig
from psworker.launcher.inject import check_fault_tasks
from psworker.launcher.pipe_safe import PipeSafe
from psworker.launcher.policy import with_rejoin_grace
from psworker.launcher.console.report import (RunResult, describe_returncode, exit_status, format_report, restart_hint,
                                      success_line)
from psworker.launcher.rundir import (LOG_SUBDIR, RunEnd, check_earlier_run, choose_run_dir, task_log_name, write_end,
                                      write_run_dir)
from psworker.launcher.console.stopline import stop_line
from psworker.launcher.supervise.supervisor import Supervisor
from psworker.spec.plan import Task, chief_name, plan
from psworker.spec import ClusterSpec
from psworker.states import RunState

__all__ = ["LaunchConfig", "SignalCatcher", "launch", "plan_tasks", "run_local", "stop_on_signals", "supervise"]


class SignalCatcher:
    """Filled in by `stop_on_signals`: the first signal received, or None."""

    signum: Optional[int] = None


@contextlib.contextmanager
def stop_on_signals(sup: Supervisor, signals: Sequence[int] = (signal.SIGINT, signal.SIGTERM)
                    ) -> Iterator[SignalCatcher]:
    """While inside, `signals` make `sup.wait()` stop every task and return (the workers first: the chief writes a
    checkpoint, `Supervisor.request_stop`); a second signal stops them at once. The old handlers return after.

    Outside the main thread (where Python cannot install handlers) it installs nothing.
    """
    caught = SignalCatcher()
    if threading.current_thread() is not threading.main_thread():
        yield caught
        return

    def handler(signum: int, frame: Any) -> None:
        again = caught.signum is not None
        if not again:
            caught.signum = signum
        sup.request_stop(f"launcher received {signal.Signals(signum).name}", hard=again)

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
        return command_tasks(spec, config.command, str(spec.train.train_dir or config.run_dir or ""))
    return with_rejoin_grace(plan(spec, spec_path, python=python), config.policy)


def supervise(tasks: Sequence[Task], processes: Backend, config: LaunchConfig, log_dir: Path, *,
              console: TextIO, install_signal_handlers: bool = True,
              metrics: Optional[metrics_.RunCollector] = None) -> tuple[RunResult, Optional[int]]:
    """Runs `tasks` under one `Supervisor` until the run ends (`metrics`: the /metrics collector to attach it to).

    Returns:
        The result, and the signal that stopped the launcher (None if none did).
    """
    from psworker.launcher.supervise import stacks
    from psworker.launcher.console.lines import ConsoleFilter
    from psworker.launcher.console.output import GROUP_WINDOW_SECS
    from psworker.launcher.elastic.scale_inbox import ScaleInbox
    from psworker.launcher.console.status import live_view

    # A worker being restarted near the end gets as long to come back as the ps wait for it (`with_rejoin_grace`).
    success = dataclasses.replace(config.success, worker_exit_grace_secs=config.success.worker_exit_grace_secs
                                  + config.policy.rejoin_secs())
    elastic = getattr(config.spec, "elastic", None)
    with live_view(config, tasks, console) as (view_console, attach):
        shown = None if config.verbose else ConsoleFilter(own_tasks=not config.command)
        sup = Supervisor(tasks, log_dir, console=view_console, console_filter=shown, run_dir=log_dir.parent,
                         console_window_secs=0.0 if config.verbose else GROUP_WINDOW_SECS,
                         grace_period_secs=config.grace_period_secs, ps_exit_grace_secs=config.ps_exit_grace_secs,
                         backend=processes, restart_policy=config.policy, faults=config.faults,
                         stall_timeout_secs=config.stall_timeout_secs, done_jobs=config.done_jobs, success=success,
                         stacks=stacks.for_run(own_tasks=not config.command, local=processes.LOCAL_PIDS),
                         elastic=elastic, scale_inbox=ScaleInbox(log_dir.parent) if elastic else None,
                         stop_save_secs=config.stop_save_secs)
        attach(sup.progress)
        if metrics is not None:
            metrics.attach(sup)
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
    if config.command:
        for line in worker_warnings(*_idle_workers(result)):
            print(f"psworker: warning: {line}", file=console, flush=True)
    print(f"psworker: {_where(config, outputs, log_dir)}", file=console, flush=True)
    chief = chief_name(result.exits) or "worker:0"
    try:
        chief_log = (log_dir / task_log_name(chief)).read_text(encoding="utf-8", errors="replace")
    except OSError:
        chief_log = ""
    exported = events.last(events.Exported, chief_log)
    precision = events.last(events.Precision, chief_log) or events.last(events.AucResult, chief_log)
    if exported:
        print(f"psworker: SavedModel in {exported.path}/ (psworker export, tf.saved_model.load)", file=console,
              flush=True)
    dealt = events.last(events.DataDealt, chief_log)
    if dealt:   # dealt shards: what was read, and read again
        of = "" if dealt.num_epochs is None else f" of {dealt.num_epochs}"
        dropped = f"; {dealt.dropped} sync batches dropped (stale) and computed again" if dealt.dropped else ""
        print(f"psworker: data: epoch {dealt.epochs:.2f}{of}: {dealt.trained} examples trained, {dealt.again} of "
              f"them dealt again ({dealt.examples_per_epoch} per epoch){dropped}", file=console, flush=True)
    if precision:   # last: the run's result
        print(f"psworker: {precision.summary}", file=console, flush=True)


def _where(config: LaunchConfig, outputs: Path, log_dir: Path, logs_first: bool = False) -> str:
    """Where the run's outputs are: the checkpoints only where the launcher knows (its own trainer, or a command
    given `{train_dir}`)."""
    if config.command and not names_train_dir(config.command):
        return (f"task logs in {log_dir}/ (checkpoints and summaries: wherever your command writes them; pass it "
                f"{{train_dir}} to have them in {outputs}/)")
    parts = [f"checkpoints and summaries in {outputs}/", f"task logs in {log_dir}/"]
    return ", ".join(parts[::-1] if logs_first else parts)


def _idle_workers(result: RunResult) -> tuple[list[str], list[str]]:
    """The worker (and chief) tasks whose latest attempt printed no step line, and those the launcher stopped."""
    workers = {name: e for name, e in result.exits.items() if name.partition(":")[0] in ("worker", "chief")}
    never = []
    for name, e in workers.items():
        try:
            log = Path(e.log_path).read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        if events.last(events.Step, events.current_attempt(log)) is None:
            never.append(name)
    return never, [name for name, e in workers.items() if e.stopped]


def _report(config: LaunchConfig, result: RunResult, signum: Optional[int], seconds: float, outputs: Path,
            log_dir: Path, console: TextIO) -> int:
    """Prints how the run ended and returns the launcher's exit status."""
    if signum is not None and not result.ok:
        stopped = [name for name, e in result.exits.items() if e.stopped]
        print(f"psworker: {result.reason}; stopped {', '.join(stopped) or 'nothing (all had exited)'}",
              file=sys.stderr, flush=True)
        print(format_report(result), file=sys.stderr, flush=True)
        print(f"psworker: {_where(config, outputs, log_dir, logs_first=True)}", file=sys.stderr, flush=True)
        if not config.command:
            print(f"psworker: {stop_line(result, outputs)}", file=sys.stderr, flush=True)
        return 128 + signum
    if result.ok:
        report_success(config, result, seconds, outputs, log_dir, console)
        return 0
    print(format_report(result), file=sys.stderr, flush=True)
    hint = restart_hint(result, config.policy.max_restarts, chief_name(result.exits))
    if hint is not None:
        print(f"psworker: {hint}", file=sys.stderr, flush=True)
    return exit_status(result.failure.returncode) if result.failure is not None else 1


def _placed(config: LaunchConfig, backend: Backend, run_dir: Path) -> tuple[LaunchConfig, list[Task]]:
    """Inside the backend's session, writing nothing (so that a refusal changes nothing in the run dir): the config
    with the placed spec, and the run's tasks.

    Raises:
        SpecError, UsageError: a fixed port in use, a spec this backend cannot run, an injection naming no task.
    """
    spec = backend.place(config.spec, run_dir)
    config = dataclasses.replace(config, spec=spec, run_dir=str(run_dir))
    tasks = plan_tasks(spec, config, backend.python, backend.spec_path(run_dir))
    check_fault_tasks(config.faults, [t.name for t in tasks])
    return config, tasks


def _run(config: LaunchConfig, planned: list[Task], backend: Backend, run_dir: Path, console: TextIO,
         install_signal_handlers: bool, lock_holder: str, endpoint: Optional[metrics_.Endpoint] = None) -> int:
    """Inside the backend's session, holding the run dir's lock (its tasks learn who holds it: `lock_holder`):
    write, supervise (with `endpoint`: /metrics served), report."""
    spec = config.spec
    tasks = [dataclasses.replace(t, env=(*t.env, (traindir_lock.HOLDER_ENV, lock_holder))) for t in planned]
    write_end(run_dir, None)        # an earlier run's record, in a run dir that goes on
    text = write_run_dir(run_dir, spec)
    backend.prepare(spec, text)
    log_dir = run_dir / LOG_SUBDIR
    print(f"psworker: {backend.banner(tasks, log_dir)}"
          + ("" if config.command else " (TensorFlow's import takes a few seconds)"), file=console, flush=True)
    outputs = backend.outputs_dir(spec, run_dir)
    space = diskspace.space_warning(str(outputs))      # None unless its checkpoints are here to measure
    if space is not None:
        print(f"psworker: warning: train dir {outputs}: {space}", file=console, flush=True)
    if getattr(spec, "elastic", None) is not None:
        e = spec.elastic
        print(f"psworker: elastic workers ({e.describe()}): worker:0-{e.start - 1} start now, the others are reserved; "
              f"psworker scale {run_dir} --workers N changes the count", file=console, flush=True)
    collector = _serve_metrics(endpoint, config, backend, outputs, console)
    started = time.monotonic()
    result, signum = supervise(tasks, backend, config, log_dir, console=console,
                               install_signal_handlers=install_signal_handlers, metrics=collector)
    seconds = time.monotonic() - started
    code = None
    try:
        code = _report(config, result, signum, seconds, outputs, log_dir, console)
    finally:    # also when the console went away (`| tee` ended by the same Ctrl-C): status reads how the run ended
        end = run_end(result, signum, _exit_code(result, signum) if code is None else code, seconds)
        write_end(run_dir, end)
    if endpoint is not None:
        endpoint.finish(end.outcome, 0.0 if signum is not None else config.metrics.linger_secs, console)
    return code


def _exit_code(result: RunResult, signum: Optional[int]) -> int:
    """The launcher's exit status for `result`, as `_report` returns it."""
    if signum is not None and not result.ok:
        return 128 + signum
    if result.ok:
        return 0
    return exit_status(result.failure.returncode) if result.failure is not None else 1


def _serve_metrics(endpoint: Optional[metrics_.Endpoint], config: LaunchConfig, backend: Backend, outputs: Path,
                   console: TextIO) -> Optional[metrics_.RunCollector]:
    """`--metrics_port`: serves the run's /metrics and says where; returns the collector (None: metrics off)."""
    if endpoint is None:
        return None
    options = config.metrics
    stall = options.stall_secs or config.stall_timeout_secs or metrics_.DEFAULT_STALL_SECS
    facts = metrics_.RunFacts(stall, outputs, None if config.command else config.spec.train.max_steps,
                              getattr(backend, "link_bytes", None))
    print(f"psworker: {endpoint.serve(facts)}", file=console, flush=True)
    return endpoint.collector


def run_end(result: RunResult, signum: Optional[int], code: int, seconds: float) -> RunEnd:
    """The record of how the run ended (`psworker status` shows it)."""
    outcome = (RunState.STOPPED if signum is not None and not result.ok else
               RunState.SUCCEEDED if result.ok else RunState.FAILED)
    f = result.failure
    reason = f"{f.name} {f.reason or describe_returncode(f.returncode)}" if f is not None else result.reason
    return RunEnd(outcome=outcome, exit_status=code, reason=reason, seconds=round(seconds, 1),
                  ended_at=f"{datetime.datetime.now():%Y-%m-%d %H:%M:%S}", first_failure=f and f.name)


def launch(config: LaunchConfig, *, console: Optional[TextIO] = None, install_signal_handlers: bool = True) -> int:
    """Runs `config.spec` on `config.backend` and reports.

    Returns:
        0 on success; 130/143 after SIGINT/SIGTERM; else the failing task's exit status (128+N for signal N), or 1.

    Raises:
        SpecError, UsageError: the spec cannot run on this backend, an injection names no task, another run holds
            the run dir (`traindir_lock`), or it holds another model's run (`rundir.check_earlier_run`); each before
            anything is written into the run dir.
    """
    console = console if console is not None else PipeSafe(sys.stdout)
    backend = backends.create(config.backend, config.python)
    if not config.command:
        check_earlier_run(config.run_dir or config.spec.train.train_dir, config.spec.train)
    run_dir = choose_run_dir(config.run_dir, config.spec, console)
    # the metrics socket before the session: bound on this host's network, kept across a re-exec into a namespace
    with metrics_.serving(config.metrics) as endpoint, backend.session(run_dir, console):    # after a re-exec, if any
        config, tasks = _placed(config, backend, run_dir)
        with traindir_lock.hold(run_dir) as lock:
            return _run(config, tasks, backend, run_dir, console, install_signal_handlers, lock.holder.token,
                        endpoint)


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
