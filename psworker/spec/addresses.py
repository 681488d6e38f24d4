"""One task's address: `host:port` parsing (DNS names, IPv4, bracketed IPv6, `auto` ports), formatting and
duplicate checks, with `SpecError`s that name the field."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from psworker.errors import SpecError, describe_value

AUTO_PORT = 0
_PORT_RE = re.compile(r"-?[0-9]+", re.ASCII)
_HOST_RE = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?", re.ASCII)
_SHELL_META = set(";&|$`'\"\\<>(){}*?!#~^=,%@")


@dataclass(frozen=True)
class Address:
    """One task's `host:port`. `port == 0` means "pick a free port" (local runs only)."""

    host: str
    port: int

    def __str__(self) -> str:  # IPv6 literals are bracketed: [::1]:2222
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def parse_address(s: Any, field_path: str, source: str) -> Address:
    """Parses one `host:port` entry.

    Accepts DNS names, IPv4, bracketed IPv6 (`[::1]:2222`) and `localhost`; port `0` or `auto` means
    "pick a free port at launch" (`Address.port == 0`).

    Args:
        s: the entry as written (anything; non-strings are reported).
        field_path: where it sits, e.g. `cluster.worker[1]`, for messages.
        source: the file path, `TF_CONFIG` or `--flags`, for messages.

    Returns:
        The parsed Address.

    Raises:
        SpecError: not a string, no port, bad host, non-numeric or out-of-range port.
    """
    if isinstance(s, dict) and len(s) == 1:
        (k, v), = s.items()
        raise SpecError(source, field_path, f"expected a 'host:port' string, got {describe_value(s)}; "
                                            f"write it as '{k}:{v}' (no space after the colon)")
    if not isinstance(s, str):
        raise SpecError(source, field_path, f"expected a 'host:port' string, got {describe_value(s)}")
    text = s.strip()
    if not text:
        raise SpecError(source, field_path, "empty address; expected 'host:port'")
    if text.startswith("["):
        end = text.find("]")
        if end < 0 or not text[end + 1:].startswith(":"):
            raise SpecError(source, field_path, f"{s!r} is not '[ipv6]:port' (e.g. '[::1]:2222')")
        host, port_text = text[1:end], text[end + 2:]
        _check_ipv6(host, s, field_path, source)
    else:
        if ":" not in text:
            raise SpecError(source, field_path, f"{s!r} has no port; expected 'host:port'")
        host, port_text = text.rsplit(":", 1)
        if ":" in host:
            raise SpecError(source, field_path,
                            f"{s!r}: IPv6 addresses must be in brackets, e.g. '[::1]:2222'")
        _check_host(host, s, field_path, source)
    return Address(host, _parse_port(port_text, s, field_path, source))


def _check_host(host: str, entry: str, field_path: str, source: str) -> None:
    if not host:
        raise SpecError(source, field_path, f"{entry!r} has an empty host")
    bad = next((c for c in host if c.isspace() or c in _SHELL_META), None)
    if bad is not None:
        raise SpecError(source, field_path, f"host {host!r} contains {bad!r}; whitespace and shell "
                                            f"metacharacters are not allowed in host names")
    if not _HOST_RE.fullmatch(host) or ".." in host:
        raise SpecError(source, field_path, f"host {host!r} is not a valid host name or IP address")


def _check_ipv6(host: str, entry: str, field_path: str, source: str) -> None:
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        raise SpecError(source, field_path, f"{host!r} in {entry!r} is not a valid IPv6 address") from None


def _parse_port(text: str, entry: str, field_path: str, source: str) -> int:
    if text.lower() == "auto":
        return AUTO_PORT
    if not text:
        raise SpecError(source, field_path, f"{entry!r} has an empty port")
    if not _PORT_RE.fullmatch(text):
        raise SpecError(source, field_path, f"port {text!r} is not a number (use 1-65535, or 'auto')")
    port = int(text)
    if port == AUTO_PORT and text.isdigit():   # "0", not "-0"
        return AUTO_PORT
    if not 1 <= port <= 65535:
        raise SpecError(source, field_path, f"port {port} is out of range 1-65535")
    return port


def format_address(address: Address) -> str:
    """`str(address)`, except that an automatic port shows as `host:auto` (what a spec file says)."""
    return str(address) if address.port != AUTO_PORT else str(address)[:-1] + "auto"


def parse_address_list(items: Any, path: str, source: str) -> tuple[Address, ...]:
    if items is None:
        raise SpecError(source, path, "missing; need a list of at least one 'host:port' address")
    if isinstance(items, str) or not isinstance(items, (list, tuple)):
        raise SpecError(source, path, f"expected a list of 'host:port' strings, got {describe_value(items)}")
    if not items:
        raise SpecError(source, path, "empty; need at least one 'host:port' address")
    return tuple(parse_address(item, f"{path}[{i}]", source) for i, item in enumerate(items))


def check_duplicates(jobs: Iterable[tuple[str, tuple[Address, ...]]], source: str) -> None:
    seen: dict[tuple[str, int], str] = {}
    for path, addresses in jobs:
        for i, a in enumerate(addresses):
            if a.port == AUTO_PORT:
                continue
            key = (a.host.lower(), a.port)
            here = f"{path}[{i}]"
            if key in seen:
                raise SpecError(source, here, f"duplicate address {a} (also at {seen[key]})")
            seen[key] = here


__all__ = ["AUTO_PORT", "Address", "parse_address", "format_address", "parse_address_list", "check_duplicates"]
