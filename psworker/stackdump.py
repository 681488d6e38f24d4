"""Python's stack dumps in a task's log, between psworker's own lines (`events.StacksReady`,
`events.StacksRequested`) and the dump itself in `faulthandler`'s format, which psworker's tasks write on `SIGNAL`
and when a step times out, and into which the launcher turns py-spy's dump of a user's program. `parse_dumps` reads
them back for the failure report (`innermost` frames of the main thread) and for the launcher's wait (`is_complete`).

    Thread 0x00007f244d2ee6c0 (most recent call first):
      File "/usr/lib/python3.11/threading.py", line 331 in wait
      ...

    Current thread 0x00007f244ee54b80 (most recent call first):
      File "train.py", line 3 in inner
      File "train.py", line 8 in <module>

faulthandler lists the newest thread first, so the main thread (the oldest) comes last; "Current thread" is the
one that wrote the dump (`dump_on_signal`'s thread, in psworker's tasks).
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import signal
import threading
from dataclasses import dataclass
from typing import Optional, TextIO

from psworker.events import StacksReady

__all__ = ["SIGNAL", "dump_on_signal", "on_wakeup", "Frame", "ThreadStack", "Dump", "is_dump_line", "parse_dumps",
           "last_dump", "from_py_spy"]

SIGNAL = signal.SIGUSR1          # psworker's tasks dump every thread's stack on it (faulthandler), and go on

_HEADER = re.compile(r"^(?:(?P<current>Current thread|Thread) (?P<id>0x[0-9a-fA-F]+)|Stack) "
                     r"\(most recent call first\):\s*$")      # `Stack`: a dump of the current thread only
_FRAME = re.compile(r'^  File "(?P<file>.*)", line (?P<line>\d+|\?\?\?) in (?P<function>.*?)\s*$')
# a stack cut at 100 frames; a thread without any; the signal's thread while the garbage collector runs
_MORE = re.compile(r"^  (?:\.\.\.|<no Python frame>|Garbage-collecting)\s*$")
# The outermost frame of a program's main thread: a script, `python -m`, a console script.
_PROGRAM_ENTRY = frozenset({"<module>", "_run_module_as_main"})
_THREAD_ENTRY = "_bootstrap"       # threading.Thread's outermost frame
_IMPORT_MACHINERY = "<frozen importlib."
# Lines inside a thread's block that are no frame: output of a thread that went on while another one dumped (a
# signal may reach any thread), which also breaks the frame it lands in.
_FOREIGN_LINES = 3


def dump_on_signal(stream: TextIO) -> None:
    """From now on `SIGNAL` writes every thread's stack into `stream` (faulthandler's format) and the process goes
    on. Raises ValueError or OSError where it cannot: `stream` has no file descriptor, or this is not the main
    thread.

    A thread that holds the GIL writes the dump (`_dump_when_woken`), not the signal handler: there, faulthandler
    reads the other threads' frames while they run, and a deep stack popping back frees the data-stack chunk it is
    reading (a SIGSEGV: CI's tasks ended mid-dump at `  File `; tests/fake_tasks/churning.py does it in seconds).
    The signal only wakes that thread, through Python's wakeup fd, written from the C handler: it works while the
    main thread waits in C++ with the GIL released (a stalled TensorFlow step)."""
    fd = stream.fileno()
    read_end, write_end = os.pipe()
    try:
        os.set_blocking(write_end, False)
        signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    except BaseException:
        os.close(read_end)
        os.close(write_end)
        raise
    signal.signal(SIGNAL, lambda signum, frame: None)
    signal.siginterrupt(SIGNAL, False)       # SA_RESTART: system calls in C++ go on as under faulthandler's
    threading.Thread(target=_dump_when_woken, args=(read_end, fd), name="psworker-stacks", daemon=True).start()
    _woken_running.set()


_woken: dict[int, object] = {}      # signal number -> callable(signum), run by the woken thread (`on_wakeup`)
_woken_running = threading.Event()


def on_wakeup(signum: int, fn) -> bool:
    """Has the thread that `dump_on_signal` started call `fn(signum)` each time `signum` arrives, also while the
    main thread waits in C++ (where a Python handler runs only once it returns). Returns False, registering nothing,
    where that thread does not run (`dump_on_signal` was not called or failed); the caller then acts in a Python
    handler. The signal still needs a handler of its own (its default action would end the process)."""
    if not _woken_running.is_set():
        return False
    _woken[int(signum)] = fn
    return True


def _dump_when_woken(read_end: int, fd: int) -> None:
    """Dumps every thread's stack into `fd` each time `SIGNAL`'s number comes through the wakeup pipe; the other
    signals' numbers go to their `on_wakeup` callbacks, if any (their Python handlers run in the main thread as
    ever)."""
    while True:
        data = os.read(read_end, 256)
        if int(SIGNAL) in data:
            faulthandler.dump_traceback(file=fd, all_threads=True)
        for signum in data:
            if signum in _woken:
                _woken[signum](signum)


@dataclass(frozen=True)
class Frame:
    """One line of a stack: where, and in which function."""

    file: str
    line: Optional[int]
    function: str

    def render(self) -> str:
        return f'  File "{self.file}", line {"???" if self.line is None else self.line} in {self.function}'

    @property
    def short(self) -> str:
        """`inner (fake_tasks/stuck.py:3)`: the file's last two path parts."""
        where = "/".join(self.file.replace("\\", "/").split("/")[-2:])
        return f"{self.function} ({where}:{'?' if self.line is None else self.line})"


@dataclass(frozen=True)
class ThreadStack:
    """One thread's stack, innermost frame first (as faulthandler prints it)."""

    thread_id: int
    frames: tuple[Frame, ...]
    current: bool = False
    cut: bool = False               # faulthandler printed only the innermost 100 frames

    def render(self) -> str:
        head = f"{'Current thread' if self.current else 'Thread'} 0x{self.thread_id:016x} (most recent call first):"
        return "\n".join([head, *(f.render() for f in self.frames), *(["  ..."] if self.cut else [])])

    @property
    def entry(self) -> Optional[str]:
        """The outermost frame's function, None when the stack was cut or is empty."""
        return None if self.cut or not self.frames else self.frames[-1].function


@dataclass(frozen=True)
class Dump:
    """Every thread's stack at one moment, in faulthandler's order (newest thread first)."""

    threads: tuple[ThreadStack, ...]

    def render(self) -> str:
        return "\n\n".join(t.render() for t in self.threads)

    @property
    def main_thread(self) -> ThreadStack:
        """The last thread that was not started by `threading` (the oldest: the main thread), else the last."""
        own = [t for t in self.threads if t.entry is None or not t.entry.endswith(_THREAD_ENTRY)]
        return (own or list(self.threads))[-1]

    @property
    def is_complete(self) -> bool:
        """Its last thread ends at a program's entry: the main thread, which faulthandler writes last."""
        return bool(self.threads) and self.threads[-1].entry in _PROGRAM_ENTRY

    def innermost(self, count: int = 5) -> tuple[str, ...]:
        """The main thread's innermost `count` frames, `function (file:line)`, innermost first; the import
        machinery's frames left out (a task stuck in an import shows the module's line)."""
        return tuple(f.short for f in self.main_thread.frames if not f.file.startswith(_IMPORT_MACHINERY))[:count]


def is_dump_line(line: str) -> bool:
    """A line of a dump (a thread's header, a frame, a cut) or `StacksReady`: the console leaves them to the log."""
    line = line.rstrip("\r\n")
    return bool(_HEADER.match(line) or _FRAME.match(line) or _MORE.match(line) or StacksReady.parse(line))


def parse_dumps(text: str) -> list[Dump]:
    """Every dump in a text (a log), in order. A dump is a run of thread blocks with only blank lines between
    them, up to the block that ends at a program's entry (the main thread, faulthandler's last); any other line
    ends it too, except up to `_FOREIGN_LINES` inside a block (another thread's output, written into the dump).
    """
    dumps: list[Dump] = []
    threads: list[ThreadStack] = []
    block: Optional[dict] = None
    foreign = 0

    def close_block() -> None:
        nonlocal block
        if block is not None:
            threads.append(ThreadStack(block["id"], tuple(block["frames"]), block["current"], block["cut"]))
            block = None
            if threads[-1].entry in _PROGRAM_ENTRY:
                close_dump()

    def close_dump() -> None:
        nonlocal threads
        if threads:
            dumps.append(Dump(tuple(threads)))
            threads = []

    for line in text.splitlines():
        line = line.rstrip("\r")
        header, frame = _HEADER.match(line), _FRAME.match(line)
        if block is not None and frame:
            block["frames"].append(Frame(frame["file"], None if frame["line"] == "???" else int(frame["line"]),
                                         frame["function"]))
            foreign = 0
        elif block is not None and _MORE.match(line):
            block["cut"] = block["cut"] or line.strip() == "..."
        elif block is not None and line.strip() and not header and foreign < _FOREIGN_LINES:
            foreign += 1
        else:
            foreign = 0
            close_block()
            if header:
                block = {"id": int(header["id"] or "0", 16), "frames": [], "cut": False,
                         "current": header["current"] in (None, "Current thread")}
            elif line.strip():
                close_dump()
    close_block()
    close_dump()
    return dumps


def last_dump(text: str) -> Optional[Dump]:
    """The last dump in a text, or None."""
    dumps = parse_dumps(text)
    return dumps[-1] if dumps else None


def from_py_spy(output: str, pid: int) -> Dump:
    """The dump of `py-spy dump --json --pid PID`'s output, the main thread last as faulthandler orders it.

    Raises:
        ValueError: the output is not py-spy's JSON.
    """
    try:
        threads = json.loads(output)
        stacks = [(t.get("thread_name") == "MainThread" or t.get("os_thread_id") == pid,
                   ThreadStack(int(t["thread_id"]), tuple(Frame(f["filename"], f.get("line"), f["name"])
                                                          for f in t["frames"])))
                  for t in threads]
    except (ValueError, TypeError, KeyError) as err:
        raise ValueError(f"not py-spy's JSON dump: {err}") from None
    return Dump(tuple(s for _, s in sorted(stacks, key=lambda pair: pair[0])))


