"""The model registry: workloads looked up by name (`--model`, `train.model` in a spec).

The built-in models are listed by import path, so that listing names never imports TensorFlow or a model module,
and a model module never imports the registry back.
"""

from __future__ import annotations

import importlib
from typing import Callable

from psworker.models.base import Model

BUILTIN = {
    "mlp": "psworker.models.mlp:MlpModel",
    "cifar10": "psworker.models.cifar10:Cifar10Model",
    "linear": "psworker.models.linear:LinearModel",
}
_FACTORIES: dict[str, Callable[[], Model]] = {}


def register(name: str, factory: Callable[[], Model]) -> None:
    """Registers a model factory under `name` (e.g. a `Model` subclass); specs accept `name` from then on.

    Raises:
        ValueError: `name` is already registered (built-in names included).
    """
    if name in _FACTORIES or name in BUILTIN:
        raise ValueError(f"model {name!r} is already registered")
    _FACTORIES[name] = factory


def names() -> tuple[str, ...]:
    """Every registered model name: the built-in ones, then the others sorted (imports no model)."""
    return (*BUILTIN, *sorted(_FACTORIES))


def get(name: str) -> Model:
    """Returns a new instance of the model registered as `name`.

    Raises:
        KeyError: no such model; the message lists the registered names.
    """
    if name in BUILTIN:
        module, _, attr = BUILTIN[name].partition(":")
        return getattr(importlib.import_module(module), attr)()
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; registered models: {', '.join(names())}") from None
    return factory()


__all__ = ["BUILTIN", "register", "names", "get"]
