"""Shards of the training split dealt on demand from a cursor kept on the ps, beside the model (issue 25).

The split is cut into shards: contiguous ranges of a per-epoch permutation of the example positions (`ShardPlan`,
pure, in `shard_plan.py` with the reading of the state). Shard `k` is range `k % shards_per_epoch` of epoch `k //
shards_per_epoch`. The state lives in variables on
the ps that holds the global step, so the chief's Saver writes it into every checkpoint with the weights:

- `next_shard`: the next fresh shard. A worker takes one when it runs out, at any speed, in any number.
- per reserved worker index `i`, its lease: the shards (with a start offset) dealt to it and not yet known to be
  trained, in the order it reads them (a ring of `RING` entries), and `trained[i]`: the examples it has trained
  past the start of the first. The train op adds its batch's size there after the update, so a checkpoint holds
  exactly what its weights were trained on; read-ahead examples not trained yet are not counted.
- a pool of pieces given back: a worker that leaves the job (scaled away, preempted) returns the untrained rest of
  its lease; the chief also returns the lease of a worker whose port stays closed once the epochs are dealt. The
  next worker to ask takes a piece from the pool before a fresh shard.

Taking, retiring and giving back run in one `tf.CriticalSection` on that ps: each is atomic for every worker.
A worker restarted at its index resumes its own lease where `trained[i]` says; a run restored from a checkpoint
resumes every lease from the checkpoint. At least once: an example is read again only if its worker died (or the
ps rolled back to a checkpoint) after reading it, so the examples read twice are bounded by the shards in flight.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import numpy as np

from psworker.train.shard_plan import RING, ShardPlan, lease_entries, remaining

log = logging.getLogger(__name__)

SCOPE = "psworker_data"
POLL_SECS = 0.05                  # a worker waiting for its read-ahead to be trained (its ring is full)
END_POLL_SECS = 0.2               # the chief waiting for the last leases of the others
FULL, EXHAUSTED = -2, -1          # what `take` returns instead of a shard
SIDE_CALL_SECS = 15.0             # a side-session call (its session's creation too) that a dead ps left hanging
SIDE_ATTEMPTS = 8                 # side-session calls tried, each in a new session, before the error is raised


@dataclass(frozen=True)
class Dealing:
    """What one worker's graph needs to take shards: the plan, its index among `num_workers` reserved ones, and
    the side session's target and config. The chief waits for the others' last shards at the end, and returns the
    lease of a worker `gone(j)` says is gone."""

    plan: ShardPlan
    index: int
    num_workers: int
    target: str
    session_config: object = None
    is_chief: bool = False
    seed: Optional[int] = None
    pad_to: int = 1                       # towers: the last batch is filled up to a multiple of this
    gone: Optional[Callable[[int], bool]] = None
    ps_addresses: tuple = ()              # `host:port` of each ps: the side session goes to the state's ps itself


class DealerState:
    """The dealer's variables, created in the current graph on `device` (the global step's ps)."""

    def __init__(self, num_workers: int, device: str, seed: Optional[int]):
        import tensorflow as tf

        v1 = tf.compat.v1
        w, pool = num_workers, num_workers * RING
        i64 = tf.int64

        def var(name, shape, value):
            init = v1.constant_initializer(value) if not callable(value) else value
            return v1.get_variable(name, shape, i64, initializer=init, trainable=False, use_resource=True)

        seed_init = (v1.constant_initializer(seed) if seed is not None
                     else (lambda shape, dtype=None, partition_info=None:
                           tf.random.uniform(shape, 0, 2 ** 31 - 1, dtype=i64)))
        # device(None): not through the model's placement (the greedy strategy would count these bytes)
        with v1.device(None), v1.device(device), v1.variable_scope(SCOPE, reuse=v1.AUTO_REUSE):
            self.seed = v1.get_variable("seed", [], i64, initializer=seed_init, trainable=False, use_resource=True)
            self.next_shard = var("next_shard", [], 0)
            self.ring_shard = var("ring_shard", [w, RING], -1)
            self.ring_start = var("ring_start", [w, RING], 0)
            self.ring_head = var("ring_head", [w], 0)
            self.ring_count = var("ring_count", [w], 0)
            self.trained = var("trained", [w], 0)
            self.pool_shard = var("pool_shard", [pool], -1)
            self.pool_start = var("pool_start", [pool], 0)
            self.examples_trained = var("examples_trained", [], 0)
        self.variables = [self.seed, self.next_shard, self.ring_shard, self.ring_start, self.ring_head,
                          self.ring_count, self.trained, self.pool_shard, self.pool_start, self.examples_trained]
        self.num_workers = num_workers

    def count(self, index: int, batch_size, train_op, claimed=None):
        """`train_op`, then the record of `batch_size` examples trained by worker `index` (none unless `claimed`, when
        given: `step_claim`): the new train op. Every op of it is on the dealer's ps: a group on the worker would cost
        the step a round trip per control edge (measured: the MLP at about half the steps/s)."""
        import tensorflow as tf

        n = tf.reshape(tf.cast(batch_size, tf.int64) * (1 if claimed is None else tf.cast(claimed, tf.int64)), [1])
        with tf.compat.v1.device(None), tf.compat.v1.device(self.trained.device), \
                tf.control_dependencies([train_op]), tf.name_scope(f"{SCOPE}/count"):
            return tf.group(self.trained.scatter_add(tf.IndexedSlices(n, tf.constant([index]))),
                            self.examples_trained.assign_add(n[0], read_value=False), name="train_op_and_count")


def _shard_length(plan: ShardPlan, shard):
    import tensorflow as tf

    j = tf.math.floormod(tf.maximum(shard, 0), plan.shards_per_epoch)
    return tf.minimum(tf.constant(plan.shard_examples, tf.int64), plan.num_examples - j * plan.shard_examples)


class _Ops:
    """The atomic operations, built in a side graph (same variables by name, same device, one critical section)."""

    def __init__(self, plan: ShardPlan, num_workers: int, device: str):
        import tensorflow as tf

        v1 = tf.compat.v1
        self.graph = tf.Graph()
        with self.graph.as_default(), v1.device(device):
            self.state = s = DealerState(num_workers, device, None)
            self.who = v1.placeholder(tf.int32, [], name="who")
            lock = tf.CriticalSection(shared_name=f"{SCOPE}_lock", name=f"{SCOPE}_lock")
            self.take = lock.execute(lambda: self._take(plan, s), exclusive_resource_access=False)
            self.retire = lock.execute(lambda: self._retire(plan, s), exclusive_resource_access=False)
            self.give_back = lock.execute(lambda: self._give_back(plan, s), exclusive_resource_access=False)
            self.read = {"seed": s.seed.read_value(), "next_shard": s.next_shard.read_value(),
                         "ring_shard": s.ring_shard.read_value(), "ring_start": s.ring_start.read_value(),
                         "ring_head": s.ring_head.read_value(), "ring_count": s.ring_count.read_value(),
                         "trained": s.trained.read_value(), "pool_shard": s.pool_shard.read_value(),
                         "pool_start": s.pool_start.read_value(), "examples_trained": s.examples_trained.read_value()}
        self.graph.finalize()

    def _take(self, plan: ShardPlan, s: DealerState):
        """Retires the first entry of the ring of `who` if it is wholly trained, then appends a piece from the pool,
        else a fresh shard: `(shard, start)`; `(FULL, 0)` when the ring is full, `(EXHAUSTED, 0)` when nothing is
        left. One call per shard: a worker's only round trip for its data."""
        import tensorflow as tf

        who, i64 = self.who, tf.int64
        pool, pool_start = s.pool_shard.read_value(), s.pool_start.read_value()
        fresh, trained = s.next_shard.read_value(), s.trained.read_value()[who]
        done, left, head, count = self._head_done(plan, s)
        retired = tf.cast(done, i64)
        head, count = head + retired, count - retired
        full = count >= RING
        has = tf.reduce_any(pool >= 0)
        j = tf.argmax(tf.cast(pool >= 0, tf.int32), output_type=tf.int32)
        use_pool = has & ~full
        use_fresh = ~has & ~full & (fresh < plan.limit)
        nothing = tf.where(full, tf.constant(FULL, i64), tf.constant(EXHAUSTED, i64))
        shard = tf.where(use_pool, pool[j], tf.where(use_fresh, fresh, nothing))
        start = tf.where(use_pool, pool_start[j], tf.constant(0, i64))
        got = use_pool | use_fresh
        slot = tf.stack([who, tf.cast(tf.math.floormod(head + count, RING), tf.int32)])[None]
        old = s.ring_shard.read_value()[who, slot[0, 1]]
        old_start = s.ring_start.read_value()[who, slot[0, 1]]
        # An empty ring has nothing in flight: what `trained` holds beyond it (a padded last batch) is void.
        # Subtractions, never writes: the train op adds to `trained` outside the critical section.
        void = tf.where(got & tf.equal(count, 0), trained - retired * left, tf.constant(0, i64))
        updates = [
            s.pool_shard.scatter_update(tf.IndexedSlices(tf.where(use_pool, tf.constant(-1, i64), pool[j])[None],
                                                         j[None])),
            s.next_shard.assign_add(tf.cast(use_fresh, i64), read_value=False),
            tf.compat.v1.scatter_nd_update(s.ring_shard, slot, tf.where(got, shard, old)[None]),
            tf.compat.v1.scatter_nd_update(s.ring_start, slot, tf.where(got, start, old_start)[None]),
            s.ring_head.scatter_add(tf.IndexedSlices(retired[None], who[None])),
            s.ring_count.scatter_add(tf.IndexedSlices((tf.cast(got, i64) - retired)[None], who[None])),
            s.trained.scatter_sub(tf.IndexedSlices((retired * left + void)[None], who[None])),
        ]
        with tf.control_dependencies(updates):
            return tf.identity(shard), tf.identity(start)

    def _head_done(self, plan: ShardPlan, s: DealerState):
        """`(done, left, head, count)` of the ring of `who`: whether its first entry is wholly trained, and the
        examples that entry holds."""
        import tensorflow as tf

        who = self.who
        count, head = s.ring_count.read_value()[who], s.ring_head.read_value()[who]
        at = tf.cast(tf.math.floormod(head, RING), tf.int32)
        shard, start = s.ring_shard.read_value()[who, at], s.ring_start.read_value()[who, at]
        left = _shard_length(plan, shard) - start
        return (count > 0) & (s.trained.read_value()[who] >= left), left, head, count

    def _retire(self, plan: ShardPlan, s: DealerState):
        """Drops the first entry of the ring of `who` once it is wholly trained; True if it did."""
        import tensorflow as tf

        who = self.who
        done, left, _, _ = self._head_done(plan, s)
        one = tf.cast(done, tf.int64)
        updates = [s.trained.scatter_sub(tf.IndexedSlices((one * left)[None], who[None])),
                   s.ring_head.scatter_add(tf.IndexedSlices(one[None], who[None])),
                   s.ring_count.scatter_sub(tf.IndexedSlices(one[None], who[None]))]
        with tf.control_dependencies(updates):
            return tf.identity(done)

    def _give_back(self, plan: ShardPlan, s: DealerState):
        """Moves the untrained rest of the lease of `who` into the pool and empties its ring; returns the examples
        given back."""
        import tensorflow as tf

        who = self.who
        count, head = s.ring_count.read_value()[who], s.ring_head.read_value()[who]
        k = tf.range(RING, dtype=tf.int64)
        at = tf.cast(tf.math.floormod(head + k, RING), tf.int32)
        shards = tf.gather(s.ring_shard.read_value()[who], at)
        starts = tf.gather(s.ring_start.read_value()[who], at)
        starts += tf.where(tf.equal(k, 0), s.trained.read_value()[who], 0)
        live = (k < count) & (starts < _shard_length(plan, shards))
        back_shard, back_start = tf.boolean_mask(shards, live), tf.boolean_mask(starts, live)
        free = tf.cast(tf.where(s.pool_shard.read_value() < 0)[:, 0], tf.int32)[:tf.size(back_shard)]
        zero = tf.constant(0, tf.int64)[None]
        updates = [s.pool_shard.scatter_update(tf.IndexedSlices(back_shard, free)),
                   s.pool_start.scatter_update(tf.IndexedSlices(back_start, free))]
        with tf.control_dependencies([back_shard, back_start, free]):   # the ring is read before it is emptied
            updates += [s.ring_count.scatter_update(tf.IndexedSlices(zero, who[None])),
                        s.trained.scatter_update(tf.IndexedSlices(zero, who[None]))]
        with tf.control_dependencies(updates):
            return tf.reduce_sum(_shard_length(plan, back_shard) - back_start)


class DealerClient:
    """One worker's side of the dealer: a small session of its own to the worker's master (the train session's
    graph is finalised) that takes, retires and gives back shards, and the generator of its positions."""

    def __init__(self, dealing: Dealing, device: str):
        self.dealing = dealing
        self._device = device
        self._ops: Optional[_Ops] = None
        self._session = None
        self._lock = threading.Lock()
        self.exhausted = False      # the deal has ended for this worker: its input ran out for good
        self._waiting_for: set = set()

    def _run(self, fetches, who: Optional[int] = None):
        """Runs `fetches(ops)` in the side session; a session that met a restarted ps (aborted, unavailable) or
        hung on a dead one (past `SIDE_CALL_SECS`, its creation included) is left behind and the run tried again
        in a new one, `SIDE_ATTEMPTS` times in all."""
        import tensorflow as tf

        retried = (tf.errors.AbortedError, tf.errors.UnavailableError, tf.errors.DeadlineExceededError)
        for attempt in range(SIDE_ATTEMPTS):
            with self._lock:
                if self._ops is None:
                    self._ops = _Ops(self.dealing.plan, self.dealing.num_workers, self._device)
                if self._session is None:
                    target, config = self._side_target()
                    self._session = tf.compat.v1.Session(target, graph=self._ops.graph, config=config)
                feed = {self._ops.who: self.dealing.index if who is None else who}
                try:
                    return self._session.run(fetches(self._ops), feed)
                except retried as exc:
                    self._session = None   # not closed: a close can wait on the dead ps
                    if attempt == SIDE_ATTEMPTS - 1:
                        raise
                    log.info("worker:%d: the dealer's session failed (%s); trying a new one", self.dealing.index,
                             type(exc).__name__)
        raise AssertionError("unreachable")

    def _side_target(self):
        """Where the side session runs, and its config (every blocking call bounded: `operation_timeout_in_ms`).

        With the ps addresses known, on the ps that holds the state, which it alone is filtered to: not through
        this worker's own master, whose new sessions can wait on the train session's close while that close waits
        for this very input (a ps restart then hung the worker)."""
        import tensorflow as tf

        config = tf.compat.v1.ConfigProto()
        target = self.dealing.target
        match = re.fullmatch(r"/job:ps/(?:replica:\d+/)?task:(\d+)(?:/.*)?", self._device or "")
        if self.dealing.ps_addresses and match:
            target = f"grpc://{self.dealing.ps_addresses[int(match.group(1))]}"
            config.device_filters.append(f"/job:ps/task:{match.group(1)}")
        elif self.dealing.session_config is not None:
            config.CopyFrom(self.dealing.session_config)
        config.operation_timeout_in_ms = int(SIDE_CALL_SECS * 1000)
        return target, config

    def _new_session(self) -> None:
        """The next run makes a new side session (the train session was made again: a ps may have restarted)."""
        with self._lock:
            self._session = None

    def state(self) -> dict:
        return self._run(lambda ops: ops.read)

    def give_back(self, who: Optional[int] = None) -> int:
        """Returns the untrained rest of the lease of `who` (this worker by default) to the pool; its examples."""
        while self._run(lambda ops: ops.retire, who):
            pass
        back = int(self._run(lambda ops: ops.give_back, who))
        log.info("worker:%d: gave back the untrained rest of %s lease: %d examples",
                 self.dealing.index if who is None else who, "its" if who is None else f"worker:{who}'s", back)
        return back

    def positions(self) -> Iterator[np.ndarray]:
        """This worker's positions: first the untrained rest of its own lease (a restart at its index), then shard
        after shard as it asks; ends when the deal is over (the chief: once every lease is trained)."""
        plan, me = self.dealing.plan, self.dealing.index
        self._new_session()
        while self._run(lambda ops: ops.retire):
            pass
        state = self.state()
        seed = int(state["seed"])
        resumed = lease_entries(state, me)
        if resumed:
            log.info("worker:%d: resuming its lease: %s", me, ", ".join(f"shard {s} from {st}" for s, st in resumed))
        self.exhausted = False
        yielded = 0
        for shard, start in resumed:
            chunk = plan.positions(seed, shard, start)
            yielded += len(chunk)
            yield chunk
        while True:
            shard, start = self._next_shard()
            if shard is None:
                break
            chunk = plan.positions(seed, shard, start)
            yielded += len(chunk)
            yield chunk
        self.exhausted = True
        pad = -yielded % self.dealing.pad_to
        if pad and yielded:
            yield np.resize(chunk, pad)   # towers: a whole last batch; these examples are read twice

    def _next_shard(self) -> tuple[Optional[int], int]:
        """The next shard to read and its start, waiting while the ring is full; None once the deal is over."""
        while True:
            shard, start = (int(x) for x in self._run(lambda ops: ops.take))
            if shard >= 0:
                return shard, start
            if shard == FULL:
                time.sleep(POLL_SECS)
            elif not self.dealing.is_chief or self._others_done():
                return None, 0
            else:
                time.sleep(END_POLL_SECS)

    def _others_done(self) -> bool:
        """The chief, with nothing left to take: whether every other worker's lease is trained. A worker that
        `gone` says has left has its lease given back (the chief takes it next)."""
        state = self.state()
        waiting = {j: remaining(self.dealing.plan, state, j) for j in range(self.dealing.num_workers)
                   if j != self.dealing.index and remaining(self.dealing.plan, state, j) > 0}
        if waiting and set(waiting) != self._waiting_for:
            log.info("worker:%d: every shard is dealt; waiting for the last ones of %s", self.dealing.index,
                     ", ".join(f"worker:{j} ({n} examples)" for j, n in sorted(waiting.items())))
        self._waiting_for = set(waiting)
        for j in waiting:
            if self.dealing.gone is not None and self.dealing.gone(j):
                self.give_back(j)
        return not waiting


def positions_dataset(client: DealerClient):
    """The `tf.data.Dataset` of int64 positions that `client` deals (`InputSpec.positions`)."""
    import tensorflow as tf

    chunks = tf.data.Dataset.from_generator(client.positions,
                                            output_signature=tf.TensorSpec([None], tf.int64))
    return chunks.unbatch()


def has_cursor(checkpoint: str) -> bool:
    """Whether `checkpoint` holds the dealer's state (checkpoints before issue 25 do not)."""
    import tensorflow as tf

    return any(name.startswith(f"{SCOPE}/") for name, _ in tf.train.list_variables(checkpoint))


def restore(saver, session, checkpoint: str, state: DealerState, name: str) -> None:
    """Restores `checkpoint`; one without the dealer's state restores the rest and starts the data position fresh."""
    import tensorflow as tf

    if has_cursor(checkpoint):
        saver.restore(session, checkpoint)
        return
    log.info("%s: the checkpoint holds no data position (written before dealt shards): the data position starts "
             "fresh", name)
    graph = session.graph
    mine = {v.name for v in state.variables}
    rest = [v for v in graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES) if v.name not in mine]
    graph._unsafe_unfinalize()   # pylint: disable=protected-access  (a second Saver, for old checkpoints only)
    try:
        partial = tf.compat.v1.train.Saver(var_list=rest, sharded=True)
        init = tf.compat.v1.variables_initializer(state.variables)
    finally:
        graph.finalize()
    partial.restore(session, checkpoint)
    session.run(init)


__all__ = ["Dealing", "DealerState", "DealerClient", "positions_dataset", "restore", "has_cursor", "SCOPE"]
