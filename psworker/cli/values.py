"""The value checks of psworker's flags: each an argparse `type` whose bad value is a usage error (exit 2,
`argument --flag: MESSAGE`)."""

from __future__ import annotations

import argparse
from typing import Callable, TypeVar

from psworker.errors import PsworkerError, SpecError

T = TypeVar("T")
MAX_PORT = 65535


def value_type(check: Callable[[str], T], name: str) -> Callable[[str], T]:
    """An argparse `type` from a check that raises ValueError or PsworkerError: a bad value is a usage error
    (exit 2, `argument --flag: MESSAGE`)."""
    def parse(text: str) -> T:
        try:
            return check(text)
        except SpecError as e:
            raise argparse.ArgumentTypeError(e.message) from None
        except (ValueError, PsworkerError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parse.__name__ = name
    return parse


def _whole_number(text: str, what: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"expected {what}, got {text!r}") from None


def _port(text: str, free_ok: bool) -> int:
    port = _whole_number(text, "a port number")
    if not (0 if free_ok else 1) <= port <= MAX_PORT:
        raise ValueError(f"port {port} is out of range {'0' if free_ok else '1'}-{MAX_PORT}"
                         + (" (0: a free one)" if free_ok else ""))
    return port


def port_type(free_ok: bool = False) -> Callable[[str], int]:
    """The one argparse type of every port flag: 1-65535, and 0 (a free port) where `free_ok`."""
    return value_type(lambda text: _port(text, free_ok), "port")


def int_type(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `minimum`."""
    def check(text: str) -> int:
        value = _whole_number(text, "an integer")
        if value < minimum:
            raise ValueError(f"must be >= {minimum}, got {value}")
        return value
    return value_type(check, "int")


def _number(text: str, zero_ok: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (0 <= value if zero_ok else 0 < value) or not value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number {'>=' if zero_ok else '>'} 0, got {text}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    return _number(text, zero_ok=False)


def non_negative_float(text: str) -> float:
    """An argparse type: a finite number >= 0."""
    return _number(text, zero_ok=True)


__all__ = ["MAX_PORT", "int_type", "non_negative_float", "port_type", "positive_float", "value_type"]
