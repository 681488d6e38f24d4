"""The Slurm backend: inside an allocation, each task runs as its own `srun` step on the node TensorFlow's
SlurmClusterResolver gives it (`allocation`, `psworker.spec.plan.layout`), so a restart is a new step of the same task
(`steps`). The batch job that runs it is written and queued by `job`.

start runs `srun ... --nodelist=HOST --job-name=psworker-JOB-I -- ARGV` (srun's exit status is the task's, its
`--unbuffered` stdout the task's output); a signal goes to the step with `scancel --signal=SIG JOB.STEP`; the
hard end kills srun, which cancels its step at once.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Mapping, Optional, Sequence

from psworker.deadline import poll_until
from psworker.errors import UsageError
from psworker.launcher.backends.base import Backend, popen_task
from psworker.launcher.backends.slurm import allocation, steps
from psworker.spec.plan import Task, layout
from psworker.spec import ClusterSpec, CountSpec

__all__ = ["SlurmBackend", "SlurmOptions"]

logger = logging.getLogger(__name__)

STEP_LOOKUP_SECS = 30.0               # how long to look for a just-started step in squeue
SLURM_COMMAND_TIMEOUT_SECS = 30.0
STEP_RETRY_SECS = 0.2                 # between scancels of a step whose slurmstepd is not up yet


@dataclass(frozen=True)
class SlurmOptions:
    """How the slurm backend lays the tasks out on its allocation (read from the environment)."""

    BACKEND: ClassVar[str] = "slurm"

    port_base: Optional[int] = None      # first port on each node; None: the spec's cluster.port, else 2222
    srun: str = "srun"
    squeue: str = "squeue"
    scancel: str = "scancel"


def _run(argv: Sequence[str]) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          timeout=SLURM_COMMAND_TIMEOUT_SECS)


class SlurmBackend(Backend):
    """Starts each task as an srun step of the allocation this launcher runs in. The step of each start is looked
    up in `squeue --steps` (in a thread) and logged, so each (re)start of a task shows its own step id."""

    Options = SlurmOptions
    HARD_END = "killing their srun"

    def __init__(self, options: Optional[SlurmOptions] = None, *, python: str = sys.executable) -> None:
        super().__init__(options, python=python)
        self._job_id = ""
        self._lock = threading.Lock()
        self._steps: dict[int, str] = {}                 # srun pid -> JOB.STEP
        self._found: dict[int, threading.Event] = {}

    def place(self, spec: ClusterSpec | CountSpec, run_dir: Path) -> ClusterSpec:
        """The spec laid out on the allocation of this environment (SLURM_JOB_NODELIST, SLURM_TASKS_PER_NODE)
        by TensorFlow's SlurmClusterResolver rules; a listed spec's hosts are replaced, its task counts kept.

        Raises:
            UsageError: not inside an allocation, or its task count differs from the spec's.
        """
        self._job_id = os.environ.get("SLURM_JOB_ID", "")
        if not self._job_id:
            raise UsageError("SLURM_JOB_ID not set: `psworker slurm launch` runs inside an allocation "
                             "(the sbatch script `psworker slurm submit` writes, or salloc)")
        counts = allocation.count_spec(spec, self.options.port_base)
        nodes, per_node = allocation.allocation_from_environ(os.environ)
        placed = layout(counts, nodes, allocation.check_allocation(counts, nodes, per_node))
        return dataclasses.replace(placed, train=dataclasses.replace(
            placed.train, train_dir=placed.train.train_dir or str(run_dir)))

    def banner(self, tasks: Sequence[Task], log_dir: Path) -> str:
        where = ", ".join(f"{t.name}={t.address.host}:{t.address.port}" for t in tasks)
        return f"Slurm job {self._job_id}: starting {len(tasks)} tasks as srun steps ({where}); logs in {log_dir}"

    def start(self, task: Task, env: Mapping[str, str]) -> subprocess.Popen:
        proc = popen_task(subprocess.Popen, steps.srun_argv(task, task.argv, srun=self.options.srun),
                          {**os.environ, **env})
        with self._lock:
            self._found[proc.pid] = threading.Event()
            taken = set(self._steps.values())
        threading.Thread(target=self._find_step, args=(proc, task, taken), daemon=True,
                         name=f"psworker-step-{task.name}").start()
        return proc

    def step_of(self, proc: subprocess.Popen, timeout: float = 0.0) -> Optional[str]:
        """The `JOB.STEP` id of the step `proc` (an srun) started, once seen in squeue; None before."""
        found = self._found.get(proc.pid)
        if found is not None and timeout > 0:
            found.wait(timeout)
        with self._lock:
            return self._steps.get(proc.pid)

    def _new_step(self, name: str, taken: set) -> Optional[str]:
        """The id of a running step called `name` that is not in `taken`, from one squeue call; None if none."""
        try:
            result = _run(steps.steps_argv(self._job_id, squeue=self.options.squeue))
        except (OSError, subprocess.TimeoutExpired):
            return None
        listed = steps.parse_steps(result.stdout) if result.returncode == 0 else []
        new = [step for step, named in listed if named == name and step not in taken]
        return new[-1] if new else None

    def _find_step(self, proc: subprocess.Popen, task: Task, taken: set) -> None:
        name = steps.step_job_name(task.job, task.index)
        try:
            step = poll_until(lambda: proc.poll() is not None or self._new_step(name, taken), STEP_LOOKUP_SECS,
                              interval=0.5)
            if isinstance(step, str):
                with self._lock:
                    self._steps[proc.pid] = step
                logger.info("%s runs as Slurm step %s (%s)", task.name, step, name)
            elif proc.poll() is None:
                logger.warning("%s: step %s not seen in squeue within %.0f s", task.name, name, STEP_LOOKUP_SECS)
        finally:
            self._found[proc.pid].set()

    def signal(self, proc: subprocess.Popen, sig: int) -> None:
        if proc.poll() is not None:
            return                              # srun gone: its step is gone too
        step = None if sig == signal.SIGKILL else self.step_of(proc, timeout=STEP_LOOKUP_SECS)
        if step is None:
            if sig != signal.SIGKILL:
                logger.warning("no Slurm step known for srun pid %d; sending %s to srun itself", proc.pid,
                               signal.Signals(sig).name)
            try:
                proc.send_signal(sig)           # SIGKILL: ending srun cancels its step at once
            except ProcessLookupError:
                pass
            return
        argv = steps.signal_step_argv(step, signal.Signals(sig).name.removeprefix("SIG"), scancel=self.options.scancel)
        try:
            result = self._scancel(argv, proc)
            if result.returncode != 0 and proc.poll() is None:
                logger.warning("%s exited %d: %s", " ".join(argv), result.returncode, result.stderr.strip())
        except subprocess.TimeoutExpired:
            logger.warning("%s: no answer within %.0f s", " ".join(argv), SLURM_COMMAND_TIMEOUT_SECS)

    @staticmethod
    def _scancel(argv: Sequence[str], proc: subprocess.Popen) -> subprocess.CompletedProcess:
        """Runs `argv` (a scancel); again while slurmd says the step is not there (`Invalid job id`) and its srun
        runs, for up to `STEP_LOOKUP_SECS`: squeue lists a step before its slurmstepd takes signals (a stop
        injected at time 0 was lost so, and the run went on unstopped)."""
        results = []

        def settled() -> bool:
            results.append(_run(argv))
            return results[-1].returncode == 0 or steps.NOT_YET not in results[-1].stderr or proc.poll() is not None

        poll_until(settled, STEP_LOOKUP_SECS, interval=STEP_RETRY_SECS)
        return results[-1]

    def alive(self, procs: Sequence[subprocess.Popen]) -> list[str]:
        return [self.step_of(p) or f"srun pid {p.pid}" for p in procs if p.poll() is None]
