"""How tasks end: one done-token protocol, one "peer gone" watcher, and one `poll_until` with named timeouts.

Done tokens: every task that waits for others to finish (each ps for the workers; each serving worker for the
in-graph client) owns a FIFO queue, shared by name, on its own device. A finished task enqueues its index there
(`send_done`); the owner dequeues until every expected sender is in (`serve_until_done`), watching the senders'
ports meanwhile (`GoneWatch`) so that one that went away without a token cannot keep it waiting forever.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Callable, Iterable, Optional, TypeVar

from psworker.errors import PeerGone
from psworker.spec import ClusterSpec

log = logging.getLogger(__name__)

T = TypeVar("T")

# Named timeouts and intervals (seconds).
POLL_SECS = 0.05              # how often a waiting loop looks again
PORT_PROBE_SECS = 0.2         # one TCP connect to a peer's port
PEER_CHECK_SECS = 0.5         # how often the ports of peers that have not said they are done are probed
SEND_DONE_SECS = 5.0          # one done-token enqueue
SEND_DONE_AFTER_FAILURE_SECS = 2.0   # the same, from a worker that is failing (be quick)
VANISHED_GRACE_SECS = 2.0     # once training is over, a worker whose port stays closed this long counts as done
PS_EXIT_WAIT_SECS = 10.0      # a ps waits at most this long for the workers' ports to close before it exits

DONE_QUEUE_PREFIX = "psworker_done_"


def poll_until(check: Callable[[], Optional[T]], deadline: float, *, interval: float = POLL_SECS,
               clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep
               ) -> Optional[T]:
    """Calls `check()` until it returns something truthy (returned) or `clock()` passes `deadline` (None).

    `check` runs at least once, even when the deadline has already passed.
    """
    while True:
        value = check()
        if value:
            return value
        now = clock()
        if now >= deadline:
            return None
        sleep(max(0.0, min(interval, deadline - now)))


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

    if poll_until(closed, time.monotonic() + timeout_secs, interval=0.02):
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
        """Seconds since the last peer went away, once every peer has been seen up; else 0."""
        if len(self.seen) < len(self._peers):
            return 0.0
        return min(self.gone_for(i) for i in self._peers)


# ---------------------------------------------------------------------------------------------- done tokens


def done_queue(job: str, index: int, num_workers: int):
    """The FIFO queue on task `job:index` into which finished tasks put their index (shared by name)."""
    import tensorflow as tf

    with tf.device(f"/job:{job}/task:{index}"):
        return tf.queue.FIFOQueue(
            capacity=max(16, 4 * num_workers), dtypes=[tf.int32], shapes=[[]],
            shared_name=f"{DONE_QUEUE_PREFIX}{job}{index}", name=f"done_queue_{job}{index}",
        )


def send_done(target: str, sender: int, receivers: Iterable[tuple[str, int]], num_workers: int, *,
              timeout_secs: float = SEND_DONE_SECS) -> None:
    """From worker `sender`'s session at `target`: puts its index into each receiver's done queue.

    A receiver that cannot be reached is logged, not fatal: it watches the sender's port as well.
    """
    import tensorflow as tf

    receivers = list(receivers)
    graph = tf.Graph()
    with graph.as_default():
        enqueues = [done_queue(job, i, num_workers).enqueue(tf.constant(sender, tf.int32)) for job, i in receivers]
    filters = sorted({f"/job:{job}/task:{i}" for job, i in receivers} | {f"/job:worker/task:{sender}"})
    config = tf.compat.v1.ConfigProto(device_filters=filters)
    options = tf.compat.v1.RunOptions(timeout_in_ms=int(timeout_secs * 1000))
    with tf.compat.v1.Session(target, graph=graph, config=config) as sess:
        for (job, i), op in zip(receivers, enqueues):
            try:
                sess.run(op, options=options)
            except tf.errors.OpError as exc:
                log.warning("worker:%d could not tell %s:%d that it is done: %s", sender, job, i,
                            exc.message.splitlines()[0])


def signal_done(target: str, spec: ClusterSpec, worker: int, *, timeout_secs: float = SEND_DONE_SECS) -> None:
    """Tells every ps that worker `worker` is done."""
    send_done(target, worker, [("ps", p) for p in range(len(spec.ps))], len(spec.worker), timeout_secs=timeout_secs)


def serve_until_done(target: str, job: str, index: int, senders: Iterable[int], num_workers: int, *,
                     on_idle: Callable[[set[int]], None]) -> set[int]:
    """Dequeues tokens from this task's done queue until every one of `senders` is done; returns them.

    `on_idle(done)` runs whenever the queue is empty: it may add senders that went away to `done`, or raise.
    """
    import tensorflow as tf

    expected = set(senders)
    graph = tf.Graph()
    with graph.as_default():
        queue = done_queue(job, index, num_workers)
        dequeue, size = queue.dequeue(), queue.size()
    config = tf.compat.v1.ConfigProto(device_filters=[f"/job:{job}/task:{index}"])
    done: set[int] = set()
    with tf.compat.v1.Session(target, graph=graph, config=config) as sess:
        while not expected <= done:
            # Poll the size rather than dequeue with a timeout: a timed-out dequeue logs a warning every time.
            if not sess.run(size):
                on_idle(done)
                time.sleep(POLL_SECS)
                continue
            sender = int(sess.run(dequeue))
            if sender in expected and sender not in done:
                done.add(sender)
                log.info("%s:%d: worker:%d is done (%d of %d)", job, index, sender, len(done & expected),
                         len(expected))
    return done


def serve_ps_until_workers_done(target: str, spec: ClusterSpec, index: int, *,
                                gone_timeout_secs: Optional[float] = None, wait_for_exit: bool = True) -> None:
    """A ps's loop: returns once every worker has put its token here (or went away after training ended).

    Once any worker is done, training is over (every worker stops at the same global step), so a worker whose port
    stays closed for `VANISHED_GRACE_SECS` counts as done too: it ended while this ps was down and restarting.
    Before that, with `gone_timeout_secs`: every worker was up once and all have been gone that long.

    Raises:
        PeerGone: every worker went away without saying it was done and none came back.
    """
    name = f"ps:{index}"
    workers = {i: str(a) for i, a in enumerate(spec.worker)}
    watch = GoneWatch(workers)
    warned = False

    def on_idle(done: set[int]) -> None:
        nonlocal warned
        watch.update()
        if done:
            for i in set(workers) - done:
                if watch.gone_for(i) >= VANISHED_GRACE_SECS:
                    done.add(i)
                    log.info("%s: worker:%d has gone away after training ended; counting it as done", name, i)
            return
        gone = watch.all_gone_for()
        if not gone_timeout_secs or not gone:
            warned = False
            return
        if not warned:
            warned = True
            log.warning("%s: every worker has gone away without saying it is done; waiting %g s for them to "
                        "come back", name, gone_timeout_secs)
        if gone >= gone_timeout_secs:
            raise PeerGone(f"{name}: every worker went away without saying it was done and none came back within "
                           f"{gone_timeout_secs:g} s (--workers_gone_timeout_secs); exiting")

    serve_until_done(target, "ps", index, workers, len(workers), on_idle=on_idle)
    if wait_for_exit:
        wait_until_closed({f"worker:{i}": a for i, a in workers.items()}, timeout_secs=PS_EXIT_WAIT_SECS, who=name)


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
        if watch.gone_for(client) >= client_gone_secs:
            raise PeerGone(f"worker:{index}: the in-graph client worker:{client} at {address} has been unreachable "
                           f"for {client_gone_secs:g} s (--startup_timeout_secs) without saying that training is "
                           "over")

    serve_until_done(target, "worker", index, [client], len(spec.worker), on_idle=on_idle)


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


__all__ = ["poll_until", "port_open", "wait_until_closed", "GoneWatch", "done_queue", "send_done", "signal_done",
           "serve_until_done", "serve_ps_until_workers_done", "serve_until_client_done", "release_workers"]
