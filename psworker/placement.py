"""Where variables live: a greedy byte-balancing ps strategy for `replica_device_setter`, and a report."""

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


def describe(model_name: str, num_ps: int, batch_size: int = 2) -> str:
    """Builds `model_name`'s training graph (no servers) and reports each variable, its bytes and its ps."""
    import tensorflow as tf

    from psworker import models

    model = models.get(model_name)
    strategy = GreedyByteStrategy(num_ps)
    cluster = {"ps": [f"ps{i}:1" for i in range(num_ps)], "worker": ["worker0:1"]}
    with tf.Graph().as_default():
        setter = tf.compat.v1.train.replica_device_setter(
            cluster=cluster, worker_device="/job:worker/task:0", ps_strategy=strategy
        )
        with tf.compat.v1.device(setter):
            shape = _input_shape(model)
            images = tf.compat.v1.placeholder(tf.float32, [batch_size, *shape])
            model.inference(images, training=True)
            params = sum(int(v.shape.num_elements()) for v in tf.compat.v1.trainable_variables())
    lines = [f"model {model_name}: {params:,} trainable parameters, {len(strategy.assigned)} variables, {num_ps} ps"]
    width = max((len(n) for n, _, _ in strategy.assigned), default=8)
    lines.append(f"  {'variable':<{width}}  {'bytes':>12}  ps")
    for name, size, task in strategy.assigned:
        lines.append(f"  {name:<{width}}  {size:>12,}  ps:{task}")
    total = sum(strategy.loads) or 1
    for i, load in enumerate(strategy.loads):
        lines.append(f"  ps:{i} holds {load:,} bytes ({100.0 * load / total:.1f}%)")
    return "\n".join(lines)


def _input_shape(model) -> tuple[int, ...]:
    return tuple(getattr(model, "image_shape", (64,)))
