"""`psworker plan --model`: where a model's training graph puts its variables, built without servers or data."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class PlacedVariable:
    """One variable of a training graph and the ps task that holds it."""

    name: str
    shape: tuple[int, ...]
    nbytes: int
    ps: int
    trainable: bool
    checkpoint_name: str = ""             # a shard's: its whole variable's (what the checkpoint holds); else `name`
    checkpoint_shape: tuple[int, ...] = ()

    @property
    def is_shard(self) -> bool:
        return self.checkpoint_name != self.name


@dataclass(frozen=True)
class PlacementReport:
    """Where a model's training graph puts its variables (what `describe` prints)."""

    model: str
    num_ps: int
    variables: tuple[PlacedVariable, ...]
    traffic: object = None   # `traffic.StepTraffic` of one worker step
    tables: tuple[str, ...] = ()   # the sparse tables' checkpoint names (their shards are in `variables`)
    split_from: int = 0            # variables of this many bytes or more are split (`placement.min_partition_bytes`)

    @property
    def trainable_parameters(self) -> int:
        return sum(_elements(v.shape) for v in self.variables if v.trainable)

    @property
    def bytes_per_ps(self) -> list[int]:
        loads = [0] * self.num_ps
        for v in self.variables:
            loads[v.ps] += v.nbytes
        return loads

    @property
    def max_over_mean(self) -> float:
        """The largest ps's bytes over the mean (1.0 is perfect balance)."""
        loads = self.bytes_per_ps
        return max(loads) * len(loads) / (sum(loads) or 1)


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

        images = tf.zeros([spec.batch_size, *self._model.image_shape], tf.as_dtype(self._model.preprocessed_dtype))
        return images, tf.zeros([spec.batch_size], tf.int32)


def placement_report(model_name: str, num_ps: int, *, batch_size: int = 2, pack_transfers: bool = False
                     ) -> PlacementReport:
    """Builds `model_name`'s training graph as worker 0 of a between-graph cluster would (no servers, no data)
    and reads where each variable landed.

    The graph is the trainer's own (`graph.build_train_graph`, async): the global step, the model's variables and
    its moving averages (colocated with their variables), large variables split into a shard per ps, placed by
    `GreedyByteStrategy` in the trainer's order.
    In-graph replication and towers create the variables in the same order, so they get the same placement.

    Args:
        model_name: a registered model.
        num_ps: number of ps tasks.
        batch_size: the (irrelevant) batch of the zero inputs.
        pack_transfers: the graph of `--pack_transfers true` (smaller variables split too).

    Returns:
        The variables (shards) in creation order, each with its shape, bytes, ps task, whether it is trainable, and
        the name and shape it has in a checkpoint.
    """
    from psworker.tf_import import import_tensorflow

    tf = import_tensorflow()   # without Keras and scikit-learn (1.5 s of CPU)

    from psworker import models
    from psworker.models.base import SPARSE_TABLES
    from psworker.spec import TrainConfig
    from psworker.train.graph import build_train_graph
    from psworker.train.placement import min_partition_bytes
    from psworker.train.traffic import step_traffic

    if num_ps < 1:
        raise ValueError(f"num_ps must be at least 1, got {num_ps}")
    model = _NoDataModel(models.get(model_name))
    cluster = {"ps": [f"ps{i}:1" for i in range(num_ps)], "worker": ["worker0:1"]}
    config = TrainConfig(model=model_name, batch_size=batch_size, pack_transfers=pack_transfers)
    rows = []
    from tensorflow.python.util import deprecation

    with tf.Graph().as_default() as graph, deprecation.silence():   # TF's v1 notes: nothing for a user to act on
        build_train_graph(model, config, cluster=cluster, task_index=0)
        traffic = step_traffic(graph, num_ps)
        trainable = {id(v) for v in tf.compat.v1.trainable_variables()}
        for var in tf.compat.v1.global_variables():
            device = tf.DeviceSpec.from_string(var.device or "")
            if device.job != "ps" or device.task is None:
                raise RuntimeError(f"{var.op.name} is not on a ps task (device {var.device!r})")
            shape = tuple(int(d) for d in var.shape)
            whole = getattr(var, "_save_slice_info", None)   # set on the shards of a partitioned variable
            rows.append(PlacedVariable(var.op.name, shape, _elements(shape) * var.dtype.base_dtype.size,
                                       int(device.task), id(var) in trainable,
                                       whole.full_name if whole else var.op.name,
                                       tuple(whole.full_shape) if whole else shape))
        tables = tuple(sorted({getattr(getattr(v, "_save_slice_info", None), "full_name", v.op.name)
                               for v in tf.compat.v1.get_collection(SPARSE_TABLES)}))
    return PlacementReport(model_name, num_ps, tuple(rows), traffic, tables, min_partition_bytes(pack_transfers))


def describe(model_name: str, num_ps: int, batch_size: int = 2, *, workers: int = 1, step_rate: float = 10.0,
             bandwidth_gbps: float = 10.0, report: Optional[PlacementReport] = None) -> str:
    """`psworker plan --model`: each variable of the training graph, its bytes and its ps; bytes per ps; totals; the
    network estimate (`traffic.describe`) for `workers` workers at `step_rate` steps/s each.

    Builds no servers and reads no data (see `placement_report`; `report`: one the caller has built already).
    """
    from psworker.train import traffic

    report = report or placement_report(model_name, num_ps, batch_size=batch_size)
    rows = report.variables
    name_w = max([len("variable")] + [len(v.name) for v in rows])
    shape_w = max([len("shape")] + [len(_shape(v.shape)) for v in rows])
    lines = [f"model {model_name}: {report.trainable_parameters:,} trainable parameters; "
             f"{len(rows)} variables on {num_ps} ps (global step and moving averages included)",
             f"  {'variable':<{name_w}}  {'shape':<{shape_w}}  {'bytes':>12}  ps"]
    for v in rows:
        lines.append(f"  {v.name:<{name_w}}  {_shape(v.shape):<{shape_w}}  {v.nbytes:>12,}  ps:{v.ps}"
                     + ("" if v.trainable else "  (not trainable)")
                     + (f"  (shard of {v.checkpoint_name} {_shape(v.checkpoint_shape)})" if v.is_shard else ""))
    loads = report.bytes_per_ps
    total = sum(loads)
    for i, load in enumerate(loads):
        lines.append(f"  ps:{i} holds {load:,} bytes ({100.0 * load / (total or 1):.1f}%)")
    shards = sum(v.is_shard for v in rows)
    lines.append(f"  bytes per ps: max/mean {report.max_over_mean:.3f}"
                 + (f"; {shards} shards of {len({v.checkpoint_name for v in rows if v.is_shard})} split variables"
                    f" (variables of {report.split_from:,} bytes or more are split over the ps tasks)"
                    if shards else ""))
    lines.append(f"  total: {report.trainable_parameters:,} trainable parameters, {total:,} bytes on the ps tasks")
    lines.append(traffic.describe(report.traffic, steps_per_sec_per_worker=step_rate, workers=workers,
                                  bandwidth_gbps=bandwidth_gbps, imbalance=report.max_over_mean))
    lines += _table_lines(report)
    return "\n".join(lines)


def _table_lines(report: PlacementReport) -> list[str]:
    """Per sparse table (its shards named in `report.tables`): its bytes per ps, and the traffic per row touched,
    which the network estimate above leaves out (a step's rows are known only when it runs)."""
    lines = []
    for table in report.tables:
        shards = [v for v in report.variables if v.checkpoint_name == table or v.name == table]
        rows, dim = shards[0].checkpoint_shape
        per_ps = sorted({v.ps for v in shards})
        lines.append(f"sparse table {table}: {rows:,} rows x {dim}, {sum(v.nbytes for v in shards):,} bytes over "
                     f"{', '.join(f'ps:{i}' for i in per_ps)} (its optimizer slots beside each shard); per "
                     f"distinct row a step touches: {8 + 4 * dim} bytes pulled (id, values), {8 + 4 * dim} pushed "
                     f"(id, gradient), not in the estimate above")
    return lines


def sparse_traffic_line(report: PlacementReport, batch_size: int, *, data_dir: Optional[str] = None,
                        rows_per_step: Optional[int] = None) -> Optional[str]:
    """The sparse tables' bytes per worker step at `batch_size` (`sparse_traffic`: the distinct rows measured on
    `data_dir`, given as `rows_per_step`, or bounded), with the dense estimate's; None for a model without tables."""
    from psworker import models
    from psworker.train import sparse_traffic

    if not report.tables:
        return None
    dims = [next(v for v in report.variables if table in (v.checkpoint_name, v.name)).checkpoint_shape[1]
            for table in report.tables]
    table_bytes = sum(v.nbytes for v in report.variables if v.trainable and v.checkpoint_name in report.tables)
    rows = sparse_traffic.rows_touched(models.get(report.model), batch_size, data_dir, rows_per_step)
    return sparse_traffic.describe(sparse_traffic.per_step(rows, dims), batch_size, sum(report.traffic.pull),
                                   sum(report.traffic.push), table_bytes)


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


__all__ = ["PlacedVariable", "PlacementReport", "placement_report", "describe", "sparse_traffic_line"]
