"""What a person sees of the tasks' output on the launcher's console; the log files keep every line.

TensorFlow's C++ start-up and rendezvous lines (absl format, `I0000 ...`), its Python INFO chatter and
deprecation warnings are repeated by every task and say nothing a user can act on. They stay in
`<train_dir>/logs/` and come back on the console with `--verbose`.

Lines that several tasks print within a short window are shown once, prefixed with the tasks' range
(`[worker:0-3,5]`): a `LineGrouper` compares the lines with each task's own name, index, address and pid
replaced (`normalise`), and releases each group once its window is over and no older group of its tasks waits
(each task's lines in order). The routine lines that differ in their numbers fold in it too (`launcher.console.folds`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

from psworker import events, stackdump

__all__ = ["ConsoleFilter", "LOST_PS_TEXT", "is_noise", "is_psworker_line", "starts_tf_text", "for_console",
           "PeopleFormatter", "TaskTokens", "normalise", "format_tasks", "expand_tasks", "by_task", "render_group",
           "LineGrouper"]

# absl/C++ log lines: severity letter, MMDD, time, thread id, file:line], e.g.
# `I0000 00:00:1796091826.657988    2432 port.cc:153] oneDNN custom operations are on ...`.
# Fatal (F) lines are never hidden.
_CPP_LINE = re.compile(r"^[IWE]\d{4} [\d:.]+\s+\d+ \S+:\d+\]")
_NOISE = (
    re.compile(r"^WARNING: All log messages before absl::InitializeLog\(\) is called"),
    # the second line of cpu_feature_guard's info line (a script that does not set TF_CPP_MIN_LOG_LEVEL)
    re.compile(r"^To enable the following instructions: .* rebuild TensorFlow with the appropriate compiler flags"),
    # Python logging from TensorFlow's own loggers (INFO and deprecation warnings), in psworker's task format
    re.compile(r"^\S+ \S+ (INFO|WARNING) (tensorflow|absl|h5py)\b"),
    re.compile(r"^(INFO|WARNING):tensorflow:"),
)
_NOISE_EVENTS = (events.TfImported, events.FirstStep)   # psworker's own start-up milestones (benchmarks read them)
# The fragments of TensorFlow's error text (a gRPC error block, an op's node, a deprecation's advice): in the log
_TF_FRAGMENT = re.compile(
    r"^(?:\s*\[\[\{\{node .*\}\}\]\]|Instructions for updating:|=+$|[A-Z_]+: From /job:|recvmsg:"
    r"|Additional GRPC error information from remote target |:UNKNOWN:Error received from peer"
    r"|Recent warning and error logs:|\s+[IWEF]\d{4} [\d:.]+\s+\d+ \S+:\d+\]|Original stack trace for "
    r"|Detected at node |Node: '|\s+File \".*/tensorflow/"
    r"|Colocations handled automatically by placer\.$)")     # colocate_with's advice (packed transfers use it)
_LOST_PS = re.compile(r"(?:remote target|From) /job:ps/replica:\d+/task:(\d+)\b")
_FATAL = re.compile(r"^F\d{4} ")
LOST_PS_TEXT = "lost {} (TensorFlow's gRPC errors are in the task logs)"


def is_noise(line: str) -> bool:
    """True for a task output line that belongs in its log file only (not on a person's console)."""
    return (bool(_CPP_LINE.match(line)) or any(p.match(line) for p in _NOISE)
            or any(kind.parse(line) is not None for kind in _NOISE_EVENTS))


def for_console(line: str, task: Optional[str] = None) -> str | None:
    """The text to show for one task output line on a person's console, or None to show nothing (`task`, the
    printing task's name, changes nothing here: `ConsoleFilter` uses it).

    psworker's own log lines lose their timestamp, logger and task name (the console prefix names the task);
    warnings and errors keep their level.
    """
    if is_noise(line) or not line.strip() or _TF_FRAGMENT.match(line):   # blank lines: gRPC blocks hold many
        return None
    if stackdump.is_dump_line(line):           # in the log; the report shows the innermost frames
        return None
    record = events.LogRecord.parse(line)
    if record is None or record.logger.split(".")[0] != "psworker":
        return line
    return record.message if record.level == "INFO" else f"{record.level.lower()}: {record.message}"


def is_psworker_line(line: str) -> bool:
    """A line of psworker's own: a psworker log record, or an event line (`psworker.events`) other than a Python
    traceback's first line."""
    record = events.LogRecord.parse(line)
    if record is not None:
        return record.logger.split(".")[0] == "psworker"
    event = events.parse_line(line)
    return event is not None and not isinstance(event, events.Traceback)


def starts_tf_text(line: str) -> bool:
    """A line that TensorFlow (or another library) writes, whose message may go on over the next lines: an absl
    line, a log record of a logger not psworker's, a fragment of its error text."""
    if _CPP_LINE.match(line) or _TF_FRAGMENT.match(line):
        return True
    record = events.LogRecord.parse(line)
    return record is not None and record.logger.split(".")[0] != "psworker"


class ConsoleFilter:
    """`for_console` with a memory, called from every task's output reader (`filter(line, task)`): a task's gRPC
    error text about ps:N becomes one line, `lost ps:N (...)`, once until that task prints a step line again (the
    console folds the workers' lines into one, `folds`). With `own_tasks` (psworker's tasks, not a user's command)
    TensorFlow's text is left out whole: from a line of its own (`starts_tf_text`) to psworker's next line, every
    line of its message (a gRPC error block, an op's `[[{{node ...}}]]`, a deprecation's `Instructions for
    updating:`) stays in the log."""

    def __init__(self, own_tasks: bool) -> None:
        self._own = own_tasks
        self._lock = threading.Lock()
        self._lost: dict[str, set[str]] = {}    # task -> the ps it was shown to have lost
        self._in_tf: set[str] = set()           # the tasks whose output is inside TensorFlow's text

    def __call__(self, line: str, task: Optional[str] = None) -> Optional[str]:
        key = task or ""
        lost = None if events.LogRecord.parse(line) is not None else _LOST_PS.search(line)
        with self._lock:
            if lost is not None:
                return self._lost_ps(key, f"ps:{lost.group(1)}")
            if isinstance(events.Step.parse(line), events.Step):
                self._lost.pop(key, None)
            if self._own and not _FATAL.match(line):
                if is_psworker_line(line):
                    self._in_tf.discard(key)
                elif starts_tf_text(line) or key in self._in_tf:
                    self._in_tf.add(key)
                    return None
        return for_console(line)

    def _lost_ps(self, task: str, ps: str) -> Optional[str]:
        """Under the lock."""
        self._in_tf.add(task)
        if ps in self._lost.setdefault(task, set()):
            return None
        self._lost[task].add(ps)
        return LOST_PS_TEXT.format(ps)


class PeopleFormatter(logging.Formatter):
    """`psworker: message` for the launcher's own INFO lines; `psworker: warning: ...` above INFO."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + self.formatException(record.exc_info)
        if record.levelno > logging.INFO:
            return f"psworker: {record.levelname.lower()}: {message}"
        return f"psworker: {message}"


# -- grouping the lines that several tasks print ------------------------------------------------------------

_LOCAL_HOSTS = ("localhost", "127.0.0.1", "0.0.0.0", "[::1]", "[::]")
_TASK_RANGE = re.compile(r"([a-z][a-z0-9_]*):(\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*)")
_ANY_PID = re.compile(r"\b(pid[ =:]*)\d+\b", re.IGNORECASE)


@dataclass(frozen=True)
class TaskTokens:
    """What in a line is the printing task's own: its name (`worker:3`), index, address and pid."""

    job: str
    index: int
    host: Optional[str] = None
    port: Optional[int] = None
    pid: Optional[int] = None

    @classmethod
    def of(cls, task: Any, pid: Optional[int] = None) -> "TaskTokens":
        """From a `psworker.spec.plan.Task` (or anything with `job`, `index` and maybe `address`: `host:port`)."""
        address = getattr(task, "address", None)
        host, port = None, None
        if address is not None:
            h, _, p = str(address).rpartition(":")
            host, port = (h, int(p)) if h and p.isdigit() else (None, None)
        return cls(task.job, task.index, host, port, pid)


@functools.lru_cache(maxsize=4096)
def _patterns(t: TaskTokens) -> tuple[tuple[re.Pattern, str], ...]:
    found = []
    if t.port:
        hosts = "|".join(re.escape(h) for h in dict.fromkeys(((t.host,) if t.host else ()) + _LOCAL_HOSTS))
        found.append((re.compile(rf"(?<![\w.\-])(?:{hosts}):{t.port}(?!\d)"), "<address>"))
    # TensorFlow's device names: /job:worker/replica:0/task:3
    found.append((re.compile(rf"(/job:{re.escape(t.job)}(?:/replica:\d+)?/task:){t.index}(?!\d)"), r"\1<index>"))
    found.append((re.compile(rf"(?<![\w:/]){re.escape(t.job)}:{t.index}(?![\w:])"), "<task>"))
    if t.pid is not None:
        found.append((re.compile(rf"(?<![\w.]){t.pid}(?![\w]|\.\d)"), "<pid>"))
    return tuple(found)


def normalise(text: str, tokens: TaskTokens) -> str:
    """`text` with the task's own address, name (`worker:3`), index in TF device names and pid (its own, or after
    `pid`) replaced by `<address>`, `<task>`, `<index>` and `<pid>`: the lines of two tasks that differ only there
    compare equal. A bare number is left alone (`step 3` is not task 3)."""
    for pattern, replacement in _patterns(tokens):
        text = pattern.sub(replacement, text)
    return _ANY_PID.sub(r"\1<pid>", text)


def format_tasks(names: Iterable[str]) -> str:
    """`ps:0-1, worker:0-3,5,7-9`: task names by job (jobs in name order), runs of indices as ranges."""
    by_job: dict[str, set[int]] = {}
    others = []
    for name in names:
        job, _, index = name.rpartition(":")
        if job and index.isdigit():
            by_job.setdefault(job, set()).add(int(index))
        else:
            others.append(name)
    return ", ".join([f"{job}:{_ranges(sorted(ix))}" for job, ix in sorted(by_job.items())] + sorted(set(others)))


def expand_tasks(prefix: str) -> list[str]:
    """The task names in a console prefix (`format_tasks`'s inverse): `ps:0, worker:0-2,5` -> ps:0, worker:0, ...

    Raises:
        ValueError: `prefix` is not in that form.
    """
    names = []
    for part in prefix.split(", "):
        m = _TASK_RANGE.fullmatch(part)
        if m is None:
            raise ValueError(f"not a task range: {part!r}")
        job, ranges = m.groups()
        for run in ranges.split(","):
            first, _, last = run.partition("-")
            names += [f"{job}:{i}" for i in range(int(first), int(last or first) + 1)]
    return names


def by_task(console: str) -> dict[str, list[str]]:
    """Each task's lines in a console copy, prefix cut, in order; a grouped line counts for every task of its range.
    Lines without a task prefix (the launcher's own) are left out."""
    lines: dict[str, list[str]] = {}
    for line in console.splitlines():
        m = re.fullmatch(r"\[([a-z][^\]]*)\] (.*)", line)
        if m is not None:
            with contextlib.suppress(ValueError):       # `[something else] ...`: not a task prefix
                for name in expand_tasks(m.group(1)):
                    lines.setdefault(name, []).append(m.group(2))
    return lines


def _ranges(indices: list[int]) -> str:
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def render_group(lines: list[tuple[str, str]], key: str) -> str:
    """The console line for one group of (task name, text) lines: one task's line as it printed it, several
    tasks' identical text once, or (when their texts differ in their own tokens) the neutral form `key`."""
    names = [name for name, _ in lines]
    texts = {text for _, text in lines}
    if len(names) == 1:
        return f"[{names[0]}] {lines[0][1]}"
    return f"[{format_tasks(names)}] {texts.pop() if len(texts) == 1 else key}"


@dataclass(eq=False)
class _Group:
    seq: int
    key: Optional[str]
    due: float
    lines: list[tuple[str, str]] = field(default_factory=list)
    render: Optional[Callable[[list[tuple[str, str]]], str]] = None   # a fold's: several lines of a task allowed

    def names(self) -> set[str]:
        return {name for name, _ in self.lines}


class LineGrouper:
    """Groups the lines that several tasks print within `window_secs` of the first one; time comes from the caller.

    A line joins the oldest waiting group with the same key that began after the task's own previous line's group
    (or, for a fold's group, holds that line), or begins a new group (alone when it has no key). A group is released
    once its window is over and no older waiting group holds a line of one of its tasks: no line waits longer than
    the longest window, and each task's lines keep their order. A window of 0 releases every line as it comes.
    """

    def __init__(self, window_secs: float) -> None:
        self._window = window_secs
        self._queue: list[_Group] = []      # waiting, oldest first
        self._by_key: dict[str, list[_Group]] = {}
        self._last: dict[str, int] = {}     # task name -> seq of the group of its latest line
        self._seq = 0

    def add(self, name: str, text: str, key: Optional[str], now: float, *, hold: Optional[float] = None,
            render: Optional[Callable[[list[tuple[str, str]]], str]] = None) -> list[str]:
        """Adds task `name`'s line `text`, compared by `key` (None: a line shown alone and at once, such as a step
        line, once the lines before it are out); returns the console lines due at `now`.

        `hold`: this line's window, if not the grouper's (a routine line's, `launcher.console.folds`); `render`: its
        group's console line from the group's lines (a fold's)."""
        out = self.due(now)                 # a group released takes no more lines
        last = self._last.get(name, 0)
        group = next((g for g in self._by_key.get(key, ())
                      if g.seq > last or (g.seq == last and g.render is not None)), None)
        if group is None:
            self._seq += 1
            window = self._window if hold is None or self._window <= 0 else hold
            group = _Group(self._seq, key, now if key is None else now + window, render=render)
            self._queue.append(group)
            if key is not None:
                self._by_key.setdefault(key, []).append(group)
        group.lines.append((name, text))
        self._last[name] = group.seq
        return out + self.due(now)

    def due(self, now: float) -> list[str]:
        """Releases the groups whose window is over at `now` and whose tasks wait behind no older group, oldest
        first."""
        out, behind = [], set()
        for group in list(self._queue):
            if group.due <= now and not group.names() & behind:
                out.append(self._release(group))
            else:
                behind |= group.names()
        return out

    def release(self, name: str) -> list[str]:
        """Releases the groups up to the one of task `name`'s latest line (its output has ended: nothing of it waits
        behind the launcher's word that it exited)."""
        last = self._last.get(name, 0)
        return [self._release(g) for g in [g for g in self._queue if g.seq <= last]]

    def drain(self) -> list[str]:
        """Releases every waiting group (the run is over)."""
        return [self._release(g) for g in list(self._queue)]

    def next_due(self) -> Optional[float]:
        """When the next group is due (one behind an older group of its tasks: when that one is), None when
        nothing waits."""
        soonest, ready = None, {}           # ready: task -> when its latest group so far can be released
        for group in self._queue:
            at = max([group.due] + [ready[n] for n in group.names() if n in ready])
            for n in group.names():
                ready[n] = at
            soonest = at if soonest is None else min(soonest, at)
        return soonest

    def _release(self, group: _Group) -> str:
        self._queue.remove(group)
        if group.key is None:
            return render_group(group.lines, "")
        same = self._by_key[group.key]
        same.remove(group)
        if not same:
            del self._by_key[group.key]
        if group.render is not None:
            return group.render(group.lines)
        return render_group(group.lines, group.key)
