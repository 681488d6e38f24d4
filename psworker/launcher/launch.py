"""The launch seam: one frozen `LaunchConfig` from the CLI; a backend's `prepare(config) -> (config, tasks)`; then
`supervise(tasks, processes, config)` -> `RunResult`; `launch` wires them and reports.

Task argvs may name this machine only through the symbols `PYTHON` and `SPEC`, which the process backend
replaces where the task really starts (a remote backend puts its own interpreter and spec path).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, TextIO

from psworker.launcher.inject import Fault, parse_fault, parse_faults
from psworker.launcher.policy import RestartPolicy, SuccessPolicy
from psworker.launcher.process import ProcessBackend
from psworker.launcher.report import RunResult, exit_status, format_report
from psworker.launcher.supervisor import Supervisor
from psworker.spec import ClusterSpec

__all__ = ["LaunchConfig", "PYTHON", "SPEC", "SignalCatcher", "launch", "stop_on_signals", "supervise"]

PYTHON = "{python}"       # argv symbol: the task's interpreter
SPEC = "{spec}"           # argv symbol: the path of the run's resolved cluster.yaml


@dataclass(frozen=True)
class LaunchConfig:
    """Everything one launch needs, built once by the CLI (or a library caller)."""

    spec: ClusterSpec
    train_dir: Optional[str] = None          # None: a fresh runs/<spec>-<time> here
    command: tuple[str, ...] = ()            # `psworker run`: the user's command; empty: psworker's trainer
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    injections: tuple[str, ...] = ()         # `--inject` values, checked on construction
    stall_timeout_secs: Optional[float] = None
    network: str = "auto"
    verbose: bool = False
    live: Optional[bool] = None              # live status view; None: when the console is a terminal, else
    status_every_secs: float = 15.0          # ... plain status lines this often; False: neither
    grace_period_secs: float = 10.0
    ps_exit_grace_secs: float = 15.0
    success: SuccessPolicy = field(default_factory=SuccessPolicy)     # TFJob's default: the chief, else worker 0
    python: str = sys.executable
    backend: str = "local"
    backend_options: tuple[tuple[str, Any], ...] = ()   # (name, value) pairs only that backend reads

    def __post_init__(self) -> None:
        for text in self.injections:
            parse_fault(text)                # UsageError naming the bad part
        if self.stall_timeout_secs is not None and self.stall_timeout_secs <= 0:
            raise ValueError(f"stall_timeout_secs must be > 0, got {self.stall_timeout_secs}")

    @property
    def done_jobs(self) -> frozenset[str]:
        """The jobs whose tasks must all exit 0 under `all-workers`, and that get the worker grace once the run has
        succeeded: the chief if any, else the workers (plus, for psworker's own trainer, every non-ps job)."""
        jobs = set(self.spec.jobs())
        if not self.command:
            return frozenset(jobs - {"ps"})
        return frozenset({"chief"} if "chief" in jobs else {"worker"})


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


def supervise(tasks: Sequence[Any], processes: ProcessBackend, config: LaunchConfig, log_dir: Path, *,
              console: TextIO, faults: Sequence[Fault] = (), install_signal_handlers: bool = True,
              ) -> tuple[RunResult, Optional[int]]:
    """Runs `tasks` under one `Supervisor` until the run ends.

    Returns:
        The result, and the signal that stopped the launcher (None if none did).
    """
    from psworker.launcher import stacks
    from psworker.launcher.console import for_console
    from psworker.launcher.output import GROUP_WINDOW_SECS
    from psworker.launcher.status import live_view

    # A worker being restarted near the end gets as long to come back as the ps wait for it (`with_rejoin_grace`).
    success = replace(config.success, worker_exit_grace_secs=config.success.worker_exit_grace_secs
                      + config.policy.rejoin_secs())
    with live_view(config, tasks, console) as (view_console, attach):
        sup = Supervisor(tasks, log_dir, console=view_console, console_filter=None if config.verbose else for_console,
                         console_window_secs=0.0 if config.verbose else GROUP_WINDOW_SECS,
                         grace_period_secs=config.grace_period_secs, ps_exit_grace_secs=config.ps_exit_grace_secs,
                         backend=processes, restart_policy=config.policy, faults=faults,
                         stall_timeout_secs=config.stall_timeout_secs, done_jobs=config.done_jobs,
                         success=success,
                         stacks=stacks.for_run(own_tasks=not config.command, local=config.backend == "local"))
        attach(sup.progress)
        signals = stop_on_signals(sup) if install_signal_handlers else contextlib.nullcontext(SignalCatcher())
        with signals as caught, sup:
            result = sup.wait()
    return result, caught.signum


def launch(config: LaunchConfig, *, console: Optional[TextIO] = None, install_signal_handlers: bool = True) -> int:
    """Prepares the run with `config.backend`, supervises it, and reports.

    Returns:
        0 on success; 130/143 after SIGINT/SIGTERM; else the failing task's exit status (128+N for signal N), or 1.

    Raises:
        SpecError, UsageError: the spec cannot run on this backend, or an injection names no task.
    """
    from psworker import launcher

    console = console if console is not None else sys.stdout
    backend = launcher.get(config.backend)
    config, tasks = backend.prepare(config, console)
    faults = parse_faults(config.injections, [t.name for t in tasks])
    log_dir = Path(config.train_dir) / "logs"
    started = time.monotonic()
    result, signum = supervise(tasks, backend.processes(config), config, log_dir, console=console, faults=faults,
                               install_signal_handlers=install_signal_handlers)
    if signum is not None and not result.ok:
        stopped = [name for name, e in result.exits.items() if e.stopped]
        print(f"psworker: {result.reason}; stopped {', '.join(stopped) or 'nothing (all had exited)'}",
              file=sys.stderr, flush=True)
        return 128 + signum
    if result.ok:
        backend.report_success(config, result, time.monotonic() - started, console)
        return 0
    print(format_report(result), file=sys.stderr, flush=True)
    return exit_status(result.failure.returncode) if result.failure is not None else 1

