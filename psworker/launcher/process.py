"""How the supervisor starts, polls, signals and stops task processes: the `ProcessBackend` interface and
its local implementation (process groups, PDEATHSIG, grandchild cleanup).

A task's argv may hold symbolic tokens for what names this machine (`PYTHON`, `SPEC`: see `psworker.launcher.
launch`); a backend replaces them where the process really starts, so a remote backend can put its own.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Callable, Mapping, Optional, Protocol, Sequence

import psutil

__all__ = ["LocalProcessBackend", "ProcessBackend", "die_with_parent"]

logger = logging.getLogger(__name__)

_REAP_TIMEOUT_SECS = 5.0          # after SIGKILL; only a process stuck in the kernel takes longer
_PR_SET_PDEATHSIG = 1


class ProcessBackend(Protocol):
    """Starts task processes and signals or stops them. Handles are `subprocess.Popen`-like: `pid`,
    `stdout` (a binary stream of the task's merged stdout and stderr), `poll()`, `wait(timeout)`."""

    def start(self, argv: Sequence[str], env: Mapping[str, str]) -> subprocess.Popen:
        """Starts one task; its output must come back on the handle's `stdout`."""

    def signal(self, proc: subprocess.Popen, sig: int) -> None:
        """Sends `sig` to the task and everything it started (no error if it is gone)."""

    def stop(self, procs: Sequence[subprocess.Popen], grace_secs: float) -> None:
        """Ends every task in `procs` and what they started: SIGTERM, `grace_secs`, SIGKILL, reap."""


def die_with_parent() -> Optional[Callable[[], None]]:
    """On Linux, a preexec_fn that makes the child die by SIGKILL when the launcher dies (even by SIGKILL).

    PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, so start tasks from the thread that
    lives as long as the run (the supervisor starts them from whichever thread calls start/poll/start_task).
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl   # looked up before fork: the child only calls it
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:      # the launcher died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def _live_group_members(pgids: set[int]) -> dict[int, list[int]]:
    """The non-zombie processes in each of the process groups `pgids`."""
    found: dict[int, list[int]] = {}
    live = set()
    for pgid in pgids:
        try:
            os.killpg(pgid, 0)
            live.add(pgid)
        except ProcessLookupError:
            pass
        except PermissionError:
            live.add(pgid)
    if not live:
        return found
    for proc in psutil.process_iter():
        try:
            pgid = os.getpgid(proc.pid)
            if pgid in live and proc.status() != psutil.STATUS_ZOMBIE:
                found.setdefault(pgid, []).append(proc.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return found


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class LocalProcessBackend:
    """Runs each task as a subprocess of this launcher, in its own session (process group == pid), dying
    with the launcher (PR_SET_PDEATHSIG on Linux)."""

    def __init__(self, *, popen: Callable[..., subprocess.Popen] = subprocess.Popen,
                 symbols: Optional[Mapping[str, str]] = None) -> None:
        """Args:
            popen: starts a process, with subprocess.Popen's signature (injected so tests may swap it).
            symbols: argv tokens to replace whole (e.g. `{"PYTHON": sys.executable}`).
        """
        self._popen = popen
        self._symbols = dict(symbols or {})

    def start(self, argv: Sequence[str], env: Mapping[str, str]) -> subprocess.Popen:
        return self._popen(
            [self._symbols.get(a, a) for a in argv],
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent(),
        )

    def signal(self, proc: subprocess.Popen, sig: int) -> None:
        _signal_group(proc.pid, sig)

    def stop(self, procs: Sequence[subprocess.Popen], grace_secs: float) -> None:
        pgids = {p.pid for p in procs}        # new session: pgid == pid; exited ones may leave stragglers
        descendants: list[psutil.Process] = []
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(psutil.Error):
                    descendants += psutil.Process(p.pid).children(recursive=True)
        members = _live_group_members(pgids)
        for pgid in members:
            _signal_group(pgid, signal.SIGTERM)
            _signal_group(pgid, signal.SIGCONT)    # a stopped (SIGSTOP) task acts on SIGTERM only once resumed
        for proc in descendants:                   # also those that left the group (setsid)
            with contextlib.suppress(psutil.Error):
                proc.terminate()

        deadline = time.monotonic() + grace_secs
        while True:
            members = _live_group_members(pgids)
            strays = [p for p in descendants if _alive(p)]
            if not members and not strays and all(p.poll() is not None for p in procs):
                break
            if time.monotonic() >= deadline:
                logger.warning("still alive %.1f s after SIGTERM, sending SIGKILL: pids %s", grace_secs,
                               sorted({pid for pids in members.values() for pid in pids} |
                                      {p.pid for p in strays}))
                for pgid in members:
                    _signal_group(pgid, signal.SIGKILL)
                for proc in strays:
                    with contextlib.suppress(psutil.Error):
                        proc.kill()
                break
            time.sleep(0.05)
        for p in procs:
            if p.poll() is None:
                try:
                    p.wait(_REAP_TIMEOUT_SECS)
                except subprocess.TimeoutExpired:
                    logger.error("pid %d survived SIGKILL", p.pid)
