"""The lines a task prints about its training: progress (`Step`, `FirstStep`), its end (`WorkerDone`, `FoundComplete`,
`PsDone`), `TfImported`, the chief's evaluation (`Precision`), export (`Exported`) and dealt data (`DataDealt`)."""

from __future__ import annotations

import datetime
import re
from dataclasses import dataclass
from typing import ClassVar, Optional

from psworker.events.base import NUMBER, TASK, Event, line_pattern, named, task_of, to_float, to_int

__all__ = ["CheckpointSaved", "DataDealt", "Exported", "ModelStart", "FirstStep", "FoundComplete", "PsDone",
           "Precision", "AucResult", "Step", "StopSaved", "TfImported", "WorkerDone"]


@dataclass(frozen=True)
class Step(Event):
    """A worker's progress line at global step `step` (psworker's workers print one every `log_every_steps`)."""

    step: int
    loss: Optional[float] = None
    examples_per_sec: Optional[float] = None
    sec_per_batch: Optional[float] = None
    epoch: Optional[float] = None          # dealt shards: examples trained / examples per epoch
    num_epochs: Optional[int] = None       # ... of this many (None: until max_steps)

    regex: ClassVar[re.Pattern] = line_pattern(
        rf"(?:(?i:step)[ \t]*[=:#]?[ \t]*(?P<step>\d+)(?:/\d+)?\b"
        rf"(?:[ \t]*[,:;|-]?[ \t]*(?i:loss)[ \t]*[=:]?[ \t]*(?P<loss>{NUMBER})\b)?"
        rf"(?:, epoch (?P<epoch>{NUMBER})(?: of (?P<epochs>\d+))?)?"
        rf"(?:[ \t]*\((?P<rate>{NUMBER}) examples/sec(?:; (?P<spb>{NUMBER}) sec/batch)?)?"
        rf"|(?i:loss) = (?P<est_loss>{NUMBER}), (?i:step) = (?P<est_step>\d+)\b)")   # TF Estimator's

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
            return cls(int(m.group("est_step")), to_float(m.group("est_loss")))
        return cls(int(m.group("step")), to_float(m.group("loss")), to_float(m.group("rate")), to_float(m.group("spb")),
                   to_float(m.group("epoch")), to_int(m.group("epochs")))


@dataclass(frozen=True)
class FirstStep(Event):
    """A worker ran its first step (logged by psworker's workers)."""

    task: Optional[str]
    step: int

    regex: ClassVar[re.Pattern] = line_pattern(rf"{TASK}first step done at global step (?P<step>\d+)\b")

    def render(self) -> str:
        return named(self.task, f"first step done at global step {self.step}")

    @classmethod
    def _from(cls, m: re.Match) -> "FirstStep":
        return cls(task_of(m), int(m.group("step")))


@dataclass(frozen=True)
class WorkerDone(Event):
    """A worker finished training (logged by psworker's workers; the chief evaluates after it)."""

    task: Optional[str]
    step: int
    local_steps: Optional[int] = None
    seconds: Optional[float] = None

    regex: ClassVar[re.Pattern] = line_pattern(
        rf"{TASK}done at global step (?P<step>\d+)\b"
        r"(?: after (?P<local>\d+) local steps in (?P<secs>[\d.]+) s)?")

    def render(self) -> str:
        more = "" if self.local_steps is None else f" after {self.local_steps} local steps in {self.seconds or 0:.1f} s"
        return named(self.task, f"done at global step {self.step}{more}")

    @classmethod
    def _from(cls, m: re.Match) -> "WorkerDone":
        return cls(task_of(m), int(m.group("step")), to_int(m.group("local")), to_float(m.group("secs")))


@dataclass(frozen=True)
class FoundComplete(Event):
    """A worker started after training ended runs no step: the live ps tasks' global step (`checkpoint_dir` None)
    or, the ps tasks gone, the newest checkpoint in `checkpoint_dir` is at `max_steps`."""

    task: Optional[str]
    step: int
    max_steps: int
    checkpoint_dir: Optional[str] = None

    regex: ClassVar[re.Pattern] = line_pattern(
        rf"{TASK}training is already complete: (?:the global step on the ps tasks is (?P<step>\d+)"
        r"|the ps tasks are not up and the newest checkpoint in (?P<dir>.+) is at global step (?P<disk_step>\d+))"
        r" \(--max_steps (?P<max>\d+)\)")

    def render(self) -> str:
        if self.checkpoint_dir is None:
            return named(self.task, f"training is already complete: the global step on the ps tasks is {self.step} "
                                     f"(--max_steps {self.max_steps}); no step to run")
        return named(self.task, f"training is already complete: the ps tasks are not up and the newest checkpoint "
                                 f"in {self.checkpoint_dir} is at global step {self.step} (--max_steps "
                                 f"{self.max_steps}); nothing to do")

    @classmethod
    def _from(cls, m: re.Match) -> "FoundComplete":
        step = m.group("step") or m.group("disk_step")
        return cls(task_of(m), int(step), int(m.group("max")), m.group("dir"))


@dataclass(frozen=True)
class PsDone(Event):
    """A ps is done serving: every worker said it was done, or (`training_complete`) the train_dir shows training
    complete; it exits (with its peak RSS, `peak_rss` bytes), or serves on with `--keep_ps_running`
    (`still_serving`)."""

    task: Optional[str]
    training_complete: bool = False
    still_serving: bool = False
    peak_rss: Optional[int] = None        # bytes (getrusage's ru_maxrss), to 0.1 MiB

    regex: ClassVar[re.Pattern] = line_pattern(
        rf"{TASK}(?P<why>every worker is done|training is complete); (?P<then>exiting|still serving)\b"
        rf"(?: \(peak RSS (?P<rss>{NUMBER}) MiB\))?")

    def render(self) -> str:
        why = "training is complete" if self.training_complete else "every worker is done"
        then = "still serving (--keep_ps_running)" if self.still_serving else "exiting"
        rss = "" if self.peak_rss is None else f" (peak RSS {self.peak_rss / 2 ** 20:.1f} MiB)"
        return named(self.task, f"{why}; {then}{rss}")

    @classmethod
    def _from(cls, m: re.Match) -> "PsDone":
        rss = to_float(m.group("rss"))
        return cls(task_of(m), m.group("why") == "training is complete", m.group("then") == "still serving",
                   None if rss is None else int(rss * 2 ** 20))


@dataclass(frozen=True)
class TfImported(Event):
    """A psworker task imported TensorFlow (its start-up's largest part)."""

    task: Optional[str]
    seconds: float

    regex: ClassVar[re.Pattern] = line_pattern(rf"{TASK}TensorFlow imported in (?P<secs>[\d.]+) s\b")

    def render(self) -> str:
        return named(self.task, f"TensorFlow imported in {self.seconds:.3f} s")

    @classmethod
    def _from(cls, m: re.Match) -> "TfImported":
        return cls(task_of(m), float(m.group("secs")))


@dataclass(frozen=True)
class Precision(Event):
    """The tutorial's evaluation line: `2026-11-30 12:00:00: precision @ 1 = 0.972 (359 examples, global step
    401)` (the chief at the end of training, `psworker eval`; the launcher's report repeats `summary`)."""

    precision: float
    examples: Optional[int] = None
    global_step: Optional[int] = None
    at: Optional[str] = None    # local time, `YYYY-MM-DD HH:MM:SS`

    regex: ClassVar[re.Pattern] = line_pattern(
        rf"(?:psworker: )?(?:(?P<at>\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d): )?precision @ 1 = (?P<p>{NUMBER})"
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
        return cls(float(m.group("p")), to_int(m.group("n")), to_int(m.group("step")), m.group("at"))


@dataclass(frozen=True)
class AucResult(Event):
    """A click-through model's evaluation line, where the others print `Precision`: `2026-11-30 12:00:00: auc =
    0.853, logloss = 0.412 (4000 examples, global step 401)`."""

    auc: float
    logloss: float
    examples: Optional[int] = None
    global_step: Optional[int] = None
    at: Optional[str] = None

    regex: ClassVar[re.Pattern] = line_pattern(
        rf"(?:psworker: )?(?:(?P<at>\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d): )?auc = (?P<auc>{NUMBER}), "
        rf"logloss = (?P<logloss>{NUMBER})(?: \((?P<n>\d+) examples, global step (?P<step>\d+)\))?")

    @property
    def summary(self) -> str:
        """The line without its time."""
        what = "" if self.examples is None else f" ({self.examples} examples, global step {self.global_step})"
        return f"auc = {self.auc:.4f}, logloss = {self.logloss:.4f}{what}"

    def render(self) -> str:
        return self.summary if self.at is None else f"{self.at}: {self.summary}"

    @classmethod
    def _from(cls, m: re.Match) -> "AucResult":
        return cls(float(m.group("auc")), float(m.group("logloss")), to_int(m.group("n")), to_int(m.group("step")),
                   m.group("at"))


@dataclass(frozen=True)
class Exported(Event):
    """A SavedModel written to `path` from `checkpoint` (the chief after its evaluation, `psworker export`)."""

    checkpoint: str
    step: int
    path: str
    task: Optional[str] = None

    regex: ClassVar[re.Pattern] = line_pattern(
        rf"{TASK}exported (?P<ckpt>.+?) \(global step (?P<step>\d+)\) to (?P<path>.+?)[ \t]*$")

    def render(self) -> str:
        return named(self.task, f"exported {self.checkpoint} (global step {self.step}) to {self.path}")

    @classmethod
    def _from(cls, m: re.Match) -> "Exported":
        return cls(m.group("ckpt"), int(m.group("step")), m.group("path"), task_of(m))


@dataclass(frozen=True)
class StopSaved(Event):
    """The chief stopped on a signal (`task.stop`) and wrote the checkpoint of global step `step` into `train_dir`
    first: the launcher's last line after a stop names it."""

    task: Optional[str]
    signal: str
    step: int
    train_dir: str

    regex: ClassVar[re.Pattern] = line_pattern(
        rf"{TASK}stopping on (?P<sig>SIG[A-Z]+): checkpoint of global step (?P<step>\d+) saved in (?P<dir>.+?)[ \t]*$")

    def render(self) -> str:
        return named(self.task, f"stopping on {self.signal}: checkpoint of global step {self.step} saved in "
                                f"{self.train_dir}")

    @classmethod
    def _from(cls, m: re.Match) -> "StopSaved":
        return cls(task_of(m), m.group("sig"), int(m.group("step")), m.group("dir"))


@dataclass(frozen=True)
class DataDealt(Event):
    """The chief's account of the dealt shards at its end: examples trained, how many of them were trained again
    (read after a fault by a second worker or a second time), the epochs that makes, and (sync mode) the batches
    whose gradients were dropped as stale and computed again (their examples are not counted as trained)."""

    task: Optional[str]
    trained: int
    again: int
    epochs: float
    num_epochs: Optional[int]
    examples_per_epoch: int
    dropped: int = 0

    regex: ClassVar[re.Pattern] = line_pattern(
        rf"{TASK}data: (?P<trained>\d+) examples trained, (?P<again>\d+) of them again; epoch (?P<epochs>{NUMBER})"
        r"(?: of (?P<of>\d+))? \((?P<per>\d+) examples each\)"
        r"(?:; (?P<dropped>\d+) batches dropped \(stale\) and computed again)?")

    def render(self) -> str:
        of = "" if self.num_epochs is None else f" of {self.num_epochs}"
        dropped = f"; {self.dropped} batches dropped (stale) and computed again" if self.dropped else ""
        return named(self.task, f"data: {self.trained} examples trained, {self.again} of them again; epoch "
                                 f"{self.epochs:.2f}{of} ({self.examples_per_epoch} examples each){dropped}")

    @classmethod
    def _from(cls, m: re.Match) -> "DataDealt":
        return cls(task_of(m), int(m.group("trained")), int(m.group("again")), float(m.group("epochs")),
                   to_int(m.group("of")), int(m.group("per")), int(m.group("dropped") or 0))


@dataclass(frozen=True)
class CheckpointSaved(Event):
    """The chief's word that the checkpoint of global step `step` is complete on disk."""

    task: Optional[str]
    step: int

    regex: ClassVar[re.Pattern] = line_pattern(rf"{TASK}checkpoint of global step (?P<step>\d+) saved\b")

    def render(self) -> str:
        return named(self.task, f"checkpoint of global step {self.step} saved")

    @classmethod
    def _from(cls, m: re.Match) -> "CheckpointSaved":
        return cls(task_of(m), int(m.group("step")))


@dataclass(frozen=True)
class ModelStart(Event):
    """Where the chief's model starts in a new session: the checkpoint it restores (`checkpoint`, its basename,
    `<prefix>-<global step>`), or none (None: initialised, step 0)."""

    task: Optional[str]
    checkpoint: Optional[str]

    regex: ClassVar[re.Pattern] = line_pattern(
        rf"{TASK}(?:restoring the checkpoint (?P<ckpt>\S*?-\d+)[ \t]*$"
        r"|(?P<none>no checkpoint to restore; initialising the model))")

    @property
    def step(self) -> int:
        """The global step the model starts at."""
        return 0 if self.checkpoint is None else int(self.checkpoint.rpartition("-")[2])

    def render(self) -> str:
        if self.checkpoint is None:
            return named(self.task, "no checkpoint to restore; initialising the model")
        return named(self.task, f"restoring the checkpoint {self.checkpoint}")

    @classmethod
    def _from(cls, m: re.Match) -> "ModelStart":
        return cls(task_of(m), None if m.group("none") else m.group("ckpt"))
