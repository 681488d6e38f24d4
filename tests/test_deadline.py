"""The one poll-with-a-deadline (`psworker.deadline`), over a fake clock: pure."""

from __future__ import annotations

import pytest

from psworker.deadline import WaitTimeout, poll_until, wait_for


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, secs: float) -> None:
        self.sleeps.append(secs)
        self.now += secs


def test_poll_until_returns_the_first_truthy_value():
    clock = Clock()
    answers = iter([None, 0, "up"])
    assert poll_until(lambda: next(answers), 10.0, interval=1.0, clock=clock, sleep=clock.sleep) == "up"
    assert clock.sleeps == [1.0, 1.0]


def test_poll_until_gives_none_at_the_deadline_and_cuts_the_last_sleep_short():
    clock = Clock()
    calls = []
    assert poll_until(lambda: calls.append(clock.now), 2.5, interval=1.0, clock=clock, sleep=clock.sleep) is None
    assert clock.sleeps == [1.0, 1.0, 0.5] and calls == [0.0, 1.0, 2.0, 2.5]


def test_poll_until_checks_once_past_the_deadline_and_counts_from_since():
    clock = Clock()
    clock.now = 5.0
    calls = []
    assert poll_until(lambda: calls.append(1), 3.0, since=1.0, clock=clock, sleep=clock.sleep) is None
    assert calls == [1] and clock.sleeps == []


def test_wait_for_names_what_it_waited_for():
    with pytest.raises(WaitTimeout, match=r"timed out after 0.05 s waiting for the ps to answer"):
        wait_for(lambda: False, 0.05, "the ps to answer", interval=0.01)
    with pytest.raises(KeyError, match="waiting for x"):
        wait_for(lambda: None, 0.0, "x", error=KeyError)
    assert wait_for(lambda: 7, 1.0, "seven") == 7
    assert issubclass(WaitTimeout, TimeoutError)
