"""The run policy as pure functions, the way torchelastic's `_invoke_run` decides over `WorkerState`: what the
supervisor saw of its tasks goes in (`TaskView`s, one task's exit, the time), decisions come out (`Settled`,
`Restart`, `Fail`; an `Ending` that drains and then finishes). The `Supervisor` carries them out (start, poll,
signal); nothing here touches a process, a clock or a log.

The rules, as Kubeflow TFJob's: the run succeeds when every task of `done_jobs` has exited 0 (`all-workers`), or the
deciding task (`chief:0`, else `worker:0`) has (`chief-or-worker0`); when the chief and every ps have exited 0,
training is over too. The other `done_jobs` tasks then get the worker grace to exit by themselves (and to be
restarted), the servers the ps grace after them; whoever is left is stopped and the run still succeeds. A task's
exit fails the run unless restarted when a `done_jobs` task exits non-zero, a ps exits before success, or another
task exits non-zero before success.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence, Union

from psworker.launcher.console.report import describe_returncode
from psworker.launcher.elastic.membership import STILL_MEMBER, MemberExit
from psworker.states import TaskState

__all__ = ["Ending", "Fail", "Restart", "RestartRule", "Rules", "SERVER_JOBS", "Settled", "TaskView", "Verdict",
           "drain", "judge", "may_restart", "restartable", "start_ending", "stragglers", "succeeded", "training_over",
           "verdict"]

SERVER_JOBS = frozenset({"ps"})   # serve until stopped; by default every other job must exit 0
OVER_REASON = "the chief and every ps exited 0: training is over"


class RestartRule(Protocol):
    """Which exits are restarted, and after how long (`psworker.launcher.policy.RestartPolicy`)."""

    def __call__(self, name: str, returncode: int, restarts: int) -> bool: ...
    def delay(self, restarts: int) -> float: ...


@dataclass(frozen=True)
class Rules:
    """The run's policy: which jobs must exit 0, the deciding task (None: all of `done_jobs`), the graces, the
    restart rule (None: a failure ends the run)."""

    done_jobs: frozenset[str]
    deciding: Optional[str] = None
    worker_grace: float = 0.0
    ps_grace: float = 0.0
    restart: Optional[RestartRule] = None


@dataclass(frozen=True)
class TaskView:
    """What the policy sees of one task at a poll."""

    name: str
    job: str
    is_chief: bool = False
    started: bool = True                # it has a process (an elastic job's reserved worker has none)
    returncode: Optional[int] = None    # None: running
    restarts: int = 0
    cause: Optional[str] = None         # why this attempt ended, beyond its code (injection, stall, memory cap)
    stopped: bool = False               # stopped by the launcher
    waiting: bool = False               # waiting for its restart's backoff
    counts: bool = True                 # its exit counts for success (not an elastic job's left worker)

    @property
    def running(self) -> bool:
        return self.started and self.returncode is None

    @property
    def described(self) -> str:
        return self.cause or describe_returncode(self.returncode)


@dataclass(frozen=True)
class Settled:
    """The exit does not fail the run; the task's state is now `state` (None: membership set it). `note`: a warning
    worth logging (a server's failure after the run was done)."""

    state: Optional[TaskState]
    note: str = ""


@dataclass(frozen=True)
class Restart:
    """Restart the task after `delay` seconds; `reason` is why its exit would fail the run, `cause` its marker's."""

    delay: float
    cause: str
    reason: str


@dataclass(frozen=True)
class Fail:
    """The exit fails the run, for `reason`."""

    reason: str


Verdict = Union[Settled, Restart, Fail]


@dataclass(frozen=True)
class Ending:
    """Once the run has succeeded (`at`), until when the other `done_jobs` tasks and then the servers may exit by
    themselves, and why it succeeded."""

    at: Optional[float] = None
    workers_until: float = 0.0
    servers_until: Optional[float] = None
    reason: str = ""

    @property
    def begun(self) -> bool:
        return self.at is not None


def succeeded(tasks: Sequence[TaskView], rules: Rules) -> bool:
    """Whether the success rule holds: the deciding task, else every counted `done_jobs` task, has exited 0."""
    if rules.deciding is not None:
        deciding = [t for t in tasks if t.name == rules.deciding]
        if deciding:
            return deciding[0].returncode == 0
    return all(t.returncode == 0 for t in tasks if t.counts and t.job in rules.done_jobs)


def training_over(tasks: Sequence[TaskView]) -> bool:
    """A ps exits by itself only once training is over: every server exited 0 (not stopped) and the chief too."""
    servers = [t for t in tasks if t.job in SERVER_JOBS]
    return (bool(servers) and all(t.returncode == 0 and not t.stopped for t in servers)
            and any(t.is_chief and t.returncode == 0 for t in tasks))


def start_ending(ending: Ending, now: float) -> Ending:
    """Training is over (`training_over`): the run ends now, the other workers get no grace."""
    return ending if ending.begun else Ending(now, now, None, OVER_REASON)


def judge(task: TaskView, rules: Rules, done: bool) -> Optional[str]:
    """Why this exit fails the run (unless restarted), or None if it does not."""
    if task.job in rules.done_jobs:
        if task.returncode == 0:
            return None
        return f"ended ({task.described})" if task.cause else f"exited with {task.described}"
    if done or (task.returncode == 0 and task.job not in SERVER_JOBS):
        return None
    return f"exited ({task.described}) while workers were still running"


def restartable(task: TaskView, rules: Rules) -> bool:
    """Whether the restart rule restarts this exit."""
    return rules.restart is not None and rules.restart(task.name, task.returncode, task.restarts)


def verdict(task: TaskView, rules: Rules, done: bool, over: bool, member: MemberExit = STILL_MEMBER) -> Verdict:
    """What one exit means: settled, restarted after the rule's backoff, or the run's failure.

    Args:
        done: the run has succeeded (this poll or before). over: training is over (`training_over`).
        member: an elastic job's worker's exit through membership first.
    """
    if member.failure:
        return Fail(member.failure)
    if member.left:
        return Settled(None)
    reason = None if over else judge(task, rules, done)
    if reason is None:
        late = not over and done and task.job not in rules.done_jobs and task.returncode != 0
        return Settled(TaskState.DONE if task.returncode == 0 else TaskState.EXITED,
                       f"exited with {task.described} after the run was done" if late else "")
    if restartable(task, rules):
        return Restart(rules.restart.delay(task.restarts), task.described, reason)
    return Fail(reason)


def may_restart(task: TaskView, rules: Rules, ending: Ending, now: float) -> bool:
    """No restarts once the run has succeeded, but of the `done_jobs` tasks within their grace."""
    return not ending.begun or (task.job in rules.done_jobs and now < ending.workers_until)


def success_reason(rules: Rules) -> str:
    return (f"{rules.deciding} exited 0" if rules.deciding
            else f"every {'/'.join(sorted(rules.done_jobs))} task exited 0")


def stragglers(tasks: Sequence[TaskView], rules: Rules) -> tuple[str, ...]:
    """The `done_jobs` tasks still running or waiting for a restart."""
    return tuple(t.name for t in tasks if t.job in rules.done_jobs and (t.running or t.waiting))


def drain(tasks: Sequence[TaskView], rules: Rules, ending: Ending, now: float) -> tuple[Ending, bool]:
    """After success: the other `done_jobs` tasks get the worker grace to exit by themselves, then the servers the ps
    grace. Returns the ending and whether the run finishes now (it has succeeded; whoever is left is stopped)."""
    workers = stragglers(tasks, rules)
    if not ending.begun:
        ending = Ending(now, now + rules.worker_grace, None, success_reason(rules))
    if workers:
        return ending, now >= ending.workers_until
    if ending.servers_until is None:
        ending = dataclasses.replace(ending, servers_until=now + rules.ps_grace)
    return ending, not any(t.running for t in tasks) or now >= ending.servers_until
