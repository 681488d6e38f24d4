"""A `/metrics` endpoint for Prometheus, the launcher's (`launcher/metrics.py`) and a task's (`task/metrics.py`): a
prometheus_client registry served on a socket of our own (prometheus_client writes the exposition format).

The endpoint has no authentication, like TensorFlow's servers: it binds loopback unless asked for another address,
and refuses a public or every-interface one unless `allow_public` (`check_host`, the rule of
`task.server.check_bind_safety`). The launcher binds its socket before it moves into a private network namespace
(`inherit`), and the re-executed launcher serves on it (`inherited`), so that a scraper on this host reaches it.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
from socketserver import ThreadingMixIn
from typing import Any, Callable, Iterable, Optional
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app

from psworker.errors import ServerError, UsageError

__all__ = ["DEFAULT_HOST", "INHERIT_ENV", "Endpoint", "check_host", "inherit", "inherited", "listen", "public_reason"]

DEFAULT_HOST = "127.0.0.1"
INHERIT_ENV = "PSWORKER_METRICS_FD"     # the launcher's bound socket, across its re-exec into a network namespace


def public_reason(host: str) -> Optional[str]:
    """Why serving on `host` would reach beyond private networks (`resolves to the public address ...`, `names
    every interface of this host`), or None for loopback, private (RFC 1918, ULA) and link-local addresses.

    Raises:
        ServerError: `host` cannot be resolved.
    """
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror as exc:
        raise ServerError(f"cannot resolve the metrics host {host!r}: {exc}") from None
    for info in infos:
        ip = ipaddress.ip_address(info[4][0].split("%")[0])
        if ip.is_global or ip.is_unspecified:
            return f"resolves to the public address {ip}" if ip.is_global else "names every interface of this host"
    return None


def check_host(host: str, *, allow_public: bool, flag: str) -> None:
    """Refuses (UsageError, exit 2) a metrics host that is public or names every interface, unless `allow_public`
    (`flag`: the flag that allows it)."""
    if allow_public:
        return
    reason = public_reason(host)
    if reason is not None:
        raise UsageError(f"refusing to serve metrics on {host}: it {reason}. The /metrics endpoint is "
                         f"unauthenticated; serve it on a private network only, or pass {flag} if this host is "
                         "firewalled and you accept the risk.")


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket listening on `host:port` (0: a free port), on its IPv4 address where it has one (`localhost`
    may resolve to ::1 first, where a scraper of 127.0.0.1 would not find it).

    Raises:
        UsageError: the port is taken, or the address is not this host's or cannot be resolved.
    """
    try:
        infos = socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)
    except socket.gaierror as err:
        raise UsageError(f"cannot serve metrics on {host}:{port}: {err}") from None
    family, address = min((info[0] != socket.AF_INET, info[0], info[4]) for info in infos)[1:]   # IPv4 first
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(16)
    except OSError as err:
        sock.close()
        raise UsageError(f"cannot serve metrics on {host}:{port}: {err.strerror or err}") from None
    return sock


def inherit(sock: socket.socket) -> None:
    """Lets a process this one becomes (exec) serve on `sock`: it stays open across exec, its fd named in
    `INHERIT_ENV`. (subprocess closes it in every child: tasks never get it.)"""
    os.set_inheritable(sock.fileno(), True)
    os.environ[INHERIT_ENV] = str(sock.fileno())


def inherited() -> Optional[socket.socket]:
    """The socket an earlier image of this process bound (`inherit`), once; None if there is none."""
    fd = os.environ.pop(INHERIT_ENV, None)
    if fd is None:
        return None
    sock = socket.socket(fileno=int(fd))
    os.set_inheritable(sock.fileno(), False)
    return sock


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:    # no access log on the console
        pass


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class Endpoint:
    """`registry` served on `sock` (`/metrics`; any path) by a daemon thread until `close()`."""

    def __init__(self, sock: socket.socket, registry: CollectorRegistry) -> None:
        app = make_wsgi_app(registry)
        self.scrapes = 0                # requests begun, numbered in order
        self._answered, self._newest = threading.Condition(), 0   # the newest number answered

        def counted(environ: dict, start_response: Callable) -> Iterable[bytes]:
            with self._answered:
                self.scrapes += 1
                number = self.scrapes
            body = app(environ, start_response)
            with self._answered:
                self._newest = max(self._newest, number)
                self._answered.notify_all()
            return body

        self._server = _Server(sock.getsockname()[:2], _Quiet, bind_and_activate=False)
        self._server.socket.close()
        self._server.socket, self._server.address_family = sock, sock.family
        self._server.server_address = sock.getsockname()
        self._server.server_name, self._server.server_port = self.host, self.port
        self._server.setup_environ()
        self._server.set_app(counted)
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.2,), name="psworker-metrics",
                                        daemon=True)
        self._thread.start()

    @property
    def host(self) -> str:
        return str(self._server.server_address[0])

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def wait_scrape(self, after: int, timeout: float) -> bool:
        """Whether a request begun after the first `after` was answered within `timeout` seconds."""
        with self._answered:
            return self._answered.wait_for(lambda: self._newest > after, timeout)

    def close(self) -> None:
        """Stops serving and closes the socket (nothing left listening)."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5.0)
