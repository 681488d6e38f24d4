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

log = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class TransferOptions:
    """What `Pulls` changes: staging, and the dtype on the wire (`float32`: none)."""

    staged: bool = False
    dtype: str = "float32"

    @property
    def active(self) -> bool:
        return self.staged or self.dtype != "float32"


def options_of(config) -> TransferOptions:
    """The `TransferOptions` of a `TrainConfig`."""
    return TransferOptions(staged=bool(config.staged_vars), dtype=config.transfer_dtype)


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
            sent = tf.identity(var.read_value(), name=f"{base}/pull")
            if wire != tf.float32:
                sent = tf.cast(sent, wire, name=f"{base}/pull_{self.options.dtype}")
        with v1.colocate_with(None, ignore_existing=True), v1.device(self._host):
            got = tf.cast(sent, tf.float32, name=f"{base}/pulled_float32") if wire != tf.float32 else sent
            if self.options.staged:
                area = data_flow_ops.StagingArea([tf.float32], shapes=[var.shape])
                self._reads[id(var)] = sent
                fresh, got = got, area.get()[0]
                self._areas.append((area, fresh, var, got))
            elif wire == tf.float32:
                got = tf.identity(got, name=f"{base}/pulled")
        self.pairs.append((got, var))
        return got

    def compute_gradients(self, loss, var_list=None, **_):
        """`[(gradient, variable)]` of `loss` for every variable pulled so far (an optimizer's signature, so that
        `towers.build_tower_gradients` can take this object as its optimizer)."""
        import tensorflow as tf

        if var_list is not None:
            raise ValueError("Pulls.compute_gradients takes every pulled variable")
        grads = tf.gradients(loss, [t for t, _ in self.pairs] + self.tables)
        return list(zip(grads, [v for _, v in self.pairs] + self.tables))

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
        lack exactly this step's update (one step stale, never a race between zero and one)."""
        tables = {id(t) for t in self.tables}   # a table's gradient is its rows' IndexedSlices, pushed as they are
        return [(grad if grad is None or id(var) in tables else self._push_one(grad, var), var)
                for grad, var in grads_and_vars]

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
