"""Data-parallel towers inside one process (the CIFAR-10 multi-GPU tutorial's pattern): split, build, average."""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

log = logging.getLogger(__name__)

# Ops that hold variable state: they keep whatever device an outer scope (e.g. `replica_device_setter`) gives
# them instead of the tower's.
_VARIABLE_OPS = frozenset(
    {"Variable", "VariableV2", "VarHandleOp", "AutoReloadVariable", "MutableHashTable", "MutableHashTableV2",
     "MutableHashTableOfTensors", "MutableHashTableOfTensorsV2", "MutableDenseHashTable",
     "MutableDenseHashTableV2"}
)


def tower_devices(num_devices: int) -> list[str]:
    """Device names (without job/task) for `num_devices` towers.

    Args:
        num_devices: how many towers.

    Returns:
        `["/device:GPU:0", ...]` when this machine has GPUs, else `["/device:CPU:0", ...]` (the session or
        server must then have `num_devices` CPU devices: see `session_config_for_towers`).

    Raises:
        ValueError: `num_devices < 1`, or GPUs are present but fewer than `num_devices`.
    """
    import tensorflow as tf

    if num_devices < 1:
        raise ValueError(f"num_devices must be at least 1, got {num_devices}")
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        if num_devices > len(gpus):
            raise ValueError(f"requested {num_devices} towers, only {len(gpus)} GPUs present")
        return [f"/device:GPU:{i}" for i in range(num_devices)]
    return [f"/device:CPU:{i}" for i in range(num_devices)]


def session_config_for_towers(num_devices: int, *, allow_soft_placement: bool = True, base: Any = None):
    """A `tf.compat.v1.ConfigProto` with `num_devices` CPU devices (at least; other fields from `base`).

    A process has one CPU device unless configured for more: CPU towers need this config (or one whose
    `device_count["CPU"]` is at least the number of towers) on their `Session`, or, in a cluster, on the
    worker's `tf.compat.v1.train.Server(..., config=...)`.

    Args:
        num_devices: how many CPU towers the session must be able to place.
        allow_soft_placement: let ops without a kernel on the tower's device fall back to another.
        base: an existing `ConfigProto` to copy and extend.
    """
    import tensorflow as tf

    config = tf.compat.v1.ConfigProto()
    if base is not None:
        config.CopyFrom(base)
    config.device_count["CPU"] = max(num_devices, config.device_count.get("CPU", 1))
    config.allow_soft_placement = config.allow_soft_placement or allow_soft_placement
    return config


def average_gradients(tower_grads: Sequence[Sequence[tuple]]) -> list[tuple]:
    """Averages each variable's gradient over the towers.

    Args:
        tower_grads: one `[(grad, var), ...]` list per tower, variables in the same order in each (as
            `optimizer.compute_gradients` returns them).

    Returns:
        `[(mean_grad, var), ...]`; the gradient is None where every tower's is None.

    Raises:
        ValueError: no towers, lists of different lengths or orders, or None in some towers only.
    """
    import tensorflow as tf

    if not tower_grads:
        raise ValueError("average_gradients needs at least one tower")
    n = len(tower_grads)
    if len({len(g) for g in tower_grads}) != 1:
        raise ValueError(f"towers have different numbers of gradients: {[len(g) for g in tower_grads]}")
    averaged = []
    for pairs in zip(*tower_grads):
        var = pairs[0][1]
        if any(v is not var for _, v in pairs):
            raise ValueError(f"towers list different variables at the position of {var.name}")
        grads = [g for g, _ in pairs]
        if all(g is None for g in grads):
            averaged.append((None, var))
            continue
        if any(g is None for g in grads):
            raise ValueError(f"{var.name} has a gradient in some towers only")
        if n == 1:
            averaged.append((grads[0], var))
        elif all(isinstance(g, tf.IndexedSlices) for g in grads):
            averaged.append(
                (
                    tf.IndexedSlices(
                        tf.concat([g.values for g in grads], 0) / n,
                        tf.concat([g.indices for g in grads], 0),
                        grads[0].dense_shape,
                    ),
                    var,
                )
            )
        else:
            dense = [tf.convert_to_tensor(g) for g in grads]
            averaged.append((tf.math.divide(tf.add_n(dense), float(n)), var))
    return averaged


def _tower_device_function(device: str):
    """A device function: `device` for every op but variables, which keep what outer scopes give them."""
    import tensorflow as tf

    merge = tf.DeviceSpec.from_string(device)

    def choose(op):
        current = tf.DeviceSpec.from_string(op.device or "")
        if op.type in _VARIABLE_OPS:
            return current.to_string()
        return current.make_merged_spec(merge).to_string()

    return choose


def build_tower_gradients(model, optimizer, images, labels, num_devices: int, *, device_prefix: str = "",
                          devices: Optional[Sequence[str]] = None):
    """Splits a batch over `num_devices` towers sharing one set of variables; averages their gradients.

    Each tower runs `model.inference` and `model.loss` on its slice under the caller's variable scope reopened
    with `reuse=AUTO_REUSE` (the first tower creates the variables, the others reuse them) and name scope
    `tower_<i>`. Tower ops go to `device_prefix + devices[i]`; splitting the batch and averaging go to
    `device_prefix + "/device:CPU:0"`; variables are left to the outer device scope (a `replica_device_setter`
    puts them on the ps).

    Args:
        model: a `psworker.models.base.Model`.
        optimizer: a `tf.compat.v1.train.Optimizer` (only `compute_gradients` is called).
        images: the batch; its first dimension must divide by `num_devices`.
        labels: the labels of the batch.
        num_devices: number of towers.
        device_prefix: prepended to each tower device, e.g. `/job:worker/task:0`; empty for the current one.
        devices: tower devices to use instead of `tower_devices(num_devices)`.

    Returns:
        `(avg_grads_and_vars, mean_loss)`: averaged `[(grad, var)]` for `optimizer.apply_gradients`, and the
        mean of the tower losses.

    Raises:
        ValueError: the static batch size does not divide by `num_devices`.
    """
    import tensorflow as tf

    v1 = tf.compat.v1
    devices = list(devices) if devices is not None else tower_devices(num_devices)
    if len(devices) != num_devices:
        raise ValueError(f"got {len(devices)} devices for {num_devices} towers")
    batch = images.shape[0]
    if batch is not None and int(batch) % num_devices:
        raise ValueError(f"batch size {int(batch)} does not divide into {num_devices} towers")
    # Splitting and averaging run on this worker's CPU (as in the tutorial), not wherever an outer scope points:
    # an in-graph client builds every worker's towers under its own worker device.
    host = _tower_device_function(device_prefix + "/device:CPU:0")
    with v1.device(host):
        image_parts = tf.split(images, num_devices, axis=0) if num_devices > 1 else [images]
        label_parts = tf.split(labels, num_devices, axis=0) if num_devices > 1 else [labels]

    tower_grads, losses = [], []
    scope = v1.get_variable_scope()
    for i, device in enumerate(devices):
        with v1.variable_scope(scope, reuse=v1.AUTO_REUSE), tf.name_scope(f"tower_{i}"):
            with v1.device(_tower_device_function(device_prefix + device)):
                logits = model.inference(image_parts[i], training=True)
                loss = model.loss(logits, label_parts[i])
                tower_grads.append(optimizer.compute_gradients(loss))
        losses.append(loss)
        log.debug("built tower %d on %s%s", i, device_prefix, device)
    with tf.name_scope("tower_average"), v1.device(host):
        mean_loss = tf.math.divide(tf.add_n(losses), float(num_devices), name="mean_loss")
        return average_gradients(tower_grads), mean_loss


__all__ = ["tower_devices", "session_config_for_towers", "average_gradients", "build_tower_gradients"]
