"""Copies one task's output: every line to its log file, to the launcher's `Progress`, and (filtered and
prefixed `[job:index] `) to the console. Runs in a reader thread per task attempt."""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from typing import Any, Callable, Optional, TextIO

from psworker.launcher.progress import Progress

__all__ = ["OutputCopier"]

logger = logging.getLogger(__name__)


class OutputCopier:
    """Shared by every reader thread of a run: the console, its lock and filter, and the errors seen."""

    def __init__(self, console: TextIO, console_filter: Optional[Callable[[str], Optional[str]]],
                 progress: Progress) -> None:
        self._console = console
        self._filter = console_filter
        self._progress = progress
        self._lock = threading.Lock()
        self.errors: list[tuple[str, BaseException]] = []

    def pump(self, name: str, stream: Any, log: Any, tail: collections.deque) -> None:
        """Reads `stream` to its end; closes it and `log`. Never raises (errors land in `errors`)."""
        prefix = f"[{name}] "
        log_ok = console_ok = True
        try:
            for raw in iter(stream.readline, b""):
                if not raw.endswith(b"\n"):
                    raw += b"\n"
                text = raw.decode("utf-8", "replace").rstrip("\r\n")
                tail.append(text)
                self._progress.feed(name, text)
                if log_ok:
                    try:
                        log.write(raw)
                        log.flush()
                    except Exception as err:    # keep draining the pipe so the task never blocks on it
                        log_ok = False
                        self._error(name, err)
                shown = text if self._filter is None else self._filter(text)
                if console_ok and shown is not None:
                    try:
                        with self._lock:
                            self._console.write(prefix + shown + "\n")
                            self._console.flush()
                    except Exception as err:   # e.g. `psworker local ... | head`: not worth failing a run for
                        console_ok = False
                        logger.warning("console copy of %s stopped (%r); its full log is still written", name, err)
        except Exception as err:
            self._error(name, err)
        finally:
            for f in (stream, log):
                with contextlib.suppress(Exception):
                    f.close()

    def _error(self, name: str, err: BaseException) -> None:
        logger.error("copying the output of %s failed", name, exc_info=err)
        self.errors.append((name, err))
