"""How tasks end: one done-token protocol, one "peer gone" watcher, and named timeouts.

Done tokens: every task that waits for others to finish (each ps for the workers; each serving worker for the
in-graph client) owns a FIFO queue, shared by name, on its own device. A finished task enqueues its index there
(`done_queue.send_done`); the owner dequeues until every expected sender is in (`serve_until_done`), watching the
senders' ports meanwhile (`GoneWatch`) so that one that went away without a token cannot keep it waiting forever.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Callable, Optional

from psworker.deadline import poll_until
from psworker.errors import PeerGone
from psworker.task import stop
from psworker.task.done_queue import READER_STALL_SECS, SEND_DONE_SECS, DoneReader, decode, send_done
from psworker.spec import ClusterSpec
from psworker.states import TaskState

log = logging.getLogger(__name__)

# Named timeouts and intervals (seconds).
POLL_SECS = 0.05              # how often a waiting loop looks again
PORT_PROBE_SECS = 0.2         # one TCP connect to a peer's port
PEER_CHECK_SECS = 0.5         # how often the ports of peers that have not said they are done are probed
VANISHED_GRACE_SECS = 30.0    # once training is over, a non-chief whose port stays closed this long counts as done
                              # (time for a task restarted by hand, a pod or a Slurm step to come back)
ABSENT_WARN_SECS = 2.0       # a ps says it waits for workers gone without a done token only after this long (the
                             # token of one that exited done may be read just after its port is seen closed)
PS_EXIT_WAIT_SECS = 10.0      # a ps waits at most this long for the workers' ports to close before it exits



def port_open(address: str, timeout: float = PORT_PROBE_SECS) -> bool:
    """Whether something accepts TCP connections at `host:port` (a refused connection answers at once)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def wait_until_closed(tasks: dict[str, str], *, timeout_secs: float, who: str) -> bool:
    """Waits until no task in `{name: "host:port"}` accepts connections; returns False (and logs) on timeout."""
    pending = dict(tasks)

    def closed() -> bool:
        for name in [n for n, a in pending.items() if not port_open(a)]:
            pending.pop(name)
        return not pending

    if poll_until(closed, timeout_secs, interval=0.02):
        return True
    log.warning("%s: %s still up %g s after saying it was done; exiting anyway", who,
                ", ".join(f"{n} at {a}" for n, a in pending.items()), timeout_secs)
    return False


class GoneWatch:
    """Since when each peer's port has been closed. Peers never seen up count as gone from construction.

    Args:
        peers: `{index: "host:port"}`.
        every_secs: `update()` probes the ports at most this often.
        clock: monotonic clock (tests pass a fake).
        probe: `address -> bool`, whether the peer is up.
    """

    def __init__(self, peers: dict[int, str], *, every_secs: float = PEER_CHECK_SECS,
                 clock: Callable[[], float] = time.monotonic, probe: Callable[[str], bool] = port_open):
        self._peers = dict(peers)
        self._every = every_secs
        self._clock = clock
        self._probe = probe
        now = clock()
        self._gone_since: dict[int, Optional[float]] = {i: now for i in peers}
        self.seen: set[int] = set()
        self._next_probe = now

    def update(self) -> None:
        """Probes every peer's port, unless it did so less than `every_secs` ago."""
        now = self._clock()
        if now < self._next_probe:
            return
        self._next_probe = now + self._every
        for i, address in self._peers.items():
            if self._probe(address):
                self.seen.add(i)
                self._gone_since[i] = None
            elif self._gone_since[i] is None:
                self._gone_since[i] = now

    def gone_for(self, index: int) -> float:
        """Seconds that peer `index` has been gone (0 while it is up)."""
        since = self._gone_since[index]
        return 0.0 if since is None else self._clock() - since

    def all_gone_for(self) -> float:
        """Seconds since the last peer went away (0 while one is up). A peer never seen up counts as gone since
        the watch was made, so that peers which never come (or had finished before it was made) end a wait too."""
        return min(self.gone_for(i) for i in self._peers)


# ---------------------------------------------------------------------------------------------- done tokens


def serve_until_done(target: str, job: str, index: int, senders: Callable[[], set[int]], num_workers: int, *,
                     on_idle: Callable[[set[int]], Optional[bool]], reader: Optional[DoneReader] = None,
                     on_member: Optional[Callable[[str, int], None]] = None) -> set[int]:
    """Takes tokens from this task's done queue until every one of `senders()` is done; returns them. `senders` is
    asked again after every token and every idle poll (an elastic job's members change while the ps waits).

    `on_idle(done)` runs whenever no token came for `POLL_SECS`: it may add senders that went away to `done`,
    return True to stop waiting, or raise. It runs on this thread, which never waits in TensorFlow (`DoneReader`).
    `on_member(kind, sender)` gets an elastic job's `JOINED` and `LEFT` tokens.
    """
    own = reader is None
    if reader is None:
        reader = DoneReader(target, job, index, num_workers)
    who = f"{job}:{index}"
    done: set[int] = set()
    stall_logged = False
    try:
        while not senders() <= done:
            token = reader.get(timeout=POLL_SECS)
            if token is None:
                stalled = reader.stalled_for()
                if stalled >= READER_STALL_SECS and not stall_logged:
                    stall_logged = True
                    log.warning("%s: its done queue has not answered for %.0f s; still watching the workers' "
                                "ports", who, stalled)
                elif stalled < READER_STALL_SECS:
                    stall_logged = False
                if on_idle(done):
                    break
                continue
            kind, sender = decode(token)
            if kind != TaskState.DONE:
                if on_member is not None:
                    on_member(kind, sender)
                continue
            waiting_for = senders()
            if sender in waiting_for and sender not in done:
                done.add(sender)
                log.info("%s: worker:%d is done (%d of %d)", who, sender, len(done & waiting_for), len(waiting_for))
    finally:
        if own:
            reader.stop()
    return done


def checkpoint_at_max_steps(train_dir: Optional[str], max_steps: int) -> Optional[int]:
    """The global step of the newest usable checkpoint the state file lists in `train_dir` (`checkpoints.choose`:
    a damaged one proves nothing) when it has reached `max_steps`, else None (no train_dir, not readable from this
    host, or training not over)."""
    if not train_dir:
        return None
    try:
        import tensorflow as tf

        from psworker.train import checkpoints

        path = checkpoints.choose(train_dir, listed_only=True).path
        if not path:
            return None
        step = int(tf.train.load_checkpoint(path).get_tensor("global_step"))
    except Exception as exc:   # unreadable, half-written, or another format: not proof of anything
        log.info("cannot read the latest checkpoint in %s: %s", train_dir, exc)
        return None
    return step if step >= max_steps else None


def training_complete(spec: ClusterSpec) -> Optional[int]:
    """`checkpoint_at_max_steps` of the spec's `train.train_dir` and `train.max_steps`.

    How a ps that has seen no worker for a long time tells "training is over" from "the workers crashed". A ps
    reads only the spec (its command takes no training flags), and on a real cluster it may not see the train_dir
    at all: then it cannot tell, and says so.
    """
    return checkpoint_at_max_steps(spec.train.train_dir, spec.train.max_steps)


PS_DONE = "done"            # every worker said it is done (or a non-chief went away after training ended)
PS_COMPLETE = "complete"    # the workers (or the chief) stayed away, and the train_dir shows training complete
CHIEF = 0


class _PsWait:
    """A ps's decisions while it waits for done tokens (`serve_ps_until_workers_done`'s `on_idle`).

    Once some worker is done, training is over: a non-chief whose port stays closed for `rejoin_grace_secs`
    counts as done. The chief never does: until its token comes, its final checkpoint is outstanding, so a chief
    that vanished is waited for (`gone_timeout_secs`, counted from the end of training at the earliest). Before
    any token, the wait ends when every worker has been down for `gone_timeout_secs` (never seen: at least the
    spec's `startup_timeout_secs`). Either wait ends in `complete(spec)`: training complete, or `PeerGone`.

    In an elastic job these rules apply to the members only (`members`): the chief, and every worker that joined
    (its `JOINED` token) and has not left since (`LEFT`). A worker that never joined, or was scaled away, holds
    nothing up.
    """

    def __init__(self, spec: ClusterSpec, name: str, *, gone_timeout_secs: Optional[float], rejoin_grace_secs: float,
                 complete: Callable[[ClusterSpec], Optional[int]], clock: Callable[[], float] = time.monotonic,
                 probe: Callable[[str], bool] = port_open):
        self.spec, self.name = spec, name
        self.workers = {i: str(a) for i, a in enumerate(spec.worker)}
        self.watch = GoneWatch(self.workers, clock=clock, probe=probe)
        self.gone_timeout, self.grace, self.complete, self.clock = gone_timeout_secs, rejoin_grace_secs, complete, clock
        self.finished: Optional[int] = None   # the checkpoint's step, once training is known complete that way
        self.over_at: Optional[float] = None  # when the first done token came
        self.warned: set[str] = set()   # the waits already said in the log ("chief", "workers")
        self.joined: set[int] = set()
        self.left: set[int] = set()

    def members(self) -> set[int]:
        """The workers whose end this ps waits for: every worker, or in an elastic job the chief and every worker
        that joined and has not left."""
        if self.spec.elastic is None:
            return set(self.workers)
        return {CHIEF} | (self.joined - self.left)

    def on_member(self, kind: str, index: int) -> None:
        """An elastic job's membership token: worker `index` has `JOINED` or left."""
        if index not in self.workers:
            log.warning("%s: a %s token from worker:%d, which the spec does not have; ignored", self.name, kind, index)
            return
        if kind == TaskState.JOINED:
            self.joined.add(index)
            self.left.discard(index)
        else:
            self.left.add(index)
        log.info("%s: worker:%d %s the job (members now: %s)", self.name, index, kind,
                 ", ".join(f"worker:{i}" for i in sorted(self.members())))

    def __call__(self, done: set[int]) -> bool:
        self.watch.update()
        stop.stop_when_gone(self.watch.gone_for(CHIEF), "worker:0 (the chief)", self.spec.train.step_timeout_secs)
        members = self.members()
        if not done:
            return self._all_gone(members)
        if self.over_at is None:
            self.over_at = self.clock()
        for i in sorted(members - done - {CHIEF}):
            if self.watch.gone_for(i) >= self.grace:
                done.add(i)
                log.info("%s: worker:%d has gone away after training ended; counting it as done", self.name, i)
        return CHIEF not in done and self._chief_gone()

    def _chief_gone(self) -> bool:
        gone = min(self.watch.gone_for(CHIEF), self.clock() - self.over_at)
        if not gone or not self.gone_timeout:
            self.warned.discard("chief")
            return False
        if "chief" not in self.warned and gone >= ABSENT_WARN_SECS:
            self.warned.add("chief")
            log.warning("%s: the other workers are done, but the chief (worker:0 at %s) is down without saying it "
                        "is done: its final checkpoint is outstanding; waiting %g s for it to come back", self.name,
                        self.workers[CHIEF], self.gone_timeout)
        if gone < self.gone_timeout:
            return False
        return self._decide("chief", self.gone_timeout, (
            f"{self.name}: the chief (worker:0 at {self.workers[CHIEF]}) went away without saying it was done (its "
            f"final checkpoint is outstanding) and did not come back within {self.gone_timeout:g} s "
            "(--workers_gone_timeout_secs), and the spec's train_dir does not show training complete; exiting"))

    def _all_gone(self, members: set[int]) -> bool:
        gone = min(self.watch.gone_for(i) for i in members)
        if not self.gone_timeout or not gone:
            self.warned.discard("workers")
            return False
        never = sorted(members - self.watch.seen)
        # a worker not seen yet may still be starting: give it what a worker gives its ps (the spec's setting)
        limit = max(self.gone_timeout, self.spec.train.startup_timeout_secs) if never else self.gone_timeout
        names = ", ".join(f"worker:{i}" for i in never)
        if "workers" not in self.warned and gone >= ABSENT_WARN_SECS:
            self.warned.add("workers")
            if not never:
                log.warning("%s: every worker has gone away without saying it is done; waiting %g s for them to "
                            "come back", self.name, self.gone_timeout)
            elif self.watch.seen:
                log.warning("%s: every worker is down without saying it is done (never seen: %s); waiting %g s for "
                            "them", self.name, names, limit)
        if gone < limit:
            return False
        if never:
            why = (f"{self.name}: {names} never came up within {limit:g} s (the larger of --workers_gone_timeout_secs "
                   "and the spec's startup_timeout_secs), no other worker is up, and the spec's train_dir does not "
                   "show training complete; exiting")
        else:
            why = (f"{self.name}: every worker went away without saying it was done and none came back within "
                   f"{self.gone_timeout:g} s (--workers_gone_timeout_secs); exiting")
        return self._decide("worker", limit, why)

    def _decide(self, absent: str, waited: float, failure: str) -> bool:
        """After a wait for `absent` ("worker", "chief") ran out: True when the train_dir shows training complete,
        else `PeerGone(failure)`."""
        step = self.complete(self.spec)
        if step is None:
            raise PeerGone(failure)
        log.info("%s: no %s for %g s, and the latest checkpoint in %s is at global step %d (max_steps %d): "
                 "training is complete", self.name, absent, waited, self.spec.train.train_dir, step,
                 self.spec.train.max_steps)
        self.finished = step
        return True


def serve_ps_until_workers_done(target: str, spec: ClusterSpec, index: int, *,
                                gone_timeout_secs: Optional[float] = None, wait_for_exit: bool = True,
                                rejoin_grace_secs: float = VANISHED_GRACE_SECS,
                                reader: Optional[DoneReader] = None,
                                complete: Callable[[ClusterSpec], Optional[int]] = training_complete) -> str:
    """A ps's loop: returns once every worker has put its token here (a non-chief may instead have gone away after
    training ended); the rules are `_PsWait`'s.

    Returns:
        `PS_DONE` or `PS_COMPLETE`.

    Raises:
        PeerGone: every worker (or, once the others are done, the chief) stayed down without saying it was done,
            and training is not known to be complete.
    """
    wait = _PsWait(spec, f"ps:{index}", gone_timeout_secs=gone_timeout_secs, rejoin_grace_secs=rejoin_grace_secs,
                   complete=complete)
    serve_until_done(target, "ps", index, wait.members, len(wait.workers), on_idle=wait, reader=reader,
                     on_member=wait.on_member)
    if wait.finished is not None:
        return PS_COMPLETE
    if wait_for_exit:
        wait_until_closed({f"worker:{i}": a for i, a in wait.workers.items()}, timeout_secs=PS_EXIT_WAIT_SECS,
                          who=f"ps:{index}")
    return PS_DONE


def serve_until_client_done(target: str, spec: ClusterSpec, index: int, client: int, *,
                            client_gone_secs: float) -> None:
    """An in-graph serving worker's loop: returns when the client's token arrives on this worker's queue.

    Raises:
        PeerGone: the client's port was closed for `client_gone_secs` in a row (never started, or went away
            without saying that training is over).
    """
    address = str(spec.worker[client])
    watch = GoneWatch({client: address})

    def on_idle(done: set[int]) -> None:
        watch.update()
        stop.stop_when_gone(watch.gone_for(client), f"the in-graph client worker:{client}",
                            spec.train.step_timeout_secs)
        if watch.gone_for(client) >= client_gone_secs:
            raise PeerGone(f"worker:{index}: the in-graph client worker:{client} at {address} has been unreachable "
                           f"for {client_gone_secs:g} s (--startup_timeout_secs) without saying that training is "
                           "over")

    serve_until_done(target, "worker", index, lambda: {client}, len(spec.worker), on_idle=on_idle)


def release_workers(target: str, spec: ClusterSpec, client: int, *, timeout_secs: float = SEND_DONE_SECS) -> None:
    """From the in-graph client: puts a token on every serving worker's queue so that it exits.

    Workers whose port is closed are skipped (logged): an enqueue to them would wait for the whole timeout.
    """
    receivers = []
    for i, address in enumerate(spec.worker):
        if i == client:
            continue
        if port_open(str(address)):
            receivers.append(("worker", i))
        else:
            log.warning("worker:%d is not reachable; not telling it that training is over", i)
    if receivers:
        send_done(target, client, receivers, len(spec.worker), timeout_secs=timeout_secs)


__all__ = ["port_open", "wait_until_closed", "GoneWatch", "serve_until_done",
           "checkpoint_at_max_steps", "training_complete", "PS_DONE", "PS_COMPLETE", "serve_ps_until_workers_done",
           "serve_until_client_done", "release_workers"]
