"""TensorFlow's C++ start-up chatter kept off a one-shot command's stderr (`plan --model`, `eval`, `export`).

TensorFlow 2.21 logs its first lines (`oneDNN custom operations are on`, `Could not find cuda drivers`, and, where
CUDA libraries exist without a GPU, `E0000 ... failed call to cuInit`) before it reads `TF_CPP_MIN_LOG_LEVEL`, and
writes them to file descriptor 2 itself, past Python's `sys.stderr`. So descriptor 2 goes through a pipe while the
command runs, and a thread passes on every line the launcher's console would show (`launcher.console.is_noise`:
C++ info, warning and error lines, absl's "before InitializeLog" note, TensorFlow's Python INFO; fatal lines stay).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import BinaryIO, Iterator

from psworker.launcher.console.lines import is_noise

__all__ = ["cpp_chatter_hidden"]

STDERR_FD = 2


def _pass_on(pipe: BinaryIO, out: BinaryIO) -> None:
    with pipe, out:
        for line in pipe:
            if not is_noise(line.decode("utf-8", "replace").rstrip("\r\n")):
                out.write(line)
                out.flush()


@contextlib.contextmanager
def cpp_chatter_hidden() -> Iterator[None]:
    """While inside, lines written to descriptor 2 that the console hides are dropped; the rest keep their order.

    Also sets `TF_CPP_MIN_LOG_LEVEL` to 1 unless set, as a task does: TensorFlow's later info lines (some span two
    lines) are not written at all. Does nothing else when `sys.stderr` is not descriptor 2 (a caller capturing it,
    e.g. a test calling `cli.main`).
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    try:
        redirect = sys.stderr.fileno() == STDERR_FD
    except (AttributeError, ValueError, OSError):     # io.UnsupportedOperation is both of the last two
        redirect = False
    if not redirect:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(STDERR_FD)
    read_end, write_end = os.pipe()
    os.dup2(write_end, STDERR_FD)
    os.close(write_end)
    pump = threading.Thread(target=_pass_on, args=(os.fdopen(read_end, "rb"), os.fdopen(os.dup(saved), "wb")),
                            name="stderr-filter", daemon=True)
    pump.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, STDERR_FD)     # the pipe's last write end closes: the thread reads to its end and stops
        os.close(saved)
        pump.join(timeout=10)
