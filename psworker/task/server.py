"""One task's `tf.train.Server`: bind-safety check, session config, start, and waiting for peers to answer."""

from __future__ import annotations

import ipaddress
import logging
import socket
import time
from typing import Callable, Iterable, Optional

from psworker.errors import ServerError, StartupTimeout, UsageError
from psworker.spec import Address, ClusterSpec
from psworker.deadline import poll_until

log = logging.getLogger(__name__)

REACHABLE_PROBE_SECS = 0.5   # one gRPC readiness probe of a peer (an answer takes a few ms)
PROBE_EVERY_SECS = 0.05      # while a peer is down: how often to probe it again
WAIT_LOG_EVERY_SECS = 5.0    # while waiting for peers: how often to say so
PROBE_METHOD = "/psworker.Probe/Ping"   # a method no TensorFlow server implements: it answers UNIMPLEMENTED
# A channel of its own per probe: gRPC's shared subchannel of a refused address backs off for 1 s, which would
# make a peer that came up meanwhile look down for that long.
PROBE_CHANNEL_OPTIONS = (("grpc.use_local_subchannel_pool", 1),)


def check_bind_safety(address: Address, *, allow_public: bool) -> None:
    """Refuses to serve a task whose address is public or names every interface, unless `allow_public`.

    TensorFlow's gRPC server has no authentication, and it listens on every interface of the host whatever host
    the spec names (`0.0.0.0:<port>` is hard-coded in TF's grpc_server_lib.cc); so the spec's host is the only
    signal of intent we have. Loopback, private (RFC 1918, ULA) and link-local addresses are allowed; a public
    address, or `0.0.0.0` / `::` (every interface), is a usage error (exit 2).

    Raises:
        UsageError: the host is public or unspecified and `allow_public` is false.
        ServerError: the host cannot be resolved (and `allow_public` is false).
    """
    if allow_public:
        return
    try:
        infos = socket.getaddrinfo(address.host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror as exc:
        raise ServerError(f"cannot resolve this task's host {address.host!r}: {exc}") from None
    for info in infos:
        ip = ipaddress.ip_address(info[4][0].split("%")[0])
        if ip.is_global or ip.is_unspecified:
            what = (f"resolves to the public address {ip}" if ip.is_global
                    else "names every interface of this host")
            raise UsageError(
                f"refusing to serve {address}: {address.host} {what}. TensorFlow's gRPC servers are "
                "unauthenticated; run clusters on private networks only, or pass --allow_public_bind if this host "
                "is firewalled and you accept the risk."
            )


def session_config(job: str, index: int, *, filter_devices: bool = True):
    """A `ConfigProto` for one task: device filters so that it talks only to the ps tasks and itself."""
    import tensorflow as tf

    config = tf.compat.v1.ConfigProto(allow_soft_placement=True)
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
        raise ServerError(f"{job}:{index} could not start its server at {address}: {exc.message}") from None
    log.info("%s:%d serving at %s", job, index, server.target)
    return server


STARTUP_HINT = "is that task started, and is the address in the spec right?"
LOST_HINT = ("it answered before and stopped in the middle of the run: was it killed, or its host or network lost? "
             "Start it again (a launcher restarts it by its restart policy; by hand, the same start command)")


def is_reachable(address: str, timeout: float = 1.0) -> bool:
    """Whether a gRPC server answers at `host:port` within `timeout` seconds.

    One call of a method no server implements: a gRPC server answers UNIMPLEMENTED (3 ms here), a closed port fails
    at once with UNAVAILABLE. `grpc.channel_ready_future` answers the same question in 200-240 ms, because grpcio
    polls a channel's state every 0.2 s (issue #9: the larger part of a worker's time to its first step).
    """
    import grpc

    channel = grpc.insecure_channel(address, options=PROBE_CHANNEL_OPTIONS)
    try:
        channel.unary_unary(PROBE_METHOD)(b"", timeout=timeout, wait_for_ready=False)
        return True
    except grpc.RpcError as exc:
        return exc.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        channel.close()


def wait_for_tasks(
    tasks: dict[str, str],
    *,
    timeout_secs: float,
    who: str,
    clock: Callable[[], float] = time.monotonic,
    log_every_secs: float = WAIT_LOG_EVERY_SECS,
    meanwhile: Optional[Callable[[], None]] = None,
    hint: str = STARTUP_HINT,
) -> None:
    """Waits until every task in `{name: "host:port"}` answers; logs what it waits for.

    `meanwhile()`, if given, runs after each round of probes that left a task down (it may raise to end the wait);
    `hint` ends the timeout's message (what to check).

    Raises:
        StartupTimeout: some task did not answer within `timeout_secs`; the message names them.
    """
    start = clock()
    pending = dict(tasks)
    next_log = start

    def everyone_up() -> bool:
        nonlocal next_log
        for name in list(pending):
            if is_reachable(pending[name], timeout=REACHABLE_PROBE_SECS):
                log.info("%s: %s at %s is up", who, name, pending.pop(name))
        if pending and clock() >= next_log:
            log.info("%s: waiting for %s (%.0f s of %g s)", who, _names(pending), clock() - start, timeout_secs)
            next_log = clock() + log_every_secs
        if pending and meanwhile is not None:
            meanwhile()
        return not pending

    if not poll_until(everyone_up, timeout_secs, since=start, interval=PROBE_EVERY_SECS, clock=clock):
        raise StartupTimeout(
            f"{who} gave up after {timeout_secs:g} s (--startup_timeout_secs) waiting for {_names(pending)}: {hint}"
        )


def _names(tasks: dict[str, str]) -> str:
    return ", ".join(f"{n} at {a}" for n, a in tasks.items())


def task_addresses(spec: ClusterSpec, jobs: Iterable[str] = ("ps",)) -> dict[str, str]:
    """`{"ps:0": "host:port", ...}` for the given jobs."""
    return {f"{job}:{i}": str(a) for job in jobs for i, a in enumerate(spec.addresses(job))}


__all__ = ["STARTUP_HINT", "LOST_HINT", "check_bind_safety", "session_config", "start_server", "is_reachable",
           "wait_for_tasks", "task_addresses"]
