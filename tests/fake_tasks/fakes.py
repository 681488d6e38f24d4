"""Test helpers: Task-shaped fakes that run the programs in this folder, and bounded waits on processes."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import psutil

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class FakeTask:
    """Has what the supervisor reads from `psworker.plan.Task`."""

    job: str
    index: int
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    is_chief: bool = False
    address: str = ""             # host:port, for fakes that print their own (chorus.py)

    @property
    def name(self) -> str:
        return f"{self.job}:{self.index}"


def fake(job: str, index: int, program: str, *args: object, env: dict[str, str] | None = None) -> FakeTask:
    """A task running `tests/fake_tasks/<program>.py` with `args`."""
    argv = (sys.executable, str(HERE / f"{program}.py"), *(str(a) for a in args))
    return FakeTask(job, index, argv, tuple((env or {}).items()))


def wait_for(predicate: Callable[[], object], timeout: float, what: str = "condition") -> object:
    """Polls `predicate` until it returns something truthy, which it returns; fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def poll_until(sup, predicate: Callable[[], object], timeout: float, what: str = "condition") -> object:
    """Runs the supervisor's loop (`sup.poll()`) until `predicate` holds; fails if the run ends first or after
    `timeout` seconds. A test drives the loop itself to act between two of its decisions (e.g. let a ps exit only
    once the supervisor has seen the chief's exit)."""
    def check() -> object:
        result = sup.poll()
        if result is not None:
            raise AssertionError(f"the run ended ({result.reason}) before {what}")
        return predicate()

    return wait_for(check, timeout, what)


def task_state(sup, name: str) -> str:
    """The supervisor's state of task `name` (starting, training, done, restarting N, ...)."""
    return sup.progress.snapshot()[name].state


def gone(pid: int) -> bool:
    """True when `pid` no longer runs (a zombie counts as gone: it runs no code and holds no port)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pids: list[int], timeout: float) -> None:
    wait_for(lambda: all(gone(p) for p in pids), timeout, f"pids {pids} to be gone")


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
