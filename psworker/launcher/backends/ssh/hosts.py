"""SSH to every host at once: a reachability check before anything starts (as horovodrun does), and one command
run on every host (the ssh backend's copy of cluster.yaml)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterable, Sequence
from typing import Optional

from psworker.errors import UnreachableHosts
from psworker.launcher.backends.ssh.remote import ssh_argv

__all__ = ["check_reachable", "require_reachable", "run_on_hosts"]

DEFAULT_CHECK_TIMEOUT_SECS = 10.0


def check_reachable(hosts: Iterable[str], *, ssh_config: Optional[str] = None,
                    timeout: float = DEFAULT_CHECK_TIMEOUT_SECS, ssh: str = "ssh",
                    options: Sequence[str] = ()) -> dict[str, str]:
    """Runs `ssh HOST true` on every host at once, like horovodrun before it starts anything.

    Args:
        hosts: hosts to check (duplicates are checked once).
        timeout: seconds for all of them together (also ssh's ConnectTimeout).

    Returns:
        `{host: reason}` for each host that failed (empty when all are reachable); the reason is ssh's last
        error line, or that it did not answer within `timeout`.
    """
    connect = max(1, int(timeout))
    return run_on_hosts(hosts, ["true"], ssh_config=ssh_config, timeout=timeout, ssh=ssh,
                        options=("-o", f"ConnectTimeout={connect}", *options))


def run_on_hosts(hosts: Iterable[str], remote_argv: Sequence[str], *, ssh_config: Optional[str] = None,
                 timeout: float, ssh: str = "ssh", options: Sequence[str] = (),
                 stdin: Optional[bytes] = None) -> dict[str, str]:
    """Runs one quoted command on every host at once (no terminal; `stdin` fed to each) and waits for them all.

    Returns:
        `{host: reason}` for each host where it failed: ssh's (or the command's) last error line, or that it did
        not answer within `timeout` seconds (for all hosts together; the late ones are killed).
    """
    procs = {}
    for host in dict.fromkeys(hosts):
        argv = ssh_argv(host, remote_argv, ssh_config=ssh_config, ssh=ssh, options=options, tty=False)
        procs[host] = subprocess.Popen(argv, stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout
    failures = {}
    for host, proc in procs.items():
        try:
            _, err = proc.communicate(stdin, timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            failures[host] = f"no answer within {timeout:g} s"
            continue
        if proc.returncode != 0:
            lines = [line for line in err.decode(errors="replace").splitlines() if line.strip()]
            failures[host] = (lines[-1] if lines else f"ssh exited {proc.returncode}")
    return failures


def require_reachable(hosts: Iterable[str], **kwargs) -> None:
    """`check_reachable`, raising UnreachableHosts (naming each failing host and why) when any host fails."""
    failures = check_reachable(hosts, **kwargs)
    if failures:
        raise UnreachableHosts(failures)
