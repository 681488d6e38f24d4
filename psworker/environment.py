"""The `PSWORKER_*` environment variables a person sets, each with its check, in one table.

`psworker.cli.main` checks them all before it reads a flag, so a bad value is one line and exit 2 from the
launcher before any task starts (and from every other command), not an error in each task after its TensorFlow
import. The variables psworker sets itself (a `psworker run` task's `PSWORKER_JOB_NAME`, `PSWORKER_TASK_INDEX`,
`PSWORKER_PS_HOSTS`, `PSWORKER_WORKER_HOSTS`; the launcher's own marks) are not listed.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from psworker.errors import UsageError

SPINNING_ENV = "PSWORKER_TF_THREAD_SPINNING"
SPINNING_CHOICES = ("on", "ps-off", "off")   # the first is the default
THREADS_ENV = "PSWORKER_TF_THREADS"
THREADS_CHOICES = ("auto", "tf")              # or a positive number; the first is the default
# Three waits of a task, in seconds, for tests and experiments that need them shorter than their defaults:
PEERS_STOP_ENV = "PSWORKER_PEERS_STOP_SECS"   # a stopping chief's wait for the other workers (`task.stop`)
SLOW_STEP_ENV = "PSWORKER_SLOW_STEP_SECS"     # a step's time before the first slow-step warning (`task.runner`)
GIVE_UP_ENV = "PSWORKER_GIVE_UP_GRACE_SECS"   # a step past its deadline before the watchdog ends it (`task.runner`)


def _spinning(value: str) -> Optional[str]:
    return None if value.strip().lower() in SPINNING_CHOICES else f"expected one of {', '.join(SPINNING_CHOICES)}"


def spinning_setting(env: Optional[Mapping[str, str]] = None) -> str:
    """`PSWORKER_TF_THREAD_SPINNING` in `env` (default `os.environ`), lower-cased; `on` when unset.

    Raises:
        UsageError: it holds something else than `on`, `ps-off` or `off`.
    """
    value = (os.environ if env is None else env).get(SPINNING_ENV, SPINNING_CHOICES[0]).strip().lower()
    problem = _spinning(value)
    if problem is not None:
        raise UsageError(f"{SPINNING_ENV}={value!r}: {problem}")
    return value


def _threads(value: str) -> Optional[str]:
    value = value.strip().lower()
    if value in THREADS_CHOICES or (value.isdigit() and int(value) >= 1):
        return None
    return f"expected {', '.join(THREADS_CHOICES)} or a number of threads (>= 1)"


def threads_setting(env: Optional[Mapping[str, str]] = None) -> str:
    """`PSWORKER_TF_THREADS` in `env` (default `os.environ`), lower-cased; `auto` when unset.

    Raises:
        UsageError: it holds something else than `auto`, `tf` or a positive number.
    """
    value = (os.environ if env is None else env).get(THREADS_ENV, THREADS_CHOICES[0]).strip().lower()
    problem = _threads(value)
    if problem is not None:
        raise UsageError(f"{THREADS_ENV}={value!r}: {problem}")
    return value


def _seconds(value: str) -> Optional[str]:
    try:
        ok = float(value) > 0
    except ValueError:
        ok = False
    return None if ok else "expected a number of seconds > 0"


def seconds(name: str, default: float, env: Optional[Mapping[str, str]] = None) -> float:
    """The seconds in the variable `name` of `env` (default `os.environ`), `default` when unset or empty.

    Raises:
        UsageError: it holds something else than a number > 0.
    """
    value = (os.environ if env is None else env).get(name, "").strip()
    if not value:
        return default
    problem = _seconds(value)
    if problem is not None:
        raise UsageError(f"{name}={value!r}: {problem}")
    return float(value)


def _spec_file(value: str) -> Optional[str]:
    if not value:   # empty: unset (`interop.resolve_cluster` skips it)
        return None
    return None if os.path.isfile(value) else "no such file"


def _program(value: str) -> Optional[str]:
    return None if shutil.which(value) else "no such program (the launch/ scripts run it as the interpreter)"


@dataclass(frozen=True)
class Variable:
    """One variable: its name, what it is for, and its check (the problem with a value, or None)."""

    name: str
    meaning: str
    check: Callable[[str], Optional[str]]


VARIABLES = (
    Variable("PSWORKER_MODELS", "modules that register models of your own, comma-separated (imported by "
             "`models.registry.import_plugins`, which reports a failure itself)", lambda value: None),
    Variable(SPINNING_ENV, f"TensorFlow's thread spinning: {', '.join(SPINNING_CHOICES)}", _spinning),
    Variable(THREADS_ENV, "threads in each of a task's TensorFlow pools: auto (the host's CPUs shared among the "
             "spec's tasks on it), tf (TensorFlow's own: one per CPU) or a number", _threads),
    Variable("PSWORKER_SPEC", "a `ps` or `worker` task's spec file, when no flag names the cluster", _spec_file),
    Variable("PSWORKER_PYTHON", "the interpreter of the launch/ start scripts", _program),
    Variable(PEERS_STOP_ENV, "seconds a stopping chief waits for the other workers to stop (10)",
             lambda value: None if not value.strip() else _seconds(value.strip())),
    Variable(SLOW_STEP_ENV, "seconds a step runs before the first slow-step warning (10; at most half of "
             "--step_timeout_secs)", lambda value: None if not value.strip() else _seconds(value.strip())),
    Variable(GIVE_UP_ENV, "seconds a step may run past --step_timeout_secs before the watchdog ends the process, "
             "when TensorFlow's own deadline did not end it (5)",
             lambda value: None if not value.strip() else _seconds(value.strip())),
)


def check(env: Optional[Mapping[str, str]] = None) -> None:
    """Checks every set `PSWORKER_*` variable of `env` (default `os.environ`).

    Raises:
        UsageError: the first bad value, in one line: `NAME='VALUE': the problem`.
    """
    env = os.environ if env is None else env
    for variable in VARIABLES:
        value = env.get(variable.name)
        problem = None if value is None else variable.check(value)
        if problem is not None:
            raise UsageError(f"{variable.name}={value!r}: {problem}")


__all__ = ["GIVE_UP_ENV", "PEERS_STOP_ENV", "SLOW_STEP_ENV", "SPINNING_ENV", "SPINNING_CHOICES", "THREADS_ENV",
           "THREADS_CHOICES", "Variable", "VARIABLES", "check", "seconds", "spinning_setting", "threads_setting"]
