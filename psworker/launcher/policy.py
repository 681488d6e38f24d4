"""Which task exits are retried and after how long: per-task restart limits, exponential backoff with jitter,
and the exit-code classes of `psworker.errors` (1-127 permanent; 128-255 and signals retryable)."""

from __future__ import annotations

import dataclasses

import random
from dataclasses import dataclass, field
from typing import Iterable, Optional

from psworker.spec.plan import chief_name

__all__ = ["ALL_WORKERS", "CHIEF_OR_WORKER0", "RestartPolicy", "SUCCESS_POLICIES", "SuccessPolicy",
           "WORKER_EXIT_GRACE_SECS", "is_retryable"]

# When a run has succeeded, as Kubeflow TFJob's successPolicy: with a `chief` job its exit 0 decides under both.
CHIEF_OR_WORKER0 = "chief-or-worker0"   # TFJob's default: the chief, else worker 0, exits 0
ALL_WORKERS = "all-workers"             # TFJob's AllWorkers: without a chief job, every worker exits 0
SUCCESS_POLICIES = (CHIEF_OR_WORKER0, ALL_WORKERS)
# Once the run has succeeded, how long the other workers get to exit by themselves. A worker that is training stops
# at its next step (psworker's own workers exit before the chief, which evaluates and exports after its last step).
# A classic non-chief still waiting for the chief's model sleeps up to 30 s between polls (TF's SessionManager
# `recovery_wait_secs`): with device filters it then finds training over and exits, in 40 s with 10 s to spare for
# its session on a loaded host; without them its session needs every task, the chief included, and it never will.
WORKER_EXIT_GRACE_SECS = 40.0


@dataclass(frozen=True)
class SuccessPolicy:
    """When a run has succeeded (`rule`, one of `SUCCESS_POLICIES`), and how long the other workers then get to exit
    by themselves before whoever is left is stopped."""

    rule: str = CHIEF_OR_WORKER0
    worker_exit_grace_secs: float = WORKER_EXIT_GRACE_SECS

    def __post_init__(self) -> None:
        if self.rule not in SUCCESS_POLICIES:
            raise ValueError(f"success policy must be one of {', '.join(SUCCESS_POLICIES)}, got {self.rule!r}")
        if not 0 <= self.worker_exit_grace_secs < float("inf"):
            raise ValueError(f"worker_exit_grace_secs must be >= 0, got {self.worker_exit_grace_secs}")

    def deciding_task(self, names: Iterable[str]) -> Optional[str]:
        """The task whose exit 0 alone ends the run: under `CHIEF_OR_WORKER0` `chief:0` when there is one, else
        `worker:0` (None when neither is in `names`); under `ALL_WORKERS` none."""
        return None if self.rule == ALL_WORKERS else chief_name(names)


def is_retryable(returncode: int) -> bool:
    """Whether a task exit may be retried: killed by a signal (negative, or 128-255 as a shell reports it),
    or `EXIT_PEER_GONE` (170, inside that range). 0 and 1-127 (bugs, usage, training failures) are not."""
    return returncode < 0 or returncode >= 128


RESTART_START_SECS = 60.0


@dataclass(frozen=True)
class RestartPolicy:
    """Restart a task whose exit is retryable, at most `max_restarts` times per task.

    The n-th restart (from 0) waits `min(backoff_secs * 2**n, max_backoff_secs)`, times a random factor in
    `[1 - jitter, 1 + jitter]` (`seed` makes it repeatable).
    """

    max_restarts: int = 0
    backoff_secs: float = 1.0
    max_backoff_secs: float = 30.0
    jitter: float = 0.2
    seed: Optional[int] = None
    _rng: random.Random = field(default=None, init=False, repr=False, compare=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.backoff_secs < 0 or self.max_backoff_secs < 0:
            raise ValueError("restart backoff must be >= 0")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"jitter must be in [0, 1], got {self.jitter}")
        object.__setattr__(self, "_rng", random.Random(self.seed))

    def rejoin_secs(self) -> float:
        """At most how long a restarted task takes to be back: the longest backoff with jitter, plus
        `RESTART_START_SECS` for its start (TensorFlow's import and server on a loaded host). 0 without restarts."""
        if not self.max_restarts:
            return 0.0
        longest = min(self.backoff_secs * 2 ** (self.max_restarts - 1), self.max_backoff_secs)
        return longest * (1 + self.jitter) + RESTART_START_SECS

    def __call__(self, name: str, returncode: int, restarts: int) -> bool:
        """Whether to restart task `name` that exited with `returncode` after `restarts` restarts."""
        return restarts < self.max_restarts and is_retryable(returncode)

    def delay(self, restarts: int) -> float:
        """Seconds to wait before restart number `restarts + 1`."""
        base = min(self.backoff_secs * (2 ** restarts), self.max_backoff_secs)
        return base * self._rng.uniform(1 - self.jitter, 1 + self.jitter)



def with_rejoin_grace(tasks: list, policy: RestartPolicy) -> list:
    """With restarts on, each ps task waits `policy.rejoin_secs()` for a worker that went away near the end (being
    restarted) to rejoin, instead of counting it as done and leaving it no ps to come back to."""
    seconds = policy.rejoin_secs()
    if not seconds:
        return tasks
    return [dataclasses.replace(t, argv=(*t.argv, "--rejoin_grace_secs", f"{seconds:g}")) if t.job == "ps" else t
            for t in tasks]
