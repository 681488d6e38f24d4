"""The backends that run a spec's tasks, in one registry: name -> the `Backend` class (imported on use).

A backend is one module or one package here (`local.py`; `slurm/`, `ssh/`: each scheduler's pure pieces beside its
backend): a frozen options dataclass (with `BACKEND`, its name in this registry) and a
`psworker.launcher.backends.base.Backend` subclass that supplies only what differs between backends. Adding one is
that folder and one line in `_BACKENDS` (or `register`, for a backend that lives elsewhere; `scoped` for tests).
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, Iterator

__all__ = ["create", "get", "names", "register", "scoped"]

_BACKENDS: dict[str, str] = {
    "local": "psworker.launcher.backends.local:LocalBackend",
    "slurm": "psworker.launcher.backends.slurm.backend:SlurmBackend",
    "ssh": "psworker.launcher.backends.ssh.backend:SshBackend",
}


def register(name: str, target: str) -> None:
    """Registers the backend class `target` (`"package.module:Class"`, imported on use) as `name`.

    Raises:
        ValueError: `name` is taken, or `target` is not `module:Class`.
    """
    if name in _BACKENDS:
        raise ValueError(f"backend {name!r} is already registered ({_BACKENDS[name]})")
    if target.count(":") != 1:
        raise ValueError(f"a backend is registered as 'package.module:Class', got {target!r}")
    _BACKENDS[name] = target


@contextlib.contextmanager
def scoped() -> Iterator[None]:
    """For tests: every backend registered inside the block is forgotten after it."""
    before = dict(_BACKENDS)
    try:
        yield
    finally:
        _BACKENDS.clear()
        _BACKENDS.update(before)


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
