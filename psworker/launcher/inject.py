"""Fault injection for local runs: `--inject ACTION:JOB:INDEX@TRIGGER[,OPTION...]`, deterministic and logged.

    kill:worker:1@step=300          SIGKILL to the task's process group once the global step reaches 300
    kill:ps:0@time=20               the same, 20 s after the launcher started the tasks
    stop:worker:1@step=200,for=10   SIGSTOP, then SIGCONT 10 s later (a straggler)
    exit:worker:0@step=100,code=143 end the task (SIGKILL) and judge it as if it had exited with code 143
    preempt:worker:2@step=300       SIGTERM, as a cloud, Slurm or Kubernetes preemption sends it (in an elastic
                                    job the worker finishes its step, leaves and exits 171, EXIT_PREEMPTED)

The global step is the largest one seen in the workers' step lines (`psworker.launcher.console.progress`). Each
fault fires once; one whose task is not running when due (e.g. waiting to restart) fires when it runs again.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Sequence

from psworker.errors import UsageError

__all__ = ["Fault", "check_fault_tasks", "parse_fault"]

ACTIONS = ("kill", "stop", "exit", "preempt")
_FORM = "ACTION:JOB:INDEX@step=N|time=SECS[,for=SECS][,code=N]"


@dataclass(frozen=True)
class Fault:
    """One injected fault. `at_step` or `at_secs` is set; `for_secs` for stop, `code` for exit."""

    text: str
    action: str
    job: str
    index: int
    at_step: Optional[int] = None
    at_secs: Optional[float] = None
    for_secs: Optional[float] = None
    code: Optional[int] = None

    @property
    def task(self) -> str:
        return f"{self.job}:{self.index}"

    def due(self, elapsed_secs: float, global_step: int) -> bool:
        """Whether the trigger has been reached."""
        if self.at_step is not None:
            return global_step >= self.at_step
        return elapsed_secs >= self.at_secs


def _bad(text: str, message: str) -> UsageError:
    return UsageError(f"--inject {text!r}: {message} (form: {_FORM})")


def _number(text: str, key: str, value: str, kind: type) -> float:
    try:
        number = kind(value)
    except ValueError:
        raise _bad(text, f"{key}={value!r} is not {'an integer' if kind is int else 'a number'}") from None
    if number < 0 or number != number or number == float("inf"):
        raise _bad(text, f"{key}={value!r} must be a finite number >= 0")
    return number


def parse_fault(text: str) -> Fault:
    """Parses one `--inject` value.

    Raises:
        UsageError: malformed; the message names the bad part.
    """
    head, at, tail = text.partition("@")
    if not at:
        raise _bad(text, "missing '@' and a trigger")
    parts = head.split(":")
    if len(parts) != 3:
        raise _bad(text, f"{head!r} must be ACTION:JOB:INDEX")
    action, job, index = parts
    if action not in ACTIONS:
        raise _bad(text, f"action {action!r} is not one of {', '.join(ACTIONS)}")
    if not re.fullmatch(r"[a-z][a-z0-9_]*", job):
        raise _bad(text, f"job {job!r} is not a job name")
    if not index.isdigit():
        raise _bad(text, f"task index {index!r} is not an integer >= 0")
    options: dict[str, str] = {}
    for item in tail.split(","):
        key, eq, value = item.partition("=")
        if not eq or not value:
            raise _bad(text, f"{item!r} must be KEY=VALUE")
        if key not in ("step", "time", "for", "code"):
            raise _bad(text, f"unknown option {key!r}")
        if key in options:
            raise _bad(text, f"{key} given twice")
        options[key] = value
    if ("step" in options) == ("time" in options):
        raise _bad(text, "give exactly one trigger, step=N or time=SECS")
    if action == "stop" and "for" not in options:
        raise _bad(text, "stop needs for=SECS (how long the task stays stopped)")
    if action != "stop" and "for" in options:
        raise _bad(text, "for=SECS applies to stop only")
    if action == "exit" and "code" not in options:
        raise _bad(text, "exit needs code=N")
    if action != "exit" and "code" in options:
        raise _bad(text, "code=N applies to exit only")
    code = None
    if "code" in options:
        code = int(_number(text, "code", options["code"], int))
        if not 1 <= code <= 255:
            raise _bad(text, f"code={code} must be in 1-255")
    return Fault(
        text=text, action=action, job=job, index=int(index),
        at_step=int(_number(text, "step", options["step"], int)) if "step" in options else None,
        at_secs=_number(text, "time", options["time"], float) if "time" in options else None,
        for_secs=_number(text, "for", options["for"], float) if "for" in options else None,
        code=code)


def check_fault_tasks(faults: Sequence[Fault], task_names: Sequence[str]) -> None:
    """Checks that every fault names a task of the run.

    Raises:
        UsageError: a fault names no task (the run's tasks are listed).
    """
    for f in faults:
        if f.task not in task_names:
            raise _bad(f.text, f"no task {f.task} in this run (tasks: {', '.join(task_names)})")
