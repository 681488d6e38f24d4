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
  next worker to ask takes a piece from the pool before a fresh shard. In sync mode only applied batches count as
  trained: a worker whose gradient was dropped (stale, never applied) computes the same batch again
  (`sync_replay`), so `--num_epochs N` applies every example's gradient N times (issue 40). There a worker's deal
  ends only once every lease is applied: a dry worker passes its turn at each step (a token) so that the workers
  holding the last batches can fill the steps.

Taking, retiring and giving back run (`dealer_ops`) in one `tf.CriticalSection` on that ps: each is
atomic for every worker. The variables are `dealer_state.DealerState`.
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

from psworker.train.dealer_ops import FULL, DealerOps
from psworker.train.dealer_state import SCOPE, DealerState
from psworker.train.shard_plan import ShardPlan, lease_entries, remaining

log = logging.getLogger(__name__)

POLL_SECS = 0.05                  # a worker waiting for its read-ahead to be trained (its ring is full)
END_POLL_SECS = 0.2               # the chief waiting for the last leases of the others
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
    redeal: bool = False                  # sync: the deal ends once every lease is applied (`_next_shard`)
    last_step: Optional[int] = None       # sync: the global step that applies the last batch (`redeal`)


class DealerClient:
    """One worker's side of the dealer: a small session of its own to the worker's master (the train session's
    graph is finalised) that takes, retires and gives back shards, and the generator of its positions."""

    def __init__(self, dealing: Dealing, device: str):
        self.dealing = dealing
        self._device = device
        self._ops: Optional[DealerOps] = None
        self._session = None
        self._lock = threading.Lock()
        self.exhausted = False      # the deal has ended for this worker: its input ran out for good
        self._closed = False        # sync: the chief closed the token queue while this worker waited to end
        self._waiting_for: set = set()

    def _run(self, fetches, who: Optional[int] = None, n: Optional[int] = None, token: Optional[int] = None):
        """Runs `fetches(ops)` in the side session; a session that met a restarted ps (aborted, unavailable) or
        hung on a dead one (past `SIDE_CALL_SECS`, its creation included) is left behind and the run tried again
        in a new one, `SIDE_ATTEMPTS` times in all."""
        import tensorflow as tf

        retried = (tf.errors.AbortedError, tf.errors.UnavailableError, tf.errors.DeadlineExceededError)
        for attempt in range(SIDE_ATTEMPTS):
            with self._lock:
                if self._ops is None:
                    self._ops = DealerOps(self.dealing.plan, self.dealing.num_workers, self._device)
                if self._session is None:
                    target, config = self._side_target()
                    self._session = tf.compat.v1.Session(target, graph=self._ops.graph, config=config)
                feed = {self._ops.who: self.dealing.index if who is None else who}
                if n is not None:
                    feed[self._ops.n] = n
                if token is not None:
                    feed[self._ops.token] = token
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
            log.info("worker:%d: resuming its lease: %s", me,
                     ", ".join(f"shard {s} from {st}" + (f" to {e}" if e else "") for s, st, e in resumed))
        self.exhausted = self._closed = False
        yielded = 0
        for shard, start, end in resumed:
            chunk = plan.positions(seed, shard, start, end)
            yielded += len(chunk)
            yield chunk
        while True:
            shard, start, end = self._next_shard()
            if shard is None:
                break
            chunk = plan.positions(seed, shard, start, end)
            yielded += len(chunk)
            yield chunk
        self.exhausted = not self._closed
        pad = -yielded % self.dealing.pad_to
        if pad and yielded:
            yield np.resize(chunk, pad)   # towers: a whole last batch; these examples are read twice

    def _next_shard(self) -> tuple[Optional[int], int, int]:
        """The next piece to read, `(shard, start, end)`, waiting while the ring is full; None once the deal is over.
        With `redeal` (sync), over only once every lease holds its slots and the global step reached `last_step`
        (a chief that stopped at the step before lost the last batches' update): until then this worker, dry, passes
        its turn at each step (`pass_turn`) so that the workers still holding data can fill the steps (issue 40: a
        worker that left early stalled the last steps)."""
        passed = -1
        while True:
            shard, start, end = (int(x) for x in self._run(lambda ops: ops.take))
            if shard >= 0:
                return shard, start, end
            if shard == FULL:
                time.sleep(POLL_SECS)
                continue
            if self.dealing.redeal:
                if passed >= (self.dealing.last_step or 0) and self._all_applied():
                    return None, 0, 0
                passed = self.pass_turn(passed)
                if passed is None:
                    self._closed = True
                    return None, 0, 0
            elif not self.dealing.is_chief or self._others_done():
                return None, 0, 0
            time.sleep(END_POLL_SECS)

    def pass_turn(self, passed: int) -> Optional[int]:
        """Sync, nothing left to take while examples are still leased: once per global step, puts a token of that
        step in the sync token queue, the turn this dry worker would have taken, so that a worker still holding
        data pushes in its place (a step needs `replicas_to_aggregate` gradients; a lone worker with the last
        batches would else wait for a token no one brings). Returns the global step read, None if the chief closed
        the queue before the last step (it stopped early). A stale token costs a push dropped and computed again."""
        import tensorflow as tf

        last = self.dealing.last_step or 0
        try:
            turn = self._run(lambda ops: ops.turn)
            step = int(turn["step"])
            if not turn["closed"] and passed < step < last:
                self._run(lambda ops: ops.pass_turn, token=step)
                if passed < 0:
                    log.info("worker:%d: nothing left to take while examples are still leased: passing its turn at "
                             "each step (from global step %d) until every lease is applied", self.dealing.index, step)
        except tf.errors.CancelledError:   # closed between the read and the enqueue
            return None
        return None if turn["closed"] and step < last else step

    def _all_applied(self) -> bool:
        """Sync: every lease's batches hold a slot (counted), so the last step applies once its slots are pushed."""
        state = self.state()
        return remaining(self.dealing.plan, state, self.dealing.index) == 0 and self._others_done(state)

    def _others_done(self, state: Optional[dict] = None) -> bool:
        """The chief, with nothing left to take: whether every other worker's lease is trained (in `state`, read
        now if not given). A worker that `gone` says has left has its lease given back (the chief takes it next)."""
        state = self.state() if state is None else state
        left = {j: remaining(self.dealing.plan, state, j) for j in range(self.dealing.num_workers)
                if j != self.dealing.index}
        waiting = {j: n for j, n in left.items() if n > 0}
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
    """Restores `checkpoint`; one without the dealer's state restores the rest and starts the data position fresh;
    one without the pieces' ends (written before issue 40) restores the rest with every end 0 (the shard's end)."""
    import tensorflow as tf

    names = {n for n, _ in tf.train.list_variables(checkpoint)}
    fresh = [v for v in state.variables if v.op.name not in names]
    if not fresh:
        saver.restore(session, checkpoint)
        return
    if len(fresh) == len(state.variables):
        log.info("%s: the checkpoint holds no data position (written before dealt shards): the data position "
                 "starts fresh", name)
    else:
        log.info("%s: the checkpoint's data position has no pieces' ends (written before issue 40): each starts "
                 "at its shard's end", name)
    graph = session.graph
    mine = {v.name for v in fresh}
    rest = [v for v in graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES) if v.name not in mine]
    graph._unsafe_unfinalize()   # pylint: disable=protected-access  (a second Saver, for old checkpoints only)
    try:
        partial = tf.compat.v1.train.Saver(var_list=rest, sharded=True)
        init = tf.compat.v1.variables_initializer(fresh)
    finally:
        graph.finalize()
    partial.restore(session, checkpoint)
    session.run(init)


__all__ = ["Dealing", "DealerState", "DealerClient", "positions_dataset", "restore", "has_cursor", "SCOPE"]
