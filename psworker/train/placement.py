"""Where variables live: a greedy byte-balancing ps strategy for `replica_device_setter` (see `report` for the
resulting placement of a model)."""

from __future__ import annotations

from dataclasses import dataclass, field


def variable_bytes(op) -> int:
    """Bytes of the variable that `op` (a VarHandleOp / VariableV2) creates; 0 when its shape is unknown."""
    import tensorflow as tf

    try:
        shape = tf.TensorShape(op.get_attr("shape"))
        dtype = tf.as_dtype(op.get_attr("dtype"))
    except ValueError:
        return 0
    if not shape.is_fully_defined():
        return 0
    return int(shape.num_elements()) * dtype.size


@dataclass
class GreedyByteStrategy:
    """Places each new variable on the ps that holds the fewest bytes so far (ties: lowest index).

    A callable `op -> ps task index`, as `tf.compat.v1.train.replica_device_setter(ps_strategy=...)` takes.
    Deterministic: every worker builds the graph in the same order, so every worker computes the same placement.
    It is also called for ops colocated with a variable (moving averages, optimizer slots); those follow their
    variable wherever the strategy says, so `loads` counts them where it chose, not where they end up: read the
    graph's devices (`placement_report`) for the real placement.
    """

    num_tasks: int
    loads: list[int] = field(init=False)
    assigned: list[tuple[str, int, int]] = field(init=False)   # (variable name, bytes, ps index)

    def __post_init__(self) -> None:
        if self.num_tasks < 1:
            raise ValueError("GreedyByteStrategy needs at least one ps task")
        self.loads = [0] * self.num_tasks
        self.assigned = []

    def __call__(self, op) -> int:
        size = variable_bytes(op)
        task = min(range(self.num_tasks), key=lambda i: (self.loads[i], i))
        self.loads[task] += size
        self.assigned.append((op.name, size, task))
        return task


__all__ = ["GreedyByteStrategy", "variable_bytes"]
