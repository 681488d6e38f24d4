"""`psworker run SPEC -- COMMAND...`: one process per task of the spec running the user's own command, told which
task it is the ways distributed-TensorFlow programs expect.

Each task's environment has `TF_CONFIG` (cluster and task, as `psworker tf-config` prints it) and
`PSWORKER_JOB_NAME`, `PSWORKER_TASK_INDEX`, `PSWORKER_PS_HOSTS`, `PSWORKER_WORKER_HOSTS` (comma-separated
host:port lists); in COMMAND the placeholders `{job_name} {task_index} {ps_hosts} {worker_hosts}` are replaced,
so a classic script with `--ps_hosts/--worker_hosts/--job_name/--task_index` flags runs unchanged.
"""

from __future__ import annotations

import json
from typing import Sequence

from psworker.interop import command_env, command_values, fill_command, to_tf_config
from psworker.plan import Task
from psworker.spec import ClusterSpec, format_address

__all__ = ["command_tasks", "format_command_plan"]


def command_tasks(spec: ClusterSpec, command: Sequence[str]) -> list[Task]:
    """One Task per task of `spec` (chief, ps, worker, evaluator order), each running `command`.

    Args:
        spec: the cluster, with every port fixed (as a local run resolves it).
        command: argv of the user's program; placeholders are replaced per task.

    Returns:
        The tasks, in start order. The chief is the `chief` task, else worker 0.
    """
    tasks = []
    has_chief = bool(spec.chief)
    for job in spec.jobs():
        for i, address in enumerate(spec.addresses(job)):
            values = command_values(spec, job, i)
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
                  "PSWORKER_JOB_NAME, PSWORKER_TASK_INDEX, PSWORKER_PS_HOSTS, PSWORKER_WORKER_HOSTS"]
    return "\n".join(lines)
