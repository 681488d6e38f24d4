"""A private network namespace for local clusters, so that their unauthenticated servers are unreachable from outside.

TensorFlow's gRPC server listens on `0.0.0.0:<port>` whatever host the spec names. Inside a fresh network namespace
the only interface is loopback, so a local cluster really is bound to 127.0.0.1.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import socket
import struct
import subprocess
import sys
from typing import NoReturn, Sequence

log = logging.getLogger(__name__)

ENV_MARK = "PSWORKER_NETNS"
UNSHARE = ("unshare", "--net", "--map-root-user")
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1


def inside() -> bool:
    """Whether this process was re-executed by `reexec_isolated`."""
    return os.environ.get(ENV_MARK) == "1"


def available() -> bool:
    """Whether this machine lets us make a network namespace (Linux, util-linux `unshare`, user namespaces)."""
    if not sys.platform.startswith("linux") or shutil.which(UNSHARE[0]) is None:
        return False
    try:
        return subprocess.run([*UNSHARE, "true"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def reexec_isolated(psworker_argv: Sequence[str]) -> NoReturn:
    """Replaces this process with `psworker ARGV` running in a new network namespace (same pid, same signals)."""
    env = dict(os.environ, **{ENV_MARK: "1"})
    argv = [*UNSHARE, "--", sys.executable, "-m", "psworker", *psworker_argv]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(argv[0], argv, env)


def bring_up_loopback() -> None:
    """Sets `lo` up: a new namespace starts with it down."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(sock, _SIOCGIFFLAGS, request)[:18])[1]
        if not flags & _IFF_UP:
            fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | _IFF_UP))


def interfaces() -> list[str]:
    """Names of this namespace's network interfaces."""
    return [name for _, name in socket.if_nameindex()]
