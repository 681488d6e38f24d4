"""A real OpenSSH server for tests and benchmarks: Debian's /usr/sbin/sshd with its own keys and config in a temp dir.

It listens on one free port on 127.0.0.1, 127.0.0.2 and 127.0.0.3 (three "hosts" on Linux's whole 127/8
loopback), lets the current user in with a generated key only, and comes with a client config
(`ssh -F cfg HOST`) that pins the generated host key. Needs root (sshd's privilege separation) and the
`openssh-server` package (installed by `.ci/run`).
"""

from __future__ import annotations

import contextlib
import getpass
import os
import shutil
import signal
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import psutil

from psworker.deadline import poll_until

SSHD = "/usr/sbin/sshd"
HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")
START_TIMEOUT_SECS = 15.0
PRIVSEP_DIR = Path("/run/sshd")   # Debian's sshd refuses to start without it (its init script creates it)


def why_no_sshd() -> Optional[str]:
    """None when this machine can run the test sshd, else the reason (for pytest.skip)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "a test sshd needs root (privilege separation); run the tests as root"
    missing = [p for p in (SSHD,) if not os.access(p, os.X_OK)]
    missing += [n for n in ("ssh", "ssh-keygen") if shutil.which(n) is None]
    if missing:
        return f"OpenSSH not installed (missing {', '.join(missing)}); .ci/run installs openssh-server"
    return None


def _free_port_on_all(hosts: tuple[str, ...]) -> int:
    """A port that is free on every address in `hosts` (probed by binding each)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind((hosts[0], 0))
            port = s.getsockname()[1]
        try:
            for h in hosts[1:]:
                with socket.socket() as t:
                    t.bind((h, port))
            return port
        except OSError:
            continue
    raise RuntimeError(f"no port free on all of {hosts}")


def _listening(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
        return True
    return False


@dataclass
class SshServer:
    """A running test sshd. `client_config` is the path to pass as `ssh -F`."""

    root: Path
    port: int
    hosts: tuple[str, ...]
    client_config: Path
    proc: subprocess.Popen

    def ssh(self, host: str, *remote: str, timeout: float = 30.0) -> subprocess.CompletedProcess:
        """Runs `ssh -F cfg HOST REMOTE...` and returns its result (never raises on exit status)."""
        return subprocess.run(["ssh", "-F", str(self.client_config), host, *remote], capture_output=True,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL)

    def log_tail(self, lines: int = 20) -> str:
        text = (self.root / "sshd.log").read_text(errors="replace").splitlines()[-lines:]
        return "--- sshd.log\n" + "\n".join(text)


def _write_keys(root: Path) -> tuple[Path, Path, Path]:
    """A host key and a user key under `root`; the user's public key as the only authorized one."""
    host_key, user_key = root / "ssh_host_ed25519_key", root / "id_ed25519"
    for key in (host_key, user_key):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"psworker-test-{key.name}",
                        "-f", str(key)], check=True, capture_output=True, timeout=30)
    authorized = root / "authorized_keys"
    shutil.copy(f"{user_key}.pub", authorized)
    authorized.chmod(0o600)
    return host_key, user_key, authorized


def _write_server_config(root: Path, hosts: tuple[str, ...], port: int, host_key: Path, authorized: Path) -> Path:
    listen = "\n".join(f"ListenAddress {h}:{port}" for h in hosts)
    config = root / "sshd_config"
    config.write_text(f"""\
# A test sshd written by psworker/testing_sshd.py: the generated keys only, nothing from /etc/ssh.
{listen}
HostKey {host_key}
PidFile {root}/sshd.pid
AuthorizedKeysFile {authorized}
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
AllowUsers {getpass.getuser()}
UsePAM no
StrictModes no
PermitUserEnvironment no
AcceptEnv PSWORKER_*
X11Forwarding no
AllowTcpForwarding no
PrintMotd no
PrintLastLog no
Subsystem sftp internal-sftp
LogLevel VERBOSE
""")
    return config


def _write_client_config(root: Path, hosts: tuple[str, ...], port: int, host_key: Path, user_key: Path) -> Path:
    pub = Path(f"{host_key}.pub").read_text().split()
    known_hosts = root / "known_hosts"
    known_hosts.write_text("".join(f"[{h}]:{port} {pub[0]} {pub[1]}\n" for h in hosts))
    client_config = root / "ssh_config"
    client_config.write_text(f"""\
# Client side of the test sshd (psworker/testing_sshd.py): `ssh -F {client_config} 127.0.0.2 true`
Host *
    User {getpass.getuser()}
    Port {port}
    IdentityFile {user_key}
    IdentitiesOnly yes
    StrictHostKeyChecking yes
    UserKnownHostsFile {known_hosts}
    GlobalKnownHostsFile /dev/null
    BatchMode yes
    ConnectTimeout 5
    LogLevel ERROR
""")
    return client_config


def _wait_listening(server: SshServer, timeout: float) -> None:
    def listening() -> bool:
        if server.proc.poll() is not None:
            raise RuntimeError(f"test sshd exited {server.proc.returncode} while starting\n{server.log_tail()}")
        return all(_listening(h, server.port) for h in server.hosts)

    if not poll_until(listening, timeout, interval=0.1):
        raise TimeoutError(f"test sshd: not accepting on {', '.join(server.hosts)} port {server.port} within "
                           f"{timeout:g} s\n{server.log_tail()}")


def _stop(proc: subprocess.Popen) -> None:
    """Each connection has its own sshd process (in its own session): ends those too, then the listener."""
    with contextlib.suppress(psutil.NoSuchProcess):
        children = psutil.Process(proc.pid).children(recursive=True)
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        psutil.wait_procs(children, timeout=10)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@contextlib.contextmanager
def running_sshd(root: Path, *, hosts: tuple[str, ...] = HOSTS,
                 timeout: float = START_TIMEOUT_SECS) -> Iterator[SshServer]:
    """Starts `sshd -D -f <own config>` under `root`, waits until it accepts on every host, yields it, stops it.

    Raises:
        TimeoutError: sshd did not accept connections within `timeout` (the message holds its log).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o700)
    host_key, user_key, authorized = _write_keys(root)
    port = _free_port_on_all(hosts)
    config = _write_server_config(root, hosts, port, host_key, authorized)
    client_config = _write_client_config(root, hosts, port, host_key, user_key)
    PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)
    proc = subprocess.Popen([SSHD, "-D", "-f", str(config), "-E", str(root / "sshd.log")],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    server = SshServer(root=root, port=port, hosts=hosts, client_config=client_config, proc=proc)
    try:
        _wait_listening(server, timeout)
        yield server
    finally:
        _stop(proc)
