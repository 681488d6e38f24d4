"""Fake task whose main thread waits inside C with the GIL released (a `read` that SIGUSR1 restarts, as a
TensorFlow step waits in C++) while three threads push and pop 900 Python frames, across the interpreter's
data-stack chunks (each one freed as its frames pop: faulthandler's own handler, reading them unlocked, crashed
on one). Dumps its stacks on SIGUSR1 as psworker's tasks do, prints "ready", then waits until killed."""
import ctypes
import os
import sys
import threading

from psworker import stackdump


def recurse(depth: int) -> int:
    return 0 if depth == 0 else recurse(depth - 1) + 1


def churn() -> None:
    while True:
        recurse(900)


def wait_in_c() -> None:
    read_end, _ = os.pipe()               # the write end stays open and silent: the read never returns
    read, buffer = ctypes.CDLL(None).read, ctypes.create_string_buffer(1)
    print("ready", flush=True)            # from here on, only the C call: every dump sees this frame on top
    read(read_end, buffer, 1)


stackdump.dump_on_signal(sys.stderr)
for i in range(3):
    threading.Thread(target=churn, name=f"churn-{i}", daemon=True).start()
wait_in_c()
