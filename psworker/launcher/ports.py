"""Free TCP ports for local clusters, chosen under one lock so that concurrent callers get distinct ports."""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import threading
from typing import Iterable

__all__ = ["pick_free_ports", "ports_in_use"]

logger = logging.getLogger(__name__)

_LOCK = threading.Lock()


def pick_free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """Returns `n` distinct ports that were free on `host` a moment ago.

    All `n` sockets are bound at the same time, so the ports differ from each other; they are closed before
    returning, so another process may still take one before the task binds it (the same race as TF's
    multi_process_runner; a task that cannot bind fails at start-up, which the supervisor reports).

    Args:
        n: how many ports; 0 gives an empty list.
        host: the address to bind, "127.0.0.1" for local clusters; IPv6 literals work too.

    Returns:
        The ports, in the order they were bound.

    Raises:
        ValueError: `n` is negative.
        OSError: the ports could not be bound.
    """
    if n < 0:
        raise ValueError(f"pick_free_ports: n must be >= 0, got {n}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with _LOCK, contextlib.ExitStack() as stack:
        ports = []
        for _ in range(n):
            sock = stack.enter_context(socket.socket(family, socket.SOCK_STREAM))
            sock.bind((host, 0))
            ports.append(sock.getsockname()[1])
    logger.debug("free ports on %s: %s", host, ports)
    return ports


def ports_in_use(ports: Iterable[int]) -> list[int]:
    """Which of `ports` another socket listens on here, on any address (TensorFlow's servers bind every interface).

    Probes by binding the wildcard address with SO_REUSEADDR, as gRPC does, so a port a finished run left in
    TIME_WAIT counts as free.
    """
    busy = []
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("0.0.0.0", port))
            except OSError as e:
                if e.errno != errno.EADDRINUSE:
                    raise
                busy.append(port)
    return busy
