"""Planning: pure functions from a spec to task processes, and from task counts to addresses (`layout`)."""

from __future__ import annotations

import dataclasses
import math
import os
import shlex
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, TypeVar, Union

from psworker.errors import SpecError
from psworker.spec.fast_path import fast_path
from psworker.spec import (SCRIPT_JOBS, Address, ClusterSpec, CountSpec, build_cluster, check_elastic,
                           format_address, merge_train, parse_address)

HOSTS_SOURCE = "--hosts"
AnySpec = TypeVar("AnySpec", ClusterSpec, CountSpec)

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
    def host(self) -> str:
        """The host of the task's address."""
        return self.address.host

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
    workers = f"{len(spec.worker)} workers" + (f" (elastic: {spec.elastic.describe()})" if spec.elastic else "")
    header = (f"cluster {spec.source or ''}: {len(spec.ps)} ps, {workers}; "
              f"model {t.model}, mode {t.mode}, max_steps {t.max_steps}, batch_size {t.batch_size}")
    rows = [("TASK", "ADDRESS", "ROLE", "COMMAND")]
    rows += [(k.name, format_address(k.address), k.role, shlex.join(k.argv)) for k in tasks]
    widths = [max(len(r[c]) for r in rows) for c in range(3)]
    lines = [header, *fast_path(t).lines(), ""]
    lines += ["  ".join(r[c].ljust(widths[c]) for c in range(3)) + "  " + r[3] for r in rows]
    if any(k.address.port == 0 for k in tasks):
        lines += ["", "ports shown as 'auto' are chosen when `psworker local` starts the cluster; tasks started "
                      "by hand (below) need fixed ports in the spec"]
    if spec.elastic is not None and spec.elastic.start < spec.elastic.max:
        lines += ["", f"`psworker local` starts worker:0-{spec.elastic.start - 1}; the others start when the run is "
                      f"scaled up (`psworker scale RUN_DIR --workers N`, {spec.elastic.min} <= N <= "
                      f"{spec.elastic.max}); their addresses are reserved from the start"]
    lines += ["", "equivalent shell launchers (one per host):"]
    lines += [f"  {k.name:<{widths[0]}}  {shell_equivalent(k)}" for k in tasks]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- layout

def task_counts(spec: Union[ClusterSpec, CountSpec]) -> dict[str, int]:
    """`{job: number of tasks}` of either kind of spec, in JOBS order, jobs with no tasks left out."""
    if isinstance(spec, CountSpec):
        return {job: n for job, n in spec.counts if n}
    return {job: len(spec.addresses(job)) for job in spec.jobs()}


def with_train(spec: AnySpec, overrides: Mapping[str, Any], source: str = "--flags") -> AnySpec:
    """The spec with training settings applied (a command's flags: None values are left out): the one merge of
    every command (launchers, tasks, manifests, a Slurm submission), checked against the worker job's size
    (`replicas_to_aggregate`) and its elastic range.

    Raises:
        SpecError: a bad value, or a rule across settings and the cluster broken.
    """
    workers = task_counts(spec).get("worker", 0)
    train = merge_train(spec.train, overrides, source, num_workers=workers)
    check_elastic(getattr(spec, "elastic", None), train, source, workers)
    return dataclasses.replace(spec, train=train)


def chief_name(names: Iterable[str]) -> Optional[str]:
    """The chief among task `names`, as TensorFlow and Kubeflow's TFJob take it: `chief:0` when there is a chief job,
    else `worker:0` (None when neither is there)."""
    names = set(names)
    return "chief:0" if "chief:0" in names else "worker:0" if "worker:0" in names else None


def placeholder_hosts(n: int) -> list[str]:
    """`node0 .. node{n-1}`, zero-padded so that sorting by name (as layout does) keeps their order."""
    width = len(str(max(n - 1, 0)))
    return [f"node{i:0{width}d}" for i in range(n)]


def nodes_needed(spec: CountSpec, tasks_per_node: int) -> int:
    """How many hosts `tasks_per_node` tasks each take to hold every task of `spec`."""
    return math.ceil(sum(n for _, n in spec.counts) / tasks_per_node)


def layout(spec: CountSpec, hosts: Sequence[str],
           tasks_per_node: Union[int, Sequence[int]] = 1) -> ClusterSpec:
    """Assigns the tasks of a count spec to hosts, exactly as TensorFlow's SlurmClusterResolver does.

    The resolver's rules: hosts are taken in order of their names (`sorted`), each offering `tasks_per_node`
    slots with ports `port, port+1, ...`; jobs are taken in order of their names too (`chief`, `evaluator`,
    `ps`, `worker`), each filling the next slots. So `SlurmClusterResolver(jobs=counts, port_base=spec.port,
    tasks_per_node=...)` on the same nodes writes the same TF_CONFIG cluster, and the task of Slurm rank R is
    `task_of_rank(spec, R)`. One difference: the resolver refuses spare slots; here the last ones stay free.

    Args:
        spec: the counts, base port and train settings.
        hosts: the allocation's host names (no duplicates; any order).
        tasks_per_node: slots per host: one number for all, or one per host in `hosts` order
            (Slurm's expanded SLURM_STEP_TASKS_PER_NODE).

    Returns:
        A validated ClusterSpec with fixed addresses, the spec's train settings and source.

    Raises:
        SpecError: a bad or duplicate host, a bad slot count, fewer slots than tasks ("requested N tasks,
            only M slots"), or a port past 65535.
    """
    hosts = list(hosts)
    per_host = [tasks_per_node] * len(hosts) if isinstance(tasks_per_node, int) else list(tasks_per_node)
    if len(per_host) != len(hosts):
        raise SpecError(HOSTS_SOURCE, "--tasks_per_node", f"{len(per_host)} slot counts for {len(hosts)} hosts")
    seen: dict[str, int] = {}
    for i, (host, n) in enumerate(zip(hosts, per_host)):
        parse_address(f"{host}:{spec.port}", f"{HOSTS_SOURCE}[{i}]", HOSTS_SOURCE)   # a host name, no port
        if host in seen:
            raise SpecError(HOSTS_SOURCE, f"{HOSTS_SOURCE}[{i}]", f"duplicate host {host!r} (also at [{seen[host]}])")
        seen[host] = i
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise SpecError(HOSTS_SOURCE, "--tasks_per_node", f"must be an integer >= 1, got {n!r}")
    slots = [f"{host}:{spec.port + i}" for host, n in sorted(zip(hosts, per_host)) for i in range(n)]
    wanted = sum(n for _, n in spec.counts)
    if wanted > len(slots):
        raise SpecError(spec.source or "spec", "cluster",
                        f"requested {wanted} tasks, only {len(slots)} slots ({len(hosts)} hosts, "
                        f"{'/'.join(map(str, sorted(set(per_host)))) or 0} tasks per node)")
    addresses: dict[str, list[str]] = {}
    start = 0
    for job, n in sorted(spec.counts):
        addresses[job], start = slots[start:start + n], start + n
    cluster = build_cluster(addresses["ps"], addresses["worker"], HOSTS_SOURCE, train=spec.train,
                            ps_path="cluster.ps", worker_path="cluster.worker")
    single = {job: tuple(parse_address(a, f"cluster.{job}[{i}]", HOSTS_SOURCE) for i, a in enumerate(found))
              for job, found in addresses.items() if job not in ("ps", "worker")}   # chief, evaluator
    return ClusterSpec(cluster.ps, cluster.worker, spec.train, spec.source, elastic=spec.elastic, **single)


def task_of_rank(spec: CountSpec, rank: int) -> tuple[str, int]:
    """`(job, index)` of the task that Slurm rank `rank` runs under `layout` (the resolver's get_task_info).

    Raises:
        SpecError: `rank` is not one of the spec's tasks.
    """
    start = 0
    for job, n in sorted(spec.counts):
        if start <= rank < start + n:
            return job, rank - start
        start += n
    raise SpecError("SLURM_PROCID", "", f"rank {rank} is not between 0 and {start - 1}")


def format_layout(spec: CountSpec, cluster: ClusterSpec, hosts: Sequence[str],
                  tasks_per_node: Union[int, Sequence[int]], spec_path: str) -> str:
    """Renders a count spec laid out on hosts: the rules used, the task table, and the laid-out spec."""
    from psworker.spec import dump_spec
    laid_out = f"{os.path.splitext(os.path.basename(spec_path))[0]}.layout.yaml"
    counts = ", ".join(f"{job}: {n}" for job, n in spec.counts)
    lines = [f"{spec_path}: task counts ({counts}) laid out on {', '.join(hosts)} like TensorFlow's "
             f"SlurmClusterResolver(port_base={spec.port}, tasks_per_node={tasks_per_node}): hosts and jobs "
             f"in name order, ports {spec.port}+ on each host", ""]
    lines.append(format_plan(cluster, plan(cluster, laid_out)))
    lines += ["", f"# {laid_out}: the laid-out spec those commands read", dump_spec(cluster).rstrip()]
    return "\n".join(lines)


__all__ = ["Task", "plan", "format_plan", "shell_equivalent", "layout", "task_of_rank", "task_counts", "with_train",
           "chief_name", "placeholder_hosts", "nodes_needed", "format_layout"]
