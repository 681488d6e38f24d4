"""Model registry: workloads are looked up by name (`--model`)."""

from __future__ import annotations

from typing import Callable

from psworker.models.base import InputSpec, Model

_FACTORIES: dict[str, Callable[[], Model]] = {}


def register(name: str, factory: Callable[[], Model]) -> None:
    """Registers a model factory under `name`."""
    if name in _FACTORIES:
        raise ValueError(f"model {name!r} is already registered")
    _FACTORIES[name] = factory


def names() -> tuple[str, ...]:
    _load_builtin()
    return tuple(sorted(_FACTORIES))


def get(name: str) -> Model:
    """Returns a new instance of the model registered as `name`.

    Raises:
        KeyError: no such model; the message lists the registered names.
    """
    _load_builtin()
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; registered models: {', '.join(sorted(_FACTORIES))}") from None
    return factory()


BUILTIN = ("mlp", "cifar10", "linear")


def _load_builtin() -> None:
    # Imported lazily so that `psworker validate` never imports TensorFlow.
    if "mlp" not in _FACTORIES:
        from psworker.models import mlp  # noqa: F401
    if "linear" not in _FACTORIES:
        from psworker.models import linear  # noqa: F401
    if "cifar10" not in _FACTORIES:
        try:
            from psworker.models import cifar10  # noqa: F401
        except ImportError:  # pragma: no cover - only while the module is being written
            pass


__all__ = ["InputSpec", "Model", "register", "get", "names", "BUILTIN"]
