"""A Slurm allocation: its nodes and tasks per node (expanded from Slurm's hostlist and count forms, as TensorFlow's
`SlurmClusterResolver` reads them), and the check that it runs exactly the spec's tasks.

The layout itself, TensorFlow's rules, is `psworker.spec.plan.layout` (the one implementation): nodes in **sorted
hostname order** (`node10` before `node9`), `port + k` for the k-th task on a node, jobs taking consecutive slices
in **sorted job-name order** (`ps` before `worker`), and the number of tasks of all jobs equal to the allocation's
task count.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Optional, Union

from psworker.errors import UsageError
from psworker.spec import DEFAULT_PORT_BASE, ClusterSpec, CountSpec

__all__ = ["allocation_from_environ", "check_allocation", "count_spec", "expand_hostlist", "expand_tasks_per_node"]


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

