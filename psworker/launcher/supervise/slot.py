"""The supervisor's record of one task: what it runs (`TaskLike`) and its mutable runtime state (`Slot`)."""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Protocol, Sequence

from psworker import errorfile, events
from psworker.launcher.rundir import task_error_name
from psworker.launcher.supervise.run_policy import TaskView

__all__ = ["LOG_TAIL_LINES", "Slot", "TaskLike", "distinct_names"]

logger = logging.getLogger(__name__)

LOG_TAIL_LINES = 20


class TaskLike(Protocol):
    """What the supervisor needs from a `psworker.spec.plan.Task`."""

    @property
    def name(self) -> str: ...
    @property
    def job(self) -> str: ...
    @property
    def index(self) -> int: ...
    @property
    def argv(self) -> Sequence[str]: ...
    @property
    def env(self) -> Sequence[tuple[str, str]]: ...
    @property
    def is_chief(self) -> bool: ...


@dataclass(eq=False)
class Slot:
    """One task's mutable runtime state, owned by the supervisor (private to the launcher)."""

    task: Any
    log_path: Path
    popen: Optional[subprocess.Popen] = None
    reader: Optional[threading.Thread] = None
    tail: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=LOG_TAIL_LINES))
    started_at: float = 0.0
    ended_at: Optional[float] = None
    returncode: Optional[int] = None
    judged: bool = False            # its exit has been through the run policy
    stopped: bool = False
    restarts: int = 0
    causes: list = dataclasses.field(default_factory=list)
    exits: list = dataclasses.field(default_factory=list)   # (code, cause) of each attempt restarted (/metrics)
    cause: Optional[str] = None     # why this attempt ended, beyond its code: the launcher ended it (injection,
                                    # stall), or the backend knows (`exit_cause`: the kernel's memory cap)
    forced_code: Optional[int] = None   # an injected `exit` fault: the code to judge instead of the real one
    restart_at: Optional[float] = None  # a restart waiting for its backoff
    restart_cause: str = ""
    resume_at: Optional[float] = None   # SIGSTOPped by an injected fault until then
    kill_after: Any = None          # stalled: a `stacks.DumpWait`; SIGKILL once it is over

    @property
    def name(self) -> str:
        return self.task.name

    @property
    def running(self) -> bool:
        return self.popen is not None and self.returncode is None

    def view(self, counts: bool = True) -> TaskView:
        """What the run policy sees of this task now (`counts`: its exit counts for success)."""
        return TaskView(self.name, self.task.job, self.task.is_chief, self.popen is not None, self.returncode,
                        self.restarts, self.cause, self.stopped, self.restart_at is not None, counts)

    @property
    def error_path(self) -> Path:
        """The attempt's error file (`psworker.errorfile`), beside its log."""
        return self.log_path.with_name(task_error_name(self.name))

    def error_file_env(self) -> dict[str, str]:
        """The variable that tells the next attempt where its error record goes; an earlier attempt's (or run's) record
        is removed first, so that a record found after this attempt is its own."""
        try:
            self.error_path.unlink(missing_ok=True)
        except OSError as err:
            logger.warning("cannot remove %s, an earlier attempt's error file: %s", self.error_path, err)
        return {errorfile.ERROR_FILE_ENV: os.path.abspath(self.error_path)}

    def error_record(self) -> Optional[errorfile.ErrorRecord]:
        """The record the attempt that ended wrote of its failure, if it wrote one."""
        return errorfile.read_record(self.error_path)

    def open_log(self, marker: Optional[events.Restart]) -> Any:
        """Opens the log for appending; a new attempt (or a new run on an old log) starts with a marker line."""
        try:
            log = open(self.log_path, "ab")
        except OSError as err:    # e.g. no space for a new file: the output still reaches the console
            logger.warning("cannot open %s, the log of %s: %s; its output goes to the console only",
                           self.log_path, self.name, err)
            return open(os.devnull, "ab")
        line: Optional[events.Event] = marker
        if marker is None and self.log_path.stat().st_size > 0:
            line = events.NewRun.now(self.name)
        if line is not None:
            try:
                log.write(f"{line.render()}\n".encode())
                log.flush()
            except OSError:      # the reader's first write fails the same way, and says so
                pass
        return log

    def new_attempt(self, popen: subprocess.Popen) -> None:
        """Resets the per-attempt state for a just-started process."""
        self.popen, self.started_at = popen, time.time()
        self.ended_at = self.returncode = self.cause = self.forced_code = self.resume_at = self.kill_after = None
        self.judged = self.stopped = False
        self.tail = collections.deque(maxlen=LOG_TAIL_LINES)


def distinct_names(tasks: Sequence[TaskLike]) -> list[str]:
    """The tasks' names, in order; ValueError when two tasks share one."""
    names = [t.name for t in tasks]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"duplicate task names: {', '.join(duplicates)}")
    return names
