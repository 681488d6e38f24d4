"""On paper: the bytes one worker step moves to and from each ps, the network load that makes at a step rate, and how
many ps tasks a given bandwidth needs for N workers (`psworker plan SPEC --model M --step_rate R --bandwidth_gbps B`).

The model: per step, each worker pulls every variable (shard) it reads from the ps that holds it, once per read op
(TF's receiver pulls; a variable read twice in the graph crosses twice), and pushes one gradient per trainable
variable (shard) to its ps. Moving averages and the apply run on the ps and cross nothing. Scalars (global step,
learning rate) and RPC framing are left out. Async workers each do this once per own step, so a ps's load is the
sum over workers.
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
    """Reads `StepTraffic` off a between-graph training graph (variables on `/job:ps/task:i`, compute on a worker)."""
    import tensorflow as tf

    def ps_of(device: str):
        spec = tf.DeviceSpec.from_string(device or "")
        return spec.task if spec.job == "ps" and spec.task is not None else None

    pull, push = [0] * num_ps, [0] * num_ps
    variables = {}
    for op in graph.get_operations():
        if op.type in ("VarHandleOp", "VariableV2") and ps_of(op.device) is not None:
            variables[op.name] = op
    for op in graph.get_operations():
        if op.type != "ReadVariableOp" or not op.inputs or op.inputs[0].op.name not in variables:
            continue
        if any(_on_worker(c.device) for c in op.outputs[0].consumers()):   # crosses to the worker once per step
            pull[ps_of(op.inputs[0].op.device)] += _nbytes(op.outputs[0])
    for op in graph.get_operations():
        if op.type.startswith("ResourceApply") and op.inputs and op.inputs[0].op.name in variables:
            shape = tf.TensorShape(op.inputs[0].op.get_attr("shape"))
            grads = [t for t in op.inputs[1:] if _on_worker(t.op.device) and t.shape == shape]
            if grads:   # the gradient: computed on the worker, applied on the ps
                push[ps_of(op.inputs[0].op.device)] += _nbytes(grads[0])
    return StepTraffic(tuple(pull), tuple(push))


def _on_worker(device: str) -> bool:
    return "/job:worker" in (device or "")


def _nbytes(tensor) -> int:
    shape = tensor.shape
    if not shape.is_fully_defined():
        return 0
    return int(shape.num_elements()) * tensor.dtype.base_dtype.size


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
