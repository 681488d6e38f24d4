"""The Slurm backend: inside an allocation, each task runs as its own `srun` step on the node TensorFlow's
SlurmClusterResolver gives it (`psworker.schedulers.slurm`), so a restart is a new step of the same task.

`SlurmProcessBackend` is the `ProcessBackend` (start: `srun`; poll: srun's exit status, which is the task's;
signal: `scancel --signal=SIG JOB.STEP`, or SIGKILL to srun, which cancels its step at once; output: srun's
`--unbuffered` stdout). The module is a backend of `psworker.launcher`'s registry (`prepare`, `processes`,
`report_success`); `psworker slurm launch` builds the `LaunchConfig` with `spec_for_allocation`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Mapping, Optional, Sequence, TextIO, Union

from psworker.errors import UsageError
from psworker.launcher.launch import PYTHON, SPEC, LaunchConfig
from psworker.launcher.policy import with_rejoin_grace
from psworker.launcher.process import die_with_parent
from psworker.launcher.report import RunResult
from psworker.plan import Task, layout, plan
from psworker.schedulers import slurm as sched
from psworker.spec import ClusterSpec, CountSpec, dump_spec

__all__ = ["SlurmProcessBackend", "prepare", "processes", "report_success", "spec_for_allocation"]

logger = logging.getLogger(__name__)

SPEC_FILE = "cluster.yaml"
LOG_SUBDIR = "logs"
STEP_LOOKUP_SECS = 30.0          # how long to look for a just-started step in squeue
SLURM_COMMAND_TIMEOUT_SECS = 30.0
_REAP_TIMEOUT_SECS = 10.0


def spec_for_allocation(spec: Union[ClusterSpec, CountSpec], port_base: Optional[int],
                        environ: Mapping[str, str]) -> ClusterSpec:
    """The spec laid out on the allocation `environ` describes (SLURM_JOB_NODELIST, SLURM_TASKS_PER_NODE), by
    TensorFlow's SlurmClusterResolver rules; a listed spec's hosts are replaced, its task counts kept.

    Raises:
        UsageError: not inside an allocation, or its task count differs from the spec's.
    """
    counts = sched.count_spec(spec, port_base)
    nodes, per_node = sched.allocation_from_environ(environ)
    sched.layout(counts, nodes, per_node)           # refuses a task count other than the allocation's
    return layout(counts, nodes, per_node)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _tasks(config: LaunchConfig) -> list[Task]:
    if config.command:
        raise UsageError("the slurm backend runs psworker's own trainer; `psworker run` is not supported on it")
    return with_rejoin_grace(plan(config.spec, SPEC, python=PYTHON), config.policy)


def prepare(config: LaunchConfig, console: TextIO) -> tuple[LaunchConfig, list]:
    """Writes `<run_dir>/cluster.yaml` (the laid-out spec every task reads; `config.train_dir` is the run dir, a
    directory every node sees) and returns the tasks (argv symbolic in PYTHON and SPEC).

    Raises:
        UsageError: no run dir, not inside an allocation, or a `psworker run` command.
    """
    if not config.train_dir:
        raise UsageError("the slurm backend needs a run dir (a directory every node of the allocation sees)")
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        raise UsageError("SLURM_JOB_ID not set: `psworker slurm launch` runs inside an allocation "
                         "(the sbatch script `psworker slurm submit` writes, or salloc)")
    run_dir = Path(config.train_dir).resolve()
    (run_dir / LOG_SUBDIR).mkdir(parents=True, exist_ok=True)
    _write_atomically(run_dir / SPEC_FILE, dump_spec(config.spec))
    config = dataclasses.replace(config, train_dir=str(run_dir))
    tasks = _tasks(config)
    where = ", ".join(f"{t.name}={t.address.host}:{t.address.port}" for t in tasks)
    print(f"psworker: Slurm job {job_id}: starting {len(tasks)} tasks as srun steps ({where}); logs in "
          f"{run_dir / LOG_SUBDIR}", file=console, flush=True)
    return config, tasks


def processes(config: LaunchConfig) -> "SlurmProcessBackend":
    """One srun step per task start, with the argv symbols replaced by this allocation's values."""
    tasks = _tasks(config)
    return SlurmProcessBackend({tuple(t.argv): t for t in tasks}, os.environ["SLURM_JOB_ID"],
                               symbols={PYTHON: config.python, SPEC: str(Path(config.train_dir) / SPEC_FILE)})


def report_success(config: LaunchConfig, result: RunResult, seconds: float, console: TextIO) -> None:
    """The local backend's report, with the checkpoints in the spec's train_dir and the logs in the run dir."""
    from psworker.launcher import local
    local.report_success(config, result, seconds, console, outputs_dir=config.spec.train.train_dir)


def _run(argv: Sequence[str]) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          timeout=SLURM_COMMAND_TIMEOUT_SECS)


class SlurmProcessBackend:
    """Starts each task as `srun ... --nodelist=HOST --job-name=psworker-JOB-I -- ARGV` from inside the job.

    The step of each start is looked up in `squeue --steps` (in a thread) and logged, so each (re)start of a task
    shows its own step id; `signal` sends anything but SIGKILL with `scancel --signal` to that step."""

    def __init__(self, tasks: Mapping[tuple, Task], job_id: str, *, symbols: Optional[Mapping[str, str]] = None,
                 srun: str = "srun", squeue: str = "squeue", scancel: str = "scancel") -> None:
        """Args:
            tasks: the run's tasks by their (symbolic) argv: where each runs.
            job_id: the allocation (SLURM_JOB_ID).
            symbols: argv tokens to replace whole (PYTHON, SPEC).
        """
        self._tasks = dict(tasks)
        self._job_id = str(job_id)
        self._symbols = dict(symbols or {})
        self._srun, self._squeue, self._scancel = srun, squeue, scancel
        self._lock = threading.Lock()
        self._names: dict[int, str] = {}                 # srun pid -> step name
        self._steps: dict[int, str] = {}                 # srun pid -> JOB.STEP
        self._found: dict[int, threading.Event] = {}

    def start(self, argv: Sequence[str], env: Mapping[str, str]) -> subprocess.Popen:
        try:
            task = self._tasks[tuple(argv)]
        except KeyError:
            raise UsageError(f"slurm backend: no task of this run has argv {list(argv)}") from None
        placed = sched.SlurmTask(task.job, task.index, task.address.host, task.address.port, 0)
        real = [self._symbols.get(a, a) for a in argv]
        proc = subprocess.Popen(sched.srun_argv(placed, real, srun=self._srun), env={**os.environ, **env},
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=die_with_parent())
        name = sched.step_job_name(task.job, task.index)
        with self._lock:
            self._names[proc.pid] = name
            self._found[proc.pid] = threading.Event()
            taken = set(self._steps.values())
        threading.Thread(target=self._find_step, args=(proc, task.name, name, taken), daemon=True,
                         name=f"psworker-step-{task.name}").start()
        return proc

    def step_of(self, proc: subprocess.Popen, timeout: float = 0.0) -> Optional[str]:
        """The `JOB.STEP` id of the step `proc` (an srun) started, once seen in squeue; None before."""
        found = self._found.get(proc.pid)
        if found is not None and timeout > 0:
            found.wait(timeout)
        with self._lock:
            return self._steps.get(proc.pid)

    def _find_step(self, proc: subprocess.Popen, task_name: str, name: str, taken: set) -> None:
        deadline = time.monotonic() + STEP_LOOKUP_SECS
        try:
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    result = _run(sched.steps_argv(self._job_id, squeue=self._squeue))
                except (OSError, subprocess.TimeoutExpired):
                    result = None
                if result is not None and result.returncode == 0:
                    steps = [line.split(None, 1) for line in result.stdout.splitlines()]
                    new = [s[0] for s in steps if len(s) == 2 and s[1].strip() == name and s[0] not in taken]
                    if new:
                        with self._lock:
                            self._steps[proc.pid] = new[-1]
                        logger.info("%s runs as Slurm step %s (%s)", task_name, new[-1], name)
                        return
                time.sleep(0.5)
            if proc.poll() is None:
                logger.warning("%s: step %s not seen in squeue within %.0f s", task_name, name, STEP_LOOKUP_SECS)
        finally:
            self._found[proc.pid].set()

    def signal(self, proc: subprocess.Popen, sig: int) -> None:
        if proc.poll() is not None:
            return                              # srun gone: its step is gone too
        if sig == signal.SIGKILL:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()                     # ending srun cancels its step at once
            return
        step = self.step_of(proc, timeout=STEP_LOOKUP_SECS)
        if step is None:
            logger.warning("no Slurm step known for srun pid %d; sending %s to srun itself", proc.pid,
                           signal.Signals(sig).name)
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
            return
        name = signal.Signals(sig).name.removeprefix("SIG")
        try:
            result = _run(sched.signal_step_argv(step, name, scancel=self._scancel))
            if result.returncode != 0 and proc.poll() is None:
                logger.warning("%s exited %d: %s", " ".join(sched.signal_step_argv(step, name)), result.returncode,
                               result.stderr.strip())
        except subprocess.TimeoutExpired:
            logger.warning("scancel --signal=%s %s: no answer within %.0f s", name, step, SLURM_COMMAND_TIMEOUT_SECS)

    def stop(self, procs: Sequence[subprocess.Popen], grace_secs: float) -> None:
        running = [p for p in procs if p.poll() is None]
        for p in running:
            self.signal(p, signal.SIGCONT)      # a stopped (SIGSTOP) task acts on SIGTERM only once resumed
            self.signal(p, signal.SIGTERM)
        deadline = time.monotonic() + grace_secs
        while any(p.poll() is None for p in running) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in running if p.poll() is None]
        if left:
            logger.warning("still running %.1f s after SIGTERM, killing their srun: steps %s", grace_secs,
                           ", ".join(self.step_of(p) or f"pid {p.pid}" for p in left))
        for p in left:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
        for p in running:
            try:
                p.wait(_REAP_TIMEOUT_SECS)
            except subprocess.TimeoutExpired:
                logger.error("srun pid %d survived SIGKILL", p.pid)
