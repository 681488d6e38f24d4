"""The backends that run a spec's tasks, in one registry: name -> the `Backend` class (imported on use).

A backend is one module or one package here (`local.py`; `slurm/`, `ssh/`: each scheduler's pure pieces beside its
backend): a frozen options dataclass (with `BACKEND`, its name in this registry) and a
`psworker.launcher.backends.base.Backend` subclass that supplies only what differs between backends.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["create", "get", "names"]

_BACKENDS: dict[str, str] = {
    "local": "psworker.launcher.backends.local:LocalBackend",
    "slurm": "psworker.launcher.backends.slurm.backend:SlurmBackend",
    "ssh": "psworker.launcher.backends.ssh.backend:SshBackend",
}


def names() -> tuple[str, ...]:
    """The registered backend names, sorted."""
    return tuple(sorted(_BACKENDS))


def get(name: str) -> Any:
    """The backend class `name`.

    Raises:
        KeyError: no such backend; the message lists the registered ones.
    """
    try:
        module, cls = _BACKENDS[name].split(":")
    except KeyError:
        raise KeyError(f"no backend {name!r}; backends are {', '.join(names())}") from None
    return getattr(importlib.import_module(module), cls)


def create(options: Any, python: str) -> Any:
    """The backend that `options` (a backend's options dataclass, with its `BACKEND` name) configures."""
    return get(options.BACKEND)(options, python=python)
