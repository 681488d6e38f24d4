"""What a person sees of the tasks' output on the launcher's console; the log files keep every line.

TensorFlow's C++ start-up and rendezvous lines (absl format, `I0000 ...`), its Python INFO chatter and
deprecation warnings are repeated by every task and say nothing a user can act on. They stay in
`<train_dir>/logs/` and come back on the console with `--verbose`.
"""

from __future__ import annotations

import logging
import re

from psworker import events

__all__ = ["is_noise", "for_console", "PeopleFormatter"]

# absl/C++ log lines: severity letter, MMDD, time, thread id, file:line], e.g.
# `I0000 00:00:1796091826.657988    2432 port.cc:153] oneDNN custom operations are on ...`.
# Fatal (F) lines are never hidden.
_CPP_LINE = re.compile(r"^[IWE]\d{4} [\d:.]+\s+\d+ \S+:\d+\]")
_NOISE = (
    re.compile(r"^WARNING: All log messages before absl::InitializeLog\(\) is called"),
    # Python logging from TensorFlow's own loggers (INFO and deprecation warnings), in psworker's task format
    re.compile(r"^\S+ \S+ (INFO|WARNING) (tensorflow|absl|h5py)\b"),
    re.compile(r"^(INFO|WARNING):tensorflow:"),
)
_NOISE_EVENTS = (events.TfImported, events.FirstStep)   # psworker's own start-up milestones (benchmarks read them)


def is_noise(line: str) -> bool:
    """True for a task output line that belongs in its log file only (not on a person's console)."""
    return (bool(_CPP_LINE.match(line)) or any(p.match(line) for p in _NOISE)
            or any(kind.parse(line) is not None for kind in _NOISE_EVENTS))


# psworker's own task log lines: `2026-12-01 02:23:51,105 INFO psworker.task: worker:0: message`
_OWN_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (?P<level>[A-Z]+) psworker[.\w]*: "
                       r"(?:(?:ps|worker|chief|evaluator):\d+: )?(?P<message>.*)$")


def for_console(line: str) -> str | None:
    """The text to show for one task output line on a person's console, or None to show nothing.

    psworker's own log lines lose their timestamp, logger and task name (the console prefix names the task);
    warnings and errors keep their level.
    """
    if is_noise(line) or not line.strip():     # blank lines: gRPC error blocks are full of them
        return None
    m = _OWN_LINE.match(line)
    if m is None:
        return line
    level = m.group("level")
    return m.group("message") if level == "INFO" else f"{level.lower()}: {m.group('message')}"


class PeopleFormatter(logging.Formatter):
    """`psworker: message` for the launcher's own INFO lines; `psworker: warning: ...` above INFO."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + self.formatException(record.exc_info)
        if record.levelno > logging.INFO:
            return f"psworker: {record.levelname.lower()}: {message}"
        return f"psworker: {message}"
