"""How a worker's step moves the variables and gradients: staged variables (`--staged_vars`) and the transfer dtype
(`--transfer_dtype`).

Both replace the model's reads of its trainable variables: within `Pulls.scope()`, `get_variable` still makes the
variable (on its ps, sharded as usual), but hands the model a tensor on this worker instead:

- each variable (shard) is read once on its ps, cast there to the transfer dtype (so the wire carries that dtype),
  and cast back to float32 on the worker;
- with staging, that pull goes through a `StagingArea` on the worker (tf_cnn_benchmarks' `--staged_vars`): a step
  computes with the values put there by the step before, while it pulls the values for the next one. The pull then
  runs alongside the compute instead of before it. Each variable's update waits for that pull's read (`push`), so
  the pulled values lack exactly this step's own update; under plain gradient descent the worker adds it
  (`stage_next`: pulled - rate * gradient), so its own updates are never stale and only the other workers' arrive
  one step later than in plain async mode. Under any other optimizer the step computes one update stale (a
  one-step-delayed gradient, stable at about half the learning rate: docs/performance.md). `fill_op` (run as part
  of the scaffold's local init, on every session creation) empties the areas and puts the first values.

`Pulls.compute_gradients` differentiates with respect to the worker-side tensors and pairs each gradient with its
variable; `push` casts each gradient to the transfer dtype on the worker and back to float32 on the variable's ps.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

from psworker.train import packing

log = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16")


PACK_MAX_BYTES = 1 << 20   # packed: variables up to this size share their ps's one pull and one push


@dataclass(frozen=True)
class TransferOptions:
    """What `Pulls` changes: staging, the dtype on the wire (`float32`: none), and packing."""

    staged: bool = False
    dtype: str = "float32"
    packed: bool = False

    @property
    def active(self) -> bool:
        return self.staged or self.dtype != "float32" or self.packed


def options_of(config, servers: bool = True) -> TransferOptions:
    """The `TransferOptions` of a `TrainConfig` (`pack_transfers` auto: `fast_path` decides; `servers`: False for a
    graph of one process without a cluster)."""
    from psworker.spec.fast_path import fast_path

    return TransferOptions(staged=bool(config.staged_vars), dtype=config.transfer_dtype,
                           packed=fast_path(config, servers).pack)


class Pulls:
    """Builds the worker-side tensors of the trainable variables (see the module docstring), and the matching
    gradients and pushes. Build the model's inference within `scope()`; one instance per training graph."""

    def __init__(self, options: TransferOptions, worker_device: str):
        self.options = options
        self._host = f"{worker_device}/device:CPU:0" if worker_device else "/device:CPU:0"
        self._by_name: dict[str, Any] = {}     # variable name -> what the model got
        self.pairs: list[tuple[Any, Any]] = []   # (worker-side tensor, variable or shard)
        # (StagingArea, the pulled float32 values it is filled from, variable, the area's get)
        self._areas: list[tuple[Any, Any, Any, Any]] = []
        self._puts: list = []
        self._reads: dict[int, Any] = {}         # id(variable or shard) -> its read on the ps (staged only)
        self.tables: list = []                   # sparse tables (shards): read by rows on the ps, never pulled whole
        self._landed: list = []                  # packed: (worker-side identity, variable, its read on the ps, None)
        self._rows: list = []                    # packed: (worker-side identity, table shard, its gather, the ids)
        self.packs: list[tuple[str, list[str]]] = []   # packed: (ps device, the variables read as one tensor)
        self.packed_rows: list[tuple[str, str]] = []   # packed: (ps device, a table shard whose rows go with it)

    def scope(self):
        """A variable scope (the current one, reopened) whose trainable `get_variable`s go through `pull`."""
        import tensorflow as tf

        v1 = tf.compat.v1
        return v1.variable_scope(v1.get_variable_scope(), custom_getter=self._getter)

    def _getter(self, getter, name, *args, **kwargs):
        if name in self._by_name:
            return self._by_name[name]
        var = getter(name, *args, **kwargs)
        if not kwargs.get("trainable", True):
            return var
        if _is_table(kwargs):
            shards = list(getattr(var, "_variable_list", None) or [var])
            self.tables += shards
            self._by_name[name] = var
            log.info("sparse table %s: read and updated by rows on its ps, not pulled whole: no staging, no %s "
                     "transfer for it", name, self.options.dtype)
            return var
        self._by_name[name] = self._pulled(var)
        return self._by_name[name]

    def _pulled(self, var):
        import tensorflow as tf

        shards = getattr(var, "_variable_list", None)
        if shards is None:
            return self._pull_one(var)
        axes = [i for i, n in enumerate(var._get_partitions()) if n > 1]   # pylint: disable=protected-access
        pieces = [self._pull_one(shard) for shard in shards]
        with tf.compat.v1.device(self._host):
            return tf.concat(pieces, axes[0] if axes else 0, name=f"{var.name}/pulled")

    def _pull_one(self, var):
        """`var` as a float32 tensor on this worker: read (and cast) on its ps, cast back here, staged here."""
        import tensorflow as tf
        from tensorflow.python.ops import data_flow_ops   # StagingArea: no public tf.compat.v1 name

        v1 = tf.compat.v1
        wire = tf.as_dtype(self.options.dtype)
        base = var.op.name
        with v1.colocate_with(None, ignore_existing=True), v1.device(var.device):
            read = var.read_value()
            sent = tf.identity(read, name=f"{base}/pull")
            if wire != tf.float32:
                sent = tf.cast(sent, wire, name=f"{base}/pull_{self.options.dtype}")
        with v1.colocate_with(None, ignore_existing=True), v1.device(self._host):
            landed = sent
            if self._packable(var):   # its input becomes its slice of the ps's pack (`pack`)
                landed = tf.identity(sent, name=f"{base}/landed")
                self._landed.append((landed, var, read, None))
            got = tf.cast(landed, tf.float32, name=f"{base}/pulled_float32") if wire != tf.float32 else landed
            if self.options.staged:
                area = data_flow_ops.StagingArea([tf.float32], shapes=[var.shape])
                self._reads[id(var)] = sent
                fresh, got = got, area.get()[0]
                self._areas.append((area, fresh, var, got))
            elif wire == tf.float32:
                got = tf.identity(got, name=f"{base}/pulled")
        self.pairs.append((got, var))
        return got

    def _packable(self, var) -> bool:
        """Packed: whether `var` (dense float32, fully shaped, at most `PACK_MAX_BYTES`) shares its ps's transfers."""
        shape = var.shape
        return (self.options.packed and var.dtype.base_dtype.name == "float32" and shape.is_fully_defined()
                and shape.num_elements() * 4 <= PACK_MAX_BYTES)

    def finish(self) -> None:
        """Once the model is built: `check_complete`, then `pack`."""
        self.check_complete()
        self.pack()

    def pack(self) -> None:
        """Packed: each ps's small variables (`_packable`) and the rows its table shards' gathers read
        (`_land_rows`) travel as one transfer a step. They are read on their ps as one tensor, their values
        concatenated (and cast once), and split here; each pulled variable's tensor, and each gather's rows, is
        rewired to its slice. Call once the model is built."""
        import tensorflow as tf

        v1 = tf.compat.v1
        wire = tf.as_dtype(self.options.dtype)
        for device, members in packing.by_device(self._landed + self._rows).items():
            if len(members) < 2:
                continue
            tag = f"psworker_pack_{len(self.packs)}"
            with v1.colocate_with(None, ignore_existing=True), v1.device(device):
                flat = tf.concat([tf.reshape(read, [-1]) for _, _, read, _ in members], 0, name=f"{tag}/pull")
                if wire != tf.float32:
                    flat = tf.cast(flat, wire, name=f"{tag}/pull_{self.options.dtype}")
            with v1.colocate_with(None, ignore_existing=True), v1.device(self._host):
                sizes = tf.stack([packing.piece_size(var, ids) for _, var, _, ids in members])   # rows': by ids, here
                pieces = tf.split(flat, sizes, num=len(members), name=f"{tag}/pulled")
                for (landed, var, _, ids), piece in zip(members, pieces):
                    shape = var.shape if ids is None else [-1, *var.shape[1:]]
                    landed.op._update_input(0, tf.reshape(piece, shape))   # pylint: disable=protected-access
                    if id(var) in self._reads:
                        self._reads[id(var)] = flat   # staged: the update waits for the pack's read
            self.packs.append((device, [v.op.name for _, v, _, ids in members if ids is None]))
            self.packed_rows += [(device, v.op.name) for _, v, _, ids in members if ids is not None]
        self._landed, self._rows = [], []
        for device, names in self.packs:
            rows = [name for where, name in self.packed_rows if where == device]
            log.info("packed transfers: %d variables%s on %s pulled and pushed as one tensor each way", len(names),
                     f" and the rows read from {', '.join(rows)}" if rows else "", device)

    def compute_gradients(self, loss, var_list=None, **_):
        """`[(gradient, variable)]` of `loss` for every variable pulled so far (an optimizer's signature, so that
        `towers.build_tower_gradients` can take this object as its optimizer). A table shard whose rows landed here
        (`_land_rows`) gets the gradient of those rows, indexed by its gather's ids."""
        import tensorflow as tf

        if var_list is not None:
            raise ValueError("Pulls.compute_gradients takes every pulled variable")
        rows = self._land_rows(loss.graph)
        landed = {id(shard): (rows_here, ids) for rows_here, shard, _, ids in rows}
        xs = [t for t, _ in self.pairs] + [landed[id(t)][0] if id(t) in landed else t for t in self.tables]
        # v1's gradients, as an optimizer's `compute_gradients` takes them: TF2's colocate each gradient with its op,
        # which would put a table's dedup gradient (a segment sum over the batch's ids) on the ps and send it every id.
        grads = tf.compat.v1.gradients(loss, xs)
        for i, table in enumerate(self.tables, start=len(self.pairs)):
            if id(table) in landed and grads[i] is not None:
                grads[i] = tf.IndexedSlices(self._by_row(grads[i], landed[id(table)][1], table), landed[id(table)][1],
                                            tf.constant(table.shape.as_list(), tf.int64))
        return list(zip(grads, [v for _, v in self.pairs] + self.tables))

    def _by_row(self, grad, ids, table):
        """The gradient of a table's landed rows as one row per id of `ids`, summed here (the batch's dedup: never
        every id pushed)."""
        import tensorflow as tf

        if not isinstance(grad, tf.IndexedSlices):
            return grad
        with tf.compat.v1.device(self._host):
            count = tf.shape(ids, out_type=grad.indices.dtype)[0]
            return tf.math.unsorted_segment_sum(grad.values, grad.indices, count,
                                                name=f"gradients_of_{table.op.name}_rows")

    def _land_rows(self, graph) -> list:
        """Packed in float32, unstaged: each table shard's one gather not yet seen gets a worker-side identity that
        its readers take instead (its input becomes the rows' slice of the ps's pack: `pack`). Returns the new
        `(identity, shard, gather's rows, gather's ids)`; none for a shard gathered twice."""
        import tensorflow as tf

        v1 = tf.compat.v1
        if not (self.options.packed and self.options.dtype == "float32" and not self.options.staged):
            return []
        seen = {read.op.name for _, _, read, _ in self._rows}
        gathers: dict = {}
        for op in graph.get_operations():
            if op.type == "ResourceGather" and op.name not in seen and op.inputs[1].shape.rank == 1:
                gathers.setdefault(op.inputs[0].op.name, []).append(op)
        new = []
        for shard in self.tables:
            ops = gathers.get(shard.handle.op.name, [])
            if len(ops) != 1 or not shard.shape[1:].is_fully_defined():
                continue
            out = ops[0].outputs[0]
            with v1.colocate_with(None, ignore_existing=True), v1.device(self._host):
                here = tf.identity(out, name=f"{shard.op.name}/rows_landed")
            for consumer in [c for c in out.consumers() if c is not here.op]:
                for i, tensor in enumerate(consumer.inputs):
                    if tensor is out:
                        consumer._update_input(i, here)   # pylint: disable=protected-access
            new.append((here, shard, out, ops[0].inputs[1]))
        self._rows += new
        return new

    def check_complete(self) -> None:
        """Raises ValueError when a trainable variable did not go through `scope()` (it would get no gradient)."""
        import tensorflow as tf

        pulled = {id(v) for _, v in self.pairs} | {id(t) for t in self.tables}
        missed = [v.op.name for v in tf.compat.v1.trainable_variables() if id(v) not in pulled]
        if missed:
            raise ValueError(f"--staged_vars/--transfer_dtype: trainable variables made outside the model's "
                             f"get_variable calls: {', '.join(missed)}")

    def push(self, grads_and_vars):
        """The gradients as the ps receives them: cast to the transfer dtype on the worker, back on the ps. Staged,
        each is applied only after this step's pull has read its variable, so the next step computes on values that
        lack exactly this step's update (one step stale, never a race between zero and one). Packed, each ps's small
        variables' gradients and its table shards' rows travel as one tensor (`_pack_pushes`), and a table's rows go
        with the ids its gather already sent."""
        tables = {id(t) for t in self.tables}   # a table's gradient is its rows' IndexedSlices
        packed = self._pack_pushes(grads_and_vars, tables) if self.options.packed else {}
        out = []
        for grad, var in grads_and_vars:
            if grad is not None and id(var) in packed:
                grad = packed[id(var)]
            elif grad is not None and id(var) not in tables:
                grad = self._push_one(grad, var)
            out.append((grad, var))
        return out

    def _pack_pushes(self, grads_and_vars, tables: set) -> dict:
        """`{id(variable): its gradient on its ps}` for each ps's packable variables and, in float32, its table
        shards' rows (their values; the ids are the gather's, already there), concatenated (and cast) here and split
        on the ps: one transfer a ps. A table shard's gradient not packed still takes its gather's ids."""
        import tensorflow as tf

        v1 = tf.compat.v1
        wire = tf.as_dtype(self.options.dtype)
        out = {id(v): packing.with_gathered_ids(g) for g, v in grads_and_vars if g is not None and id(v) in tables}
        members = [(g, v) for g, v in grads_and_vars
                   if isinstance(g, tf.Tensor) and id(v) not in tables and self._packable(v)]
        if wire == tf.float32:   # a table's rows stay float32 on the wire whatever --transfer_dtype says
            members += [(out[id(v)], v) for _, v in grads_and_vars
                        if id(v) in out and packing.rows_packable(out[id(v)], v)]
        for i, (device, group) in enumerate(packing.by_device(members).items()):
            if len(group) < 2:
                continue
            with v1.colocate_with(None, ignore_existing=True), v1.device(self._host):
                flat = tf.concat([tf.reshape(packing.values(g), [-1]) for g, _ in group], 0,
                                 name=f"psworker_push_{i}/push")
                if wire != tf.float32:
                    flat = tf.cast(flat, wire, name=f"psworker_push_{i}/push_{self.options.dtype}")
            reads = list({id(r): r for r in (self._reads.get(id(v)) for _, v in group) if r is not None}.values())
            with v1.colocate_with(None, ignore_existing=True), v1.device(device), tf.control_dependencies(reads):
                got = tf.cast(flat, tf.float32) if wire != tf.float32 else tf.identity(flat)
                sizes = tf.stack([packing.piece_size(v, getattr(g, "indices", None)) for g, v in group])
                pieces = tf.split(got, sizes, num=len(group), name=f"psworker_push_{i}/pushed")
                out.update({id(v): packing.unflat(p, g, v) for (g, v), p in zip(group, pieces)})
        return out

    def _push_one(self, grad, var):
        import tensorflow as tf

        v1 = tf.compat.v1
        wire = tf.as_dtype(self.options.dtype)
        read = self._reads.get(id(var))
        if wire == tf.float32 and read is None:
            return grad
        base = var.op.name
        if wire != tf.float32:
            with v1.colocate_with(None, ignore_existing=True), v1.device(self._host):
                grad = tf.cast(grad, wire, name=f"{base}/push_{self.options.dtype}")
        with v1.colocate_with(None, ignore_existing=True), v1.device(var.device), \
                tf.control_dependencies([read] if read is not None else []):
            if wire != tf.float32:
                return tf.cast(grad, tf.float32, name=f"{base}/pushed_float32")
            return tf.identity(grad, name=f"{base}/pushed_after_pull")

    def stage_next(self, grads_and_vars, learning_rate=None) -> None:
        """Builds what each step puts for the next one (`step_ops`): each variable's values as this step pulled
        them, read before this step's update (see `push`), plus this worker's own update,
        `-learning_rate * gradient`, when `learning_rate` is given (plain gradient descent at that rate): the next
        step then computes on values that lack none of this worker's own updates, only the other workers' latest.
        Without it, each step's gradient is taken one step stale. The gradient is taken as the ps receives it
        (rounded to the transfer dtype)."""
        import tensorflow as tf

        v1 = tf.compat.v1
        wire = tf.as_dtype(self.options.dtype)
        grads = {id(var): grad for grad, var in grads_and_vars}
        for area, fresh, var, got in self._areas:
            grad = grads.get(id(var))
            with v1.colocate_with(None, ignore_existing=True), v1.device(self._host), \
                    tf.control_dependencies([got]):   # after this step's get: the area holds one step's values
                value = fresh
                if learning_rate is not None and grad is not None:
                    grad = tf.convert_to_tensor(grad)
                    if wire != tf.float32:
                        grad = tf.cast(tf.cast(grad, wire), tf.float32)
                    value = tf.subtract(fresh, tf.cast(learning_rate, tf.float32) * grad,
                                        name=f"{var.op.name}/staged_with_own_update")
                self._puts.append(area.put([value]))

    @property
    def areas(self) -> list[tuple[Any, Any]]:
        """`(StagingArea, variable or shard)` of every staged variable."""
        return [(area, var) for area, _, var, _ in self._areas]

    @property
    def step_ops(self) -> list:
        """What every step runs besides the train op: the puts of the next step's values (`stage_next`)."""
        return list(self._puts)

    def fill_op(self) -> Optional[Any]:
        """Empties every staging area, then puts the current values: the first step's (None unless staged)."""
        import tensorflow as tf

        if not self._areas:
            return None
        fills = []
        for area, fresh, _, _ in self._areas:
            with tf.compat.v1.device(self._host):
                with tf.control_dependencies([area.clear()]):
                    fills.append(area.put([fresh]))
        return tf.group(*fills, name="psworker_staged_vars_fill")


def _is_table(getter_kwargs: dict) -> bool:
    """Whether a `get_variable` call makes a sparse table (`models.base.SPARSE_TABLES` among its collections)."""
    from psworker.models.base import SPARSE_TABLES

    return SPARSE_TABLES in (getter_kwargs.get("collections") or ())


def register_fill(fill) -> None:
    """Makes `fill` part of the scaffold's default local init op (run on every session creation, once the model is
    ready on the ps, by the chief and the other workers alike)."""
    import tensorflow as tf

    v1 = tf.compat.v1
    key = v1.GraphKeys.LOCAL_INIT_OP
    if v1.get_collection(key):
        raise ValueError("a local init op is already registered; staged variables need their own")
    with tf.control_dependencies([v1.train.Scaffold.default_local_init_op()]):
        v1.add_to_collection(key, tf.group(fill, name="local_init_and_staged_fill"))


__all__ = ["DTYPES", "TransferOptions", "options_of", "Pulls", "register_fill"]
