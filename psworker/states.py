"""The house's one vocabulary of states: every state name is defined here, once. The launcher's live view,
`psworker status`, an elastic job's membership and the task side's done tokens all speak `TaskState`."""

from __future__ import annotations

import enum

__all__ = ["RunState", "TaskState"]


class TaskState(enum.StrEnum):
    """What the launcher (live) or `psworker status` (from the logs) knows of a task: the one list of states. Their
    text is what the live view, `psworker status` and its JSON show."""

    NOT_STARTED = "not started"     # `psworker status`: no log yet
    RESERVED = "reserved"           # an elastic job's worker that has not joined
    STARTING = "starting"           # started, no output yet
    RUNNING = "running"             # output, no step line yet (a ps serves)
    JOINED = "joined"               # an elastic job's worker that is a member: started (membership), its token sent
    TRAINING = "training"           # step lines
    PAUSED = "stopped (injected)"   # SIGSTOPped by an injected fault
    RESTARTING = "restarting"       # waiting for its restart's backoff (shown `restarting N`)
    LEAVING = "leaving"             # an elastic job's worker asked to leave
    LEFT = "left"                   # ... that has left
    PREEMPTED = "left (preempted)"  # ... preempted and not restarted
    DONE = "done"                   # exited 0 (its log: training over)
    EXITED = "exited"               # exited non-zero, which did not fail the run
    FAILED = "failed"
    STOPPED = "stopped"             # stopped by the launcher at the end of the run
    GONE = "gone"                   # `psworker status`: no process left, and no word of how it ended (its launcher
                                    # is gone, or the run ended without a record of it)

    @property
    def active(self) -> bool:
        """A process that should be printing: started and not yet seen to end or pause."""
        return self in (TaskState.STARTING, TaskState.RUNNING, TaskState.TRAINING)

    @property
    def live(self) -> bool:
        """A process is there or about to be (its silence may mean it hangs): not ended, not reserved."""
        return self in (TaskState.STARTING, TaskState.RUNNING, TaskState.TRAINING, TaskState.PAUSED,
                        TaskState.RESTARTING, TaskState.LEAVING)


class RunState(enum.StrEnum):
    """What a launcher's run is: starting, running, then how it ended (`ended.json`, `psworker status`, the
    `psworker_run_state` metric)."""

    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"             # by a signal (Ctrl-C, a scheduler's stop)
