"""More steps in flight on one async worker (`--concurrent_steps N`): N - 1 threads run the train op beside the step
loop, each step on its own batch and its own update, as N - 1 more workers would, without their processes.

A step of a ps cluster spends most of its time waiting: for the ps's values, then for the ps to take the gradients.
One worker at a time leaves its cores and its ps idle in those waits; a second step in flight fills them (criteo,
1 ps + 1 worker on 2 cores: docs/performance.md, "Two steps in flight, packed transfers"). Each extra step is
asynchronous like any other worker's: it computes on values up to N - 1 updates staler than a lone step would.

The step loop stays the one that owns the session: its hooks (progress, stop, the chief's savers), its recovery
from a failed ps, its deadlines and its stop. The helpers only run `train_op`, on the raw session the loop last
stepped on (`stepped`), never before the loop's first step on it, and never raise: a helper whose step fails
waits until the loop has stepped again (on the same or a re-created session) and goes on; the loop meets any
lasting failure itself and handles it as it always does. A helper that fetched the global step at `max_steps` ends
for good (the loop ends at its next check).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Optional

log = logging.getLogger(__name__)

FAILED_JOIN_SECS = 5.0   # how long the helpers are waited for when the step loop ended in an error


class ExtraSteps:
    """`count` helper threads running `train_op` with `options` (a step's deadline) beside the step loop, until the
    `global_step` fetched with a step shows `last_step` reached; `steps` counts their steps (with `claimed`, a bool
    tensor of `step_claim`, only those that claimed a global step). A context manager: on exit the helpers finish
    the step they are in and end (joined, each for at most `join_secs`)."""

    def __init__(self, count: int, train_op: Any, options: Any, name: str, join_secs: float, global_step: Any,
                 last_step: int, claimed: Any = None):
        self._count = count
        self._train_op = train_op
        self._claimed = [] if claimed is None else [claimed]   # `step_claim`: a step counts only if it claimed one
        self._global_step = global_step   # fetched with each step: a helper ends once it reaches `last_step`
        self._last_step = last_step
        self._options = options
        self._name = name
        self._join_secs = join_secs
        self._cond = threading.Condition()
        self._session: Optional[Any] = None
        self._loop_steps = 0         # the step loop's steps (`stepped`)
        self._stop = False
        self.steps = 0               # the helpers' steps done, all together
        self.failures = 0
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> "ExtraSteps":
        for i in range(self._count):
            thread = threading.Thread(target=self._loop, name=f"psworker-extra-step-{i + 1}", daemon=True)
            thread.start()
            self._threads.append(thread)
        if self._count:
            log.info("%s: %d steps in flight (%d helper thread%s beside the step loop)", self._name,
                     self._count + 1, self._count, "" if self._count == 1 else "s")
        return self

    def __exit__(self, exc_type, *exc) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        # After a failure the process is about to leave: a helper stuck in a step on the failed peer is not waited for.
        secs = self._join_secs if exc_type is None else min(self._join_secs, FAILED_JOIN_SECS)
        deadline = time.monotonic() + secs
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck:
            log.warning("%s: %s still in a step %.0f s after the loop ended; leaving %s behind", self._name,
                        ", ".join(stuck), secs, "it" if len(stuck) == 1 else "them")

    def stepped(self, session: Any) -> None:
        """From the step loop, after each step it completed: the raw session it stepped on."""
        if not self._count:
            return
        with self._cond:
            self._session = session
            self._loop_steps += 1
            self._cond.notify_all()

    def _next(self, after: int) -> Optional[tuple[Any, int]]:
        """(session, loop steps) once the loop has stepped past `after`; None once stopping."""
        with self._cond:
            self._cond.wait_for(lambda: self._stop or self._loop_steps > after)
            return None if self._stop else (self._session, self._loop_steps)

    def _loop(self) -> None:
        import tensorflow as tf

        got, failed = self._next(0), False
        while got is not None:
            session, seen = got
            try:
                _, step, *claimed = session.run([self._train_op, self._global_step, *self._claimed],
                                                options=self._options)
            except (tf.errors.OpError, RuntimeError) as e:   # RuntimeError: a session the loop closed
                with self._cond:
                    self.failures += 1
                log.info("%s: a helper's step failed (%s); it waits for the step loop's next step",
                         self._name, type(e).__name__)
                got, failed = self._next(seen), True
                continue
            with self._cond:
                self.steps += all(claimed)
            if failed:
                log.info("%s: a helper's steps go on after a failed one", self._name)
            if step + 1 >= self._last_step:
                return   # the step loop ends at the next check: no step past the last
            got, failed = self._next(0), False


__all__ = ["ExtraSteps"]
