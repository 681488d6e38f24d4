"""How a task stops on SIGINT or SIGTERM (Ctrl-C, the launcher's stop, a scheduler's preemption or time limit): the
first signal is remembered and the task ends at a safe point; a second one ends it at once (`exit_now`).

- A worker ends after its running step (`runner`); the chief then writes a checkpoint of the step reached.
- A ps serves on until the chief has exited (its checkpoint written) or `ps_wait_secs` has passed.

Either then exits with 128 + the signal's number, without telling the other tasks that it is done: a stop is not the
end of training, and the same command goes on from the checkpoint. An elastic job's non-chief worker keeps its own
SIGTERM (`task.leave`: preempted, exit 171).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Optional

from psworker import stackdump
from psworker.errors import PsworkerError
from psworker.task.hard_exit import exit_now

__all__ = ["PEERS_STOP_SECS", "SAVE_SECS", "SIGNALS", "StopOnSignal", "StoppedBySignal", "current", "peers_stop_secs",
           "ps_wait_secs", "stop_when_gone"]

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)
SAVE_SECS = 60.0          # beyond the running step: for the chief to write its checkpoint (and exit)
PEERS_STOP_SECS = 10.0    # an async chief waits at most this long for the other workers to stop before it saves


def peers_stop_secs() -> float:
    """`PEERS_STOP_SECS`, or `PSWORKER_PEERS_STOP_SECS` where set (a test's shorter wait; `psworker.environment`)."""
    from psworker.environment import PEERS_STOP_ENV, seconds

    return seconds(PEERS_STOP_ENV, PEERS_STOP_SECS)


class StoppedBySignal(PsworkerError):
    """A task stopped on SIGINT or SIGTERM (after its step; the chief after its checkpoint). Not a failure: the
    task leaves with 128 + the signal's number."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + int(signum)


class StopOnSignal:
    """The first of `SIGNALS` is remembered (`signum`, `at`), with a log line saying what happens (`what`); a
    second one flushes the logs and ends the process at once. `install` (main thread only) puts the handlers in.

    Where the stack-dump thread runs (`stackdump.on_wakeup`), it counts the signals, so that a second one ends the
    process also while the main thread waits in TensorFlow; else the Python handlers do, between bytecodes.
    """

    def __init__(self, name: str, what: str):
        self.name, self.what = name, what
        self.signum: Optional[int] = None
        self.at: Optional[float] = None
        self._lock = threading.Lock()

    @property
    def stopping(self) -> bool:
        return self.signum is not None

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else "no signal"

    def install(self) -> bool:
        """Installs the handlers; False (nothing installed) outside the main thread."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for signum in SIGNALS:
            if stackdump.on_wakeup(signum, self.received):
                signal.signal(signum, lambda s, f: None)    # the woken thread acts; without a handler the signal kills
            else:
                signal.signal(signum, lambda s, f: self.received(s))
            signal.siginterrupt(signum, False)   # SA_RESTART: TensorFlow's system calls go on (as for stackdump's)
        global _current
        _current = self
        return True

    def received(self, signum: int) -> None:
        """One signal: the first is remembered, a second ends the process at once."""
        with self._lock:
            first = self.signum is None
            if first:
                self.signum, self.at = int(signum), time.monotonic()
        name = signal.Signals(signum).name
        if first:
            log.warning("%s: got %s: %s (a second SIGINT or SIGTERM ends it at once)", self.name, name, self.what)
            return
        log.warning("%s: got %s again: exiting at once", self.name, name)
        exit_now(128 + int(signum))

    def stopped(self, message: str) -> StoppedBySignal:
        """The error a stopped task leaves with (`message` says where it stopped)."""
        return StoppedBySignal(f"{self.name}: stopped on {self.signal_name}: {message}", self.signum or 0)


class _NoStop:
    """What `current()` is where no handler was installed (a task run in a test's thread): never stopping."""

    signum = at = None
    stopping = False


_current: object = _NoStop()


def current():
    """The installed `StopOnSignal` of this process, or one that never stops."""
    return _current


def ps_wait_secs(step_timeout_secs: float) -> float:
    """How long a stopping ps serves on for the chief: its running step, the wait for its peers, its checkpoint."""
    return step_timeout_secs + peers_stop_secs() + SAVE_SECS


def stop_when_gone(gone_for: float, who: str, step_timeout_secs: float) -> None:
    """After a SIGINT or SIGTERM, a task that serves a peer (a ps its chief, an in-graph worker its client), which
    has been gone `gone_for` seconds (0: up): `StoppedBySignal` once it is gone (its checkpoint written, or it never
    came) or the stop's wait (`ps_wait_secs`) has run out; nothing before the signal."""
    stopper = current()
    if not stopper.stopping:
        return
    waited = time.monotonic() - stopper.at
    limit = ps_wait_secs(step_timeout_secs)
    if gone_for > 0:
        raise stopper.stopped(f"{who} has exited; exiting after {waited:.1f} s")
    if waited >= limit:
        raise stopper.stopped(f"{who} still up after {limit:g} s; exiting without waiting longer")
