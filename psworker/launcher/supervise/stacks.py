"""Asking a running task for its Python stacks before the launcher stops it (stalled, or left at the end or on
Ctrl-C), so that its log shows where it was stuck (`psworker.stackdump` parses them back for the report).

psworker's own tasks dump every thread on `stackdump.SIGNAL` (SIGUSR1), sent through the process backend, so it
reaches a task over ssh and srun as any other signal does; the launcher then waits (at most `WAIT_SECS`) for the
dump to reach the task's log. A user's program (`psworker run -- CMD`) never gets that signal (it would kill
it): on this machine py-spy dumps it when installed (`pip install 'psworker[stacks]'`), written into its log in
faulthandler's format; otherwise its log says how to get the stacks.
"""

from __future__ import annotations

import logging
import math
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import psutil

from psworker import events, stackdump
from psworker.deadline import poll_until
from psworker.launcher.backends.base import ProcessBackend
from psworker.launcher.supervise.slot import Slot

__all__ = ["DumpWait", "QUIET_SECS", "StackAsker", "WAIT_SECS", "for_run", "log_offset"]

logger = logging.getLogger(__name__)

WAIT_SECS = 5.0               # for a task's dump to reach its log (it takes milliseconds on a live task)
# A dump whose end cannot be told (the main thread's stack cut at faulthandler's 100 frames, or no program entry
# at its bottom) is over once the log ends a line and has not grown for this long. A task writes it all at once,
# but over ssh or srun it reaches the log through a pump that a loaded host can stall. (The dumps CI saw cut at
# "  File " were no stall: faulthandler's signal handler crashed the task; see `stackdump.dump_on_signal`.)
QUIET_SECS = 2.0
_POLL_SECS = 0.05
_PY_SPY_SECS = 10.0


@dataclass(eq=False)
class DumpWait:
    """Waiting for a task's dump in its log after `offset`, until `deadline` (`time.monotonic()`)."""

    path: Path
    offset: int
    deadline: float
    _size: int = field(default=-1, init=False)
    _grown_at: float = field(default=0.0, init=False)

    def over(self, now: Optional[float] = None) -> Optional[str]:
        """None while waiting, else `"dumped"` (a complete dump, or one after which the log ends a line and has
        not grown for `QUIET_SECS`) or `"timed out"`."""
        now = time.monotonic() if now is None else now
        size = log_offset(self.path)
        if size != self._size:
            self._size, self._grown_at = size, now
        text = _read_from(self.path, self.offset)
        dumps = stackdump.parse_dumps(text)
        quiet = text.endswith("\n") and now - self._grown_at >= QUIET_SECS
        if any(d.is_complete for d in dumps) or (dumps and quiet):
            return "dumped"
        return "timed out" if now >= self.deadline else None


@dataclass(frozen=True)
class StackAsker:
    """How the supervisor asks a run's tasks for their stacks."""

    by_signal: bool = False          # psworker's own tasks: SIGUSR1 through the backend
    py_spy: Optional[str] = None     # a user's program on this machine: this py-spy executable
    local: bool = True               # the tasks run on this machine (their pids are this machine's)
    wait_secs: float = WAIT_SECS

    def ask(self, slot: Slot, backend: ProcessBackend, why: str, ready: bool) -> Optional[DumpWait]:
        """Asks the running task of `slot` for its stacks and returns the wait for its dump, or None when there
        is nothing to wait for: the dump (py-spy's), or why there is none, is in the log already. `ready`: this
        attempt has printed a line (a psworker task's first line says that its handler is in place: before it,
        the signal would kill it)."""
        if self.by_signal:
            if not ready:
                logger.info("not asking %s for its stacks: it has printed nothing yet (its handler may not be in "
                            "place)", slot.name)
                return None
            offset = _note(slot, events.StacksRequested.now(slot.name, why, stackdump.SIGNAL.name).render())
            backend.signal(slot.popen, stackdump.SIGNAL)
            return DumpWait(slot.log_path, offset, time.monotonic() + self.wait_secs)
        if self.py_spy is not None and self.local:
            _note(slot, events.StacksRequested.now(slot.name, why, "py-spy").render())
            _note(slot, _py_spy_dump(self.py_spy, slot.popen.pid))
            return None
        where = (f"py-spy dump --pid {slot.popen.pid}" if self.local else
                 "on its host: py-spy dump --pid PID (PID: its process there)")
        _note(slot, f"--- stacks of {slot.name} not taken ({why}): to see them, pip install py-spy; {where} ---")
        return None

    def ask_all(self, slots: Sequence[Slot], backend: ProcessBackend, why: str) -> None:
        """Asks every running task in `slots` at once (resuming those an injected fault stopped), then waits
        until each one's dump is in its log, it has exited, or `wait_secs` have passed."""
        pending = {}
        for slot in slots:
            wait = self.ask(slot, backend, why, bool(slot.tail))
            if wait is not None:
                pending[slot.name] = (slot, wait)
                if slot.resume_at is not None:      # stopped by an injected fault: it dumps once resumed
                    backend.signal(slot.popen, signal.SIGCONT)
        if pending:
            logger.info("asked %s for their stacks (into their logs)", ", ".join(pending))
        def all_over() -> bool:
            now = time.monotonic()
            for name, (slot, wait) in list(pending.items()):
                over = "exited" if slot.popen.poll() is not None else wait.over(now)
                if over == "timed out":
                    logger.warning("no stack dump from %s within %.0f s", name, self.wait_secs)
                if over is not None:
                    del pending[name]
            return not pending

        poll_until(all_over, math.inf, interval=_POLL_SECS)     # each wait ends itself (`wait.over`)


def for_run(own_tasks: bool, local: bool) -> StackAsker:
    """psworker's own tasks: by signal on every backend; a user's program: py-spy where installed (on PATH or
    beside this Python), on this machine only."""
    if own_tasks:
        return StackAsker(by_signal=True, local=local)
    here = Path(sys.executable).parent / "py-spy"
    return StackAsker(py_spy=shutil.which("py-spy") or (str(here) if here.exists() else None), local=local)


def log_offset(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _read_from(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _note(slot: Slot, text: str) -> int:
    """Appends `text` (lines) to the task's log beside its own output; returns the log's size after it."""
    try:
        with open(slot.log_path, "ab") as log:      # O_APPEND: one write, never inside a line of the task's
            log.write(text.rstrip("\n").encode() + b"\n")
            return log.tell()
    except OSError as err:     # a full disk: the launcher's copy of the output has said so already
        logger.debug("cannot note in %s: %s", slot.log_path, err)
        return log_offset(slot.log_path)


def _py_spy_dump(py_spy: str, pid: int) -> str:
    """py-spy's dump of `pid` (or, for a wrapper such as a shell, of its first Python descendant), in
    faulthandler's format; else a line saying why there is none."""
    try:
        candidates = [pid] + [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        candidates = [pid]
    error = "no process"
    for target in candidates:
        try:
            done = subprocess.run([py_spy, "dump", "--json", "--pid", str(target)], capture_output=True, text=True,
                                  timeout=_PY_SPY_SECS, check=False)
        except (OSError, subprocess.TimeoutExpired) as err:
            error = str(err)
            continue
        if done.returncode == 0:
            try:
                return stackdump.from_py_spy(done.stdout, target).render()
            except ValueError as err:
                error = str(err)
                continue
        error = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[0]
    return f"--- py-spy could not dump pid {pid}: {error} ---"
