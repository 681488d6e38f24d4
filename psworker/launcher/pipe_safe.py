"""A console that outlives its reader: `psworker local ... | head` keeps training after `head` has gone."""

from __future__ import annotations

import errno
import io
from typing import TextIO


class PipeSafe(io.TextIOBase):
    """Writes through to `stream` until its reader closes the pipe, then drops what follows.

    The run is not stopped for it: whoever closed the pipe chose to stop reading, not to stop training, and every
    line is still in the task logs and the run dir.
    """

    def __init__(self, stream: TextIO):
        super().__init__()
        self._stream = stream
        self.closed_by_reader = False

    def write(self, text: str) -> int:
        if not self.closed_by_reader:
            try:
                self._stream.write(text)
            except OSError as e:
                self._reader_gone(e)
        return len(text)

    def flush(self) -> None:
        if not self.closed_by_reader:
            try:
                self._stream.flush()
            except OSError as e:
                self._reader_gone(e)

    def isatty(self) -> bool:
        return not self.closed_by_reader and self._stream.isatty()

    @property
    def encoding(self) -> str:
        return getattr(self._stream, "encoding", None) or "utf-8"

    def fileno(self) -> int:
        return self._stream.fileno()

    def _reader_gone(self, error: OSError) -> None:
        if error.errno != errno.EPIPE:
            raise error
        self.closed_by_reader = True
