"""Launch backends, kept in one registry: name -> the function that runs a ClusterSpec (imported on use)."""

from __future__ import annotations

import importlib
from typing import Any, Callable

__all__ = ["get", "names"]

# name -> "module:function": takes a ClusterSpec (plus keyword options), returns an exit status.
_BACKENDS: dict[str, str] = {
    "local": "psworker.backends.local:run_local",
}


def names() -> tuple[str, ...]:
    """The registered backend names, sorted (use for argparse `choices=`)."""
    return tuple(sorted(_BACKENDS))


def get(name: str) -> Callable[..., Any]:
    """The run function of backend `name`.

    Raises:
        KeyError: no such backend; the message lists the registered ones.
    """
    try:
        module, func = _BACKENDS[name].split(":")
    except KeyError:
        raise KeyError(f"no backend {name!r}; backends are {', '.join(names())}") from None
    return getattr(importlib.import_module(module), func)
