"""Adagrad for the sparse tables: slots whose initial value a ps does not keep, and a row update in whole-block ops
(issue 37).

TF's `AdagradOptimizer` starts each accumulator from `constant_initializer(0.1)`: a constant of the slot's whole
shape in the init graph. The ps keeps that constant's tensor for as long as the chief's session lives (the init
graph's kernels stay cached), and shares it with the accumulator until the first sparse update copies the
accumulator away from it (`EnsureSparseVariableAccess`): from then on the ps holds the accumulator twice. Measured in
one process (a 82 MiB accumulator): +85 MB resident after the first step, for good; with `fill(shape, value)` whose
value is a `placeholder_with_default` (not a constant, so not folded into one), +3 MB.

TF's sparse Adagrad kernel (`ResourceSparseApplyAdagrad`) evaluates two Eigen expressions per touched row; with rows
of 8 floats that per-row cost is most of the update. `gathered_adagrad` does the same arithmetic on the touched rows
as one block: gather the accumulator's rows, add the squared gradient, scatter them back (a copy per row), likewise
the variable's rows, one worker's update of a shard at a time (`row_lock`). Measured in one process
(`benchmarks/sparse_apply.py`, 1,175 rows of a 260k x 8 shard): 0.37x the CPU of TF's kernel, lock included.

TF's optimizer first sums a sparse gradient's repeated rows (`tf.unique` and a segment sum, on the ps). A lookup that
gathers distinct rows (`models.criteo.sparse_lookup`) marks its gathers (`mark_distinct`); a gradient taken straight
from such a gather skips that sum. Any other gradient of the table (averaged over towers, taken from a sync
accumulator) is summed by row as before.
"""

from __future__ import annotations

__all__ = ["DISTINCT_ROWS", "adagrad", "gathered_adagrad", "row_lock", "mark_distinct", "is_distinct"]

DISTINCT_ROWS = "psworker_distinct_rows"     # graph collection: the row indices of gathers of distinct rows


def _fill_initializer(value: float):
    """An initializer that fills its shape with `value` at run time (nothing of the slot's size is a constant)."""
    import tensorflow as tf

    def init(shape, dtype=tf.float32, partition_info=None):
        del partition_info
        return tf.fill(shape, tf.compat.v1.placeholder_with_default(tf.constant(value, dtype), []))

    return init


def mark_distinct(gathers) -> None:
    """Records that each `ResourceGather` op of `gathers` reads distinct rows (its gradient has no repeated row)."""
    import tensorflow as tf

    for op in gathers:
        tf.compat.v1.add_to_collection(DISTINCT_ROWS, op.inputs[1].name)


def is_distinct(indices) -> bool:
    """Whether `indices` (a sparse gradient's) are those of a gather `mark_distinct` recorded: the gather's own
    (`transfer`'s packed pushes send those), or `ResourceGather`'s gradient's reshape of them to a vector."""
    marked = indices.graph.get_collection(DISTINCT_ROWS)
    return indices.name in marked or (indices.op.type == "Reshape" and indices.op.inputs[0].name in marked)


def gathered_adagrad(var, accumulator, learning_rate, grad, indices, lock=None):
    """The op that applies Adagrad to rows `indices` (distinct) of resource variable `var` and of its `accumulator`:
    `acc += grad**2; var -= lr * grad / sqrt(acc)` on those rows, TF's `ResourceSparseApplyAdagrad` arithmetic.

    Each variable's rows are read, then written: an update of the same rows by another worker in between would be
    lost (measured: 0.01-0.03 less held-out AUC at 2 and 4 workers). `lock`, a `tf.CriticalSection` shared by every
    worker's graph (`row_lock`), runs one such update at a time.
    """
    import tensorflow as tf

    def update():
        acc_rows = accumulator.sparse_read(indices) + tf.square(grad)
        var_rows = var.sparse_read(indices) - learning_rate * grad * tf.math.rsqrt(acc_rows)
        with tf.control_dependencies([accumulator.scatter_update(tf.IndexedSlices(acc_rows, indices)),
                                      var.scatter_update(tf.IndexedSlices(var_rows, indices))]):
            return tf.constant(True)

    if lock is None:
        return update()
    return lock.execute(update, exclusive_resource_access=False)


def row_lock(var):
    """The `tf.CriticalSection` on `var`'s device that every worker's updates of `var`'s rows share (by name)."""
    import tensorflow as tf

    name = var.op.name.replace("/", "_")
    with tf.compat.v1.device(var.device):
        return tf.CriticalSection(shared_name=f"psworker_rows_{name}", name=f"{name}_rows")


def adagrad(learning_rate, initial_accumulator_value: float = 0.1):
    """`tf.compat.v1.train.AdagradOptimizer`, its accumulators started by `_fill_initializer`, its sparse updates
    by `gathered_adagrad` (by TF's kernel with `use_locking`). Sparse gradients reach `_resource_apply_sparse` with
    distinct indices: summed by row first (TF's way) unless `is_distinct`."""
    import tensorflow as tf

    class FilledAdagrad(tf.compat.v1.train.AdagradOptimizer):
        def _create_slots(self, var_list):
            for v in var_list:
                if not v.get_shape().is_fully_defined():
                    super()._create_slots([v])
                    continue
                dtype = v.dtype.base_dtype
                self._get_or_make_slot_with_initializer(v, _fill_initializer(self._initial_accumulator_value),
                                                        v.get_shape(), dtype, "accumulator", self._name)

        def _resource_apply_sparse_duplicate_indices(self, grad, handle, indices):
            if is_distinct(indices):
                return self._resource_apply_sparse(grad, handle, indices)
            return super()._resource_apply_sparse_duplicate_indices(grad, handle, indices)

        def _resource_apply_sparse(self, grad, var, indices):
            if self._use_locking:
                return super()._resource_apply_sparse(grad, var, indices)
            return gathered_adagrad(var, self.get_slot(var, "accumulator"),
                                    tf.cast(self._learning_rate_tensor, grad.dtype), grad, indices, row_lock(var))

    return FilledAdagrad(learning_rate, initial_accumulator_value=initial_accumulator_value)
