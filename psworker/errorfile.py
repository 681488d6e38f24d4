"""A task's failure as data: one JSON record (`ErrorRecord`) written by the task's one error exit (`cli.main`) to
the file the launcher names in `ERROR_FILE_ENV` (`<run dir>/logs/<task>.error.json`), read by the launcher's report
instead of the task's log. Used by both sides, as torchelastic's error file.

Any program may write the file (a user's script under `psworker run` too): the report takes the record over the
log's last lines whenever the file is there.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from psworker import errors, events
from psworker.diskspace import write_atomically

__all__ = ["ERROR_FILE_ENV", "ErrorRecord", "note_step", "read_record", "record_of", "report", "write_record"]

log = logging.getLogger(__name__)

ERROR_FILE_ENV = "PSWORKER_ERROR_FILE"   # set by the launcher for each task attempt: where its record goes
TRACEBACK_LINES = 12                     # the end of an unexpected exception's traceback, kept in its record

_last_step: Optional[int] = None         # this process's last global step, once training has seen one


@dataclass(frozen=True)
class ErrorRecord:
    """How one task attempt failed: its exit code, the `errors.py` class that chose that code (None: an unexpected
    exception, a bug), the exception's own type, its message, when (`time`: seconds since the epoch; `when`: the
    same in ISO 8601, UTC), the task's last global step (None: unknown, or no training), and for a bug the end of
    its traceback."""

    exit_code: int
    exit_class: Optional[str]
    exception_type: str
    message: str
    time: float
    when: str
    global_step: Optional[int] = None
    traceback: tuple[str, ...] = ()

    def describe(self) -> str:
        """`TrainingFailed, exit 3, at global step 40` (what a report prints beside the message)."""
        what = self.exit_class or f"unexpected {self.exception_type}"
        step = "" if self.global_step is None else f", at global step {self.global_step}"
        return f"{what}, exit {self.exit_code}{step}"


def note_step(step: Optional[int]) -> None:
    """Remembers this task's last global step for its error record (the trainer calls it as a step fails)."""
    global _last_step
    _last_step = step


def _exit_class(exc: BaseException) -> Optional[str]:
    """The nearest class of `exc` that `psworker.errors` defines (the one that chose its exit code), or None."""
    for cls in type(exc).__mro__:
        if cls.__module__ == errors.__name__ and issubclass(cls, errors.PsworkerError):
            return cls.__name__
    return None


def _type_name(exc: BaseException) -> str:
    cls = type(exc)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def record_of(exc: BaseException, exit_code: int, *, cause: Optional[BaseException] = None,
              now: Optional[float] = None) -> ErrorRecord:
    """The record of a task that ends with `exit_code` because of `exc`.

    Args:
        exc: what the task reports (a `PsworkerError`, or any exception: a bug).
        exit_code: the task's exit status.
        cause: the exception actually raised, when `exc` was made from it (`DiskFull` from an `OSError`).
        now: the time of the failure (default: now).
    """
    raised = cause if cause is not None else exc
    at = time.time() if now is None else now
    tb: tuple[str, ...] = ()
    if _exit_class(exc) is None:
        lines = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).splitlines()
        tb = tuple(lines[-TRACEBACK_LINES:])
    return ErrorRecord(exit_code=exit_code, exit_class=_exit_class(exc), exception_type=_type_name(raised),
                       message=str(exc) or _type_name(exc), time=at,
                       when=datetime.datetime.fromtimestamp(at, datetime.timezone.utc).isoformat(),
                       global_step=_last_step, traceback=tb)


def write_record(record: ErrorRecord, path: Optional[str] = None) -> Optional[Path]:
    """Writes `record` (atomically) where the launcher asked (`path`, default: `$PSWORKER_ERROR_FILE`); returns the
    file, or None when nobody asked or the write failed (the exit code and the error line still tell)."""
    where = path if path is not None else os.environ.get(ERROR_FILE_ENV)
    if not where:
        return None
    target = Path(where)
    try:
        write_atomically(target, json.dumps(dataclasses.asdict(record), indent=2) + "\n")
    except OSError as err:          # a full disk, or a run dir this host cannot reach
        log.warning("cannot write the error file %s: %s", target, err)
        return None
    return target


def report(exc: BaseException, exit_code: int, *, cause: Optional[BaseException] = None, line: bool = True) -> int:
    """A task's failure, told once: its `psworker: error: MESSAGE` line on stderr (unless `line` is False: a bug's
    traceback is logged instead), and its record where the launcher asked. Returns `exit_code`."""
    if line:
        print(events.TaskError(str(exc)).render(), file=sys.stderr, flush=True)
    if exit_code != 0:
        write_record(record_of(exc, exit_code, cause=cause))
    return exit_code


def read_record(path: Path) -> Optional[ErrorRecord]:
    """The record in `path`, or None: no file, or not a record."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        data["traceback"] = tuple(data.get("traceback") or ())
        return ErrorRecord(**data)
    except (OSError, ValueError, TypeError, AttributeError):
        return None
