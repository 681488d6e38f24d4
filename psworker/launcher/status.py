"""Live status of a run (placeholder until the view lands)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence, TextIO


@contextlib.contextmanager
def live_view(config: Any, tasks: Sequence[Any], console: TextIO) -> Iterator[tuple[TextIO, Any]]:
    yield console, lambda progress: None
