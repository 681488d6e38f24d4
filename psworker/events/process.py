"""The lines about a task's process rather than its training: where an attempt starts in its log (`Restart`,
`NewRun`, written by the launcher), the remote pid of an ssh task (`RemotePid`), how it failed (`TaskError`,
`Traceback`), and its stack dumps (`StacksReady`, `StacksRequested`; `psworker.stackdump` reads the dump itself)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from psworker.events.base import CONSOLE, Event, stamp

__all__ = ["NewRun", "RemotePid", "Restart", "StacksReady", "StacksRequested", "TaskError", "Traceback",
           "current_attempt"]


@dataclass(frozen=True)
class Restart(Event):
    """The supervisor's line in a task's log before restart `number` of that task."""

    number: int
    cause: str
    at: str

    regex: ClassVar[re.Pattern] = re.compile(r"^--- restart (?P<n>\d+) \((?P<cause>.*)\) at (?P<at>\S+) ---[ \t]*$",
                                             re.MULTILINE)

    def render(self) -> str:
        return f"--- restart {self.number} ({self.cause}) at {self.at} ---"

    @classmethod
    def now(cls, number: int, cause: str) -> "Restart":
        return cls(number, cause, stamp())

    @classmethod
    def _from(cls, m: re.Match) -> "Restart":
        return cls(int(m.group("n")), m.group("cause"), m.group("at"))


@dataclass(frozen=True)
class NewRun(Event):
    """The supervisor's line before a task's first attempt when its log already holds an earlier run."""

    task: str
    at: str

    regex: ClassVar[re.Pattern] = re.compile(r"^--- new run of (?P<task>\S+) at (?P<at>\S+) ---[ \t]*$", re.MULTILINE)

    def render(self) -> str:
        return f"--- new run of {self.task} at {self.at} ---"

    @classmethod
    def now(cls, task: str) -> "NewRun":
        return cls(task, stamp())

    @classmethod
    def _from(cls, m: re.Match) -> "NewRun":
        return cls(m.group("task"), m.group("at"))


@dataclass(frozen=True)
class RemotePid(Event):
    """The first line of a task started over ssh: the remote process id (`shell_echo` prints it there)."""

    pid: int

    PREFIX: ClassVar[str] = "psworker-remote-pid"
    regex: ClassVar[re.Pattern] = re.compile(r"^psworker-remote-pid (?P<pid>\d+)[ \t\r]*$", re.MULTILINE)

    def render(self) -> str:
        return f"{self.PREFIX} {self.pid}"

    @classmethod
    def shell_echo(cls) -> str:
        """The `sh` command that renders this line for the shell it runs in (`$$`: that shell's pid)."""
        return f'echo "{cls.PREFIX} $$"'

    @classmethod
    def _from(cls, m: re.Match) -> "RemotePid":
        return cls(int(m.group("pid")))


@dataclass(frozen=True)
class TaskError(Event):
    """The one error line of a psworker command or task that failed (`cli.main`), on its stderr."""

    message: str

    regex: ClassVar[re.Pattern] = re.compile(rf"^{CONSOLE}psworker: error: (?P<message>.*)$", re.MULTILINE)

    def render(self) -> str:
        """One `psworker: error:` line per line of the message (several problems found at once)."""
        return "\n".join(f"psworker: error: {line}" for line in self.message.splitlines() or [""])

    @classmethod
    def _from(cls, m: re.Match) -> "TaskError":
        return cls(m.group("message"))


@dataclass(frozen=True)
class Traceback(Event):
    """The first line of an uncaught Python exception's traceback (Python prints it)."""

    regex: ClassVar[re.Pattern] = re.compile(rf"^{CONSOLE}Traceback \(most recent call last\):", re.MULTILINE)

    def render(self) -> str:
        return "Traceback (most recent call last):"

    @classmethod
    def _from(cls, m: re.Match) -> "Traceback":
        return cls()


# The stack-dump lines (psworker.stackdump reads the dump itself, Python's faulthandler format, around them). They
# stand alone on their line (no prefix) and are not in KINDS: `parse_line` leaves them to the stack-dump reader.


@dataclass(frozen=True)
class StacksReady(Event):
    """A psworker task's first line: its handler is in place (so the launcher may send `SIGNAL`)."""

    pid: int

    regex: ClassVar[re.Pattern] = re.compile(r"^stacks: `kill -USR1 (?P<pid>\d+)` writes every thread's Python stack "
                                             r"into this log\r?$", re.MULTILINE)

    def render(self) -> str:
        return f"stacks: `kill -USR1 {self.pid}` writes every thread's Python stack into this log"

    @classmethod
    def _from(cls, m: re.Match) -> "StacksReady":
        return cls(int(m["pid"]))


@dataclass(frozen=True)
class StacksRequested(Event):
    """The launcher's line in a task's log before the task's stacks: why and how they were asked for."""

    task: str
    why: str
    how: str                        # `SIGUSR1`, `py-spy`
    at: str

    regex: ClassVar[re.Pattern] = re.compile(
        r"^--- stacks of (?P<task>\S+) asked for by (?P<how>\S+) \((?P<why>.*)\) at (?P<at>\S+) ---[ \t\r]*$",
        re.MULTILINE)

    def render(self) -> str:
        return f"--- stacks of {self.task} asked for by {self.how} ({self.why}) at {self.at} ---"

    @classmethod
    def now(cls, task: str, why: str, how: str) -> "StacksRequested":
        return cls(task, why, how, stamp())

    @classmethod
    def _from(cls, m: re.Match) -> "StacksRequested":
        return cls(m["task"], m["why"], m["how"], m["at"])


def current_attempt(log: str) -> str:
    """The part of a task's log that its latest attempt wrote: from its last `Restart`/`NewRun` line on (the
    whole log when it has none)."""
    starts = [m.start() for kind in (Restart, NewRun) for m in kind.regex.finditer(log)]
    return log[max(starts):] if starts else log
