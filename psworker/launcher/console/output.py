"""Copies one task's output: every line to its log file, to the launcher's `Progress`, and (filtered and
prefixed `[job:index] `) to the console. Runs in a reader thread per task attempt; with a grouping window the
lines that several tasks print within it reach the console once, as `[worker:0-7] ...` (`console.LineGrouper`),
released by a flusher thread when their window is over."""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from typing import Any, Callable, Optional, Sequence, TextIO

from psworker import diskspace, events
from psworker.launcher.console import folds
from psworker.launcher.console.lines import LineGrouper, TaskTokens, normalise
from psworker.launcher.console.progress import Progress

__all__ = ["OutputCopier", "GROUP_WINDOW_SECS"]

logger = logging.getLogger(__name__)

# How long the console holds a task's line for the same line from other tasks. 9 tasks sharing 2 cores print
# their start-up lines 2 to 4 at a time within it (closer still on a cluster, each task on its own cores); a longer
# wait would group more there but hold every warning and error as long. Half a second is the live view's refresh
# period: too short for a person to notice. A constant, not a flag: `--verbose` and the logs show every line as is.
GROUP_WINDOW_SECS = 0.5
_FLUSHER_JOIN_SECS = 5.0


class OutputCopier:
    """Shared by every reader thread of a run: the console, its lock, filter and line grouper, and the errors seen
    (a log file that cannot be written is no error: a warning, once).

    `close()` releases the lines still waiting for their window (call it once the readers are done)."""

    def __init__(self, console: TextIO, console_filter: Optional[Callable[[str, str], Optional[str]]],
                 progress: Progress, *, window_secs: float = 0.0,
                 on_event: Optional[Callable[[str, Any], Any]] = None) -> None:
        self._console = console
        self._on_event = on_event           # called with (task, event) for every line that is an event
        self._filter = console_filter
        self._progress = progress
        self._window = window_secs
        self._cond = threading.Condition()      # guards the console, the grouper and what follows
        self._grouper = LineGrouper(window_secs)
        self._flusher: Optional[threading.Thread] = None
        self._closed = False
        self._console_ok = True
        self._logs_failed: list[str] = []      # the tasks whose log file could not be written
        self.errors: list[tuple[str, BaseException]] = []

    def pump(self, name: str, stream: Any, log: Any, tail: collections.deque, task: Any = None,
             pid: Optional[int] = None) -> None:
        """Reads `stream` to its end; closes it and `log`. Never raises (errors land in `errors`).

        `task` and `pid` (the attempt's process) name the tokens that count as equal across tasks' lines."""
        tokens = TaskTokens.of(task, pid) if task is not None else None
        log_ok = True
        try:
            for raw in iter(stream.readline, b""):
                if not raw.endswith(b"\n"):
                    raw += b"\n"
                text = raw.decode("utf-8", "replace").rstrip("\r\n")
                tail.append(text)
                event = events.parse_line(text)
                self._progress.record(name, event)
                if event is not None and self._on_event is not None:
                    self._on_event(name, event)
                if log_ok:
                    try:
                        log.write(raw)
                        log.flush()
                    except OSError as err:      # e.g. a full disk: keep draining the pipe, keep the console
                        log_ok = False
                        self._log_failed(name, log, err)
                    except Exception as err:
                        log_ok = False
                        self._error(name, err)
                shown = text if self._filter is None else self._filter(text, name)
                if shown is not None:     # a step line is never grouped: each task's step is its own
                    alone = self._window <= 0 or isinstance(event, events.Step)
                    key = None if alone else shown if tokens is None else normalise(shown, tokens)
                    self._show(name, shown, key, None if alone else folds.match(shown), _routine(text))
        except Exception as err:
            self._error(name, err)
        finally:
            for f in (stream, log):
                with contextlib.suppress(Exception):
                    f.close()

    def exited(self, name: str, text: str) -> bool:
        """The launcher's word that task `name` exited (`worker:3 (pid 41) exited: ...`): an exit 0 folds with the
        others' (returns True: shown in its turn, after the task's own lines); any other exit releases the task's
        waiting lines and returns False (the caller logs it, at once)."""
        fold = folds.match(text, launcher=True) if self._window > 0 else None
        with self._cond:
            if fold is None or self._closed:
                self._write(self._grouper.release(name))
                return False
        self._show(name, text, None, fold)
        return True

    def close(self) -> None:
        """Writes every line still waiting and stops the flusher; later lines go to the console at once."""
        with self._cond:
            self._closed = True
            self._write(self._grouper.drain())
            self._cond.notify_all()
        if self._flusher is not None:
            self._flusher.join(_FLUSHER_JOIN_SECS)

    def _show(self, name: str, text: str, key: Optional[str], fold: Optional[tuple[folds.Fold, Any]] = None,
              routine: bool = False) -> None:
        with self._cond:
            if self._closed:
                self._write([f"[{name}] {text}"])
                return
            if fold is None:
                hold = folds.FOLD_WINDOW_SECS if routine else None
                lines = self._grouper.add(name, text, key, time.monotonic(), hold=hold)
            else:
                lines = self._grouper.add(name, text, folds.fold_key(fold[0], text), time.monotonic(),
                                          hold=folds.FOLD_WINDOW_SECS, render=folds.renderer(fold[0]))
            self._write(lines)
            if self._window > 0 and self._flusher is None:
                self._flusher = threading.Thread(target=self._flush_when_due, name="psworker-console",
                                                 daemon=True)
                self._flusher.start()
            self._cond.notify()

    def _flush_when_due(self) -> None:
        with self._cond:
            while not self._closed:
                self._write(self._grouper.due(time.monotonic()))
                due = self._grouper.next_due()
                self._cond.wait(None if due is None else max(0.0, due - time.monotonic()))

    def _write(self, lines: Sequence[str]) -> None:
        """Under the lock."""
        if not lines or not self._console_ok:
            return
        try:
            self._console.write("".join(line + "\n" for line in lines))
            self._console.flush()
        except Exception as err:   # e.g. `psworker local ... | head`: not worth failing a run for
            self._console_ok = False
            who = lines[0][1:].partition("] ")[0]
            logger.warning("console copy of %s stopped, and of every other task (%r); the full logs are still "
                           "written", who, err)

    def _log_failed(self, name: str, log: Any, err: OSError) -> None:
        """A log file that cannot be written (a full disk, a quota): said once per run, naming the path and the
        free space; that task's output goes on to the console and the report's tail, no longer to its log."""
        path = getattr(log, "name", "?")
        with self._cond:
            first, self._logs_failed = not self._logs_failed, self._logs_failed + [name]
        if not first:
            logger.debug("cannot write the log of %s either (%s): %s", name, path, err)
            return
        free = f" ({diskspace.where_free(str(path))})" if diskspace.is_disk_errno(err) else ""
        logger.warning("cannot write %s, the log of %s: %s%s; its output (and any other task's whose log fails) "
                       "goes on to the console and the report only", path, name, err.strerror or err, free)

    def _error(self, name: str, err: BaseException) -> None:
        logger.error("copying the output of %s failed", name, exc_info=err)
        self.errors.append((name, err))


def _routine(line: str) -> bool:
    """A psworker task's own INFO record: grouped over `folds.FOLD_WINDOW_SECS`, as the folds are (a warning, an
    error and any other program's line over `GROUP_WINDOW_SECS`)."""
    record = events.LogRecord.parse(line)
    return record is not None and record.level == "INFO" and record.logger.split(".")[0] == "psworker"
