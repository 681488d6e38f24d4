"""Other ways to describe a cluster: TF_CONFIG JSON, the classic `--ps_hosts/--worker_hosts` flags, env.

Also `resolve_cluster`, which decides where a task process gets its cluster from, and the contract of a user's
command (`psworker run`, `-- COMMAND` on every backend and in pods): the placeholders `{job_name} {task_index}
{ps_hosts} {worker_hosts}` replaced in its argv (`fill_command`), and the same values as `PSWORKER_*` variables
(`command_env`), beside TF_CONFIG.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

from psworker.errors import SpecError, UsageError
from psworker.spec import ALL_JOBS, AUTO_PORT, JOBS, ClusterSpec, build_cluster, format_address, load_spec

TF_CONFIG_SOURCE = "TF_CONFIG"
FLAGS_SOURCE = "--flags"
SPEC_ENV = "PSWORKER_SPEC"
TF_CONFIG_ENV = "TF_CONFIG"
_TF_CONFIG_KEYS = ("cluster", "task", "environment", "rpc_layer")
_TASK_KEYS = ("type", "index", "trial")


def _count(n: int, job: str) -> str:
    noun = "worker" if job == "worker" else f"{job} task"
    return f"{n} {noun}{'' if n == 1 else 's'}"


def check_task(spec: ClusterSpec, job: str, index: int, what: str = "--task_index",
               jobs: tuple[str, ...] = JOBS) -> None:
    """Checks that `job` is a psworker job and `index` one of its tasks.

    Args:
        spec: the cluster.
        job: `ps` or `worker`.
        index: the task index.
        what: how the index was given, for the message (`--task_index`, `TF_CONFIG task.index`).
        jobs: the jobs allowed (default: psworker's own, ps and worker).

    Raises:
        UsageError: unknown job or index out of range; the message names both numbers.
    """
    if job not in jobs:
        raise UsageError(f"unknown job {job!r}; psworker jobs are {', '.join(jobs)}")
    n = len(spec.addresses(job))
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < n:
        raise UsageError(f"{what} {index} but the spec has {_count(n, job)} "
                         f"(valid: 0..{n - 1})")


def _require_fixed_ports(spec: ClusterSpec, target: str) -> None:
    for job in spec.jobs():
        for i, a in enumerate(spec.addresses(job)):
            if a.port == AUTO_PORT:
                raise SpecError(spec.source or "spec", f"cluster.{job}[{i}]",
                                f"automatic port {format_address(a)!r} cannot go into {target}; "
                                f"give fixed ports (only `psworker local` picks free ports)")


def to_tf_config(spec: ClusterSpec, job: str, index: int) -> dict[str, Any]:
    """Returns the TF_CONFIG dict for one task.

    Args:
        spec: the cluster; every port must be fixed.
        job: `ps`, `worker`, or `chief`/`evaluator` when the spec has them.
        index: the task index within the job.

    Returns:
        `{"cluster": {"ps": [...], "worker": [...]}, "task": {"type": job, "index": index}}`.

    Raises:
        UsageError: bad job or index. SpecError: the spec has automatic ports.
    """
    check_task(spec, job, index, jobs=ALL_JOBS)
    _require_fixed_ports(spec, "TF_CONFIG")
    return {"cluster": spec.as_dict(), "task": {"type": job, "index": index}}


def from_tf_config(json_text: str) -> tuple[ClusterSpec, Optional[str], Optional[int]]:
    """Parses a TF_CONFIG JSON string.

    Args:
        json_text: the value of the TF_CONFIG environment variable.

    Returns:
        `(spec, job, index)`; job and index are None when TF_CONFIG has no `task`.

    Raises:
        SpecError: (source `TF_CONFIG`) bad JSON, a `chief` or unknown job, bad addresses, bad task.
    """
    src = TF_CONFIG_SOURCE
    try:
        data = json.loads(json_text)
    except (json.JSONDecodeError, TypeError) as e:
        raise SpecError(src, "", f"is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise SpecError(src, "", f"expected a JSON object with 'cluster' and 'task', got {json_text!r}")
    for key in data:
        if key not in _TF_CONFIG_KEYS:
            raise SpecError(src, key, f"unknown key {key!r} (valid keys: {', '.join(_TF_CONFIG_KEYS)})")
    cluster = data.get("cluster")
    if not isinstance(cluster, dict):
        raise SpecError(src, "cluster", f"expected an object of job -> address list, got {cluster!r}")
    for job in cluster:
        if job == "chief":
            raise SpecError(src, "cluster.chief", "psworker has no 'chief' job; it uses worker 0 as the "
                                                  "chief, so put the chief's address first in 'worker'")
        if job not in JOBS:
            raise SpecError(src, f"cluster.{job}", f"unknown job type {job!r}; psworker runs only "
                                                   f"{' and '.join(JOBS)} jobs")
    spec = build_cluster(cluster.get("ps"), cluster.get("worker"), src)
    task = data.get("task")
    if task is None:
        return spec, None, None
    if not isinstance(task, dict):
        raise SpecError(src, "task", f"expected an object with 'type' and 'index', got {task!r}")
    for key in task:
        if key not in _TASK_KEYS:
            raise SpecError(src, f"task.{key}", f"unknown key {key!r} (valid keys: {', '.join(_TASK_KEYS)})")
    job, index = task.get("type"), task.get("index", 0)
    if job == "chief":
        raise SpecError(src, "task.type", "psworker has no 'chief' task; the chief is worker 0")
    if job not in JOBS:
        raise SpecError(src, "task.type", f"{job!r} is not one of {', '.join(JOBS)}")
    if isinstance(index, bool) or not isinstance(index, int):
        raise SpecError(src, "task.index", f"expected an integer, got {index!r}")
    n = len(spec.addresses(job))
    if not 0 <= index < n:
        raise SpecError(src, "task.index", f"{index} but the cluster has {_count(n, job)}")
    return spec, job, index


def to_flags(spec: ClusterSpec, job: str, index: int) -> list[str]:
    """Returns the classic TF flags for one task.

    Args:
        spec: the cluster; every port must be fixed.
        job: `ps` or `worker`.
        index: the task index.

    Returns:
        `["--ps_hosts=a:1,b:2", "--worker_hosts=...", "--job_name=worker", "--task_index=1"]`.

    Raises:
        UsageError: bad job or index. SpecError: the spec has automatic ports.
    """
    check_task(spec, job, index)
    _require_fixed_ports(spec, "--ps_hosts/--worker_hosts")
    hosts = spec.as_dict()
    return [f"--ps_hosts={','.join(hosts['ps'])}", f"--worker_hosts={','.join(hosts['worker'])}",
            f"--job_name={job}", f"--task_index={index}"]


def _split_hosts(hosts: Union[str, Sequence[str], None]) -> Any:
    if isinstance(hosts, str):
        return [h.strip() for h in hosts.split(",")] if hosts.strip() else []
    return list(hosts) if hosts is not None else None


def from_flags(ps_hosts: Union[str, Sequence[str]], worker_hosts: Union[str, Sequence[str]]) -> ClusterSpec:
    """Builds a spec from the classic comma-separated `--ps_hosts` and `--worker_hosts` values.

    Args:
        ps_hosts: `"a:1,b:2"` or a list of `host:port` strings.
        worker_hosts: likewise; the first one is the chief.

    Returns:
        The validated ClusterSpec (source `--flags`, default train settings).

    Raises:
        SpecError: bad, missing or duplicate addresses; field paths are `--ps_hosts[i]`.
    """
    return build_cluster(_split_hosts(ps_hosts), _split_hosts(worker_hosts), FLAGS_SOURCE,
                         ps_path="--ps_hosts", worker_path="--worker_hosts")


def _check_sources(job: str, spec_path: Optional[str], ps_hosts: Optional[str], worker_hosts: Optional[str],
                   job_name: Optional[str]) -> bool:
    """Checks the command-line sources of `resolve_cluster`; returns whether the host flags are given.

    Raises:
        UsageError: an unknown or disagreeing job, --spec with the host flags, or only one host flag.
    """
    if job not in JOBS:
        raise UsageError(f"unknown job {job!r}; psworker jobs are {', '.join(JOBS)}")
    if job_name is not None and job_name != job:
        raise UsageError(f"--job_name {job_name} disagrees with the '{job}' command")
    has_flags = ps_hosts is not None or worker_hosts is not None
    if spec_path is not None and has_flags:
        raise UsageError("give either --spec or --ps_hosts/--worker_hosts, not both")
    if has_flags and (ps_hosts is None or worker_hosts is None):
        missing = "--worker_hosts" if worker_hosts is None else "--ps_hosts"
        raise UsageError(f"{missing} is required with --ps_hosts/--worker_hosts")
    return has_flags


def resolve_cluster(job: str, *, spec_path: Optional[str] = None, ps_hosts: Optional[str] = None,
                    worker_hosts: Optional[str] = None, job_name: Optional[str] = None,
                    task_index: Optional[int] = None,
                    environ: Optional[Mapping[str, str]] = None) -> tuple[ClusterSpec, int]:
    """Finds the cluster and task index of a `psworker ps|worker` process.

    Precedence: `--spec` or `--ps_hosts/--worker_hosts` (not both) > env PSWORKER_SPEC (a spec path)
    > env TF_CONFIG. `--task_index` beats TF_CONFIG's index.

    Args:
        job: the subcommand, `ps` or `worker`.
        spec_path: `--spec`.
        ps_hosts: `--ps_hosts`.
        worker_hosts: `--worker_hosts`.
        job_name: `--job_name`; must agree with `job` when given.
        task_index: `--task_index`.
        environ: the environment (default `os.environ`).

    Returns:
        `(spec, index)`.

    Raises:
        UsageError: conflicting sources, a disagreeing job, a missing or out-of-range index, no source.
        SpecError: the chosen source is invalid.
    """
    env = os.environ if environ is None else environ
    has_flags = _check_sources(job, spec_path, ps_hosts, worker_hosts, job_name)
    index, what = task_index, "--task_index"
    if spec_path is not None:
        spec, origin = load_spec(spec_path), "--spec"
    elif has_flags:
        spec, origin = from_flags(ps_hosts, worker_hosts), "--ps_hosts/--worker_hosts"
    elif env.get(SPEC_ENV):
        spec, origin = load_spec(env[SPEC_ENV]), f"{SPEC_ENV}"
    elif env.get(TF_CONFIG_ENV):
        spec, tf_job, tf_index = from_tf_config(env[TF_CONFIG_ENV])
        origin = TF_CONFIG_ENV
        if tf_job is not None and tf_job != job:
            raise UsageError(f"TF_CONFIG task type '{tf_job}' disagrees with the '{job}' command")
        if index is None and tf_index is not None:
            index, what = tf_index, "TF_CONFIG task.index"
    else:
        raise UsageError(f"no cluster given for the '{job}' command; use one of: --spec FILE "
                         f"(or --ps_hosts/--worker_hosts), env {SPEC_ENV}=FILE, or env TF_CONFIG")
    if index is None:
        raise UsageError(f"--task_index is required with {origin}")
    if index < 0:
        raise UsageError(f"{what} {index} must be >= 0")
    check_task(spec, job, index, what)
    # A task started by itself cannot learn a port another task picked: only `psworker local` resolves `auto`.
    _require_fixed_ports(spec, f"a {job} task started by itself")
    return spec, index


def command_values(spec: ClusterSpec, job: str, index: Union[int, str], train_dir: str = "") -> dict[str, str]:
    """The placeholder values of one task of a user's command (`index` may be text a pod expands itself;
    `train_dir`: the run's, as the launcher knows it)."""
    return {"job_name": job, "task_index": str(index),
            "ps_hosts": ",".join(str(a) for a in spec.ps), "worker_hosts": ",".join(str(a) for a in spec.worker),
            "train_dir": train_dir}


def fill_command(command: Sequence[str], values: Mapping[str, str]) -> list[str]:
    """`command` with every `{placeholder}` replaced by its value."""
    out = []
    for arg in command:
        for key, value in values.items():
            arg = arg.replace("{" + key + "}", value)
        out.append(arg)
    return out


def command_env(values: Mapping[str, str]) -> dict[str, str]:
    """The `PSWORKER_JOB_NAME`, `PSWORKER_TASK_INDEX`, `PSWORKER_PS_HOSTS`, `PSWORKER_WORKER_HOSTS`,
    `PSWORKER_TRAIN_DIR` of a task."""
    return {f"PSWORKER_{key.upper()}": value for key, value in values.items()}


__all__ = ["to_tf_config", "from_tf_config", "to_flags", "from_flags", "resolve_cluster", "check_task",
           "SPEC_ENV", "TF_CONFIG_ENV", "command_values", "fill_command", "command_env"]
