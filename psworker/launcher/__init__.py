"""Start and watch the tasks of a cluster: the launch seam (`launch.py`), process backends (`process.py`), the
run loop (`supervisor.py`), restart policy, fault injection, live status and the report.

Backends are kept in one registry: name -> the module that prepares and starts a run (imported on use).
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["get", "names"]

# name -> module providing prepare(config, console), processes(config), report_success(...)
_BACKENDS: dict[str, str] = {
    "local": "psworker.launcher.local",
    "slurm": "psworker.launcher.slurm",
    "ssh": "psworker.launcher.ssh",
}


def names() -> tuple[str, ...]:
    """The registered backend names, sorted (use for argparse `choices=`)."""
    return tuple(sorted(_BACKENDS))


def get(name: str) -> ModuleType:
    """The backend module `name`.

    Raises:
        KeyError: no such backend; the message lists the registered ones.
    """
    try:
        module = _BACKENDS[name]
    except KeyError:
        raise KeyError(f"no backend {name!r}; backends are {', '.join(names())}") from None
    return importlib.import_module(module)
