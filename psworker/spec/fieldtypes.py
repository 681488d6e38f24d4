"""Parsers for TrainConfig fields whose values are not a plain int, float or string (booleans, `num_devices`).

Each takes the value as written (YAML value or flag string) and returns it checked, or raises a `SpecError` that
names the field. Nothing here imports TensorFlow.
"""

from __future__ import annotations

from typing import Any, Union

from psworker.errors import SpecError

AUTO = "auto"
_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


def parse_bool(value: Any, path: str, source: str) -> bool:
    """`true`/`false` (YAML booleans, or as flag strings: true|false, yes|no, on|off, 1|0)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise SpecError(source, path, f"expected true or false, got {value!r}")


def parse_num_devices(value: Any, path: str, source: str) -> Union[int, str]:
    """A positive number of towers, or `auto` (every visible GPU; one CPU tower when there is none)."""
    if isinstance(value, str):
        text = value.strip()
        if text.lower() == AUTO:
            return AUTO
        if text.isdigit():
            value = int(text)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(source, path, f"expected a number of towers or 'auto', got {_show(value)}")
    if value < 1:
        raise SpecError(source, path, f"must be >= 1, got {value} (or 'auto': every visible GPU)")
    return value


def parse_auto_bool(value: Any, path: str, source: str) -> Union[bool, str]:
    """`true`/`false`, or `auto` (`fast_path` decides)."""
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    try:
        return parse_bool(value, path, source)
    except SpecError:
        raise SpecError(source, path, f"expected true, false or auto, got {value!r}") from None


def parse_auto_count(value: Any, path: str, source: str) -> Union[int, str]:
    """A count >= 1, or `auto` (`fast_path` decides)."""
    if isinstance(value, str):
        text = value.strip()
        if text.lower() == AUTO:
            return AUTO
        if text.lstrip("-").isdigit():
            value = int(text)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(source, path, f"expected an integer or 'auto', got {_show(value)}")
    if value < 1:
        raise SpecError(source, path, f"must be >= 1, got {value} (or 'auto')")
    return value


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return f"bool {str(value).lower()}"
    return "null" if value is None else f"{type(value).__name__} {value!r}"


PARSERS = {"num_devices": parse_num_devices, "concurrent_steps": parse_auto_count, "pack_transfers": parse_auto_bool}
TYPE_PARSERS = {bool: parse_bool}

__all__ = ["AUTO", "parse_bool", "parse_num_devices", "parse_auto_bool", "parse_auto_count", "PARSERS", "TYPE_PARSERS"]
