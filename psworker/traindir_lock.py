"""One run per train dir: a launcher, or a chief started without one, holds an exclusive `fcntl.flock` on
`<train_dir>/.psworker.lock`, a file that names the holder (pid, host, start time, role). A second one is refused
at once (`UsageError`, exit 2) naming the holder. A launcher's tasks get `HOLDER_ENV` naming it: its chief (also
when restarted) finds the lock held by that launcher and goes on without taking it.

flock is released when its holder dies, so a lock file that still names a process is stale when that process is
gone: on this host a dead pid (or one reused by a younger process) is taken over with a line saying so. Where flock
does not reach across hosts (NFS mounted `nolock`, Lustre without `flock`), the file's content is checked too: its
holder rewrites its modification time every `HEARTBEAT_SECS`, and another host's lock file touched within
`FOREIGN_STALE_SECS` is respected even when flock lets us in.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Optional, Union

import psutil

from psworker.errors import UsageError

__all__ = ["FOREIGN_STALE_SECS", "HEARTBEAT_SECS", "HOLDER_ENV", "LOCK_FILE", "Holder", "TrainDirLock",
           "chief_lock", "hold", "holder_gone", "pid_alive_since"]

log = logging.getLogger(__name__)

LOCK_FILE = ".psworker.lock"
HOLDER_ENV = "PSWORKER_TRAIN_DIR_LOCK"   # `PID@HOST` of the launcher that holds its tasks' train dir
HEARTBEAT_SECS = 10.0
FOREIGN_STALE_SECS = 60.0                 # six missed heartbeats: that holder is gone (or frozen that long)


@dataclass(frozen=True)
class Holder:
    """Who holds a train dir: written into the lock file as JSON."""

    pid: int
    host: str
    since: float        # time.time() when it took the lock
    role: str           # launcher | chief

    @classmethod
    def me(cls, role: str) -> "Holder":
        return cls(os.getpid(), socket.gethostname(), time.time(), role)

    @classmethod
    def parse(cls, text: str) -> Optional["Holder"]:
        try:
            d = json.loads(text)
            return cls(int(d["pid"]), str(d["host"]), float(d["since"]), str(d["role"]))
        except (ValueError, KeyError, TypeError):
            return None

    def render(self) -> str:
        return json.dumps({"pid": self.pid, "host": self.host, "since": self.since, "role": self.role})

    @property
    def token(self) -> str:
        """`PID@HOST`: the value of `HOLDER_ENV`."""
        return f"{self.pid}@{self.host}"

    def describe(self) -> str:
        if self.pid == 0:       # flocked, its name not written yet (or unreadable)
            return "a psworker process that is just starting (its lock file names nobody yet)"
        since = datetime.datetime.fromtimestamp(self.since).strftime("%Y-%m-%d %H:%M:%S")
        return f"psworker {self.role} pid {self.pid} on {self.host} since {since}"


class TrainDirLock:
    """A held lock: the open, flocked file and its heartbeat thread. `release()` empties the file and unlocks."""

    def __init__(self, path: Path, fd: int, holder: Holder) -> None:
        self.path, self.holder, self._fd = path, holder, fd
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="psworker-lock-heartbeat", daemon=True)
        self._beat.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECS):
            with contextlib.suppress(OSError):
                os.utime(self._fd)

    def release(self) -> None:
        self._stop.set()
        self._beat.join(1.0)
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
        os.close(self._fd)    # closing the last descriptor of the file releases the flock


def pid_alive_since(pid: int, since: float) -> bool:
    """Whether `pid` runs here and started no later than `since` (a younger process reused the pid)."""
    try:
        proc = psutil.Process(pid)
        return proc.create_time() <= since + 1.0 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def holder_gone(holder: Holder, touched: float, now: float) -> Optional[str]:
    """Why the process a lock file names is no longer there (`touched`: the file's modification time, which its
    holder refreshes every `HEARTBEAT_SECS`), or None while it may be: a dead pid on this host, a heartbeat older
    than `FOREIGN_STALE_SECS` from another."""
    if holder.host == socket.gethostname():
        return None if pid_alive_since(holder.pid, holder.since) else "its process is gone"
    if now - touched > FOREIGN_STALE_SECS:
        return f"its lock file was last refreshed {now - touched:.0f} s ago"
    return None


def _read(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, 4096).decode("utf-8", "replace")


def _in_use(train_dir: Path, holder: Holder, extra: str = "") -> UsageError:
    return UsageError(f"train dir {train_dir} is in use by {holder.describe()}{extra} (lock file "
                      f"{train_dir / LOCK_FILE}); wait for that run to end or stop it, or use another --train_dir")


def _check_previous(fd: int, train_dir: Path, env: Mapping[str, str]) -> Optional[Holder]:
    """After flock let us in: the previous holder the file names, if it is still to be respected (flock not
    reliable here), else None. Says so when a stale lock is taken over."""
    prev = Holder.parse(_read(fd))
    if prev is None or prev.token == env.get(HOLDER_ENV):    # free, or our launcher's (flock did not reach us)
        return prev
    if prev.host == socket.gethostname():
        if prev.pid == os.getpid():
            return None
        if pid_alive_since(prev.pid, prev.since):
            return prev
        log.warning("train dir %s: taking over the lock of %s: that process is gone (killed?)", train_dir,
                    prev.describe())
        return None
    age = time.time() - os.fstat(fd).st_mtime
    if age < FOREIGN_STALE_SECS:
        return prev
    log.warning("train dir %s: taking over the lock of %s: its lock file was last refreshed %.0f s ago", train_dir,
                prev.describe(), age)
    return None


def _try_lock(train_dir: Path, role: str, env: Mapping[str, str]) -> tuple[Optional[TrainDirLock], Optional[Holder]]:
    """(the lock, None) when taken; (None, the holder) when someone holds it."""
    path = train_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = Holder.parse(_read(fd)) or Holder(0, "?", os.fstat(fd).st_mtime, "process")
        os.close(fd)
        return None, holder
    try:
        prev = _check_previous(fd, train_dir, env)
    except BaseException:
        os.close(fd)
        raise
    if prev is not None:
        os.close(fd)
        return None, prev
    me = Holder.me(role)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, me.render().encode(), 0)
    except OSError as err:   # e.g. a full disk: the flock holds all the same
        log.warning("train dir %s: cannot write who holds its lock (%s); the lock holds all the same", train_dir,
                    err)
    return TrainDirLock(path, fd, me), None


@contextlib.contextmanager
def hold(train_dir: Union[str, os.PathLike], role: str = "launcher") -> Iterator[TrainDirLock]:
    """Holds `train_dir`'s lock while inside (a launcher's run).

    Raises:
        UsageError: another run holds it (exit 2), naming the holder.
    """
    train_dir = Path(train_dir)
    lock, holder = _try_lock(train_dir, role, {})
    if lock is None:
        raise _in_use(train_dir, holder)
    try:
        yield lock
    finally:
        lock.release()


@contextlib.contextmanager
def chief_lock(train_dir: Union[str, os.PathLike], env: Mapping[str, str] = os.environ
               ) -> Iterator[Optional[TrainDirLock]]:
    """The chief's lock on its train dir while inside: taken, or None when the launcher named by `HOLDER_ENV` in
    `env` holds it (the chief it started, or restarted).

    Raises:
        UsageError: another run holds it (exit 2), naming the holder.
    """
    train_dir = Path(train_dir)
    train_dir.mkdir(parents=True, exist_ok=True)
    lock, holder = _try_lock(train_dir, "chief", env)
    if lock is None and holder.token != env.get(HOLDER_ENV):
        raise _in_use(train_dir, holder, f" (this chief's launcher: {env[HOLDER_ENV]})" if HOLDER_ENV in env else "")
    if lock is None:
        log.info("train dir %s: locked by this task's launcher (%s)", train_dir, holder.describe())
    try:
        yield lock
    finally:
        if lock is not None:
            lock.release()
