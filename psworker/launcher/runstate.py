"""What `psworker status` needs beyond the logs, kept in the run dir: the launcher's record of its tasks
(`<run_dir>/tasks.json`: the launcher's pid and host, each task's pid, host, state and exit, rewritten on every
change), whether that launcher is still there (its lock file, `psworker.traindir_lock`: a pid on this host, a
heartbeat from another), and the step of the newest checkpoint."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

from psworker import events, traindir_lock
from psworker.diskspace import write_atomically

__all__ = ["PROCESS_GONE", "TASKS_FILE", "LauncherState", "TaskFile", "TaskRecord", "checkpoint_step", "host_of",
           "launcher_state", "pid_alive", "read_tasks", "task_records"]

logger = logging.getLogger(__name__)

TASKS_FILE = "tasks.json"
PROCESS_GONE = "its process is gone"        # `traindir_lock.holder_gone`'s word for a dead pid on this host
_LOOPBACK = ("127.0.0.1", "localhost", "::1", "0.0.0.0", "")


@dataclass(frozen=True)
class TaskRecord:
    """One task as its launcher last saw it: the current attempt's pid and host, its state (`TaskState`'s text),
    and once it has exited its return code (negative: a signal) and whether the launcher stopped it."""

    name: str
    pid: Optional[int]
    host: str
    state: str
    restarts: int = 0
    returncode: Optional[int] = None
    stopped: bool = False
    cause: Optional[str] = None     # why it ended beyond its code (an injected fault, a stall, the memory cap)


def host_of(address: Any) -> str:
    """The host a task runs on: its address's, this machine's name for a loopback address."""
    host = str(getattr(address, "host", "") or "")
    return socket.gethostname() if host in _LOOPBACK else host


def _task_pid(popen: Any, local: bool) -> Optional[int]:
    """The pid of a task's process on its host: the one started here (`local`), else the remote one its backend
    learnt (ssh's wrapper says it first, `events.RemotePid`), else None (not the local client's: an srun, an ssh)."""
    if popen is None:
        return None
    if local:
        return popen.pid
    remote = getattr(getattr(popen, "stdout", None), "pid", None)
    return remote if isinstance(remote, int) else None


def task_records(slots: Iterable[Any], progress: Any, local: bool) -> list[TaskRecord]:
    """The records of the supervisor's slots (`launcher.supervise.slot.Slot`) as its `Progress` states them
    (`local`: the backend's pids are this machine's)."""
    states = progress.snapshot()
    here = socket.gethostname()
    return [TaskRecord(s.name, _task_pid(s.popen, local), here if local else host_of(getattr(s.task, "address", None)),
                       str(states[s.name].state), s.restarts, s.returncode, s.stopped, s.cause) for s in slots]


class TaskFile:
    """The launcher's side: `publish` rewrites `<run_dir>/tasks.json` whenever a task's record changed."""

    def __init__(self, run_dir: Path) -> None:
        self._path = Path(run_dir) / TASKS_FILE
        self._launcher = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        self._written: Optional[tuple[TaskRecord, ...]] = None
        self._failed = False

    def publish(self, records: Iterable[TaskRecord]) -> None:
        records = tuple(records)
        if records == self._written:
            return
        body = {"launcher": self._launcher, "tasks": {r.name: dataclasses.asdict(r) for r in records}}
        try:
            write_atomically(self._path, json.dumps(body, indent=1) + "\n")
        except OSError as err:     # e.g. a full disk: status then reads the logs alone; the run goes on
            if not self._failed:
                logger.warning("cannot write %s (%s); psworker status reads the logs alone", self._path, err)
            self._failed = True
            return
        self._written = records


def read_tasks(run_dir: Path) -> tuple[Optional[dict], dict[str, TaskRecord]]:
    """The launcher (`{pid, host, since}`) and task records of `run_dir`'s tasks.json; (None, {}) without one."""
    try:
        doc = json.loads((Path(run_dir) / TASKS_FILE).read_text(encoding="utf-8"))
        return doc.get("launcher"), {n: TaskRecord(**r) for n, r in doc.get("tasks", {}).items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return None, {}


@dataclass(frozen=True)
class LauncherState:
    """The launcher of a run as its run dir tells: who (`pid`, `host`), and `gone`: why it is no longer there
    (empty while it runs)."""

    pid: int
    host: str
    gone: str = ""

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}"


def launcher_state(run_dir: Path, launcher: Optional[dict], now: float) -> Optional[LauncherState]:
    """The run's launcher, read from its lock file (read before `ended.json`: a launcher writes its end before it
    lets go of the lock), else from `launcher` (tasks.json's); None when neither names one (tasks started by
    hand, by start scripts or in pods hold no launcher's lock)."""
    path = Path(run_dir) / traindir_lock.LOCK_FILE
    try:
        holder = traindir_lock.Holder.parse(path.read_text(encoding="utf-8"))
        touched = path.stat().st_mtime
    except OSError:
        holder, touched = None, 0.0
    if holder is not None and holder.role == "launcher":
        gone = traindir_lock.holder_gone(holder, touched, now)
        return LauncherState(holder.pid, holder.host, gone or "")
    if launcher is None:
        return None
    # tasks.json names a launcher that holds the lock no more: it ended (its end, if any, is in ended.json)
    return LauncherState(int(launcher.get("pid", 0)), str(launcher.get("host", "?")),
                         "it let go of the run dir without recording how the run ended")


def pid_alive(pid: Optional[int], host: str) -> Optional[bool]:
    """Whether process `pid` runs on `host`: False without a pid, None on another host (no telling from here)."""
    if pid is None:
        return False
    if host != socket.gethostname():
        return None
    return traindir_lock.pid_alive_since(pid, time.time())


_CKPT = re.compile(r'^model_checkpoint_path: "(?:.*[/\\])?[^/\\]*?-(\d+)"$', re.M)


def checkpoint_step(train_dir: Path, chief_log: str = "") -> Optional[int]:
    """The step of the newest checkpoint: its `checkpoint` state file's, else the chief's last `checkpoint of
    global step N saved` line (a chief on another host writes where this machine cannot look); None: none."""
    try:
        found = _CKPT.search((Path(train_dir) / "checkpoint").read_text(encoding="utf-8"))
        if found:
            return int(found.group(1))
    except OSError:
        pass
    saved = events.last(events.CheckpointSaved, chief_log)
    return None if saved is None else saved.step
