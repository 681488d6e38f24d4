"""The model registry: workloads looked up by name (`--model`, `train.model` in a spec).

The built-in models are listed by import path, so that listing names never imports TensorFlow or a model module,
and a model module never imports the registry back. Your own models: a module that calls `register()` when
imported, named in the environment variable `PSWORKER_MODELS` (comma-separated modules), which every task process
(and spec validation) imports first.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from typing import Callable, Iterator

from psworker.errors import UsageError
from psworker.models.base import Model

PLUGINS_ENV = "PSWORKER_MODELS"

BUILTIN = {
    "mlp": "psworker.models.mlp:MlpModel",
    "cifar10": "psworker.models.cifar10:Cifar10Model",
    "linear": "psworker.models.linear:LinearModel",
}
_FACTORIES: dict[str, Callable[[], Model]] = {}
_imported: set[str] = set()


def _import_plugins() -> None:
    """Imports the modules named in `PSWORKER_MODELS` (once each); they register their models."""
    for module in filter(None, (m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(","))):
        if module in _imported:
            continue
        _imported.add(module)
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise UsageError(f"{PLUGINS_ENV}: cannot import the model module {module!r}: {exc}") from None


def register(name: str, factory: Callable[[], Model]) -> None:
    """Registers a model factory under `name` (e.g. a `Model` subclass); specs accept `name` from then on.

    Raises:
        ValueError: `name` is already registered (built-in names included).
    """
    if name in _FACTORIES or name in BUILTIN:
        raise ValueError(f"model {name!r} is already registered")
    _FACTORIES[name] = factory


def names() -> tuple[str, ...]:
    """Every registered model name: the built-in ones, then the others sorted (imports no built-in model)."""
    _import_plugins()
    return (*BUILTIN, *sorted(_FACTORIES))


def get(name: str) -> Model:
    """Returns a new instance of the model registered as `name`.

    Raises:
        KeyError: no such model; the message lists the registered names.
    """
    _import_plugins()
    if name in BUILTIN:
        module, _, attr = BUILTIN[name].partition(":")
        return getattr(importlib.import_module(module), attr)()
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; registered models: {', '.join(names())}") from None
    return factory()


@contextlib.contextmanager
def scoped() -> Iterator[None]:
    """For tests: every model registered inside the block (by `register`, or by a `PSWORKER_MODELS` module, which
    is also unloaded) is forgotten after it, so no later test depends on it."""
    factories, imported = dict(_FACTORIES), set(_imported)
    try:
        yield
    finally:
        _FACTORIES.clear()
        _FACTORIES.update(factories)
        for module in _imported - imported:
            sys.modules.pop(module, None)
        _imported.intersection_update(imported)


__all__ = ["BUILTIN", "PLUGINS_ENV", "register", "names", "get", "scoped"]
