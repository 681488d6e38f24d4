"""The pieces of a packed step's transfers (`train.transfer`, `--pack_transfers`): each ps's small variables and
its table shards' rows in one tensor each way, cut apart by sizes the receiving side knows; and small constants
(the learning rate) copied to each ps that takes them, so that nothing crosses for them."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

LOCAL_CONST_MAX_BYTES = 4096   # constants up to this size get a copy on each ps that takes them (`local_constants`)


def local_constants(graph) -> int:
    """Gives each op on a ps that takes a small constant made on another task (a constant learning rate, a
    gradient's shape) a copy of it on its own task; returns how many inputs it rewired. TF's partitioning sends such
    a constant every step, an RPC of its own (4 bytes for a learning rate): measured in a trace, `edge_N_learning_rate`
    received by the ps at each step. Ops inside a loop keep theirs."""
    import tensorflow as tf
    from tensorflow.python.framework import tensor_util

    from psworker.train.traffic import _Devices, _ps_of

    where, copies, rewired = _Devices(graph), {}, 0
    for op in list(graph.get_operations()):
        dst = where.of(op)
        if _ps_of(dst) is None or op._control_flow_context is not None:   # pylint: disable=protected-access
            continue
        for i, tensor in enumerate(op.inputs):
            if not _small_constant(tensor) or _task_of(where.of(tensor.op)) == _task_of(dst):
                continue
            key = (tensor.name, _task_of(dst))
            if key not in copies:
                with graph.as_default(), tf.compat.v1.colocate_with(None, ignore_existing=True), \
                        tf.compat.v1.device(dst), tf.control_dependencies(None):
                    value = tensor_util.MakeNdarray(tensor.op.get_attr("value"))
                    copies[key] = tf.constant(value, tensor.dtype, name=f"{tensor.op.name}_local")
            op._update_input(i, copies[key])   # pylint: disable=protected-access
            rewired += 1
    if copies:
        log.info("small constants copied to the ps tasks that take them (the learning rate, ...): %d; none crosses "
                 "each step", len(copies))
    return rewired


def _small_constant(tensor) -> bool:
    """A `Const` of at most `LOCAL_CONST_MAX_BYTES`, outside any loop."""
    return (tensor.op.type == "Const" and tensor.op._control_flow_context is None   # pylint: disable=protected-access
            and tensor.shape.is_fully_defined()
            and tensor.shape.num_elements() * tensor.dtype.size <= LOCAL_CONST_MAX_BYTES)


def _task_of(device: str) -> tuple:
    import tensorflow as tf

    spec = tf.DeviceSpec.from_string(device or "")
    return spec.job, spec.replica or 0, spec.task or 0


def piece_size(var, ids=None):
    """The floats `var`'s piece of a pack takes, as the side that cuts it knows: its elements, or for a table shard's
    rows, `ids` (the gather's, on that side already) x the row width."""
    import tensorflow as tf

    if ids is None:
        return tf.constant(var.shape.num_elements(), tf.int32)
    return tf.size(ids, out_type=tf.int32) * int(var.shape[1:].num_elements())


def values(grad):
    """A gradient's values: an `IndexedSlices`' rows, or the tensor itself."""
    return grad.values if hasattr(grad, "indices") else grad


def rows_packable(grad, var) -> bool:
    """Whether a table shard's gradient `grad` can share its ps's push: float32 rows of a known width (their ids
    cross on their own: the ps needs them for its gather before the step's push)."""
    return (hasattr(grad, "indices") and grad.values.dtype.base_dtype.name == "float32"
            and var.shape[1:].is_fully_defined())


def unflat(piece, grad, var):
    """`piece` of a pack, on the ps, shaped as `grad`: the variable's shape, or a table's rows with `grad`'s ids."""
    import tensorflow as tf

    if hasattr(grad, "indices"):
        return tf.IndexedSlices(tf.reshape(piece, [-1, *var.shape[1:]]), grad.indices, grad.dense_shape)
    return tf.reshape(piece, var.shape)


def by_device(members: list) -> dict:
    """`members` (tuples whose second item is a variable) grouped by the variable's device, in order."""
    groups: dict = {}
    for m in members:
        groups.setdefault(m[1].device, []).append(m)
    return groups


def with_gathered_ids(grad):
    """A table shard's gradient with, as its indices, the very ids its gather received on the ps, so they cross
    once a step, not twice (the gather's gradient reshapes them to 1-D, a new tensor that would cross again)."""
    import tensorflow as tf

    indices = getattr(grad, "indices", None)
    if indices is None or indices.op.type != "Reshape" or indices.op.inputs[0].shape.rank != 1:
        return grad
    return tf.IndexedSlices(grad.values, indices.op.inputs[0], grad.dense_shape)


__all__ = ["LOCAL_CONST_MAX_BYTES", "by_device", "local_constants", "piece_size", "rows_packable", "unflat", "values",
           "with_gathered_ids"]
