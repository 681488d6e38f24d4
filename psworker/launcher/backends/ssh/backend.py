"""The SSH backend: each task runs on the host its address names, over OpenSSH (`remote`: BatchMode, `-tt` so
the remote task dies with its connection, one `shlex.quote`d remote command; `hosts`: every host at once).

start runs `ssh -tt HOST 'cd DIR && exec env K=V ... sh -c ... ARGV'` locally (its own session, dying with the
launcher); poll is local ssh's exit status (the task's, or 255 when ssh failed or the task was killed by a
signal); output is ssh's stdout with the terminal's `\\r` removed. Every host is checked (in parallel) before
anything starts, and gets the run's cluster.yaml in its remote dir. The hard end closes the local ssh (the remote
task gets SIGHUP); other signals (SIGTERM, SIGUSR2 to an elastic worker, SIGSTOP, SIGCONT, SIGUSR1) go through
`ssh HOST kill -SIG PID`, the pid being the first line the remote wrapper prints (not copied to the log). A worker
started late (an elastic job scaled up) is one more such connection.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping, Optional, Sequence

from psworker import events
from psworker.errors import PsworkerError, SpecError
from psworker.launcher.backends.base import Backend, popen_task
from psworker.launcher.backends.ssh.hosts import require_reachable, run_on_hosts
from psworker.launcher.backends.ssh.remote import ssh_argv
from psworker.launcher.rundir import SPEC_FILE
from psworker.spec.plan import Task
from psworker.spec import ClusterSpec

__all__ = ["SshBackend", "SshOptions"]

logger = logging.getLogger(__name__)

SSH_COMMAND_TIMEOUT_SECS = 30.0
# Prints the remote pid (== the task's: `exec` keeps it), then becomes the task.
_PID_WRAPPER = ("sh", "-c", f'{events.RemotePid.shell_echo()}; exec "$@"', "sh")
# Variables shipped to every task besides those the launcher set for it (its env minus the launcher's own).
SHIPPED_ALWAYS = ("PYTHONUNBUFFERED",)
_SHIP_SPEC = f'mkdir -p "$1" && cat > "$1/.{SPEC_FILE}.$$" && mv -f "$1/.{SPEC_FILE}.$$" "$1/{SPEC_FILE}"'


@dataclass(frozen=True)
class SshOptions:
    """How the ssh backend reaches the hosts."""

    BACKEND: ClassVar[str] = "ssh"

    ssh_config: Optional[str] = None             # ssh -F FILE; None: ssh's own
    ssh_options: tuple[str, ...] = ()            # `-o` values, e.g. ("Port=2200",)
    remote_dir: Optional[str] = None             # cluster.yaml and the tasks' working directory on every host;
                                                 # None: the run dir's absolute path
    ssh: str = "ssh"

    @property
    def argv_options(self) -> tuple[str, ...]:
        return tuple(part for value in self.ssh_options for part in ("-o", value))


class _RemoteOutput:
    """ssh's stdout as the supervisor reads it: `\\r\\n` -> `\\n`, and the remote wrapper's pid line taken out
    (`on_pid()` runs once it is known)."""

    def __init__(self, raw: Any, on_pid: Callable[[], None] = lambda: None) -> None:
        self._raw = raw
        self._first = True
        self._on_pid = on_pid
        self.pid: Optional[int] = None

    def readline(self) -> bytes:
        line = self._raw.readline()
        if self._first:
            self._first = False
            said = events.RemotePid.parse(line.decode("utf-8", "replace"))
            if said is not None:
                self.pid = said.pid
                self._on_pid()
                line = self._raw.readline()
        if line.endswith(b"\r\n"):
            line = line[:-2] + b"\n"
        return line.replace(b"\r", b"")

    def close(self) -> None:
        self._raw.close()


class SshBackend(Backend):
    """Runs each task on its host over one `ssh -tt` connection; the task ends when the connection does."""

    Options = SshOptions
    HARD_END = "closing their connections"

    def __init__(self, options: Optional[SshOptions] = None, *, python: str = sys.executable) -> None:
        super().__init__(options, python=python)
        self._hosts: list[str] = []
        self._remote_dir = ""
        self._where: dict[int, str] = {}       # local ssh pid -> host
        self._pending: dict[int, int] = {}     # local ssh pid -> a signal asked for before its remote pid was known
        self._pid_lock = threading.Lock()

    def _ssh(self, host: str, argv: Sequence[str], **kwargs: Any) -> list[str]:
        o = self.options
        return ssh_argv(host, argv, ssh_config=o.ssh_config, ssh=o.ssh, options=o.argv_options, **kwargs)

    def place(self, spec: ClusterSpec, run_dir: Path) -> ClusterSpec:
        """Checks that every port is fixed and every host answers (in parallel) before anything starts.

        Raises:
            SpecError: an automatic port. UnreachableHosts: a host refused or did not answer (each one named).
        """
        for job in spec.jobs():
            for i, a in enumerate(spec.addresses(job)):
                if a.port == 0:
                    raise SpecError(spec.source or "spec", f"cluster.{job}[{i}]",
                                    f"port 'auto' cannot be chosen on a remote host; give {a.host} a fixed port")
        self._hosts = list(dict.fromkeys(a.host for job in spec.jobs() for a in spec.addresses(job)))
        o = self.options
        require_reachable(self._hosts, ssh_config=o.ssh_config, options=o.argv_options, ssh=o.ssh)
        self._remote_dir = o.remote_dir or str(run_dir.resolve())
        train_dir = str(Path(spec.train.train_dir or run_dir).resolve())
        return dataclasses.replace(spec, train=dataclasses.replace(spec.train, train_dir=train_dir))

    def spec_path(self, run_dir: Path) -> str:
        return f"{self._remote_dir}/{SPEC_FILE}"

    def prepare(self, spec: ClusterSpec, text: str) -> None:
        """Writes `<remote_dir>/cluster.yaml` on every host at once (stdin of one ssh per host, renamed into place).

        Raises:
            PsworkerError: a host could not take it (each named); nothing was started.
        """
        o = self.options
        failures = run_on_hosts(self._hosts, ["sh", "-c", _SHIP_SPEC, "sh", self._remote_dir],
                                ssh_config=o.ssh_config, timeout=SSH_COMMAND_TIMEOUT_SECS, ssh=o.ssh,
                                options=o.argv_options, stdin=text.encode())
        if failures:
            raise PsworkerError("could not write the spec to " + "; ".join(
                f"{host}:{self._remote_dir}/{SPEC_FILE}: {why}" for host, why in failures.items())
                + "; nothing was started")

    def banner(self, tasks: Sequence[Task], log_dir: Path) -> str:
        where = ", ".join(f"{t.name}={t.address.host}:{t.address.port}" for t in tasks)
        return (f"starting {len(tasks)} tasks over ssh ({where}); spec in {self._remote_dir}/{SPEC_FILE} on each "
                f"host; logs in {log_dir}")

    def start(self, task: Task, env: Mapping[str, str]) -> subprocess.Popen:
        shipped = {k: v for k, v in env.items() if k in SHIPPED_ALWAYS or os.environ.get(k) != v}
        argv = self._ssh(task.address.host, [*_PID_WRAPPER, *task.argv], env=shipped, cwd=self._remote_dir or None)
        proc = popen_task(subprocess.Popen, argv, os.environ)
        proc.stdout = _RemoteOutput(proc.stdout, on_pid=lambda: self._send_pending(proc))
        self._where[proc.pid] = task.address.host
        return proc

    def _remote_kill(self, proc: subprocess.Popen, script: str) -> Optional[subprocess.Popen]:
        """Starts `ssh HOST sh -c SCRIPT sh PID` for the task's remote pid; None when the pid is not known yet."""
        pid = getattr(proc.stdout, "pid", None)
        if pid is None:
            return None
        argv = self._ssh(self._where[proc.pid], ["sh", "-c", script, "sh", str(pid)], tty=False)
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    @staticmethod
    def _await(killer: Optional[subprocess.Popen], timeout: float) -> bool:
        """Waits for a remote kill; False (and it is ended) when it did not answer in time or never started."""
        if killer is None:
            return False
        try:
            killer.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            killer.kill()
            killer.wait()
            return False

    def _send_pending(self, proc: subprocess.Popen) -> None:
        with self._pid_lock:
            sig = self._pending.pop(proc.pid, None)
        if sig is not None:
            logger.info("remote pid of ssh pid %d known: sending the %s asked for before", proc.pid,
                        signal.Signals(sig).name)
            self.signal(proc, sig)

    def _hold_until_pid(self, proc: subprocess.Popen, sig: int) -> bool:
        """Keeps SIGUSR2 (a leave) for `_send_pending` while the remote pid is not known; True if kept."""
        with self._pid_lock:
            if sig != signal.SIGUSR2 or getattr(proc.stdout, "pid", None) is not None:
                return False
            self._pending[proc.pid] = sig
        logger.info("ssh pid %d: its remote pid is not known yet; SIGUSR2 goes once it is", proc.pid)
        return True

    def signal(self, proc: subprocess.Popen, sig: int) -> None:
        if proc.poll() is not None:
            return                              # connection gone: the remote task got SIGHUP with it
        if self._hold_until_pid(proc, sig):
            return
        if sig != signal.SIGKILL:
            name = signal.Signals(sig).name.removeprefix("SIG")
            if self._await(self._remote_kill(proc, f'kill -{name} "$1"'), SSH_COMMAND_TIMEOUT_SECS):
                return
            # SIGUSR1: a request for its stacks; SIGUSR2: an elastic worker asked to leave (never end it instead)
            if sig in (signal.SIGSTOP, signal.SIGCONT, signal.SIGUSR1, signal.SIGUSR2):
                logger.warning("could not send %s to the remote task of ssh pid %d", name, proc.pid)
                return
        with contextlib.suppress(ProcessLookupError):
            proc.kill()                         # ends the connection: the remote task gets SIGHUP

    def terminate(self, procs: Sequence[subprocess.Popen]) -> None:
        """SIGCONT and SIGTERM to every running remote task, over one ssh each, all at once."""
        killers = [self._remote_kill(p, 'kill -CONT "$1" 2>/dev/null; kill -TERM "$1"')
                   for p in procs if p.poll() is None]
        deadline = time.monotonic() + SSH_COMMAND_TIMEOUT_SECS
        for killer in killers:
            if killer is not None:
                self._await(killer, max(0.1, deadline - time.monotonic()))

    def alive(self, procs: Sequence[subprocess.Popen]) -> list[str]:
        return [self._where.get(p.pid, f"pid {p.pid}") for p in procs if p.poll() is None]
