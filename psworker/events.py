"""Every line that crosses a process boundary, its formatter (`render`) beside its parser (`parse`).

A task tells the launcher (and `psworker status`, the report, the tests) what happened by printing or logging one
of these lines; the launcher tells a task's log where an attempt starts the same way. The producers call `render()`
and every reader calls `parse_line` (or a kind's `parse`/`finditer`), so a reworded line changes both sides at once.

A line is recognised behind any of the prefixes it gets on its way: the console's `[worker:0] `, and a log record's
(psworker's `LOG_FORMAT`, Python logging's default `INFO:root:`, absl's `I1201 12:00:00.123456 42 file.py:7] `).
The step line is the one a user's script prints itself, so its parser takes what such a script plausibly prints:
`step 120, loss = 0.42 (1830.2 examples/sec; 0.035 sec/batch)` (the tutorial's form), `step 120, loss = 0.4213`,
`Step 120: loss=0.42`, `step 120`, and TF Estimator's `loss = 0.42, step = 120`.
"""

from __future__ import annotations

import datetime
import re
from dataclasses import dataclass
from typing import ClassVar, Iterator, Optional, TypeVar, Union

__all__ = ["LOG_FORMAT", "Event", "Step", "FirstStep", "WorkerDone", "FoundComplete", "PsDone", "TfImported",
           "Precision", "AucResult", "Exported", "Restart", "DataDealt", "NewRun", "RemotePid", "TaskError", "Traceback", "KINDS",
           "parse_line", "last", "current_attempt", "LogRecord", "log_time", "StacksReady", "StacksRequested"]

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"   # a task's log records (cli.main)

_TASK_NAME = r"[a-z][a-z0-9_]*:\d+"
_CONSOLE = rf"(?:\[(?P<console_task>{_TASK_NAME})\] )?"
_LOG_TIME = r"(?P<log_time>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(?P<log_ms>\d{3})"
_LOG = (rf"(?:{_LOG_TIME} [A-Z]+ [\w.]+: "                      # LOG_FORMAT
        r"|(?:DEBUG|INFO|WARNING|ERROR|CRITICAL):[\w.]*:"       # logging.basicConfig()'s default
        r"|[DIWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [\w.]+:\d+\] )?")   # absl
_TASK = rf"(?:(?P<task>{_TASK_NAME}): )?"
_NUMBER = r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+|nan|inf)"

_LOG_RECORD = re.compile(rf"^{_CONSOLE}{_LOG_TIME} (?P<level>[A-Z]+) (?P<logger>[\w.]+): {_TASK}(?P<message>.*)$")

E = TypeVar("E", bound="Event")


def _line(body: str) -> re.Pattern:
    return re.compile(f"^{_CONSOLE}{_LOG}{body}", re.MULTILINE)


def _float(text: Optional[str]) -> Optional[float]:
    try:
        return None if text is None else float(text)
    except ValueError:
        return None


def _int(text: Optional[str]) -> Optional[int]:
    return None if text is None else int(text)


def _task(m: re.Match) -> Optional[str]:
    return m.group("task") or m.group("console_task")


def _named(task: Optional[str], text: str) -> str:
    return text if task is None else f"{task}: {text}"


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
class Step(Event):
    """A worker's progress line at global step `step` (psworker's workers print one every `log_every_steps`)."""

    step: int
    loss: Optional[float] = None
    examples_per_sec: Optional[float] = None
    sec_per_batch: Optional[float] = None
    epoch: Optional[float] = None          # dealt shards: examples trained / examples per epoch
    num_epochs: Optional[int] = None       # ... of this many (None: until max_steps)

    regex: ClassVar[re.Pattern] = _line(
        rf"(?:(?i:step)[ \t]*[=:#]?[ \t]*(?P<step>\d+)(?:/\d+)?\b"
        rf"(?:[ \t]*[,:;|-]?[ \t]*(?i:loss)[ \t]*[=:]?[ \t]*(?P<loss>{_NUMBER})\b)?"
        rf"(?:, epoch (?P<epoch>{_NUMBER})(?: of (?P<epochs>\d+))?)?"
        rf"(?:[ \t]*\((?P<rate>{_NUMBER}) examples/sec(?:; (?P<spb>{_NUMBER}) sec/batch)?)?"
        rf"|(?i:loss) = (?P<est_loss>{_NUMBER}), (?i:step) = (?P<est_step>\d+)\b)")   # TF Estimator's

    def render(self) -> str:
        text = f"step {self.step}"
        if self.loss is not None:
            text += f", loss = {self.loss:.2f}"
        if self.epoch is not None:
            text += f", epoch {self.epoch:.2f}" + ("" if self.num_epochs is None else f" of {self.num_epochs}")
        if self.examples_per_sec is not None:
            spb = "" if self.sec_per_batch is None else f"; {self.sec_per_batch:.3f} sec/batch"
            text += f" ({self.examples_per_sec:.1f} examples/sec{spb})"
        return text

    @classmethod
    def _from(cls, m: re.Match) -> "Step":
        if m.group("est_step") is not None:
            return cls(int(m.group("est_step")), _float(m.group("est_loss")))
        return cls(int(m.group("step")), _float(m.group("loss")), _float(m.group("rate")), _float(m.group("spb")),
                   _float(m.group("epoch")), _int(m.group("epochs")))


@dataclass(frozen=True)
class FirstStep(Event):
    """A worker ran its first step (logged by psworker's workers)."""

    task: Optional[str]
    step: int

    regex: ClassVar[re.Pattern] = _line(rf"{_TASK}first step done at global step (?P<step>\d+)\b")

    def render(self) -> str:
        return _named(self.task, f"first step done at global step {self.step}")

    @classmethod
    def _from(cls, m: re.Match) -> "FirstStep":
        return cls(_task(m), int(m.group("step")))


@dataclass(frozen=True)
class WorkerDone(Event):
    """A worker finished training (logged by psworker's workers; the chief evaluates after it)."""

    task: Optional[str]
    step: int
    local_steps: Optional[int] = None
    seconds: Optional[float] = None

    regex: ClassVar[re.Pattern] = _line(
        rf"{_TASK}done at global step (?P<step>\d+)\b"
        r"(?: after (?P<local>\d+) local steps in (?P<secs>[\d.]+) s)?")

    def render(self) -> str:
        more = "" if self.local_steps is None else f" after {self.local_steps} local steps in {self.seconds or 0:.1f} s"
        return _named(self.task, f"done at global step {self.step}{more}")

    @classmethod
    def _from(cls, m: re.Match) -> "WorkerDone":
        return cls(_task(m), int(m.group("step")), _int(m.group("local")), _float(m.group("secs")))


@dataclass(frozen=True)
class FoundComplete(Event):
    """A worker started after training ended runs no step: the live ps tasks' global step (`checkpoint_dir` None)
    or, the ps tasks gone, the newest checkpoint in `checkpoint_dir` is at `max_steps`."""

    task: Optional[str]
    step: int
    max_steps: int
    checkpoint_dir: Optional[str] = None

    regex: ClassVar[re.Pattern] = _line(
        rf"{_TASK}training is already complete: (?:the global step on the ps tasks is (?P<step>\d+)"
        r"|the ps tasks are not up and the newest checkpoint in (?P<dir>.+) is at global step (?P<disk_step>\d+))"
        r" \(--max_steps (?P<max>\d+)\)")

    def render(self) -> str:
        if self.checkpoint_dir is None:
            return _named(self.task, f"training is already complete: the global step on the ps tasks is {self.step} "
                                     f"(--max_steps {self.max_steps}); no step to run")
        return _named(self.task, f"training is already complete: the ps tasks are not up and the newest checkpoint "
                                 f"in {self.checkpoint_dir} is at global step {self.step} (--max_steps "
                                 f"{self.max_steps}); nothing to do")

    @classmethod
    def _from(cls, m: re.Match) -> "FoundComplete":
        step = m.group("step") or m.group("disk_step")
        return cls(_task(m), int(step), int(m.group("max")), m.group("dir"))


@dataclass(frozen=True)
class PsDone(Event):
    """A ps is done serving: every worker said it was done, or (`training_complete`) the train_dir shows training
    complete; it exits, or serves on with `--keep_ps_running` (`still_serving`)."""

    task: Optional[str]
    training_complete: bool = False
    still_serving: bool = False

    regex: ClassVar[re.Pattern] = _line(
        rf"{_TASK}(?P<why>every worker is done|training is complete); (?P<then>exiting|still serving)\b")

    def render(self) -> str:
        why = "training is complete" if self.training_complete else "every worker is done"
        then = "still serving (--keep_ps_running)" if self.still_serving else "exiting"
        return _named(self.task, f"{why}; {then}")

    @classmethod
    def _from(cls, m: re.Match) -> "PsDone":
        return cls(_task(m), m.group("why") == "training is complete", m.group("then") == "still serving")


@dataclass(frozen=True)
class TfImported(Event):
    """A psworker task imported TensorFlow (its start-up's largest part)."""

    task: Optional[str]
    seconds: float

    regex: ClassVar[re.Pattern] = _line(rf"{_TASK}TensorFlow imported in (?P<secs>[\d.]+) s\b")

    def render(self) -> str:
        return _named(self.task, f"TensorFlow imported in {self.seconds:.3f} s")

    @classmethod
    def _from(cls, m: re.Match) -> "TfImported":
        return cls(_task(m), float(m.group("secs")))


@dataclass(frozen=True)
class Precision(Event):
    """The tutorial's evaluation line: `2026-11-30 12:00:00: precision @ 1 = 0.972 (359 examples, global step
    401)` (the chief at the end of training, `psworker eval`; the launcher's report repeats `summary`)."""

    precision: float
    examples: Optional[int] = None
    global_step: Optional[int] = None
    at: Optional[str] = None    # local time, `YYYY-MM-DD HH:MM:SS`

    regex: ClassVar[re.Pattern] = _line(
        rf"(?:psworker: )?(?:(?P<at>\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d): )?precision @ 1 = (?P<p>{_NUMBER})"
        r"(?: \((?P<n>\d+) examples, global step (?P<step>\d+)\))?")

    @property
    def summary(self) -> str:
        """The line without its time."""
        what = "" if self.examples is None else f" ({self.examples} examples, global step {self.global_step})"
        return f"precision @ 1 = {self.precision:.3f}{what}"

    def render(self) -> str:
        return self.summary if self.at is None else f"{self.at}: {self.summary}"

    @staticmethod
    def now() -> str:
        """The `at` of a result computed now."""
        return f"{datetime.datetime.now():%Y-%m-%d %H:%M:%S}"

    @classmethod
    def _from(cls, m: re.Match) -> "Precision":
        return cls(float(m.group("p")), _int(m.group("n")), _int(m.group("step")), m.group("at"))


@dataclass(frozen=True)
class AucResult(Event):
    """A click-through model's evaluation line, where the others print `Precision`: `2026-11-30 12:00:00: auc =
    0.853, logloss = 0.412 (4000 examples, global step 401)`."""

    auc: float
    logloss: float
    examples: Optional[int] = None
    global_step: Optional[int] = None
    at: Optional[str] = None

    regex: ClassVar[re.Pattern] = _line(
        rf"(?:psworker: )?(?:(?P<at>\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d): )?auc = (?P<auc>{_NUMBER}), "
        rf"logloss = (?P<logloss>{_NUMBER})(?: \((?P<n>\d+) examples, global step (?P<step>\d+)\))?")

    @property
    def summary(self) -> str:
        what = "" if self.examples is None else f" ({self.examples} examples, global step {self.global_step})"
        return f"auc = {self.auc:.4f}, logloss = {self.logloss:.4f}{what}"

    def render(self) -> str:
        return self.summary if self.at is None else f"{self.at}: {self.summary}"

    @classmethod
    def _from(cls, m: re.Match) -> "AucResult":
        return cls(float(m.group("auc")), float(m.group("logloss")), _int(m.group("n")), _int(m.group("step")),
                   m.group("at"))


@dataclass(frozen=True)
class Exported(Event):
    """A SavedModel written to `path` from `checkpoint` (the chief after its evaluation, `psworker export`)."""

    checkpoint: str
    step: int
    path: str
    task: Optional[str] = None

    regex: ClassVar[re.Pattern] = _line(
        rf"{_TASK}exported (?P<ckpt>.+?) \(global step (?P<step>\d+)\) to (?P<path>.+?)[ \t]*$")

    def render(self) -> str:
        return _named(self.task, f"exported {self.checkpoint} (global step {self.step}) to {self.path}")

    @classmethod
    def _from(cls, m: re.Match) -> "Exported":
        return cls(m.group("ckpt"), int(m.group("step")), m.group("path"), _task(m))


def _stamp() -> str:
    return datetime.datetime.now().isoformat(timespec="milliseconds")


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
        return cls(number, cause, _stamp())

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
        return cls(task, _stamp())

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

    regex: ClassVar[re.Pattern] = re.compile(rf"^{_CONSOLE}psworker: error: (?P<message>.*)$", re.MULTILINE)

    def render(self) -> str:
        return f"psworker: error: {self.message}"

    @classmethod
    def _from(cls, m: re.Match) -> "TaskError":
        return cls(m.group("message"))


@dataclass(frozen=True)
class Traceback(Event):
    """The first line of an uncaught Python exception's traceback (Python prints it)."""

    regex: ClassVar[re.Pattern] = re.compile(rf"^{_CONSOLE}Traceback \(most recent call last\):", re.MULTILINE)

    def render(self) -> str:
        return "Traceback (most recent call last):"

    @classmethod
    def _from(cls, m: re.Match) -> "Traceback":
        return cls()


@dataclass(frozen=True)
class DataDealt(Event):
    """The chief's account of the dealt shards at its end: examples trained, how many of them were trained again
    (read after a fault by a second worker or a second time), and the epochs that makes."""

    task: Optional[str]
    trained: int
    again: int
    epochs: float
    num_epochs: Optional[int]
    examples_per_epoch: int

    regex: ClassVar[re.Pattern] = _line(
        rf"{_TASK}data: (?P<trained>\d+) examples trained, (?P<again>\d+) of them again; epoch (?P<epochs>{_NUMBER})"
        r"(?: of (?P<of>\d+))? \((?P<per>\d+) examples each\)")

    def render(self) -> str:
        of = "" if self.num_epochs is None else f" of {self.num_epochs}"
        return _named(self.task, f"data: {self.trained} examples trained, {self.again} of them again; epoch "
                                 f"{self.epochs:.2f}{of} ({self.examples_per_epoch} examples each)")

    @classmethod
    def _from(cls, m: re.Match) -> "DataDealt":
        return cls(_task(m), int(m.group("trained")), int(m.group("again")), float(m.group("epochs")),
                   _int(m.group("of")), int(m.group("per")))


KINDS: tuple[type[Event], ...] = (Step, FirstStep, WorkerDone, FoundComplete, PsDone, TfImported, Precision,
                                  AucResult, Exported, Restart, NewRun, RemotePid, TaskError, Traceback, DataDealt)
AnyEvent = Union[Step, FirstStep, WorkerDone, FoundComplete, PsDone, TfImported, Precision, AucResult, Exported, Restart,
                 NewRun, RemotePid, TaskError, Traceback, DataDealt]


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
        return cls(task, why, how, datetime.datetime.now().isoformat(timespec="milliseconds"))

    @classmethod
    def _from(cls, m: re.Match) -> "StacksRequested":
        return cls(m["task"], m["why"], m["how"], m["at"])


def parse_line(line: str) -> Optional[AnyEvent]:
    """The event that one line is (prefixes allowed, trailing newline ignored), or None for any other line."""
    line = line.rstrip("\r\n")
    for kind in KINDS:
        event = kind.parse(line)
        if event is not None:
            return event
    return None


def last(kind: type[E], lines: Union[str, list[str]]) -> Optional[E]:
    """The last event of `kind` in a text or a list of lines, or None."""
    found = None
    for found in kind.finditer(lines if isinstance(lines, str) else "\n".join(lines)):
        pass
    return found


def current_attempt(log: str) -> str:
    """The part of a task's log that its latest attempt wrote: from its last `Restart`/`NewRun` line on (the
    whole log when it has none)."""
    starts = [m.start() for kind in (Restart, NewRun) for m in kind.regex.finditer(log)]
    return log[max(starts):] if starts else log


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
        stamp = datetime.datetime.fromtimestamp(self.time)
        return (f"{stamp:%Y-%m-%d %H:%M:%S},{stamp.microsecond // 1000:03d} {self.level} {self.logger}: "
                f"{_named(self.task, self.message)}")

    @classmethod
    def parse(cls, line: str) -> Optional["LogRecord"]:
        m = _LOG_RECORD.match(line.rstrip("\r\n"))
        if m is None:
            return None
        stamp = datetime.datetime.strptime(m.group("log_time"), "%Y-%m-%d %H:%M:%S")
        return cls(stamp.timestamp() + int(m.group("log_ms")) / 1000.0, m.group("level"), m.group("logger"),
                   m.group("task"), m.group("message"))


def log_time(line: str) -> Optional[float]:
    """The `time.time()` of a task's log record, None for a line that is not one."""
    record = LogRecord.parse(line)
    return None if record is None else record.time
