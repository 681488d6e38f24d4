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
    "criteo": "psworker.models.criteo:CriteoModel",
}
_FACTORIES: dict[str, Callable[[], Model]] = {}
_imported: set[str] = set()


def plugin_modules() -> tuple[str, ...]:
    """The modules `PSWORKER_MODELS` names (comma-separated, blanks ignored)."""
    return tuple(filter(None, (m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(","))))


def _import_failure(module: str, exc: BaseException) -> str:
    """One line on why `module` failed to import; a module not found at all gets the PYTHONPATH hint."""
    missing = isinstance(exc, ModuleNotFoundError) and exc.name is not None and \
        (module == exc.name or module.startswith(exc.name + "."))
    hint = " (is its directory on PYTHONPATH? every task process imports it too)" if missing else ""
    return f"{PLUGINS_ENV}: cannot import the model module {module!r}: {type(exc).__name__}: {exc}{hint}"


def import_plugins() -> None:
    """Imports the modules named in `PSWORKER_MODELS`, each once it has imported cleanly; they register their
    models. `psworker.cli.main` calls it before anything else, so every command fails at once on a broken module.

    Raises:
        UsageError: a module failed to import (any exception it raised, named with its message); it is tried
            again at the next call.
    """
    for module in plugin_modules():
        if module in _imported:
            continue
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - whatever the user's module raises is its failure to import
            raise UsageError(_import_failure(module, exc)) from None
        _imported.add(module)


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
    import_plugins()
    return (*BUILTIN, *sorted(_FACTORIES))


def get(name: str) -> Model:
    """Returns a new instance of the model registered as `name`.

    Raises:
        KeyError: no such model; the message lists the registered names.
    """
    import_plugins()
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


__all__ = ["BUILTIN", "PLUGINS_ENV", "plugin_modules", "import_plugins", "register", "names", "get", "scoped"]
