"""The supervisor's hands on its tasks' processes, through a `ProcessBackend`: start an attempt (its log opened with
a marker line, the backend's start, a reader thread copying its output), see which attempts have exited, restart
one, and stop and reap them all. What to do is the run policy's (`psworker.launcher.supervise.run_policy`)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Callable, Mapping, Optional

from psworker import events
from psworker.deadline import poll_until
from psworker.launcher.backends.base import ProcessBackend
from psworker.launcher.console.output import OutputCopier
from psworker.launcher.console.progress import Progress
from psworker.states import TaskState
from psworker.launcher.console.report import describe_returncode
from psworker.launcher.supervise.run_policy import SERVER_JOBS
from psworker.launcher.supervise.slot import Slot
from psworker.launcher.supervise.stacks import StackAsker
from psworker.spec.plan import chief_name

__all__ = ["Attempts"]

logger = logging.getLogger(__name__)

READER_JOIN_SECS = 5.0
EXIT_READER_WAIT_SECS = 0.5     # for a task's reader to reach the end of its output once the task has exited
STOP_POLL_SECS = 0.1            # how often a stop that saves looks whether the workers have exited


class Attempts:
    """Starts, collects, restarts and stops the attempts of the tasks in `slots` (the supervisor's, by name)."""

    def __init__(self, slots: Mapping[str, Slot], backend: ProcessBackend, output: OutputCopier,
                 progress: Progress) -> None:
        self._slots, self._backend, self._output, self._progress = slots, backend, output, progress

    def spawn(self, slot: Slot, marker: Optional[events.Restart] = None) -> None:
        """Starts a new attempt of the slot's task (`marker`: the restart line its log gets first)."""
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"           # lines reach the log as printed; task.env may override
        env.update(dict(slot.task.env))
        env.update(slot.error_file_env())       # where a failing attempt writes its record (`errorfile`)
        log = slot.open_log(marker)
        try:
            popen = self._backend.start(slot.task, env)
        except BaseException:
            log.close()
            raise
        slot.new_attempt(popen)
        self._progress.started(slot.name, slot.restarts, slot.started_at)
        slot.reader = threading.Thread(target=self._output.pump, args=(slot.name, popen.stdout, log, slot.tail,
                                                                         slot.task, popen.pid),
                                       name=f"psworker-log-{slot.name}", daemon=True)
        slot.reader.start()
        logger.debug("started %s (pid %d): %s", slot.name, popen.pid, " ".join(slot.task.argv))

    def collect(self, now: float) -> None:
        """Records the exit of every task that has exited (an injected `exit` fault sets the code judged)."""
        for slot in self._slots.values():
            if slot.running:
                returncode = slot.popen.poll()
                if returncode is not None:
                    if slot.forced_code is not None:
                        returncode = slot.forced_code
                    slot.returncode, slot.ended_at = returncode, now
                    slot.cause = slot.cause or self._backend.exit_cause(slot.popen, returncode)   # e.g. the OOM killer
                    if slot.reader is not None:     # its last lines before the word that it exited
                        slot.reader.join(EXIT_READER_WAIT_SECS)
                    text = f"{slot.name} (pid {slot.popen.pid}) exited: {slot.cause or describe_returncode(returncode)}"
                    if not self._output.exited(slot.name, text):
                        logger.info("%s", text)

    def restart(self, slot: Slot, cause: str) -> None:
        """Ends what is left of the slot's last attempt and starts the next, its log marked with `cause`."""
        self._backend.signal(slot.popen, signal.SIGKILL)    # stragglers of the old attempt
        if slot.reader is not None:
            slot.reader.join(READER_JOIN_SECS)
        slot.restarts += 1
        slot.causes.append(cause)
        slot.exits.append((slot.returncode, slot.cause))
        logger.warning("restarting %s (restart %d: %s)", slot.name, slot.restarts, cause)
        self.spawn(slot, marker=events.Restart.now(slot.restarts, cause))

    def stop_workers_first(self, reason: str, bound_secs: float, idle_bound_secs: float,
                           hard: Callable[[], bool]) -> None:
        """A stop that saves: SIGTERM to every running task but the ps (the chief first), which then end after their
        running step (the chief after writing a checkpoint) while the ps tasks serve on; returns once they have
        exited (the others get `idle_bound_secs` more once the chief has), after `bound_secs` (`idle_bound_secs`
        while the chief has printed no step line: a chief still starting, or waiting for a ps that does not answer,
        has nothing to save), or once `hard()` (a second Ctrl-C). `stop_all` ends the rest."""
        running = sorted((s for s in self._slots.values() if s.running and s.task.job not in SERVER_JOBS),
                         key=lambda s: s.name not in ("chief:0", "worker:0"))
        if not running:
            return
        chief = chief_name(self._slots)
        training = chief is not None and self._progress.snapshot()[chief].state == TaskState.TRAINING
        bound = bound_secs if training else min(bound_secs, idle_bound_secs)
        logger.warning("stopping (%s): SIGTERM to %s first: each ends after its running step, the chief then "
                       "writes a checkpoint; the ps tasks serve until it has exited (at most %.0f s; a second "
                       "Ctrl-C stops at once)", reason, ", ".join(s.name for s in running), bound)
        for slot in running:
            slot.stopped = True
            self._progress.set_state(slot.name, TaskState.STOPPED)
        procs = [s.popen for s in running]
        self._backend.terminate(procs)
        deadline = time.monotonic() + bound
        self._wait_alive([s.popen for s in running if chief is None or s.name == chief], deadline, hard)
        self._wait_alive(procs, min(deadline, time.monotonic() + idle_bound_secs), hard)   # the others, after it
        now = time.time()
        for slot in running:
            code = slot.popen.poll()
            if code is not None:
                slot.returncode, slot.ended_at = code, now

    def _wait_alive(self, procs: list, deadline: float, hard: Callable[[], bool]) -> None:
        poll_until(lambda: hard() or not self._backend.alive(procs), deadline - time.monotonic(),
                   interval=STOP_POLL_SECS)

    def stop_all(self, reason: str, grace_secs: float, stacks: Optional[StackAsker]) -> None:
        """Stops every running attempt (their stacks asked for first, with `stacks`; then the backend's SIGTERM,
        `grace_secs`, SIGKILL), reaps all, and waits for the log readers to copy the last lines."""
        slots = list(self._slots.values())
        procs = [s.popen for s in slots if s.popen is not None]
        running = [s for s in slots if s.running]
        if running and stacks is not None:
            stacks.ask_all(running, self._backend, f"stopping: {reason}")
        for slot in running:
            slot.stopped = True
            self._progress.set_state(slot.name, TaskState.STOPPED)
        if running:
            logger.info("stopping %s (%s)", ", ".join(s.name for s in running), reason)
        self._backend.stop(procs, grace_secs)
        for slot in running:
            code = slot.popen.poll()
            slot.returncode = code if code is not None else -int(signal.SIGKILL)
            slot.ended_at = time.time()
        for slot in slots:
            if slot.reader is not None:
                slot.reader.join(READER_JOIN_SECS)
                if slot.reader.is_alive():
                    logger.error("the log reader of %s did not finish", slot.name)
        self._output.close()
