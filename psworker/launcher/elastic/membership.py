"""Who is in an elastic worker job (`psworker.spec.Elastic`), as plain data: each worker index is reserved
(never started, or back in reserve after it left), joined (started; also while waiting to be restarted),
leaving (asked to leave, not yet exited), left (exited after being asked to, or preempted and not restarted) or
done (exited by itself: training is over for it). Pure functions move it between states; the supervisor applies
what they decide (start these, ask those to leave).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from psworker.spec import Elastic
from psworker.states import TaskState

__all__ = ["MEMBER_LEFT", "STILL_MEMBER", "MemberExit", "Membership", "initial", "reconcile", "request"]

CHIEF = 0                     # worker 0 is never asked to leave
_SHOWN = (TaskState.JOINED, TaskState.LEAVING, TaskState.LEFT, TaskState.RESERVED, TaskState.DONE)


@dataclass(frozen=True)
class MemberExit:
    """What an elastic job's worker exit means for membership, before the run policy: `left` (neither success nor
    failure, not judged), and `failure`, why the run fails (fewer than min workers run), else empty."""

    left: bool = False
    failure: str = ""


STILL_MEMBER = MemberExit()          # still a member (or no elastic job): judged as usual
MEMBER_LEFT = MemberExit(left=True)


@dataclass(frozen=True)
class Membership:
    """The worker job's membership: one state per worker index, and how many should run (`target`)."""

    elastic: Elastic
    target: int
    states: tuple[str, ...]

    def indices(self, *states: str) -> tuple[int, ...]:
        """The worker indices in any of `states`, ascending."""
        return tuple(i for i, s in enumerate(self.states) if s in states)

    @property
    def running(self) -> int:
        return len(self.indices(TaskState.JOINED))

    def with_state(self, index: int, state: str) -> "Membership":
        """This membership with worker `index` in `state`."""
        states = list(self.states)
        states[index] = state
        return dataclasses.replace(self, states=tuple(states))

    def with_target(self, target: int) -> "Membership":
        return dataclasses.replace(self, target=target)

    def summary(self) -> dict:
        """What `psworker status` and the run dir's state file show: `workers` (how many run), `target`, the range,
        and the indices in each state."""
        return {"workers": self.running, "target": self.target, "min": self.elastic.min, "max": self.elastic.max,
                **{str(state): list(self.indices(state)) for state in _SHOWN}}


def initial(elastic: Elastic) -> Membership:
    """At launch: workers 0..start-1 joined, the others reserved."""
    states = tuple(TaskState.JOINED if i < elastic.start else TaskState.RESERVED for i in range(elastic.max))
    return Membership(elastic, elastic.start, states)


def out_of_range(elastic: Elastic, workers: int) -> Optional[str]:
    """Why `workers` is no valid target (names the range), or None."""
    if elastic.min <= workers <= elastic.max:
        return None
    return f"--workers {workers} is outside the job's elastic range {elastic.min}..{elastic.max} (min..max)"


def request(m: Membership, workers: int) -> Membership:
    """The membership with a new target.

    Raises:
        ValueError: `workers` outside min..max (the message names the range).
    """
    why = out_of_range(m.elastic, workers)
    if why:
        raise ValueError(why)
    return m.with_target(workers)


def reconcile(m: Membership) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """What moves the running count towards the target: (indices to start: the lowest reserved or left ones,
    indices to ask to leave: the highest running ones, never worker 0). A worker still leaving cannot start again
    until it has left: then a later call starts it. Once a worker is done, training is over: none starts."""
    if m.running < m.target and not m.indices(TaskState.DONE):
        free = m.indices(TaskState.RESERVED, TaskState.LEFT)
        return free[:m.target - m.running], ()
    if m.running > m.target:
        candidates = [i for i in m.indices(TaskState.JOINED) if i != CHIEF]
        return (), tuple(reversed(candidates))[:m.running - m.target]
    return (), ()
