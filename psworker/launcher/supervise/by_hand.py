"""The supervisor's controls by hand (tests, `psworker scale` through `Supervisor.scale`): scale an elastic job,
read its membership, kill a task, wait for it, start it again. A base class of
`launcher.supervise.supervisor.Supervisor`, whose
state it uses."""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
import time
from typing import Optional

from psworker.launcher.supervise.attempts import Attempts
from psworker.launcher.backends.base import ProcessBackend
from psworker.launcher.console.report import RunResult, describe_returncode
from psworker.launcher.elastic.workers import ElasticWorkers
from psworker.launcher.supervise.run_policy import Ending
from psworker.launcher.supervise.slot import Slot

__all__ = ["ByHand"]

logger = logging.getLogger("psworker.launcher.supervise.supervisor")     # its lines are the supervisor's


class ByHand:
    """`scale`, `members`, `kill_task`, `wait_task`, `start_task` of a `Supervisor`."""

    _lock: threading.RLock
    _elastic: Optional[ElasticWorkers]
    _ending: Ending
    _backend: ProcessBackend
    _attempts: Attempts
    _result: Optional[RunResult]

    def _slot(self, name: str) -> Slot:
        raise NotImplementedError

    def _restart(self, slot: Slot, cause: str) -> None:
        raise NotImplementedError

    def scale(self, workers: int) -> str:
        """Sets an elastic job's worker count: the lowest reserved workers start, or the highest running ones (never
        worker 0) are asked to leave. Returns the console line.

        Raises:
            ValueError: the job is not elastic, `workers` is outside min..max, or training is over.
        """
        with self._lock:
            if self._elastic is None:
                raise ValueError("the job is not elastic")
            return self._elastic.scale(workers, "by hand", training_over=self._ending.begun)

    def members(self) -> Optional[dict]:
        """An elastic job's membership (`Membership.summary()`: how many workers run, the target, each state's
        indices); None for a fixed job."""
        with self._lock:
            return None if self._elastic is None else self._elastic.members.summary()

    def kill_task(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Sends `sig` to task `name` and its children. Its exit then goes through the run policy at the next
        poll, unless `start_task` restarts it first."""
        with self._lock:
            slot = self._slot(name)
            if not slot.running:
                raise RuntimeError(f"kill_task: {name} is not running")
            logger.info("sending %s to %s (pid %d)", signal.Signals(sig).name, name, slot.popen.pid)
            self._backend.signal(slot.popen, sig)

    def wait_task(self, name: str, timeout: float) -> int:
        """Waits for task `name` to exit and returns its return code, without applying the run policy.

        Raises:
            TimeoutError: still running after `timeout` seconds.
        """
        slot = self._slot(name)
        if slot.popen is None:
            raise RuntimeError(f"wait_task: {name} was never started")
        try:
            slot.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"{name} still running after {timeout} s") from None
        with self._lock:
            self._attempts.collect(time.time())
            return slot.returncode

    def start_task(self, name: str) -> None:
        """Starts task `name` again after it exited: its log gets a marker line and a new segment, and its
        restart counter goes up. The old exit is not counted as a failure.

        Raises:
            RuntimeError: the run has ended, or the task is still running (kill it and `wait_task` first).
        """
        with self._lock:
            if self._result is not None:
                raise RuntimeError(f"start_task({name}): the run has already ended")
            slot = self._slot(name)
            self._attempts.collect(time.time())
            if slot.running:
                raise RuntimeError(f"start_task({name}): it is still running")
            slot.restart_at = None
            self._restart(slot, f"start_task after {describe_returncode(slot.returncode)}")
