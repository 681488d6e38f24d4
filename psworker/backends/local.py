"""The local backend: runs every task of a spec as a subprocess on this machine, bound to 127.0.0.1."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import sys
import time
from pathlib import Path
from typing import Optional, TextIO

from psworker.console import for_console
from psworker.errors import SpecError
from psworker.plan import plan
from psworker.ports import pick_free_ports
from psworker.spec import Address, ClusterSpec, dump_spec, format_address, with_addresses
from psworker.supervisor import SignalCatcher, Supervisor, exit_status, format_report, stop_on_signals

__all__ = ["LOCAL_HOST", "default_train_dir", "resolve_local_spec", "run_local"]

logger = logging.getLogger(__name__)

LOCAL_HOST = "127.0.0.1"
SPEC_FILE = "cluster.yaml"
LOG_SUBDIR = "logs"


def default_train_dir(spec: ClusterSpec, base: str | os.PathLike = ".") -> Path:
    """A fresh `runs/<spec file stem>-YYYYmmdd-HHMMSS[-N]` under `base`, created here (never reused)."""
    stem = Path(spec.source).stem if spec.source else "cluster"
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    runs = Path(base) / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    for n in range(1000):
        path = runs / (f"{stem}-{stamp}" + (f"-{n}" if n else ""))
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"no free run directory name under {runs} for {stem}-{stamp}")


def resolve_local_spec(spec: ClusterSpec, train_dir: str | os.PathLike) -> ClusterSpec:
    """The spec as a local run starts it: every host 127.0.0.1, automatic ports chosen, train_dir filled in.

    Fixed ports are kept; automatic ones (port 0) come from `pick_free_ports`, avoiding the fixed ones.

    Args:
        spec: the spec as loaded.
        train_dir: the run's training directory.

    Returns:
        A new ClusterSpec (same source) whose `train.train_dir` is `str(train_dir)`.

    Raises:
        SpecError: two tasks would share a port on 127.0.0.1 (e.g. `a:2222` and `b:2222`).
    """
    source = spec.source or "spec"
    fixed: dict[int, str] = {}
    for job in ("ps", "worker"):
        for i, a in enumerate(spec.addresses(job)):
            if a.port == 0:
                continue
            here = f"cluster.{job}[{i}]"
            if a.port in fixed:
                raise SpecError(source, here, f"port {a.port} is also used by {fixed[a.port]}; a local run "
                                              f"binds every task to {LOCAL_HOST}, so ports must differ")
            fixed[a.port] = here
    n_auto = sum(a.port == 0 for a in spec.ps + spec.worker)
    auto = iter([p for p in pick_free_ports(n_auto + len(fixed), LOCAL_HOST) if p not in fixed][:n_auto])

    def local(a: Address) -> Address:
        return Address(LOCAL_HOST, a.port or next(auto))

    resolved = with_addresses(spec, [local(a) for a in spec.ps], [local(a) for a in spec.worker])
    return dataclasses.replace(resolved, train=dataclasses.replace(spec.train, train_dir=str(train_dir)))


def _mapping_lines(spec: ClusterSpec, resolved: ClusterSpec) -> list[str]:
    return [f"{job}:{i} {format_address(old)} -> {new}"
            for job in ("ps", "worker")
            for i, (old, new) in enumerate(zip(spec.addresses(job), resolved.addresses(job)))]


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def chief_result(log_dir: Path) -> Optional[str]:
    """The chief's last `precision @ 1 = ...` report from its log file, or None (no evaluation ran)."""
    try:
        lines = (log_dir / "worker-0.log").read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    found = [line[line.index("precision @ 1"):] for line in lines if "precision @ 1 = " in line]
    return found[-1] if found else None


def run_local(
    spec: ClusterSpec,
    *,
    grace_period_secs: float = 10.0,
    console: Optional[TextIO] = None,
    python: str = sys.executable,
    install_signal_handlers: bool = True,
    ps_exit_grace_secs: float = 15.0,
    verbose: bool = False,
) -> int:
    """Runs the whole cluster on this machine and supervises it until the workers finish or one task fails.

    Writes the resolved spec to `<train_dir>/cluster.yaml` (every task reads it via `--spec`) and each
    task's output to `<train_dir>/logs/<job>-<index>.log`, with a `[job:index] `-prefixed copy on `console`.
    Nothing in train_dir is deleted, so a rerun resumes from its checkpoints.

    Args:
        spec: the cluster; `spec.train.train_dir` None means a fresh `runs/<stem>-<time>` here.
        grace_period_secs: between SIGTERM and SIGKILL when stopping tasks.
        console: where task output and progress go; None: sys.stdout.
        python: the interpreter that runs the tasks.
        install_signal_handlers: SIGINT/SIGTERM stop every task (handlers restored after).
        ps_exit_grace_secs: how long ps tasks may take to exit by themselves after the workers succeed.
        verbose: show every line of the tasks' output on the console (default: psworker's own lines,
            step lines, warnings and errors; TensorFlow's start-up chatter stays in the log files).

    Returns:
        0 on success; 130/143 after SIGINT/SIGTERM; else the failing task's exit status (128+N for
        signal N), or 1.

    Raises:
        SpecError: the spec cannot run locally (ports clash on 127.0.0.1).
    """
    console = console if console is not None else sys.stdout
    if spec.train.train_dir:
        train_dir = Path(spec.train.train_dir)
        train_dir.mkdir(parents=True, exist_ok=True)
    else:
        train_dir = default_train_dir(spec)
        print(f"psworker: train_dir is {train_dir}", file=console, flush=True)
    resolved = resolve_local_spec(spec, train_dir)
    for line in _mapping_lines(spec, resolved):
        logger.debug("local address: %s", line)
    spec_path = train_dir / SPEC_FILE
    _write_atomically(spec_path, dump_spec(resolved))
    tasks = plan(resolved, spec_path, python=python)
    log_dir = train_dir / LOG_SUBDIR
    where = ", ".join(f"{t.name}={t.address}" for t in tasks)
    print(f"psworker: starting {len(resolved.ps)} ps and {len(resolved.worker)} workers on {LOCAL_HOST} "
          f"({where}); logs in {log_dir} (TensorFlow's import takes a few seconds)", file=console, flush=True)

    started = time.monotonic()
    sup = Supervisor(tasks, log_dir, console=console, console_filter=None if verbose else for_console,
                     grace_period_secs=grace_period_secs, ps_exit_grace_secs=ps_exit_grace_secs)
    signals = stop_on_signals(sup) if install_signal_handlers else contextlib.nullcontext(SignalCatcher())
    with signals as caught, sup:
        result = sup.wait()

    if caught.signum is not None and not result.ok:
        stopped = [name for name, e in result.exits.items() if e.stopped]
        print(f"psworker: {result.reason}; stopped {', '.join(stopped) or 'nothing (all had exited)'}",
              file=sys.stderr, flush=True)
        return 128 + caught.signum
    if result.ok:
        print(f"psworker: all {len(resolved.worker)} workers finished in {time.monotonic() - started:.1f} s",
              file=console, flush=True)
        print(f"psworker: checkpoints and summaries in {train_dir}/, task logs in {log_dir}/", file=console,
              flush=True)
        result_line = chief_result(log_dir)
        if result_line:
            print(f"psworker: {result_line}", file=console, flush=True)
        return 0
    print(format_report(result), file=sys.stderr, flush=True)
    return exit_status(result.failure.returncode) if result.failure is not None else 1
