"""The grammar every event line shares: the prefixes a line may carry (the console's `[worker:0] `, a log record's),
the `Event` base class (`render` beside `parse`/`finditer`), and a task's log record (`LogRecord`, `LOG_FORMAT`)."""

from __future__ import annotations

import datetime
import re
from dataclasses import dataclass
from typing import ClassVar, Iterator, Optional, TypeVar

__all__ = ["CONSOLE", "E", "Event", "LOG_FORMAT", "LogRecord", "NUMBER", "TASK", "line_pattern", "log_time", "named",
           "stamp", "task_of", "to_float", "to_int"]

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"   # a task's log records (cli.main)

TASK_NAME = r"[a-z][a-z0-9_]*:\d+"
CONSOLE = rf"(?:\[(?P<console_task>{TASK_NAME})\] )?"
LOG_TIME = r"(?P<log_time>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(?P<log_ms>\d{3})"
LOG_PREFIX = (rf"(?:{LOG_TIME} [A-Z]+ [\w.]+: "                      # LOG_FORMAT
              r"|(?:DEBUG|INFO|WARNING|ERROR|CRITICAL):[\w.]*:"       # logging.basicConfig()'s default
              r"|[DIWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [\w.]+:\d+\] )?")   # absl
TASK = rf"(?:(?P<task>{TASK_NAME}): )?"
NUMBER = r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+|nan|inf)"

_LOG_RECORD = re.compile(rf"^{CONSOLE}{LOG_TIME} (?P<level>[A-Z]+) (?P<logger>[\w.]+): {TASK}(?P<message>.*)$")

E = TypeVar("E", bound="Event")


def line_pattern(body: str) -> re.Pattern:
    """A line's pattern: `body` behind any of the prefixes (multiline)."""
    return re.compile(f"^{CONSOLE}{LOG_PREFIX}{body}", re.MULTILINE)


def to_float(text: Optional[str]) -> Optional[float]:
    try:
        return None if text is None else float(text)
    except ValueError:
        return None


def to_int(text: Optional[str]) -> Optional[int]:
    return None if text is None else int(text)


def task_of(m: re.Match) -> Optional[str]:
    return m.group("task") or m.group("console_task")


def named(task: Optional[str], text: str) -> str:
    return text if task is None else f"{task}: {text}"


def stamp() -> str:
    """Now, as the launcher's marker lines show it."""
    return datetime.datetime.now().isoformat(timespec="milliseconds")


class Event:
    """One kind of line. A subclass is a frozen dataclass with `regex` (the line, prefixes allowed, multiline),
    `render()` (the line, without prefixes) and `_from(match)`."""

    regex: ClassVar[re.Pattern]

    def render(self) -> str:
        raise NotImplementedError

    @classmethod
    def _from(cls: type[E], m: re.Match) -> Optional[E]:
        raise NotImplementedError

    @classmethod
    def parse(cls: type[E], line: str) -> Optional[E]:
        """The event of this kind in one line (prefixes allowed), or None."""
        m = cls.regex.match(line)
        return None if m is None else cls._from(m)

    @classmethod
    def finditer(cls: type[E], text: str) -> Iterator[E]:
        """Every event of this kind in a whole text (a log), in order."""
        for m in cls.regex.finditer(text):
            event = cls._from(m)
            if event is not None:
                yield event


@dataclass(frozen=True)
class LogRecord:
    """One record of a task's log as `LOG_FORMAT` writes it (`2026-11-30 16:46:33,807 INFO psworker.task:
    worker:0: message`): the envelope of the events that tasks log, not an event itself."""

    time: float          # time.time(), to the millisecond
    level: str
    logger: str
    task: Optional[str]  # psworker's own records name their task first
    message: str

    def render(self) -> str:
        when = datetime.datetime.fromtimestamp(self.time)
        return (f"{when:%Y-%m-%d %H:%M:%S},{when.microsecond // 1000:03d} {self.level} {self.logger}: "
                f"{named(self.task, self.message)}")

    @classmethod
    def parse(cls, line: str) -> Optional["LogRecord"]:
        m = _LOG_RECORD.match(line.rstrip("\r\n"))
        if m is None:
            return None
        when = datetime.datetime.strptime(m.group("log_time"), "%Y-%m-%d %H:%M:%S")
        return cls(when.timestamp() + int(m.group("log_ms")) / 1000.0, m.group("level"), m.group("logger"),
                   m.group("task"), m.group("message"))


def log_time(line: str) -> Optional[float]:
    """The `time.time()` of a task's log record, None for a line that is not one."""
    record = LogRecord.parse(line)
    return None if record is None else record.time
