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


@dataclass(frozen=True)
class PlacedVariable:
    """One variable of a training graph and the ps task that holds it."""

    name: str
    shape: tuple[int, ...]
    nbytes: int
    ps: int
    trainable: bool


@dataclass(frozen=True)
class PlacementReport:
    """Where a model's training graph puts its variables (what `describe` prints)."""

    model: str
    num_ps: int
    variables: tuple[PlacedVariable, ...]

    @property
    def trainable_parameters(self) -> int:
        return sum(_elements(v.shape) for v in self.variables if v.trainable)

    @property
    def bytes_per_ps(self) -> list[int]:
        loads = [0] * self.num_ps
        for v in self.variables:
            loads[v.ps] += v.nbytes
        return loads


def _elements(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class _NoDataModel:
    """A model whose training inputs are zeros: its training graph builds without data files."""

    def __init__(self, model) -> None:
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)

    def train_inputs(self, spec):
        import tensorflow as tf

        images = tf.zeros([spec.batch_size, *self._model.image_shape], tf.float32)
        return images, tf.zeros([spec.batch_size], tf.int32)


def placement_report(model_name: str, num_ps: int, *, batch_size: int = 2) -> PlacementReport:
    """Builds `model_name`'s training graph as worker 0 of a between-graph cluster would (no servers, no data)
    and reads where each variable landed.

    The graph is the trainer's own (`trainer.build_train_graph`, async): the global step, the model's variables and
    its moving averages (colocated with their variables), placed by `GreedyByteStrategy` in the trainer's order.
    In-graph replication and towers create the variables in the same order, so they get the same placement.

    Args:
        model_name: a registered model.
        num_ps: number of ps tasks.
        batch_size: the (irrelevant) batch of the zero inputs.

    Returns:
        The variables in creation order, each with its shape, bytes, ps task and whether it is trainable.
    """
    import tensorflow as tf

    from psworker import models
    from psworker.spec import TrainConfig
    from psworker.trainer import build_train_graph

    if num_ps < 1:
        raise ValueError(f"num_ps must be at least 1, got {num_ps}")
    model = _NoDataModel(models.get(model_name))
    cluster = {"ps": [f"ps{i}:1" for i in range(num_ps)], "worker": ["worker0:1"]}
    config = TrainConfig(model=model_name, batch_size=batch_size)
    rows = []
    with tf.Graph().as_default():
        build_train_graph(model, config, cluster=cluster, task_index=0)
        trainable = {id(v) for v in tf.compat.v1.trainable_variables()}
        for var in tf.compat.v1.global_variables():
            device = tf.DeviceSpec.from_string(var.device or "")
            if device.job != "ps" or device.task is None:
                raise RuntimeError(f"{var.op.name} is not on a ps task (device {var.device!r})")
            shape = tuple(int(d) for d in var.shape)
            rows.append(PlacedVariable(var.op.name, shape, _elements(shape) * var.dtype.base_dtype.size,
                                       int(device.task), id(var) in trainable))
    return PlacementReport(model_name, num_ps, tuple(rows))


def describe(model_name: str, num_ps: int, batch_size: int = 2) -> str:
    """`psworker plan --model`: each variable of the training graph, its bytes and its ps; bytes per ps; totals.

    Builds no servers and reads no data (see `placement_report`).
    """
    report = placement_report(model_name, num_ps, batch_size=batch_size)
    rows = report.variables
    name_w = max([len("variable")] + [len(v.name) for v in rows])
    shape_w = max([len("shape")] + [len(_shape(v.shape)) for v in rows])
    lines = [f"model {model_name}: {report.trainable_parameters:,} trainable parameters; "
             f"{len(rows)} variables on {num_ps} ps (global step and moving averages included)",
             f"  {'variable':<{name_w}}  {'shape':<{shape_w}}  {'bytes':>12}  ps"]
    for v in rows:
        lines.append(f"  {v.name:<{name_w}}  {_shape(v.shape):<{shape_w}}  {v.nbytes:>12,}  ps:{v.ps}"
                     + ("" if v.trainable else "  (not trainable)"))
    loads = report.bytes_per_ps
    total = sum(loads)
    for i, load in enumerate(loads):
        lines.append(f"  ps:{i} holds {load:,} bytes ({100.0 * load / (total or 1):.1f}%)")
    lines.append(f"  total: {report.trainable_parameters:,} trainable parameters, {total:,} bytes on the ps tasks")
    return "\n".join(lines)


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"
