"""TensorFlow imported for a task process without what a task never uses.

TensorFlow's `__init__` loads Keras's optimizers, and Keras then imports scikit-learn for its estimator wrappers
whenever scikit-learn is installed (as it is here, for the digits data): 0.8-0.9 s of a 4-5 s import on this machine
(`python -X importtime -c "import tensorflow"`), paid by every ps and worker at every start and restart. A task never
uses those wrappers, so scikit-learn is hidden from that one import, and found again as usual afterwards
(`data.digits` reads its file without importing it)."""

from __future__ import annotations

import sys
from types import ModuleType

HIDDEN = ("sklearn",)


def import_tensorflow() -> ModuleType:
    """`import tensorflow`, with `HIDDEN` packages not importable during it (Keras's optional imports skip them)."""
    if "tensorflow" in sys.modules:
        return sys.modules["tensorflow"]
    hidden = [name for name in HIDDEN if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None   # `import sklearn` raises ImportError while this is set
    try:
        import tensorflow
    finally:
        for name in hidden:
            if sys.modules.get(name, ...) is None:
                del sys.modules[name]
    return tensorflow


__all__ = ["import_tensorflow", "HIDDEN"]
