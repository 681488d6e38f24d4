"""Planning: a pure function from a ClusterSpec to the list of task processes to start."""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Union

from psworker.errors import SpecError
from psworker.spec import SCRIPT_JOBS, Address, ClusterSpec, format_address

LAUNCH_SCRIPTS = {"ps": "launch/start_ps.sh", "worker": "launch/start_worker.sh"}


@dataclass(frozen=True)
class Task:
    """One process to start: which task it is, where it listens, and how to run it."""

    job: str
    index: int
    address: Address
    is_chief: bool
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]

    @property
    def name(self) -> str:
        """`worker:1`: the task's name in logs and results."""
        return f"{self.job}:{self.index}"

    @property
    def role(self) -> str:
        """`ps`, `worker (chief)` or `worker`."""
        return "worker (chief)" if self.is_chief else self.job


def plan(spec: ClusterSpec, spec_path: Union[str, os.PathLike], *, python: str = sys.executable,
         extra_env: Union[Mapping[str, str], Iterable[tuple[str, str]]] = ()) -> list[Task]:
    """Lists the tasks of a cluster, ps first, then workers (worker 0 is the chief).

    Each task runs `python -m psworker ps|worker --spec SPEC_PATH --task_index I`; the train settings
    travel in the spec file, so `spec_path` must hold `spec` (with automatic ports already chosen).

    Args:
        spec: the cluster.
        spec_path: the spec file the tasks read.
        python: the interpreter to run.
        extra_env: extra environment variables for every task (a mapping or `(name, value)` pairs).

    Returns:
        One Task per process, in start order.

    Raises:
        SpecError: the spec has chief or evaluator jobs (psworker's trainer makes worker 0 the chief).
    """
    for job in SCRIPT_JOBS:
        if spec.addresses(job):
            raise SpecError(spec.source or "spec", f"cluster.{job}",
                            f"psworker's own trainer has no '{job}' job (worker 0 is the chief); a spec with "
                            f"chief or evaluator jobs runs your script: psworker run SPEC -- python train.py")
    pairs = extra_env.items() if isinstance(extra_env, Mapping) else extra_env
    env = {"PYTHONUNBUFFERED": "1"}
    env.update((str(k), str(v)) for k, v in pairs)
    env_t = tuple(env.items())
    path = os.fspath(spec_path)
    tasks = []
    for job in ("ps", "worker"):
        for i, address in enumerate(spec.addresses(job)):
            argv = (python, "-m", "psworker", job, "--spec", path, "--task_index", str(i))
            tasks.append(Task(job, i, address, job == "worker" and i == 0, argv, env_t))
    return tasks


def shell_equivalent(task: Task) -> str:
    """The `launch/start_ps.sh --spec S --task_index N` line that starts the same task by hand."""
    spec_path = task.argv[task.argv.index("--spec") + 1] if "--spec" in task.argv else "SPEC"
    return shlex.join([LAUNCH_SCRIPTS[task.job], "--spec", spec_path, "--task_index", str(task.index)])


def format_plan(spec: ClusterSpec, tasks: list[Task]) -> str:
    """Renders a plan for people: a table of tasks and the equivalent launch-script lines.

    Args:
        spec: the cluster the tasks came from.
        tasks: `plan(spec, ...)`.

    Returns:
        Multi-line text (no trailing newline).
    """
    t = spec.train
    header = (f"cluster {spec.source or ''}: {len(spec.ps)} ps, {len(spec.worker)} workers; "
              f"model {t.model}, mode {t.mode}, max_steps {t.max_steps}, batch_size {t.batch_size}")
    rows = [("TASK", "ADDRESS", "ROLE", "COMMAND")]
    rows += [(k.name, format_address(k.address), k.role, shlex.join(k.argv)) for k in tasks]
    widths = [max(len(r[c]) for r in rows) for c in range(3)]
    lines = [header, ""]
    lines += ["  ".join(r[c].ljust(widths[c]) for c in range(3)) + "  " + r[3] for r in rows]
    if any(k.address.port == 0 for k in tasks):
        lines += ["", "ports shown as 'auto' are chosen when `psworker local` starts the cluster; tasks started "
                      "by hand (below) need fixed ports in the spec"]
    lines += ["", "equivalent shell launchers (one per host):"]
    lines += [f"  {k.name:<{widths[0]}}  {shell_equivalent(k)}" for k in tasks]
    return "\n".join(lines)


__all__ = ["Task", "plan", "format_plan", "shell_equivalent"]
