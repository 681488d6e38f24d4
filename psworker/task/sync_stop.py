"""A stop in sync mode whose steps wait for tokens that will not come: the workers stop after their own steps, and a
running step may need a gradient from one that has already stopped (the chief's step), or a token from a chief
that has already stopped (another worker's). A stopping sync chief queues one token per replica, at the global
step, once: `stop.peers_stop_secs()` after the signal while its own step still waits, else as its step loop ends.
Each waiting step then ends without applying anything; the chief's checkpoint holds the last applied step, and no
stop waits out `--step_timeout_secs`. The token queue stays open: a chief started again on the same ps tasks
drops the spare tokens in its reset (`train.sync_reset`)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any, Callable, Optional

from psworker.task import stop

log = logging.getLogger(__name__)

RELEASE_RUN_SECS = 10.0   # the enqueue's own deadline (a ps that does not answer)


class TokenRelease:
    """While inside (a context manager), a daemon thread that runs `release_op` on `session_of()` once this task is
    stopping, `after_secs` have passed since the signal, and `running_for()` (the step's seconds; None between
    steps) says a step still runs; on leaving, a stopping task runs it if the thread did not."""

    def __init__(self, name: str, release_op: Any, session_of: Callable[[], Any],
                 running_for: Callable[[], Optional[float]], *, after_secs: Optional[float] = None,
                 every_secs: float = 0.5):
        self._name, self._release_op, self._session_of = name, release_op, session_of
        self._running_for, self._every = running_for, every_secs
        self._after = stop.peers_stop_secs() if after_secs is None else after_secs
        self._done, self._lock, self._released = threading.Event(), threading.Lock(), False
        self._thread = threading.Thread(target=self._watch, name="psworker-sync-stop", daemon=True)

    def __enter__(self) -> "TokenRelease":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(5.0)
        if stop.current().stopping:
            self._release("its step loop has ended: the other workers' waiting steps end too")

    def _watch(self) -> None:
        while not self._done.wait(self._every):
            stopper = stop.current()
            if stopper.stopping and time.monotonic() - stopper.at >= self._after and self._running_for() is not None:
                self._release(f"its step still waits for gradients {self._after:g} s after {stopper.signal_name} "
                              f"(the other workers stopped after their own steps)")
                return

    def _release(self, why: str) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        import tensorflow as tf

        log.warning("%s: stopping: %s; queueing one sync token per worker (nothing more is applied)", self._name, why)
        try:
            options = tf.compat.v1.RunOptions(timeout_in_ms=int(RELEASE_RUN_SECS * 1000))
            self._session_of().run(self._release_op, options=options)
        except Exception as e:  # noqa: BLE001 - a waiting step then ends at --step_timeout_secs, as before
            log.warning("%s: queueing the sync tokens failed: %s", self._name, e)


def token_release(name: str, is_chief: bool, sync_optimizer: Any, session_of: Callable[[], Any],
                  running_for: Callable[[], Optional[float]]):
    """A `TokenRelease` for a sync chief; a no-op context elsewhere. Builds its op: call before the graph is
    finalized."""
    if not is_chief or sync_optimizer is None:
        return contextlib.nullcontext()
    import tensorflow as tf

    opt = sync_optimizer
    global_step = opt._global_step                                   # pylint: disable=protected-access
    with tf.compat.v1.device(global_step.device), tf.name_scope("psworker_sync_stop"):
        tokens = tf.fill([opt._total_num_replicas], global_step)     # pylint: disable=protected-access
        release = opt._sync_token_queue.enqueue_many((tokens,))      # pylint: disable=protected-access
    return TokenRelease(name, release, session_of, running_for)


__all__ = ["RELEASE_RUN_SECS", "TokenRelease", "token_release"]
