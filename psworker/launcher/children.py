"""Child processes that die with the launcher: the preexec_fn every started process (task, TensorBoard) gets."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Callable, Optional

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> Optional[Callable[[], None]]:
    """On Linux, a preexec_fn that makes the child die by SIGKILL when the launcher dies (even by SIGKILL).

    PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, so start tasks from the thread that
    lives as long as the run (the supervisor starts them from whichever thread calls start/poll/start_task).
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl   # looked up before fork: the child only calls it
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:      # the launcher died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec
