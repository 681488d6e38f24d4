"""TensorFlow imported for a task process without what a task never uses.

Every ps and worker imports TensorFlow at each start and restart, so its import is most of a task's start-up (and
most of the test suite's CPU). TensorFlow's `__init__` loads Keras (its optimizers), and Keras imports scikit-learn
for its estimator wrappers whenever scikit-learn is installed (as it is here, for the digits data). A task uses
neither: its graphs are built from `tf.compat.v1` ops and optimizers. Both are hidden from that one import, which
goes on without them (TensorFlow's Keras hooks are optional), and are found again as usual afterwards: `tf.keras`
imports Keras on first use, as it always does (a user's model may use it), and `data.digits` reads its file without
scikit-learn. Measured: scikit-learn 0.8-0.9 s, Keras ~0.9 s of CPU of a 4-5 s import (docs/performance.md,
"TensorFlow's import")."""

from __future__ import annotations

import sys
from types import ModuleType

HIDDEN = ("sklearn", "keras")


def import_tensorflow() -> ModuleType:
    """`import tensorflow`, with `HIDDEN` packages not importable during it (TensorFlow's and Keras's optional
    imports skip them)."""
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
