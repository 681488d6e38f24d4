"""One task's `tf.train.Server`: bind-safety check, start, waiting for peers, and the ps's serve-until-done loop."""

from __future__ import annotations

import ipaddress
import logging
import socket
import time
from typing import Callable, Iterable, Optional

from psworker.errors import PsworkerError, StartupTimeout
from psworker.spec import Address, ClusterSpec

log = logging.getLogger(__name__)

DONE_QUEUE_PREFIX = "psworker_done_ps"
POLL_SECS = 0.05   # while some workers are done: how often to look for the others


def check_bind_safety(address: Address, *, allow_public: bool) -> None:
    """Refuses to serve a task whose address resolves to a public IP unless `allow_public`.

    TensorFlow's gRPC server has no authentication, and it listens on every interface of the host whatever host
    the spec names (`0.0.0.0:<port>` is hard-coded in TF's grpc_server_lib.cc); so the spec's host is the only
    signal of intent we have. Loopback, private (RFC 1918, ULA) and link-local addresses are allowed.

    Raises:
        PsworkerError: the host is public (or cannot be resolved) and `allow_public` is false.
    """
    if allow_public:
        return
    try:
        infos = socket.getaddrinfo(address.host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror as exc:
        raise PsworkerError(f"cannot resolve this task's host {address.host!r}: {exc}") from None
    for info in infos:
        ip = ipaddress.ip_address(info[4][0].split("%")[0])
        if ip.is_global:
            raise PsworkerError(
                f"refusing to serve {address}: {address.host} resolves to the public address {ip}. TensorFlow's "
                "gRPC servers are unauthenticated; run clusters on private networks only, or pass "
                "--allow_public_bind if this host is firewalled and you accept the risk."
            )


def session_config(job: str, index: int, *, filter_devices: bool = True, extra: Optional[dict] = None):
    """A `ConfigProto` for one task: device filters so that it talks only to the ps tasks and itself."""
    import tensorflow as tf

    config = tf.compat.v1.ConfigProto(allow_soft_placement=True, **(extra or {}))
    if filter_devices:
        config.device_filters.extend(["/job:ps", f"/job:{job}/task:{index}"])
    return config


def start_server(spec: ClusterSpec, job: str, index: int, *, config=None):
    """Starts this task's `tf.compat.v1.train.Server` (listening at once) and returns it."""
    import tensorflow as tf

    cluster = tf.train.ClusterSpec(spec.as_dict())
    try:
        server = tf.compat.v1.train.Server(cluster, job_name=job, task_index=index, config=config, start=True)
    except (tf.errors.UnknownError, tf.errors.InvalidArgumentError) as exc:
        address = spec.addresses(job)[index]
        raise PsworkerError(f"{job}:{index} could not start its server at {address}: {exc.message}") from None
    log.info("%s:%d serving at %s", job, index, server.target)
    return server


def is_reachable(address: str, timeout: float = 1.0) -> bool:
    """Whether a gRPC server answers at `host:port` within `timeout` seconds."""
    import grpc

    channel = grpc.insecure_channel(address)
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout)
        return True
    except grpc.FutureTimeoutError:
        return False
    finally:
        channel.close()


def wait_for_tasks(
    tasks: dict[str, str],
    *,
    timeout_secs: float,
    who: str,
    clock: Callable[[], float] = time.monotonic,
    log_every_secs: float = 5.0,
) -> None:
    """Waits until every task in `{name: "host:port"}` answers; logs what it waits for.

    Raises:
        StartupTimeout: some task did not answer within `timeout_secs`; the message names them.
    """
    start = clock()
    pending = dict(tasks)
    last_log = -log_every_secs
    while pending:
        for name in list(pending):
            if is_reachable(pending[name], timeout=0.5):
                log.info("%s: %s at %s is up", who, name, pending.pop(name))
        if not pending:
            break
        waited = clock() - start
        if waited >= timeout_secs:
            names = ", ".join(f"{n} at {a}" for n, a in pending.items())
            raise StartupTimeout(
                f"{who} gave up after {timeout_secs:g} s (--startup_timeout_secs) waiting for {names}: "
                "is that task started, and is the address in the spec right?"
            )
        if waited - last_log >= log_every_secs:
            log.info("%s: waiting for %s (%.0f s of %g s)", who, ", ".join(f"{n} at {a}" for n, a in pending.items()),
                     waited, timeout_secs)
            last_log = waited
        time.sleep(0.5)


def done_queue(ps_index: int, num_workers: int):
    """The FIFO queue on ps `ps_index` into which each finished worker puts its index (shared by name)."""
    import tensorflow as tf

    with tf.device(f"/job:ps/task:{ps_index}"):
        return tf.queue.FIFOQueue(
            capacity=max(16, 4 * num_workers), dtypes=[tf.int32], shapes=[[]],
            shared_name=f"{DONE_QUEUE_PREFIX}{ps_index}", name=f"done_queue_ps{ps_index}",
        )


def serve_until_workers_done(server, spec: ClusterSpec, index: int, *, unreachable_grace_secs: float = 2.0,
                             wait_for_exit: bool = True, exit_wait_secs: float = 10.0,
                             gone_timeout_secs: Optional[float] = None) -> None:
    """Serves until every worker has finished; returns so that the ps process can exit by itself.

    A worker counts as finished once it has put its index into this ps's done queue. Once any worker has finished,
    training is over (every worker stops at the same global step), so a worker whose server stays unreachable for
    `unreachable_grace_secs` also counts as finished: that covers workers that ended while this ps was down
    and restarting. Then, with `wait_for_exit`, it waits (at most `exit_wait_secs`) until every worker's port is
    closed: a worker sends its token just before it exits, and a ps that exits before the workers looks to a
    supervisor like a ps that failed.

    Before any worker has finished: once every worker has been seen up and all of them have then been unreachable for
    `gone_timeout_secs` (they crashed, or were killed, without saying they were done), it raises `PsworkerError`
    instead of serving forever. None: no such bound.
    """
    import tensorflow as tf

    num_workers = len(spec.worker)
    graph = tf.Graph()
    with graph.as_default():
        queue = done_queue(index, num_workers)
        dequeue, size = queue.dequeue(), queue.size()
    config = tf.compat.v1.ConfigProto(device_filters=[f"/job:ps/task:{index}"])
    finished: set[int] = set()
    gone_since: dict[int, float] = {}
    watch = _AbandonWatch(spec, gone_timeout_secs) if gone_timeout_secs else None
    with tf.compat.v1.Session(server.target, graph=graph, config=config) as sess:
        while len(finished) < num_workers:
            if not sess.run(size):
                if finished:
                    _count_vanished_workers(spec, finished, gone_since, unreachable_grace_secs, index)
                elif watch is not None:
                    watch.check(index)
                time.sleep(POLL_SECS)
                continue
            worker = int(sess.run(dequeue))
            if 0 <= worker < num_workers and worker not in finished:
                finished.add(worker)
                log.info("ps:%d: worker:%d is done (%d of %d)", index, worker, len(finished), num_workers)
    if wait_for_exit:
        wait_until_closed({f"worker:{i}": str(a) for i, a in enumerate(spec.worker)}, timeout_secs=exit_wait_secs,
                          who=f"ps:{index}")


class _AbandonWatch:
    """Notices when every worker has been up and all are now gone, none having said it was done."""

    def __init__(self, spec: ClusterSpec, timeout_secs: float):
        self._addresses = [str(a) for a in spec.worker]
        self._seen: set[int] = set()
        self._timeout = timeout_secs
        self._all_gone_since: Optional[float] = None
        self._next_check = 0.0

    def check(self, index: int) -> None:
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + 1.0
        up = {i for i, a in enumerate(self._addresses) if port_open(a)}
        self._seen |= up
        if up or len(self._seen) < len(self._addresses):
            self._all_gone_since = None
            return
        if self._all_gone_since is None:
            self._all_gone_since = now
            log.warning("ps:%d: every worker has gone away without saying it is done; waiting %g s for them to "
                        "come back", index, self._timeout)
        elif now - self._all_gone_since >= self._timeout:
            raise PsworkerError(f"ps:{index}: every worker went away without saying it was done and none came back "
                                f"within {self._timeout:g} s (--workers_gone_timeout_secs); exiting")


def port_open(address: str, timeout: float = 0.2) -> bool:
    """Whether something accepts TCP connections at `host:port` (a refused connection answers at once)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def wait_until_closed(tasks: dict[str, str], *, timeout_secs: float, who: str, poll_secs: float = 0.02) -> bool:
    """Waits until no task in `{name: "host:port"}` accepts connections; returns False (and logs) on timeout."""
    deadline = time.monotonic() + timeout_secs
    pending = dict(tasks)
    while True:
        pending = {n: a for n, a in pending.items() if port_open(a)}
        if not pending:
            return True
        if time.monotonic() >= deadline:
            log.warning("%s: %s still up %g s after saying it was done; exiting anyway", who,
                        ", ".join(f"{n} at {a}" for n, a in pending.items()), timeout_secs)
            return False
        time.sleep(poll_secs)


def _count_vanished_workers(spec: ClusterSpec, finished: set[int], gone_since: dict[int, float],
                            grace: float, index: int) -> None:
    now = time.monotonic()
    for worker in set(range(len(spec.worker))) - finished:
        if port_open(str(spec.worker[worker])):
            gone_since.pop(worker, None)
            continue
        first = gone_since.setdefault(worker, now)
        if now - first >= grace:
            finished.add(worker)
            log.info("ps:%d: worker:%d has gone away after training ended; counting it as done", index, worker)


def signal_done(target: str, worker_index: int, num_ps: int, num_workers: int, *, timeout_secs: float = 5.0) -> None:
    """Tells every ps that this worker is done. A ps that cannot be reached is logged, not fatal."""
    import tensorflow as tf

    graph = tf.Graph()
    with graph.as_default():
        enqueues = [done_queue(p, num_workers).enqueue(tf.constant(worker_index, tf.int32)) for p in range(num_ps)]
    config = tf.compat.v1.ConfigProto(device_filters=["/job:ps", f"/job:worker/task:{worker_index}"])
    options = tf.compat.v1.RunOptions(timeout_in_ms=int(timeout_secs * 1000))
    with tf.compat.v1.Session(target, graph=graph, config=config) as sess:
        for p, op in enumerate(enqueues):
            try:
                sess.run(op, options=options)
            except tf.errors.OpError as exc:
                log.warning("worker:%d could not tell ps:%d that it is done: %s", worker_index, p,
                            exc.message.splitlines()[0])


def task_addresses(spec: ClusterSpec, jobs: Iterable[str] = ("ps",)) -> dict[str, str]:
    """`{"ps:0": "host:port", ...}` for the given jobs."""
    return {f"{job}:{i}": str(a) for job in jobs for i, a in enumerate(spec.addresses(job))}
