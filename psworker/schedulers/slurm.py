"""Slurm: the sbatch script `psworker slurm submit` writes and submits, TensorFlow's task layout over an
allocation, and the `srun` argv that starts one task as its own job step.

Layout rules are TensorFlow's `SlurmClusterResolver` (tensorflow/python/distribute/cluster_resolver/
slurm_cluster_resolver.py), implemented once in `psworker.plan.layout`, so a cluster psworker lays out equals
the one the resolver computes:

- nodes come from the expanded hostlist, paired in order with the expanded tasks-per-node list
  (`SLURM_TASKS_PER_NODE`, e.g. `2(x3),1`);
- task addresses are made node by node in **sorted hostname order** (string order: `node10` before `node9`),
  `port_base + k` for the k-th task on a node (the spec's `port`, psworker's default 2222; TF's is 8888);
- jobs take consecutive slices of that list in **sorted job-name order** (`ps` before `worker`), and the
  number of tasks of all jobs must equal the allocation's task count.

One `srun` step per task (`--nodes=1 --ntasks=1 --nodelist=HOST --overlap`), so a task restarted by the
launcher is a new step of the same allocation, and each step can be signalled or cancelled on its own.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
import shlex
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Protocol, Union

from psworker import plan
from psworker.errors import SubmitError, UsageError
from psworker.spec import DEFAULT_PORT_BASE, JOBS, ClusterSpec, CountSpec

__all__ = ["SbatchOptions", "SlurmTask", "SubmitError", "allocation_from_environ", "check_allocation", "check_nodes",
           "check_sbatch_value", "check_time", "cluster_dict", "count_spec",
           "expand_hostlist", "expand_tasks_per_node", "layout", "launch_argv", "parse_steps", "sbatch_script",
           "signal_step_argv", "srun_argv", "step_job_name", "steps_argv", "submit", "write_sbatch_script"]

SCRIPT_NAME = "psworker.sbatch"
SUBMITTED_SPEC = "submitted-spec.yaml"
_SBATCH_VALUE = re.compile(r"[^\s'\"\\#]+\Z")


# ---------------------------------------------------------------------------------------- allocation

def _split_outside_brackets(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for c in text:
        if c == "[":
            if depth:
                raise ValueError("nested '['")
            depth = 1
        elif c == "]":
            if not depth:
                raise ValueError("']' without '['")
            depth = 0
        elif c == "," and not depth:
            if not cur:
                raise ValueError("empty host name")
            parts.append(cur)
            cur = ""
            continue
        cur += c
    if depth:
        raise ValueError("unclosed '['")
    if cur:
        parts.append(cur)
    return parts


def _expand_ranges(ranges: str) -> list[str]:
    values = []
    for item in ranges.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if m is None:
            raise ValueError(f"bad range {item!r}")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise ValueError(f"range {item!r} goes backwards")
        values += [str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1)]
    return values


def expand_hostlist(hostlist: str) -> list[str]:
    """Expands a Slurm hostlist, keeping its order and duplicates: `n[1-2],m5,o[08-10]` ->
    `['n1', 'n2', 'm5', 'o08', 'o09', 'o10']`.

    Same results as TensorFlow's `expand_hostlist` (zero padding follows the range's first number), and also
    what TF rejects but Slurm writes for some names: a suffix after the brackets and several bracket groups
    (`rack[1-2]-n[1-2]` -> rack1-n1, rack1-n2, rack2-n1, rack2-n2).

    Raises:
        ValueError: the text is not a hostlist; the message quotes it.
    """
    hosts: list[str] = []
    try:
        for part in _split_outside_brackets(hostlist.strip()):
            pieces = re.split(r"\[([^\]]*)\]", part)   # text, ranges, text, ranges, ..., text
            expanded = [""]
            for i, piece in enumerate(pieces):
                options = _expand_ranges(piece) if i % 2 else [piece]
                expanded = [e + o for e in expanded for o in options]
            hosts += expanded
    except ValueError as e:
        raise ValueError(f'invalid Slurm hostlist "{hostlist}": {e}') from None
    if not hosts:
        raise ValueError(f'invalid Slurm hostlist "{hostlist}": no hosts')
    return hosts


def expand_tasks_per_node(text: str) -> list[int]:
    """Expands Slurm's tasks-per-node list: `3(x2),2,1` -> `[3, 3, 2, 1]` (TensorFlow's rule).

    Raises:
        ValueError: the text is not such a list.
    """
    counts: list[int] = []
    for part in text.strip().split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if m is None:
            raise ValueError(f'invalid Slurm tasks-per-node list "{text}": bad part {part!r}')
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def allocation_from_environ(environ: Mapping[str, str]) -> tuple[list[str], list[int]]:
    """The allocation a batch script runs in: (nodes, tasks per node), from SLURM_JOB_NODELIST and
    SLURM_TASKS_PER_NODE (inside an `srun` step, its SLURM_STEP_NODELIST and SLURM_STEP_TASKS_PER_NODE).

    Raises:
        UsageError: not inside a Slurm allocation, or the two lists disagree in length.
    """
    step = "SLURM_STEP_NODELIST" in environ and "SLURM_STEP_TASKS_PER_NODE" in environ
    names = (("SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE") if step
             else ("SLURM_JOB_NODELIST", "SLURM_TASKS_PER_NODE"))
    missing = [n for n in names if n not in environ]
    if missing:
        raise UsageError(f"{' and '.join(missing)} not set: not inside a Slurm allocation "
                         "(run this from an sbatch script or salloc)")
    try:
        nodes = expand_hostlist(environ[names[0]])
        counts = expand_tasks_per_node(environ[names[1]])
    except ValueError as e:
        raise UsageError(str(e)) from None
    if len(nodes) != len(counts):
        raise UsageError(f"{names[0]}={environ[names[0]]} names {len(nodes)} nodes but "
                         f"{names[1]}={environ[names[1]]} gives counts for {len(counts)}")
    return nodes, counts


# -------------------------------------------------------------------------------------------- layout

@dataclass(frozen=True)
class SlurmTask:
    """One task placed on the allocation: `job:index` on `host`, serving on `port`; `rank` is the
    SLURM_PROCID that SlurmClusterResolver would give it."""

    job: str
    index: int
    host: str
    port: int
    rank: int

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def count_spec(spec: Union[ClusterSpec, CountSpec], port_base: Optional[int] = None) -> CountSpec:
    """The task counts of any spec, for laying out on an allocation (a listed spec's hosts are dropped).

    Args:
        spec: a count spec, or a spec listing addresses (only the number of tasks per job is kept).
        port_base: first port on each node (default: a count spec's `port`, else psworker's default 2222).
    """
    if isinstance(spec, CountSpec):
        return spec if port_base is None else dataclasses.replace(spec, port=port_base)
    counts = tuple((job, len(spec.addresses(job))) for job in spec.jobs())
    return CountSpec(counts, DEFAULT_PORT_BASE if port_base is None else port_base, spec.train, spec.source,
                     elastic=spec.elastic)


def layout(spec: CountSpec, nodes: Sequence[str], tasks_per_node: Union[int, Sequence[int]]) -> list[SlurmTask]:
    """Places every task on the allocation exactly as TensorFlow's SlurmClusterResolver does
    (`psworker.plan.layout`), one task per allocated Slurm task.

    Args:
        spec: the task counts and `port` (the first port on each node).
        nodes: the allocation's nodes (`expand_hostlist(SLURM_JOB_NODELIST)`).
        tasks_per_node: one count for every node, or one per node in `nodes`' order.

    Returns:
        Every task, in rank order (jobs sorted by name, then index), with its node and port.

    Raises:
        UsageError: the spec's task count differs from the allocation's (the resolver refuses that too).
        SpecError: bad or duplicate nodes, counts, or a port past 65535.
    """
    cluster = plan.layout(spec, nodes, check_allocation(spec, nodes, tasks_per_node))
    tasks: list[SlurmTask] = []
    for job in sorted(cluster.jobs()):   # chief, evaluator, ps, worker: the resolver's order
        for index, address in enumerate(cluster.addresses(job)):
            tasks.append(SlurmTask(job, index, address.host, address.port, len(tasks)))
    return tasks


def check_allocation(spec: CountSpec, nodes: Sequence[str], tasks_per_node: Union[int, Sequence[int]]) -> list[int]:
    """The tasks-per-node count of every node, once checked against the spec: SlurmClusterResolver runs one task
    per allocated Slurm task, so the counts must add up to the spec's.

    Raises:
        UsageError: a count list of another length than `nodes`, or another total than the spec's tasks.
    """
    counts = [int(tasks_per_node)] * len(nodes) if isinstance(tasks_per_node, int) else list(tasks_per_node)
    if len(counts) != len(nodes):
        raise UsageError(f"{len(nodes)} nodes but {len(counts)} tasks-per-node counts")
    wanted, slots = sum(n for _, n in spec.counts), sum(counts)
    if wanted != slots:
        jobs = ", ".join(f"{n} {job}" for job, n in sorted(spec.counts))
        raise UsageError(f"the spec has {wanted} tasks ({jobs}) but the allocation runs {slots} "
                         f"({' + '.join(map(str, counts))} on {len(nodes)} nodes): submit with --ntasks={wanted}")
    return counts


def cluster_dict(tasks: Sequence[SlurmTask]) -> dict[str, list[str]]:
    """`{"ps": ["host:port", ...], "worker": [...]}`: TF's `ClusterSpec.as_dict()` of the same layout."""
    out: dict[str, list[str]] = {}
    for t in sorted(tasks, key=lambda t: t.rank):
        out.setdefault(t.job, []).append(t.address)
    return out


# ---------------------------------------------------------------------------------------------- srun

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
        task: which task runs where: a `SlurmTask` of `layout()`, or a `psworker.plan.Task` (its `host`).
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


def parse_steps(text: str) -> dict[str, str]:
    """`steps_argv`'s output -> `{step name: "JOB.STEP"}` (e.g. `{"psworker-worker-1": "12.3"}`)."""
    steps = {}
    for line in text.splitlines():
        parts = line.split(None, 1)
        if len(parts) == 2:
            steps[parts[1].strip()] = parts[0]
    return steps


def signal_step_argv(step: str, signal: str = "TERM", *, scancel: str = "scancel") -> list[str]:
    """`scancel --signal=TERM JOB.STEP`: delivers the signal to the step's task (which may handle it; srun then
    exits with the task's status). Without it, any signal that ends srun itself (TERM, KILL) cancels the step
    with SIGKILL: no grace period."""
    if not re.fullmatch(r"\d+\.\d+", step):
        raise UsageError(f"step {step!r}: expected JOB.STEP, e.g. 12.3")
    return [scancel, f"--signal={signal}", step]

# -------------------------------------------------------------------------------------------- sbatch

_NODES = re.compile(r"([1-9]\d*)(?:-([1-9]\d*))?\Z")
_TIME = re.compile(r"(?:\d+-)?\d+(?::\d+){0,2}\Z")
_TIME_FORMATS = "MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"
_NO_TIME_LIMIT = ("-1", "INFINITE", "UNLIMITED")


def check_nodes(text: str) -> str:
    """An sbatch `--nodes` value: a count (`2`) or a range (`2-4`), each >= 1 and the range increasing (0 nodes,
    which sbatch takes, runs no task; count lists, `1,3`, need Slurm 23.02).

    Raises:
        ValueError: the message names the value and the forms taken.
    """
    m = _NODES.match(text)
    if m is None:
        raise ValueError(f"{text!r} is not a node count: use N (>= 1) or MIN-MAX")
    if m.group(2) is not None and int(m.group(2)) < int(m.group(1)):
        raise ValueError(f"{text!r}: the range goes backwards")
    return text


def check_time(text: str) -> str:
    """An sbatch `--time` limit in one of Slurm's forms: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS (each
    field a whole number; Slurm carries over, 1:90 is 2:30), or 0, -1, INFINITE, UNLIMITED: no limit.

    Raises:
        ValueError: the message names the value and Slurm's forms.
    """
    if text.upper() in _NO_TIME_LIMIT or _TIME.match(text):
        return text
    raise ValueError(f"{text!r} is not a Slurm time limit: use {_TIME_FORMATS} (0 or UNLIMITED: none)")


def check_sbatch_value(text: str) -> str:
    """A name or path for an `#SBATCH` line (partition, account, job name, output): one word sbatch reads as is,
    so no whitespace, control characters, quotes, '\\' or '#'.

    Raises:
        ValueError: the message names the value.
    """
    if not _SBATCH_VALUE.match(text) or any(ord(c) < 32 or ord(c) == 127 for c in text):
        raise ValueError(f"{text!r}: an #SBATCH value cannot be empty or hold whitespace, control characters, "
                         f"quotes, '\\' or '#'")
    return text


@dataclass(frozen=True)
class SbatchOptions:
    """The `#SBATCH` settings of a psworker job. `ntasks` is the spec's task count (None until the job's spec is
    read: the script needs it); the other None values leave Slurm's default."""

    ntasks: Optional[int] = None
    job_name: str = "psworker"
    nodes: Optional[str] = None          # a count or a range, e.g. "2" or "2-4"
    time: Optional[str] = None           # Slurm time, e.g. "1:00:00" or "2-00:00:00"
    partition: Optional[str] = None
    account: Optional[str] = None
    output: Optional[str] = None         # default: <run_dir>/slurm-%j.out
    overcommit: bool = False             # more tasks than CPUs (the ps tasks are mostly idle)

    def lines(self, run_dir: Path) -> list[str]:
        """The `#SBATCH --opt=value` lines (values checked: sbatch does not shell-parse them)."""
        if self.ntasks is None:
            raise ValueError("SbatchOptions.ntasks: the job's task count is not set")
        values = [("job-name", self.job_name), ("ntasks", str(self.ntasks)), ("nodes", self.nodes),
                  ("time", self.time), ("partition", self.partition), ("account", self.account),
                  ("output", self.output or str(run_dir / "slurm-%j.out")), ("chdir", str(run_dir))]
        out = []
        for name, value in values:
            if value is None:
                continue
            try:
                _SBATCH_CHECKS.get(name, check_sbatch_value)(value)
            except ValueError as e:
                raise UsageError(f"--{name}: {e}") from None
            out.append(f"#SBATCH --{name}={value}")
        if self.overcommit:
            out.insert(2, "#SBATCH --overcommit")
        return out


_SBATCH_CHECKS = {"nodes": check_nodes, "time": check_time}


def launch_argv(spec_path: Union[str, os.PathLike], run_dir: Union[str, os.PathLike], *, python: str,
                port_base: int = DEFAULT_PORT_BASE, worker_flags: Sequence[str] = ()) -> list[str]:
    """`PYTHON -m psworker slurm launch SPEC --run_dir D --port_base P [worker flags]`: what the batch script runs."""
    return [python, "-m", "psworker", "slurm", "launch", os.fspath(spec_path), "--run_dir", os.fspath(run_dir),
            "--port_base", str(port_base), *worker_flags]


def sbatch_script(options: SbatchOptions, run_dir: Path, inner_argv: Sequence[str], *,
                  description: str = "") -> str:
    """The text of a readable, re-submittable batch script that runs `inner_argv` (each part shell-quoted)."""
    stamp = datetime.datetime.now().isoformat(timespec="seconds")
    header = [
        "#!/bin/bash",
        f"# psworker job{': ' + description if description else ''}",
        f"# Written by `psworker slurm submit` on {stamp}. Submit it again by hand with:",
        f"#   sbatch {shlex.quote(str(run_dir / SCRIPT_NAME))}",
        "# Inside the allocation, the line at the bottom starts one `srun` step per task (ps first, then",
        "# workers) on the nodes TensorFlow's SlurmClusterResolver would choose, and watches them.",
    ]
    body = ["", "set -euo pipefail", "", "exec " + " ".join(shlex.quote(str(a)) for a in inner_argv)]
    return "\n".join(header + options.lines(run_dir) + body) + "\n"


def write_sbatch_script(run_dir: Union[str, os.PathLike], options: SbatchOptions, inner_argv: Sequence[str],
                        *, description: str = "") -> Path:
    """Writes `<run_dir>/psworker.sbatch` (mode 0755) and returns its path; run_dir must exist."""
    run_dir = Path(run_dir).resolve()
    path = run_dir / SCRIPT_NAME
    path.write_text(sbatch_script(options, run_dir, inner_argv, description=description))
    path.chmod(0o755)
    return path


def submit(script: Union[str, os.PathLike], *, sbatch: str = "sbatch", env: Optional[Mapping[str, str]] = None,
           timeout: float = 60.0) -> str:
    """Submits a batch script with `sbatch --parsable SCRIPT` and returns the job id.

    Raises:
        SubmitError: sbatch is missing, failed (its message is included) or did not answer within `timeout`.
    """
    argv = [sbatch, "--parsable", os.fspath(script)]
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                                env=None if env is None else dict(env), stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise SubmitError(f"{sbatch}: not found; is this a Slurm login node?") from None
    except subprocess.TimeoutExpired:
        raise SubmitError(f"{shlex.join(argv)}: no answer within {timeout:g} s (is slurmctld up?)") from None
    if result.returncode != 0:
        raise SubmitError(f"{shlex.join(argv)} exited {result.returncode}: {result.stderr.strip()}")
    job_id = result.stdout.strip().split(";")[0]     # --parsable: "ID" or "ID;CLUSTER"
    if not job_id.isdigit():
        raise SubmitError(f"{shlex.join(argv)}: unexpected answer {result.stdout.strip()!r}")
    return job_id
