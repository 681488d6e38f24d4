"""A stopping sync chief whose running step waits for a gradient that will not come: the other workers stopped
after their own steps, which the chief's step needed one more of. After `stop.PEERS_STOP_SECS` it closes the sync
token queue (as its session's close would), its step ends with OutOfRange, nothing of it applied, and the session's
close writes the checkpoint of the last applied step: the stop loses at most that one step, and never hangs until
`--step_timeout_secs`."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any, Callable, Optional

from psworker.task import stop

log = logging.getLogger(__name__)


class TokenRelease:
    """While inside (a context manager), a daemon thread that runs `close_op` on `session_of()` once this task is
    stopping, `after_secs` have passed since the signal, and `running_for()` (the step's seconds; None between
    steps) says a step is still running."""

    def __init__(self, name: str, close_op: Any, session_of: Callable[[], Any],
                 running_for: Callable[[], Optional[float]], *, after_secs: float = stop.PEERS_STOP_SECS,
                 every_secs: float = 0.5):
        self._name, self._close_op, self._session_of = name, close_op, session_of
        self._running_for, self._after, self._every = running_for, after_secs, every_secs
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="psworker-sync-stop", daemon=True)

    def __enter__(self) -> "TokenRelease":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(5.0)

    def _watch(self) -> None:
        while not self._done.wait(self._every):
            stopper = stop.current()
            if not stopper.stopping or time.monotonic() - stopper.at < self._after:
                continue
            if self._running_for() is None:
                continue
            log.warning("%s: stopping: the running sync step still waits for gradients %g s after %s (the other "
                        "workers stopped after their own steps): closing the sync token queue, so the checkpoint "
                        "holds the last applied step", self._name, self._after, stopper.signal_name)
            try:
                self._session_of().run(self._close_op)
            except Exception as e:  # noqa: BLE001 - the step then ends at --step_timeout_secs, as before
                log.warning("%s: closing the sync token queue failed: %s", self._name, e)
            return


def token_release(name: str, is_chief: bool, sync_optimizer: Any, session_of: Callable[[], Any],
                  running_for: Callable[[], Optional[float]]):
    """A `TokenRelease` for a sync chief; a no-op context elsewhere. Builds its op: call before the graph is
    finalized."""
    if not is_chief or sync_optimizer is None:
        return contextlib.nullcontext()
    queue = sync_optimizer._sync_token_queue                  # pylint: disable=protected-access
    return TokenRelease(name, queue.close(cancel_pending_enqueues=True), session_of, running_for)


__all__ = ["TokenRelease", "token_release"]
