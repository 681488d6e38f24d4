"""Where variables live: large variables split into one shard per ps (`partitioner`), and a greedy byte-balancing
ps strategy for `replica_device_setter` that places each shard, and keeps each moving average and optimizer slot
with its variable (see `report` for the resulting placement of a model)."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

# Variables of at least this many bytes are split over the ps tasks (when there are several). Below it a variable
# stays whole: a shard costs a transfer per step, and small variables balance well whole.
MIN_PARTITION_BYTES = 256 * 1024
# Packed (`--pack_transfers`): a shard rides in its ps's one transfer a step, so a split costs no transfer; splitting
# the mid-sized weights too evens out the bytes each ps link carries a step.
PACKED_MIN_PARTITION_BYTES = 16 * 1024


def min_partition_bytes(packed: bool) -> int:
    """The size from which a variable is split over the ps tasks: `PACKED_MIN_PARTITION_BYTES` when each ps's
    variables travel packed, else `MIN_PARTITION_BYTES`."""
    return PACKED_MIN_PARTITION_BYTES if packed else MIN_PARTITION_BYTES


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


def partitions(shape, itemsize: int, num_ps: int, min_bytes: int = MIN_PARTITION_BYTES) -> list[int]:
    """How a variable of `shape` is split: `num_ps` shards along its longest axis (the first, on ties) when it has
    at least `min_bytes` bytes and that axis has at least `num_ps` entries; else one piece (all ones)."""
    dims = [int(d) for d in shape]
    out = [1] * len(dims)
    size = itemsize
    for d in dims:
        size *= d
    if num_ps < 2 or not dims or size < min_bytes:
        return out
    axis = max(range(len(dims)), key=lambda i: (dims[i], -i))
    out[axis] = min(num_ps, dims[axis])
    return out


@contextlib.contextmanager
def partitioned_variables(num_ps: int, min_bytes: int = MIN_PARTITION_BYTES):
    """Within this block, `get_variable` splits each trainable variable of at least `min_bytes` into `num_ps` shards
    (`partitions`; smaller ones, and the slots an optimizer makes per shard, stay plain variables). The Saver writes a
    split variable under its full name and shape, so a checkpoint reads the same whatever the number of ps tasks, and
    restores into
    any other split (or none: evaluation, export)."""
    import tensorflow as tf

    v1 = tf.compat.v1

    def split_large(getter, name, shape=None, dtype=tf.float32, partitioner=None, **kwargs):
        # Not trainable: an optimizer slot or a moving average of one shard (shaped as the shard, kept beside it).
        if partitioner is None and shape is not None and tf.TensorShape(shape).is_fully_defined() \
                and kwargs.get("trainable") is not False:
            parts = partitions(tf.TensorShape(shape).as_list(), tf.as_dtype(dtype).size, num_ps, min_bytes)
            if max(parts, default=1) > 1:
                partitioner = lambda shape, dtype: parts  # noqa: E731
        return getter(name, shape=shape, dtype=dtype, partitioner=partitioner, **kwargs)

    if num_ps < 2:
        yield
        return
    with v1.variable_scope(v1.get_variable_scope(), custom_getter=split_large):
        yield


@dataclass
class GreedyByteStrategy:
    """Places each new variable (or shard) on the ps that holds the fewest bytes so far (ties: lowest index).

    A callable `op -> ps task index`, as `tf.compat.v1.train.replica_device_setter(ps_strategy=...)` takes.
    Deterministic: every worker builds the graph in the same order, so every worker computes the same placement.
    A variable named under one already placed (`<variable>/ExponentialMovingAverage`, an optimizer slot
    `<variable>/Momentum`) is TF-colocated with it: it is counted, and placed, on that variable's ps.
    """

    num_tasks: int
    loads: list[int] = field(init=False)
    assigned: list[tuple[str, int, int]] = field(init=False)   # (variable name, bytes, ps index)
    _task_of: dict = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.num_tasks < 1:
            raise ValueError("GreedyByteStrategy needs at least one ps task")
        self.loads = [0] * self.num_tasks
        self.assigned = []
        self._task_of = {}

    def __call__(self, op) -> int:
        size = variable_bytes(op)
        task = self._owner(op.name)
        if task is None:
            task = min(range(self.num_tasks), key=lambda i: (self.loads[i], i))
        self.loads[task] += size
        self.assigned.append((op.name, size, task))
        self._task_of[op.name] = task
        return task

    def _owner(self, name: str):
        parts = name.split("/")
        for k in range(len(parts) - 1, 0, -1):
            task = self._task_of.get("/".join(parts[:k]))
            if task is not None:
                return task
        return None


__all__ = ["GreedyByteStrategy", "MIN_PARTITION_BYTES", "PACKED_MIN_PARTITION_BYTES", "min_partition_bytes",
           "partitioned_variables", "partitions", "variable_bytes", "log_tables"]

log = logging.getLogger(__name__)


def log_tables(ema) -> None:
    """One line per sparse table of the default graph: its shards and where they live, and what is off for it."""
    import tensorflow as tf

    from psworker.models.base import SPARSE_TABLES

    shards = tf.compat.v1.get_collection(SPARSE_TABLES)
    by_table: dict[str, list] = {}
    for shard in shards:
        by_table.setdefault(shard.op.name.split("/part_")[0], []).append(shard)
    for name, parts in by_table.items():
        rows = sum(int(p.shape[0]) for p in parts)
        where = ", ".join(f"{int(p.shape[0])} rows on {p.device or 'this process'}" for p in parts)
        log.info("sparse table %s (%d rows x %d): gathered and updated by rows (%s); staged variables, the transfer "
                 "dtype%s and table summaries are off for it", name, rows, int(parts[0].shape[1]), where,
                 ", moving averages" if ema is not None else "")
