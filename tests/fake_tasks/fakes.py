"""Test helpers: tasks that run the programs in this folder (`fake`), and reading and stopping a supervisor of them
(process checks and `drive_until` are `psworker.testing`'s, the bounded waits `psworker.deadline`'s)."""

from __future__ import annotations

import sys
from pathlib import Path

import psutil

from psworker.deadline import wait_for
from psworker.testing import ProgramTask, assert_processes_gone, drive_until, gone

__all__ = ["HERE", "fake", "gone", "kill_quietly", "drive_until", "stop_supervisors", "task_state", "wait_for",
           "wait_gone"]

HERE = Path(__file__).resolve().parent


def fake(job: str, index: int, program: str, *args: object, env: dict[str, str] | None = None) -> ProgramTask:
    """A task running `tests/fake_tasks/<program>.py` with `args`."""
    argv = (sys.executable, str(HERE / f"{program}.py"), *(str(a) for a in args))
    return ProgramTask(job, index, argv, tuple((env or {}).items()))


def task_state(sup, name: str) -> str:
    """The supervisor's state of task `name` as shown (starting, training, done, restarting N, ...)."""
    return sup.progress.snapshot()[name].label


def wait_gone(pids: list[int], timeout: float) -> None:
    assert_processes_gone(pids, timeout)


def stop_supervisors(sups) -> None:
    """Fixture teardown: stops each supervisor whose run has not ended, then kills whatever of it is left."""
    for sup in sups:
        if sup.result is None:
            pids = list(sup.pids().values())
            sup.stop("test teardown")
            kill_quietly(pids)


def kill_quietly(pids: list[int]) -> None:
    """Test clean-up: SIGKILL whatever is left, so a failing test leaves no processes on a shared machine."""
    for pid in pids:
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
