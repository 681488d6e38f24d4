"""What the supervisor does to running tasks on its own: injected faults (`psworker.launcher.inject`) and
killing stalled workers. Both read the global step from `psworker.launcher.console.progress`; the killed task's exit
then goes through the run and restart policy like any other, with the cause recorded."""

from __future__ import annotations

import logging
import signal
from typing import Iterable, Mapping, Optional

from psworker.launcher.inject import Fault
from psworker.launcher.backends.base import ProcessBackend
from psworker.launcher.console.progress import Progress
from psworker.states import TaskState
from psworker.launcher.supervise.slot import Slot
from psworker.launcher.supervise.stacks import StackAsker

__all__ = ["STALL_JOBS", "fire_faults", "kill_after_stacks", "kill_stalled", "resume_stopped"]

logger = logging.getLogger(__name__)

STALL_JOBS = frozenset({"worker", "chief"})   # the jobs that print step lines


def resume_stopped(slots: Iterable[Slot], backend: ProcessBackend, progress: Progress, now: float) -> None:
    """SIGCONT to every task whose injected SIGSTOP has lasted its time."""
    for slot in slots:
        if slot.resume_at is not None and now >= slot.resume_at and slot.running:
            slot.resume_at = None
            logger.warning("injected fault over: SIGCONT to %s", slot.name)
            backend.signal(slot.popen, signal.SIGCONT)
            progress.resumed(slot.name, now)


def fire_faults(slots: Mapping[str, Slot], faults: list[Fault], backend: ProcessBackend, progress: Progress,
                elapsed: float, now: float) -> None:
    """Fires (and removes from `faults`) every fault that is due and whose task is running."""
    step = progress.global_step()
    for fault in list(faults):
        slot = slots[fault.task]
        if not slot.running or not fault.due(elapsed, step):
            continue
        faults.remove(fault)
        logger.warning("injecting %s at global step %d, %.1f s after start", fault.text, step, elapsed)
        if fault.action == "stop":
            slot.resume_at = now + fault.for_secs
            backend.signal(slot.popen, signal.SIGSTOP)
            progress.set_state(slot.name, TaskState.PAUSED)
            continue
        slot.cause = f"injected {fault.text}"
        slot.forced_code = fault.code
        backend.signal(slot.popen, signal.SIGTERM if fault.action == "preempt" else signal.SIGKILL)


def kill_stalled(slots: Iterable[Slot], backend: ProcessBackend, progress: Progress, timeout_secs: float,
                 now: float, stacks: Optional[StackAsker] = None) -> None:
    """SIGKILL to every running worker whose step has not moved for `timeout_secs` (counted from its start
    until its first step line), unless an injected fault stopped it. With `stacks`, it is first asked for its
    stacks, and `kill_after_stacks` kills it once they are in its log (or their wait is over)."""
    seen = progress.snapshot()
    for slot in slots:
        if (not slot.running or slot.task.job not in STALL_JOBS or slot.cause is not None
                or slot.resume_at is not None):
            continue
        p = seen[slot.name]
        if now - p.step_moved_at >= timeout_secs:
            what = "no step line" if p.step is None else f"step {p.step} unchanged"
            slot.cause = f"stalled: {what} for {now - p.step_moved_at:.0f} s"
            logger.warning("%s %s; killing it", slot.name, slot.cause)
            slot.kill_after = None if stacks is None else stacks.ask(slot, backend, slot.cause, bool(slot.tail))
            if slot.kill_after is None:
                backend.signal(slot.popen, signal.SIGKILL)


def kill_after_stacks(slots: Iterable[Slot], backend: ProcessBackend) -> None:
    """SIGKILL to every stalled task asked for its stacks whose dump is in its log, or whose wait is over."""
    for slot in slots:
        if slot.kill_after is None or not slot.running:
            continue
        over = slot.kill_after.over()
        if over is None:
            continue
        if over == "timed out":
            logger.warning("no stack dump from %s in time; killing it", slot.name)
        slot.kill_after = None
        backend.signal(slot.popen, signal.SIGKILL)
