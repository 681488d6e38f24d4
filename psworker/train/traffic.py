"""On paper: the bytes one worker step moves to and from each ps, the network load that makes at a step rate, and how
many ps tasks a given bandwidth needs for N workers (`psworker plan SPEC --model M --step_rate R --bandwidth_gbps B`).

The model: per step, every tensor produced on a ps and consumed on the worker crosses once (a pull: each variable
(shard) once per read op, so a variable read twice in the graph crosses twice), and every tensor produced on the
worker and consumed on a ps (a push: one gradient per trainable variable (shard), and scalars such as the learning
rate), in the dtype that crosses (`--transfer_dtype`). Moving averages and the apply run on the ps and cross
nothing. RPC framing is left out. Async workers each do this once per own step, so a ps's load is the sum over
workers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class StepTraffic:
    """Bytes one worker step moves, per ps task: `pull[i]` from ps i to the worker, `push[i]` from the worker to it."""

    pull: tuple[int, ...]
    push: tuple[int, ...]

    @property
    def per_step(self) -> int:
        return sum(self.pull) + sum(self.push)


def step_traffic(graph, num_ps: int) -> StepTraffic:
    """Reads `StepTraffic` off a between-graph training graph (variables on `/job:ps/task:i`, compute on a worker):
    every tensor that one op produces on a ps and another consumes on the worker (a pull), or the other way (a
    push), counted once per tensor and destination, as TF's graph partitioning sends it. An op without a device of
    its own runs where its resource input lives (a `ReadVariableOp` on its variable's ps), or with the op it is
    colocated with; staged pulls and `--transfer_dtype` casts are counted in the dtype that crosses."""
    pull, push = [0] * num_ps, [0] * num_ps
    where = _Devices(graph)
    for op in graph.get_operations():
        dst = where.of(op)
        for tensor in op.inputs:
            if tensor.dtype.base_dtype.name == "resource":
                continue
            src = where.of(tensor.op)
            src_ps, dst_ps = _ps_of(src), _ps_of(dst)
            if src_ps is not None and dst_ps is None and _on_worker(dst) and where.first(tensor, dst):
                pull[src_ps] += _nbytes(tensor)
            elif dst_ps is not None and src_ps is None and _on_worker(src) and where.first(tensor, dst):
                push[dst_ps] += _nbytes(tensor)
    return StepTraffic(tuple(pull), tuple(push))


class _Devices:
    """Where each op of a graph runs, as far as the graph says (see `step_traffic`)."""

    def __init__(self, graph):
        self._graph = graph
        self._memo: dict[str, str] = {}
        self._sent: set = set()

    def of(self, op) -> str:
        if op.name not in self._memo:
            self._memo[op.name] = ""   # a cycle (a loop's back edge) resolves to no device
            self._memo[op.name] = self._find(op)
        return self._memo[op.name]

    def _find(self, op) -> str:
        if op.device:
            return op.device
        for tensor in op.inputs:
            if tensor.dtype.base_dtype.name == "resource":
                return self.of(tensor.op)
        for group in op.colocation_groups():
            name = group.decode()[len("loc:@"):]
            if name != op.name:
                return self.of(self._graph.get_operation_by_name(name))
        return ""

    def first(self, tensor, dst: str) -> bool:
        """True once per (tensor, destination device)."""
        key = (tensor.name, dst)
        if key in self._sent:
            return False
        self._sent.add(key)
        return True


def _ps_of(device: str):
    import tensorflow as tf

    spec = tf.DeviceSpec.from_string(device or "")
    return spec.task if spec.job == "ps" and spec.task is not None else None


def _on_worker(device: str) -> bool:
    return "/job:worker" in (device or "")


def _nbytes(tensor) -> int:
    """The bytes of `tensor` its graph knows: of a packed transfer (a concatenation, maybe cast) whose rows' part
    has no static size, its variables' part (the rows are `sparse_traffic`'s)."""
    shape, size = tensor.shape, tensor.dtype.base_dtype.size
    if shape.is_fully_defined():
        return int(shape.num_elements()) * size
    op = tensor.op
    if op.type == "ConcatV2":
        return sum(_nbytes(t) for t in op.inputs[:-1])
    if op.type in ("Cast", "Identity", "Reshape"):
        source = op.inputs[0]
        return _nbytes(source) * size // source.dtype.base_dtype.size
    return 0


@dataclass(frozen=True)
class Load:
    """Network load of one ps at a step rate: bytes/s it sends (pulls) and receives (pushes)."""

    out_bytes_per_sec: float
    in_bytes_per_sec: float

    @property
    def busiest_direction(self) -> float:
        return max(self.out_bytes_per_sec, self.in_bytes_per_sec)


def ps_load(traffic: StepTraffic, steps_per_sec_per_worker: float, workers: int) -> list[Load]:
    """Each ps's load when `workers` async workers each run `steps_per_sec_per_worker` steps/s."""
    rate = steps_per_sec_per_worker * workers
    return [Load(p * rate, q * rate) for p, q in zip(traffic.pull, traffic.push)]


def ps_needed(traffic: StepTraffic, steps_per_sec_per_worker: float, workers: int, bandwidth_bytes_per_sec: float,
              imbalance: float = 1.0) -> int:
    """The fewest ps tasks whose links (full duplex, `bandwidth_bytes_per_sec` each way) carry `workers` workers at
    that step rate, the bytes split evenly up to `imbalance` (bytes per ps max/mean)."""
    if bandwidth_bytes_per_sec <= 0 or steps_per_sec_per_worker < 0 or workers < 0:
        raise ValueError("bandwidth must be positive; step rate and workers not negative")
    busiest = max(sum(traffic.pull), sum(traffic.push)) * steps_per_sec_per_worker * workers
    return max(1, math.ceil(busiest * imbalance / bandwidth_bytes_per_sec - 1e-9))


def describe(traffic: StepTraffic, *, steps_per_sec_per_worker: float, workers: int, bandwidth_gbps: float,
             imbalance: float = 1.0, worker_counts=(1, 10, 100, 1000)) -> str:
    """The lines `psworker plan --model` prints about the network."""
    bw = bandwidth_gbps * 1e9 / 8
    lines = [f"network, per worker step: pulls {sum(traffic.pull):,} bytes from the ps tasks, pushes "
             f"{sum(traffic.push):,} bytes of gradients"]
    for i, load in enumerate(ps_load(traffic, steps_per_sec_per_worker, workers)):
        lines.append(f"  ps:{i} at {steps_per_sec_per_worker:g} steps/s x {workers} workers: sends "
                     f"{load.out_bytes_per_sec / 1e6:,.1f} MB/s, receives {load.in_bytes_per_sec / 1e6:,.1f} MB/s "
                     f"({100 * load.busiest_direction / bw:.0f}% of {bandwidth_gbps:g} Gbit/s)")
    needs = ", ".join(f"{n:,} workers: {ps_needed(traffic, steps_per_sec_per_worker, n, bw, imbalance)}"
                      for n in worker_counts)
    lines.append(f"  ps tasks needed at {bandwidth_gbps:g} Gbit/s per ps and {steps_per_sec_per_worker:g} steps/s per "
                 f"worker (bytes split evenly x{imbalance:.3f}): {needs}")
    return "\n".join(lines)


__all__ = ["StepTraffic", "Load", "step_traffic", "ps_load", "ps_needed", "describe"]
