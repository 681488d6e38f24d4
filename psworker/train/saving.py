"""The chief's checkpoint saver, built so that a ps holds about one copy of one large variable more than its variables
while a checkpoint is written or restored, not a copy of all of them (issue 37, "a ps memory model").

Why a ps held 2.3x its variables at a save (measured: `benchmarks/ps_memory_model.py`): TF 1.x's `Saver` reads each
resource variable through its plain `ReadVariableOp`. A variable that has had a sparse update (a table's rows pushed,
or gathered) is in copy-on-read mode (`EnsureSparseVariableAccess`, tensorflow#54105), so that read copies the whole
tensor; and one `SaveV2` per ps reads every variable of that ps at once, so every copy is alive together. TF 2's own
saveables call `DisableCopyOnRead` first, but without ordering it before their read, and v1's Saver does not use them.

What `saver` builds instead, per ps (`SequencedSaverBuilder`):
- each variable is read only after a `DisableCopyOnRead` of it has run (a control dependency): the read shares the
  variable's buffer; a push that comes during the write copies that one variable (copy-on-write), not the rest;
- variables of `LARGE_BYTES` or more are written one at a time, each in its own checkpoint shard, each shard's reads
  after the previous shard's write: one large variable's copy at most is alive;
- at a restore, the large variables are read and assigned one at a time too (the `RestoreV2` of a ps otherwise holds
  all of its restored tensors before any is assigned, next to the variables' old buffers).
The checkpoint written is the same (one `.index`, the keys and slices as before, more `.data` shards): restoring it into
another ps count, exporting it or reading it with `tf.train.load_checkpoint` is unchanged.
"""

from __future__ import annotations

import os

__all__ = ["LARGE_BYTES", "SAVER_ENV", "SequencedSaverBuilder", "saveable_bytes", "saver"]

SAVER_ENV = "PSWORKER_SAVER"

# A variable (or a partition of one) of at least this many bytes is saved and restored alone, after the previous one.
LARGE_BYTES = 1 << 20


def saveable_bytes(saveable) -> int:
    """Bytes that `saveable` writes: its tensors' shapes, or a resource variable's own (0 where a shape is unknown:
    it counts as small). Reads no tensor (a resource variable's spec makes its read ops when asked for it)."""
    total = 0
    for spec in saveable.specs:
        tensor = getattr(spec, "_tensor", None)
        shape = getattr(saveable, "_var_shape", None) if callable(tensor) else getattr(tensor, "shape", None)
        if shape is None or not shape.is_fully_defined():
            return 0
        total += shape.num_elements() * spec.dtype.size
    return total


def _handle(saveable):
    """The resource handle of a resource variable's saveable (one spec), else None."""
    handle = getattr(saveable, "handle_op", None)
    if handle is None or len(saveable.specs) != 1:
        return None
    from tensorflow.python.framework import dtypes

    return handle if getattr(handle, "dtype", None) == dtypes.resource else None


def _read_no_copy(saveable, spec):
    """`spec`'s tensor read after `DisableCopyOnRead` of its variable ran: the read shares the variable's buffer."""
    from tensorflow.python.framework import ops
    from tensorflow.python.ops import gen_resource_variable_ops as rv

    handle = _handle(saveable)
    if handle is None:
        return spec.tensor
    with ops.device(handle.device):
        disable = rv.disable_copy_on_read(handle)
        with ops.control_dependencies([disable]):
            return rv.read_variable_op(handle, spec.dtype)


def _builder_base():
    from tensorflow.python.training.saver import BulkSaverBuilder

    return BulkSaverBuilder


class SequencedSaverBuilder(_builder_base()):
    """A `BulkSaverBuilder` that reads variables without copies and saves/restores large ones one at a time."""

    def __init__(self, large_bytes: int = LARGE_BYTES):
        super().__init__()
        self._large = large_bytes
        self._last_save = {}      # device -> the previous shard's save op there, during one _AddShardedSaveOpsForV2

    def _split(self, saveables) -> list[list]:
        small = [s for s in saveables if saveable_bytes(s) < self._large]
        large = sorted((s for s in saveables if saveable_bytes(s) >= self._large), key=saveable_bytes, reverse=True)
        return ([small] if small else []) + [[s] for s in large]

    def _AddShardedSaveOpsForV2(self, checkpoint_prefix, per_device):  # noqa: N802 - TF's name
        """Each device's saveables as several shards: its small ones together, then each large one alone."""
        self._last_save = {}
        shards = [(device, group) for device, saveables in per_device for group in self._split(saveables)]
        return super()._AddShardedSaveOpsForV2(checkpoint_prefix, shards)

    def save_op(self, filename_tensor, saveables):
        """One shard's `SaveV2`, its reads after the previous shard's write on the same device."""
        from tensorflow.python.framework import ops
        from tensorflow.python.ops import io_ops

        device = saveables[0].device if saveables else None
        previous = self._last_save.get(device)
        with ops.control_dependencies([previous] if previous is not None else []):
            names, slices, tensors = [], [], []
            for saveable in saveables:
                for spec in saveable.specs:
                    names.append(spec.name)
                    slices.append(spec.slice_spec)
                    tensors.append(_read_no_copy(saveable, spec))
            save = io_ops.save_v2(filename_tensor, names, slices, tensors)
        self._last_save[device] = save
        return save

    def _AddRestoreOps(self, filename_tensor, saveables, restore_sequentially, reshape,  # noqa: N802
                       preferred_shard=-1, name="restore_all"):
        """The small saveables in one `RestoreV2`, then each large one read and assigned after the previous one."""
        from tensorflow.python.framework import ops
        from tensorflow.python.ops import control_flow_ops

        groups = self._split(saveables)
        assigns, previous = [], None
        for group in groups:
            with ops.control_dependencies([previous] if previous is not None else []):
                done = super()._AddRestoreOps(filename_tensor, group, restore_sequentially, reshape,
                                              preferred_shard, name="restore_group")
            assigns.append(done)
            if len(group) == 1 and saveable_bytes(group[0]) >= self._large:
                previous = done
        return control_flow_ops.group(*assigns, name=name)


def saver(**kwargs):
    """`tf.compat.v1.train.Saver(sharded=True, builder=SequencedSaverBuilder(), **kwargs)`; TF's own builder where
    the environment has `PSWORKER_SAVER=plain` (`benchmarks/ps_memory_model.py --saver plain`: the ps memory before)."""
    import tensorflow as tf

    plain = os.environ.get(SAVER_ENV, "") == "plain"
    return tf.compat.v1.train.Saver(sharded=True, builder=None if plain else SequencedSaverBuilder(), **kwargs)
