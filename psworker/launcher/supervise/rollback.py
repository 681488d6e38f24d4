"""The one line a person sees when a ps restart sends the model back: a restarted ps holds no variables, so the chief
restores the newest checkpoint (or, without one, initialises the model) and the steps since are given up. The
launcher notes the global step when it restarts a ps and says what it cost once the chief's new session says
where the model starts (`events.ModelStart`)."""

from __future__ import annotations

import logging
import threading
from typing import Optional

from psworker import events
from psworker.launcher.console.lines import format_tasks

__all__ = ["Rollbacks", "rollback_line"]

logger = logging.getLogger(__name__)


def rollback_line(ps: list[str], before: int, start: events.ModelStart) -> str:
    """`ps:1 restarted: the model goes back from step 5,060 to the checkpoint of step 4,016 (1,044 steps given
    up)`."""
    to = (f"the checkpoint of step {start.step:,}" if start.checkpoint is not None
          else "step 0 (no checkpoint had been saved)")
    before = max(before, start.step)    # the launcher's last step line can lag a checkpoint saved after it
    lost = before - start.step
    return (f"{format_tasks(ps)} restarted: the model goes back from step {before:,} to {to} "
            f"({lost:,} step{'' if lost == 1 else 's'} given up)")


class Rollbacks:
    """Thread-safe: `ps_restarted` from the supervisor, `seen` from every task's output reader."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[str, int] = {}      # a restarted ps -> the global step when it was restarted

    def ps_restarted(self, ps: str, global_step: int) -> None:
        with self._lock:
            self._pending[ps] = max(global_step, self._pending.get(ps, 0))

    def seen(self, task: str, event: Optional[events.Event]) -> Optional[str]:
        """On the chief's word where its new model starts after a ps restart: logs the rollback line and returns
        it; None for any other event."""
        if not isinstance(event, events.ModelStart):
            return None
        with self._lock:
            pending, self._pending = self._pending, {}
        if not pending:
            return None         # a run that goes on from its train dir, or a chief restarted alone
        line = rollback_line(sorted(pending), max(pending.values()), event)
        logger.warning("%s", line)
        return line
