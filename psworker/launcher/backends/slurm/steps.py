"""The `srun` steps of an allocation: the argv that starts one task as its own step on its node
(`--nodes=1 --ntasks=1 --nodelist=HOST --overlap`, so a task restarted by the launcher is a new step of the same
allocation), finding a step in `squeue --steps`, and signalling one step with `scancel`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Protocol

from psworker.errors import UsageError

__all__ = ["NOT_YET", "parse_steps", "signal_step_argv", "srun_argv", "step_job_name", "steps_argv"]


# scancel's error for a step that squeue lists but whose slurmstepd does not take signals yet (its first ~0.1 s)
NOT_YET = "Invalid job id specified"


class Placed(Protocol):
    """What `srun_argv` needs of a task: which it is and its node."""

    @property
    def job(self) -> str: ...
    @property
    def index(self) -> int: ...
    @property
    def host(self) -> str: ...


def step_job_name(job: str, index: int) -> str:
    """`psworker-worker-1`: a task's step name (`squeue --steps` shows it)."""
    return f"psworker-{job}-{index}"


def srun_argv(task: Placed, argv: Sequence[str], *, srun: str = "srun",
              extra: Sequence[str] = ()) -> list[str]:
    """The argv that starts one task as its own step of the current allocation, on its node:
    `srun --nodes=1 --ntasks=1 --nodelist=HOST --overlap --job-name=psworker-worker-1 ... -- ARGV`.

    Run it from inside the allocation (the batch script). The step inherits srun's own environment
    (`--export=ALL`), so pass the task's variables in srun's environment. The task's stdout and stderr come out
    of srun's (`--unbuffered`); srun's exit status is the task's. Each (re)start is a new step.

    Args:
        task: which task runs where: a `psworker.spec.plan.Task` (its `host`).
        argv: the task's command, e.g. `[python, "-m", "psworker", "worker", ...]`.
        extra: more srun options (placed before `--`), e.g. `("--cpus-per-task=2",)`.
    """
    if not argv:
        raise UsageError("srun: empty task argv")
    return [srun, "--nodes=1", "--ntasks=1", f"--nodelist={task.host}", "--overlap",
            f"--job-name={step_job_name(task.job, task.index)}", "--export=ALL", "--unbuffered",
            *extra, "--", *argv]


def steps_argv(job_id: str, *, squeue: str = "squeue") -> list[str]:
    """`squeue --steps -h -o '%i %j' -j JOB`: the running steps of a job, one `JOB.STEP NAME` per line."""
    return [squeue, "--steps", "-h", "-o", "%i %j", "-j", str(job_id)]


def parse_steps(text: str) -> list[tuple[str, str]]:
    """`steps_argv`'s output -> `(JOB.STEP, step name)` per step in squeue's order (e.g. `("12.3",
    "psworker-worker-1")`); a name may repeat while a restarted task's old step is still listed."""
    pairs = (line.split(None, 1) for line in text.splitlines())
    return [(parts[0], parts[1].strip()) for parts in pairs if len(parts) == 2]


def signal_step_argv(step: str, signal: str = "TERM", *, scancel: str = "scancel") -> list[str]:
    """`scancel --signal=TERM JOB.STEP`: delivers the signal to the step's task (which may handle it; srun then
    exits with the task's status). Without it, any signal that ends srun itself (TERM, KILL) cancels the step
    with SIGKILL: no grace period."""
    if not re.fullmatch(r"\d+\.\d+", step):
        raise UsageError(f"step {step!r}: expected JOB.STEP, e.g. 12.3")
    return [scancel, f"--signal={signal}", step]
