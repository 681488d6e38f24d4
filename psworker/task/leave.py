"""How an elastic job's worker leaves it: on SIGUSR2 (scaled away by `psworker scale`) or SIGTERM (preempted, as a
cloud, Slurm or Kubernetes does it) it finishes its current step, tells every ps it has left, and exits: 0 when
scaled away, `EXIT_PREEMPTED` when preempted. Before it has joined (told the ps tasks so) it leaves at once."""

from __future__ import annotations

import contextlib
import logging
import signal
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from psworker.errors import EXIT_OK, EXIT_PREEMPTED, LeftJob
from psworker.states import TaskState
from psworker.task.done_queue import SEND_DONE_AFTER_FAILURE_SECS, signal_done

log = logging.getLogger(__name__)

SCALE_AWAY_SIGNAL = signal.SIGUSR2
PREEMPT_SIGNAL = signal.SIGTERM


@dataclass(frozen=True)
class Reason:
    """Why a worker leaves: the signal it got, in words, and its exit code."""

    signum: int
    why: str
    exit_code: int


REASONS = {SCALE_AWAY_SIGNAL: Reason(SCALE_AWAY_SIGNAL, "scaled away", EXIT_OK),
           PREEMPT_SIGNAL: Reason(PREEMPT_SIGNAL, "preempted", EXIT_PREEMPTED)}


class LeaveOnSignal:
    """Installs the leave signals' handlers (`install`, main thread only) and remembers the first one received.

    Until `joined()` the handler raises `LeftJob` at once (nothing to tell the ps tasks); after it, the step loop
    asks `reason` after each step and leaves through `left()`.
    """

    def __init__(self, name: str):
        self.name = name
        self.reason: Optional[Reason] = None
        self._joined = False
        self._joining = False

    def install(self) -> None:
        for signum in REASONS:
            signal.signal(signum, self._handler)

    def _handler(self, signum: int, frame: object) -> None:
        if self.reason is None:
            self.reason = REASONS[signum]
            log.info("%s: got %s: %s; leaving the job %s", self.name, signal.Signals(signum).name, self.reason.why,
                     "after this step" if self._joined else "now (it has not joined yet)")
        if not self._joined and not self._joining:
            raise self.left()

    @contextlib.contextmanager
    def joining(self) -> Iterator[Callable[[], None]]:
        """Inside, a leave signal is only remembered (a join is never half told: the step loop leaves before its
        first step); call the yielded function once every ps has been told."""
        self._joining = True
        try:
            yield self._mark_joined
        finally:
            self._joining = False

    def _mark_joined(self) -> None:
        self._joined = True

    @property
    def has_joined(self) -> bool:
        return self._joined

    def left(self) -> LeftJob:
        """The error a leaving worker exits with (its exit code by the reason)."""
        reason = self.reason or REASONS[SCALE_AWAY_SIGNAL]
        return LeftJob(f"{self.name}: left the job ({reason.why}, {signal.Signals(reason.signum).name})",
                       exit_code=reason.exit_code)




class Member:
    """An elastic job's non-chief worker, one member of the job (the launcher's view of them all is
    `psworker.launcher.elastic.membership.Membership`): tells every ps it has joined once its session is ready (`join`),
    leaves on the leave signals (`signals`), and tells every ps it has left (`tell_left`)."""

    def __init__(self, spec, index: int):
        self.spec, self.index = spec, index
        self.signals = LeaveOnSignal(f"worker:{index}")

    def join(self, target: str) -> None:
        with self.signals.joining() as joined:
            signal_done(target, self.spec, self.index, kind=TaskState.JOINED)
            joined()
        log.info("worker:%d: joined the job (told every ps)", self.index)

    def tell_left(self, target: str) -> None:
        """Tells every ps this worker has left, if it had joined."""
        if self.signals.has_joined:
            signal_done(target, self.spec, self.index, kind=TaskState.LEFT, timeout_secs=SEND_DONE_AFTER_FAILURE_SECS)


__all__ = ["LeaveOnSignal", "Member", "Reason", "REASONS", "SCALE_AWAY_SIGNAL", "PREEMPT_SIGNAL"]
