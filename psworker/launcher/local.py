"""The local backend: every task of a spec runs as a subprocess on this machine, bound to 127.0.0.1.

A backend module of `psworker.launcher`'s registry provides `prepare(config, console) -> (config, tasks)`,
`processes(config) -> ProcessBackend` and `report_success(config, result, seconds, console)`.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import sys
from pathlib import Path
from typing import Optional, TextIO

from psworker import events
from psworker.errors import SpecError
from psworker.launcher.launch import PYTHON, SPEC, LaunchConfig, launch
from psworker.launcher.policy import with_rejoin_grace
from psworker.launcher.ports import pick_free_ports
from psworker.launcher.process import LocalProcessBackend
from psworker.launcher.report import RunResult, format_report, success_line
from psworker.plan import plan
from psworker.spec import Address, ClusterSpec, dump_spec, format_address, with_addresses

__all__ = ["LOCAL_HOST", "default_train_dir", "prepare", "processes", "report_success", "resolve_local_spec",
           "run_local"]

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
    for job in spec.jobs():
        for i, a in enumerate(spec.addresses(job)):
            if a.port == 0:
                continue
            here = f"cluster.{job}[{i}]"
            if a.port in fixed:
                raise SpecError(source, here, f"port {a.port} is also used by {fixed[a.port]}; a local run "
                                              f"binds every task to {LOCAL_HOST}, so ports must differ")
            fixed[a.port] = here
    n_auto = sum(a.port == 0 for job in spec.jobs() for a in spec.addresses(job))
    auto = iter([p for p in pick_free_ports(n_auto + len(fixed), LOCAL_HOST) if p not in fixed][:n_auto])

    def local(a: Address) -> Address:
        return Address(LOCAL_HOST, a.port or next(auto))

    new = {job: [local(a) for a in spec.addresses(job)] for job in spec.jobs()}
    resolved = with_addresses(spec, **new)
    return dataclasses.replace(resolved, train=dataclasses.replace(spec.train, train_dir=str(train_dir)))


def _mapping_lines(spec: ClusterSpec, resolved: ClusterSpec) -> list[str]:
    return [f"{job}:{i} {format_address(old)} -> {new}"
            for job in spec.jobs()
            for i, (old, new) in enumerate(zip(spec.addresses(job), resolved.addresses(job)))]


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def chief_result(log_dir: Path) -> tuple[Optional[events.Precision], Optional[events.Exported]]:
    """The chief's (worker 0's) last evaluation and SavedModel lines in its log; None for each it did not write."""
    try:
        text = (log_dir / "worker-0.log").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None, None
    return events.last(events.Precision, text), events.last(events.Exported, text)


def prepare(config: LaunchConfig, console: TextIO) -> tuple[LaunchConfig, list]:
    """Resolves the run for this machine: the train dir (made here), 127.0.0.1 addresses with free ports,
    `<train_dir>/cluster.yaml` (every task reads it), and the tasks (argv symbolic in PYTHON and SPEC).

    Returns:
        The config with its train_dir filled in, and the tasks in start order.

    Raises:
        SpecError: the spec cannot run locally (ports clash on 127.0.0.1).
    """
    spec = config.spec
    if config.train_dir or spec.train.train_dir:
        train_dir = Path(config.train_dir or spec.train.train_dir)
        train_dir.mkdir(parents=True, exist_ok=True)
    else:
        train_dir = default_train_dir(spec)
        print(f"psworker: train_dir is {train_dir}", file=console, flush=True)
    resolved = resolve_local_spec(spec, train_dir)
    for line in _mapping_lines(spec, resolved):
        logger.debug("local address: %s", line)
    _write_atomically(train_dir / SPEC_FILE, dump_spec(resolved))
    config = dataclasses.replace(config, spec=resolved, train_dir=str(train_dir))
    if config.command:
        from psworker.launcher.command import command_tasks
        tasks = command_tasks(resolved, config.command)
    else:
        tasks = with_rejoin_grace(plan(resolved, SPEC, python=PYTHON), config.policy)
    where = ", ".join(f"{t.name}={t.address}" for t in tasks)
    print(f"psworker: starting {len(tasks)} tasks on {LOCAL_HOST} ({where}); logs in {train_dir / LOG_SUBDIR}"
          + ("" if config.command else " (TensorFlow's import takes a few seconds)"), file=console, flush=True)
    return config, tasks


def processes(config: LaunchConfig) -> LocalProcessBackend:
    """Subprocesses of this launcher, with the argv symbols replaced by this machine's values."""
    return LocalProcessBackend(symbols={PYTHON: config.python, SPEC: str(Path(config.train_dir) / SPEC_FILE)})


def report_success(config: LaunchConfig, result: RunResult, seconds: float, console: TextIO, *,
                   outputs_dir: Optional[str] = None) -> None:
    """What a person reads after a successful run: time, outputs, restarts, and the chief's evaluation.

    `outputs_dir`: where the chief's checkpoints and export are, when not the run dir (`config.train_dir`, which
    holds the logs).
    """
    print(success_line(result, config.done_jobs, seconds), file=console, flush=True)
    if any(e.restarts or e.stopped for e in result.exits.values()):
        print(format_report(result), file=console, flush=True)
    outputs = Path(outputs_dir or config.train_dir)
    log_dir = Path(config.train_dir) / LOG_SUBDIR
    print(f"psworker: checkpoints and summaries in {outputs}/, task logs in {log_dir}/", file=console, flush=True)
    precision, exported = chief_result(log_dir)
    if exported:
        print(f"psworker: SavedModel in {exported.path}/ (psworker export, tf.saved_model.load)", file=console,
              flush=True)
    if precision:
        print(f"psworker: {precision.summary}", file=console, flush=True)


def run_local(spec: ClusterSpec, *, console: Optional[TextIO] = None, python: str = sys.executable,
              install_signal_handlers: bool = True, **options) -> int:
    """Runs the whole cluster on this machine (`psworker local` as a library call) and returns its exit status.

    Args:
        spec: the cluster; `spec.train.train_dir` None means a fresh `runs/<stem>-<time>` here.
        console: where task output and progress go; None: sys.stdout.
        python: the interpreter that runs the tasks.
        install_signal_handlers: SIGINT/SIGTERM stop every task (handlers restored after).
        **options: other `LaunchConfig` fields (grace_period_secs, policy, injections, verbose, ...).
    """
    options.setdefault("live", False)
    config = LaunchConfig(spec=spec, python=python, **options)
    return launch(config, console=console, install_signal_handlers=install_signal_handlers)
