"""`psworker run SPEC -- COMMAND...`: one process per task of the spec running the user's own command, told which
task it is the ways distributed-TensorFlow programs expect.

Each task's environment has `TF_CONFIG` (cluster and task, as `psworker tf-config` prints it) and
`PSWORKER_JOB_NAME`, `PSWORKER_TASK_INDEX`, `PSWORKER_PS_HOSTS`, `PSWORKER_WORKER_HOSTS` (comma-separated
host:port lists) and `PSWORKER_TRAIN_DIR`; in COMMAND the placeholders `{job_name} {task_index} {ps_hosts}
{worker_hosts} {train_dir}` are replaced, so a classic script with `--ps_hosts/--worker_hosts/--job_name/
--task_index` flags runs unchanged, and writes its checkpoints into the run's train dir when given `{train_dir}`.
"""

from __future__ import annotations

import json
from typing import Sequence

from psworker.spec.interop import command_env, command_values, fill_command, to_tf_config
from psworker.spec.plan import Task
from psworker.spec import ClusterSpec, format_address

__all__ = ["command_tasks", "format_command_plan", "names_train_dir", "worker_warnings"]


def names_train_dir(command: Sequence[str]) -> bool:
    """Whether the command is told the run's train dir (`{train_dir}`): only then does the launcher know where its
    checkpoints are."""
    return any("{train_dir}" in arg for arg in command)


def worker_warnings(never_stepped: Sequence[str], stopped: Sequence[str]) -> list[str]:
    """What a successful run of a user's command says about its workers (and chief) that printed no step line
    (they may never have trained) or did not exit by themselves (the launcher stopped them), a line per kind."""
    from psworker.launcher.console.lines import format_tasks

    both = [n for n in never_stepped if n in stopped]
    lines = []
    if both:
        lines.append(f"{format_tasks(both)}: no step line, and the launcher stopped it: it may never have trained "
                     "(a TF1 non-chief without device filters waits for the chief's session forever; see "
                     "docs/running.md, 'psworker run')")
    if [n for n in never_stepped if n not in both]:
        lines.append(f"{format_tasks(n for n in never_stepped if n not in both)}: exited without printing a step "
                     "line (no progress seen)")
    if [n for n in stopped if n not in both]:
        lines.append(f"{format_tasks(n for n in stopped if n not in both)}: did not exit by itself; the launcher "
                     "stopped it after the run had succeeded")
    return lines


def command_tasks(spec: ClusterSpec, command: Sequence[str], train_dir: str = "") -> list[Task]:
    """One Task per task of `spec` (chief, ps, worker, evaluator order), each running `command`.

    Args:
        spec: the cluster, with every port fixed (as a local run resolves it).
        command: argv of the user's program; placeholders are replaced per task.
        train_dir: the run's train dir (`{train_dir}`, `PSWORKER_TRAIN_DIR`).

    Returns:
        The tasks, in start order. The chief is the `chief` task, else worker 0.
    """
    tasks = []
    has_chief = bool(spec.chief)
    for job in spec.jobs():
        for i, address in enumerate(spec.addresses(job)):
            values = command_values(spec, job, i, train_dir)
            env = {"TF_CONFIG": json.dumps(to_tf_config(spec, job, i)), **command_env(values)}
            is_chief = job == "chief" or (not has_chief and job == "worker" and i == 0)
            tasks.append(Task(job, i, address, is_chief, tuple(fill_command(command, values)), tuple(env.items())))
    return tasks


def format_command_plan(spec: ClusterSpec) -> str:
    """The task table of a spec whose tasks run a user's script (`psworker run`)."""
    rows = [("TASK", "ADDRESS", "TF_CONFIG task")]
    rows += [(f"{job}:{i}", format_address(a), json.dumps({"type": job, "index": i}))
             for job in spec.jobs() for i, a in enumerate(spec.addresses(job))]
    widths = [max(len(r[c]) for r in rows) for c in range(2)]
    jobs = ", ".join(f"{len(spec.addresses(j))} {j}" for j in spec.jobs())
    lines = [f"cluster {spec.source or ''}: {jobs}; tasks run a script: psworker run SPEC -- python train.py ...", ""]
    lines += [f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]}" for r in rows]
    lines += ["", "each task gets TF_CONFIG (see `psworker tf-config SPEC --job J --task_index I`) and "
                  "PSWORKER_JOB_NAME, PSWORKER_TASK_INDEX, PSWORKER_PS_HOSTS, PSWORKER_WORKER_HOSTS, "
                  "PSWORKER_TRAIN_DIR"]
    return "\n".join(lines)
