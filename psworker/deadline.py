"""The one poll-with-a-deadline of the house: `poll_until` (None when time runs out) and `wait_for` (an error that
names what was awaited). Every wait in psworker that checks and sleeps goes through here."""

from __future__ import annotations

import time
from typing import Callable, Optional, TypeVar

T = TypeVar("T")

POLL_SECS = 0.05


class WaitTimeout(TimeoutError):
    """`wait_for`'s error: what was awaited did not come within the timeout."""


def poll_until(check: Callable[[], Optional[T]], timeout: float, *, interval: float = POLL_SECS,
               since: Optional[float] = None, clock: Callable[[], float] = time.monotonic,
               sleep: Callable[[float], None] = time.sleep) -> Optional[T]:
    """Calls `check()` until it returns something truthy (returned) or `timeout` seconds pass (None).

    Args:
        check: called at least once, even when the deadline has already passed, and once more at the deadline.
        timeout: seconds from `since` (default: now, by `clock`).
        interval: seconds between two calls (the last sleep is cut short at the deadline).
        since: when the wait began, by `clock`, for a wait whose clock started before this call.
        clock, sleep: time.monotonic and time.sleep; a test passes its own.
    """
    deadline = (clock() if since is None else since) + timeout
    while True:
        value = check()
        if value:
            return value
        now = clock()
        if now >= deadline:
            return None
        sleep(max(0.0, min(interval, deadline - now)))


def wait_for(check: Callable[[], Optional[T]], timeout: float, what: str, *, interval: float = POLL_SECS,
             error: type[Exception] = WaitTimeout) -> T:
    """`poll_until`, raising `error` ("timed out after N s waiting for `what`") when time runs out.

    Returns:
        The first truthy value of `check()`.
    """
    value = poll_until(check, timeout, interval=interval)
    if not value:
        raise error(f"timed out after {timeout:g} s waiting for {what}")
    return value


__all__ = ["poll_until", "wait_for", "WaitTimeout", "POLL_SECS"]
