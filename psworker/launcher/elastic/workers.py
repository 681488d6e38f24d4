"""The supervisor's hand on an elastic worker job: which workers start at launch, scale requests (from
`psworker scale` through the run dir, `psworker.launcher.elastic.scale_inbox`, or `Supervisor.scale`), starting joiners
and asking leavers to go (SIGUSR2), and what a worker's exit means for membership (left, preempted, done). The
decisions are `psworker.launcher.elastic.membership`'s; this applies them and says so on the console."""

from __future__ import annotations

import logging
import signal
import subprocess
from typing import Any, Callable, Mapping, Optional, Protocol

from psworker.errors import EXIT_PREEMPTED
from psworker.launcher.elastic import membership as ms
from psworker.launcher.elastic.membership import MEMBER_LEFT, STILL_MEMBER, MemberExit
from psworker.launcher.backends.base import ProcessBackend
from psworker.launcher.console.progress import Progress
from psworker.states import TaskState
from psworker.launcher.elastic.scale_inbox import ScaleInbox, ScaleRequest
from psworker.spec import Elastic

__all__ = ["ElasticWorkers", "LEAVE_SIGNAL", "PREEMPT_SIGNAL"]

logger = logging.getLogger(__name__)

LEAVE_SIGNAL = signal.SIGUSR2      # scaled away: finish the step, tell every ps, exit 0
PREEMPT_SIGNAL = signal.SIGTERM    # preempted: the same, exit EXIT_PREEMPTED (171)
# A worker preempted before it set its handler (still importing TensorFlow) dies of the signal itself: it left too.
PREEMPTED_CODES = (EXIT_PREEMPTED, -PREEMPT_SIGNAL, 128 + PREEMPT_SIGNAL)


class Slot(Protocol):
    """What this reads and sets of the supervisor's `launcher.supervise.slot.Slot` (that room is above this one)."""

    task: Any
    popen: Optional[subprocess.Popen]
    returncode: Optional[int]
    restart_at: Optional[float]

    @property
    def name(self) -> str: ...

    @property
    def running(self) -> bool: ...


def _name(index: int) -> str:
    return f"worker:{index}"


class ElasticWorkers:
    """Membership of the worker job of one supervised run (see `psworker.launcher.elastic.membership`)."""

    def __init__(self, elastic: Elastic, slots: Mapping[str, Slot], backend: ProcessBackend, progress: Progress,
                 spawn: Callable[[Slot], None], inbox: Optional[ScaleInbox] = None) -> None:
        """Args:
            elastic: the worker job's range.
            slots: the supervisor's slots by task name (`worker:0` .. `worker:<max-1>` among them).
            backend: signals the leavers.
            progress: shows each worker's membership state and the running/target counts.
            spawn: starts a worker's slot (a new attempt in its log).
            inbox: where `psworker scale` requests come from and the state file goes; None: `scale()` only.
        """
        self.members = ms.initial(elastic)
        self._slots, self._backend, self._progress, self._spawn = slots, backend, progress, spawn
        self._inbox = inbox
        self._joining: set[int] = set()
        self._finished: Optional[str] = None

    def starts_at_launch(self, slot: Slot) -> bool:
        """Whether the slot starts with the run (every task but the reserved workers)."""
        return slot.task.job != "worker" or self.members.states[slot.task.index] == TaskState.JOINED

    def counts_for_success(self, slot: Slot) -> bool:
        """Whether the slot's exit counts under the success policy: every task but workers that never joined,
        left, or are leaving."""
        return slot.task.job != "worker" or self.members.states[slot.task.index] in (TaskState.JOINED, TaskState.DONE)

    def launched(self) -> None:
        """Marks the reserved workers in the progress view and publishes the state."""
        for i in self.members.indices(TaskState.RESERVED):
            self._progress.set_state(_name(i), TaskState.RESERVED)
        self._show()

    def scale(self, workers: int, source: str, training_over: bool = False) -> str:
        """Sets the target to `workers` (started or asked to leave at once); returns the console line.

        Raises:
            ValueError: outside min..max, or training is over (the message says which).
        """
        if training_over:
            raise ValueError("training is over: the run is finishing")
        before = self.members.target
        self.members = ms.request(self.members, workers)
        line = f"scale {before} -> {workers} workers ({source})"
        logger.info("%s", line)
        self._reconcile()
        return line

    def poll(self, training_over: bool) -> None:
        """Takes new scale requests, starts and asks workers to leave as the target says, logs who has joined
        (its first step line), and publishes the state."""
        if self._inbox is not None:
            for request in self._inbox.requests():
                self._answer(request, training_over)
        if not training_over:
            self._reconcile()
        seen = self._progress.snapshot()
        for i in sorted(self._joining):
            step = seen[_name(i)].step
            if step is not None:
                self._joining.discard(i)
                logger.info("worker:%d joined at global step %d", i, step)
        self._show()

    def exited(self, slot: Slot, restarting: bool, training_over: bool) -> MemberExit:
        """What a worker's exit means for membership, before the run policy judges it: `STILL_MEMBER` (judged as
        usual; its exit 0 makes it done), `MEMBER_LEFT` (not judged), or left with the reason the run fails
        (preempted, and fewer than `min` workers run)."""
        i, code = slot.task.index, slot.returncode
        self._joining.discard(i)
        state = self.members.states[i]
        if state == TaskState.LEAVING:
            self._set(i, TaskState.LEFT, TaskState.LEFT)
            how = "scaled away" if code == 0 else f"asked to leave, then exit code {code}"
            (logger.info if code == 0 else logger.warning)("%s left (%s)", slot.name, how)
            return MEMBER_LEFT
        if code in PREEMPTED_CODES and i != ms.CHIEF and not training_over:
            if not restarting:
                return self._preempted(slot)
            logger.warning("%s left (preempted, exit %d); it comes back at the same address (--max_restarts)",
                           slot.name, code)
        if code == 0:
            self.members = self.members.with_state(i, TaskState.DONE)
        return STILL_MEMBER

    def finish(self, how: str) -> None:
        """Publishes that the run has ended (`psworker scale` then refuses)."""
        self._finished = how
        self._show()

    # -- internals ---------------------------------------------------------------------------------------

    def _preempted(self, slot: Slot) -> MemberExit:
        m = self.members
        self._set(slot.task.index, TaskState.LEFT, TaskState.PREEMPTED)
        self.members = self.members.with_target(self.members.running)
        e = m.elastic
        logger.warning("%s left (preempted, exit %d, not restarted): %d -> %d workers (min %d)", slot.name,
                       slot.returncode, m.target, self.members.running, e.min)
        if self.members.running >= e.min:
            return MEMBER_LEFT
        return MemberExit(left=True, failure=f"was preempted (exit {slot.returncode}) and not restarted: "
                                             f"{self.members.running} workers run, below the elastic job's min of "
                                             f"{e.min}")

    def _answer(self, request: ScaleRequest, training_over: bool) -> None:
        try:
            line = self.scale(request.workers, f"request {request.seq}", training_over)
        except ValueError as e:
            logger.warning("scale request %d refused: %s", request.seq, e)
            self._inbox.answer(request, False, str(e))
            return
        self._inbox.answer(request, True, line)

    def _reconcile(self) -> None:
        start, leave = ms.reconcile(self.members)
        for i in leave:
            slot = self._slots[_name(i)]
            self._set(i, TaskState.LEAVING, TaskState.LEAVING)
            if slot.restart_at is not None:        # waiting to be restarted: it leaves now
                slot.restart_at = None
                self._set(i, TaskState.LEFT, TaskState.LEFT)
                logger.info("%s left (scaled away while waiting to restart)", slot.name)
            elif slot.running:
                logger.info("asking %s to leave (SIG%s)", slot.name, LEAVE_SIGNAL.name.removeprefix("SIG"))
                self._backend.signal(slot.popen, LEAVE_SIGNAL)
        for i in start:
            self._set(i, TaskState.JOINED, TaskState.STARTING)
            logger.info("starting %s (joining)", _name(i))
            self._joining.add(i)
            self._spawn(self._slots[_name(i)])

    def _set(self, index: int, state: str, shown: TaskState) -> None:
        self.members = self.members.with_state(index, state)
        self._progress.set_state(_name(index), shown)

    def _show(self) -> None:
        self._progress.set_workers(self.members.running, self.members.target)
        if self._inbox is not None:
            self._inbox.publish(self.members.summary(), self._finished)
