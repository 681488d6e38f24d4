"""Test-only helpers beside `psworker.testing` (which starts and watches the clusters): the repository's paths,
the start scripts, and the one driver of a real launcher process (`Launcher`; `run_launcher` runs one to its end)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import psutil

from psworker.spec.plan import Task

REPO = Path(__file__).resolve().parent.parent
LAUNCH = REPO / "launch"
TIMEOUT_SECS = 240.0         # for each event waited for (a loaded 2-core machine starts TensorFlow slowly)
# A terminal's cursor moves and line erases (the live view redrawing itself) end a line; other escapes go.
_LINE_BREAKS = re.compile(r"\x1b\[[0-9;]*[ABEFGHJK]|\r")
_ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Za-z0-9]")


_CSI = re.compile(rb"\x1b\[([0-9;?]*)([A-Za-z])|\x1b[()][A-Za-z0-9]")


def _put(lines: list[str], row: int, col: int, text: str) -> None:
    line = lines[row]
    lines[row] = line[:col].ljust(col) + text + line[col + len(text):]


def terminal_lines(raw: bytes) -> list[str]:
    """What a terminal shows once `raw` is written to it, scrollback and screen, trailing blanks dropped. It knows
    what rich's Live and our console write: text, CR, LF, cursor up (CSI n A), column (CSI n G), erase line
    (CSI 2K; CSI K: to its end) and erase below (CSI J); colours and cursor visibility change nothing here."""
    lines, row, col, pos = [""], 0, 0, 0
    for m in [*_CSI.finditer(raw), None]:
        for part in re.split(r"(\r|\n)", raw[pos:m.start() if m else len(raw)].decode("utf-8", "replace")):
            if part == "\n":
                row, col = row + 1, 0           # the pty turns LF into CR LF
                lines += [""] * (row + 1 - len(lines))
            elif part == "\r":
                col = 0
            elif part:
                text = "".join(c for c in part if c >= " ")
                _put(lines, row, col, text)
                col += len(text)
        if m is None:
            break
        pos, arg, op = m.end(), (m.group(1) or b"").decode(), m.group(2)
        n = int(arg) if arg.isdigit() else 1
        if op == b"A":
            row = max(0, row - n)
        elif op == b"G":
            col = n - 1
        elif op == b"K":
            lines[row] = "" if arg == "2" else lines[row][:col] if arg in ("", "0") else " " * col + lines[row][col:]
        elif op == b"J" and arg in ("", "0"):
            lines[row] = lines[row][:col]
            del lines[row + 1:]
    return [line.rstrip() for line in lines]


def logged_a_step(log: Path) -> bool:
    """Whether a task's log (written as the task prints, not grouped as the console's lines are) holds a step line."""
    from psworker import events

    return log.exists() and any(events.Step.finditer(log.read_text(errors="replace")))


def task_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    env["PSWORKER_PYTHON"] = sys.executable   # launch/*.sh default to python3, which may lack our packages
    env.update(extra)
    return env


def descendants(pid: int) -> list[int]:
    """Every descendant process of `pid` now (none once it is gone)."""
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def launch_script(task: Task, extra: Sequence[str]) -> list[str]:
    """For `LocalCluster(argv=...)`: starts the task through `launch/start_<job>.sh`, as on a real host."""
    return [str(LAUNCH / f"start_{task.job}.sh"), *task.argv[task.argv.index("--spec"):], *extra]


class Launcher:
    """`psworker COMMAND ARGS` (`local` by default) in its own session, its console read line by line (on a pipe, or
    on a pseudo-terminal with `tty=True`, escape sequences removed); every descendant pid it ever had is kept."""

    def __init__(self, args: Sequence[str], cwd: Path, *, tty: bool = False, env: Optional[dict] = None,
                 command: str = "local") -> None:
        argv = [sys.executable, "-m", "psworker", command, *args]
        env = task_env(**(env or {}))
        if tty:
            self._fd, slave = os.openpty()
            fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 60, 200, 0, 0))
            self.proc = subprocess.Popen(argv, cwd=cwd, env={**env, "TERM": "xterm-256color"},
                                         stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, start_new_session=True)
            os.close(slave)
        else:
            self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, start_new_session=True)
            self._fd = self.proc.stdout.fileno()
        self.lines: list[str] = []
        self.raw = bytearray()          # every byte read, escape sequences and all (`terminal_lines`)
        self.pids: set[int] = set()
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        pending = b""
        while True:
            try:
                chunk = os.read(self._fd, 65536)
            except OSError:     # a pty's EIO once every writer is gone
                chunk = b""
            self.raw += chunk
            pending += chunk
            *whole, pending = pending.split(b"\n")
            if not chunk and pending:           # the end: a last line without its newline
                whole, pending = [*whole, pending], b""
            if whole:
                text = "\n".join(raw.decode("utf-8", "replace") for raw in whole)
                with self._lock:
                    self.lines += _ESCAPES.sub("", _LINE_BREAKS.sub("\n", text)).split("\n")
            if not chunk:
                break

    def snapshot(self) -> list[str]:
        with self._lock:
            return list(self.lines)

    def find(self, pattern: str, after: int = 0) -> Optional[tuple[int, re.Match]]:
        """The first line at index >= `after` that matches `pattern` (re.search), with its index."""
        for i, line in enumerate(self.snapshot()[after:], after):
            m = re.search(pattern, line)
            if m:
                return i, m
        return None

    def wait_until(self, done: Callable[[], bool], what: str, timeout: float = TIMEOUT_SECS,
                   each_poll: Callable[[], None] = lambda: None) -> None:
        """Polls `done()` (and `each_poll()`) every 0.1 s; fails naming `what` if the launcher exits without it (checked
        once more after the exit, with the output all read) or time is up."""
        deadline = time.monotonic() + timeout
        while True:
            self.pids.update(self._descendants())
            each_poll()
            if done():
                return
            if self.proc.poll() is not None:
                self._reader.join(10)
                if done():   # the exit (and the last output) may have come after the check above
                    return
                raise AssertionError(f"the launcher exited ({self.proc.returncode}) before {what}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {timeout:g} s:\n{self.tail()}")
            time.sleep(0.1)

    def wait_for(self, pattern: str, what: str, after: int = 0) -> tuple[int, re.Match]:
        self.wait_until(lambda: self.find(pattern, after) is not None, what)
        return self.find(pattern, after)

    def task_pids(self) -> dict[str, int]:
        """`job:index` -> pid of each task process running now (the launcher's children)."""
        found = {}
        for child in self._children():
            try:
                argv = child.cmdline()
            except psutil.Error:
                continue
            if "psworker" in argv and "--task_index" in argv:
                job = argv[argv.index("psworker") + 1]
                found[f"{job}:{argv[argv.index('--task_index') + 1]}"] = child.pid
        return found

    def end(self, sig: int, timeout: float = 120.0) -> int:
        """Sends `sig` to the launcher only (its tasks are in sessions of their own) and waits for its exit."""
        self.pids.update(self._descendants())
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the launcher still runs {timeout:g} s after {sig!r}:\n{self.tail()}") from None
        self._reader.join(10)
        return self.proc.returncode

    def wait_exit(self, timeout: float = TIMEOUT_SECS, each_poll: Callable[[], None] = lambda: None) -> int:
        """Waits (polling `each_poll()`) until the launcher exits by itself and its output is read; its status."""
        self.wait_until(lambda: self.proc.poll() is not None, "exit of the launcher", timeout, each_poll)
        self._reader.join(10)
        return self.proc.returncode

    def close(self, kill_tasks: bool = True) -> None:
        """Kills the launcher's session if it still runs and, with `kill_tasks`, every psworker process it started."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        for pid in self.pids if kill_tasks else ():
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                if "psworker" in proc.cmdline():
                    proc.kill()
        self._reader.join(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        else:
            with contextlib.suppress(OSError):
                os.close(self._fd)

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.snapshot()[-n:])

    def _children(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children()
        except psutil.Error:
            return []

    def _descendants(self) -> set[int]:
        return set(descendants(self.proc.pid))


@dataclass(frozen=True)
class LauncherRun:
    """What `run_launcher` saw: the exit status, the whole console output, every descendant pid it ever had."""

    returncode: int
    output: str
    pids: set[int]


def run_launcher(args: Sequence[str], cwd: Path, timeout: float, on_line=None, command: str = "local") -> LauncherRun:
    """Runs `psworker COMMAND ARGS` (`local` by default) to the end in a `Launcher`; after `timeout` seconds it
    fails (with the last output lines) and the launcher's session is killed. The tasks it left are left for the
    test to find (`assert_processes_gone(run.pids)`).

    Args:
        on_line: optional `callback(lines, proc) -> bool` polled while it runs (the console lines so far, without
            their newlines); once it returns True it is not called again (e.g. to send a signal once training has
            started).
    """
    run = Launcher(args, cwd, command=command)
    callbacks = [on_line] if on_line is not None else []

    def poll() -> None:
        if callbacks and callbacks[0](run.snapshot(), run.proc):
            callbacks.clear()

    try:
        returncode = run.wait_exit(timeout, each_poll=poll)
    except BaseException:
        run.close()
        raise
    run.close(kill_tasks=False)
    lines = run.snapshot()
    return LauncherRun(returncode, "".join(f"{line}\n" for line in lines), run.pids)


class Partition:
    """Drops every packet to or from some TCP ports inside the network namespace of process `pid` (a launcher run
    with `--network isolated`): a network partition that nothing in the run can see coming.

    This kernel has no `prio` qdisc, no `action drop` and no netem; an HTB class whose leaf qdisc is `pfifo limit 0`,
    with u32 filters steering the ports' packets into it, drops every one of them (a connect times out). `heal()`
    deletes the root qdisc: everything flows again (TCP retransmits on its own backoff schedule).
    """

    def __init__(self, pid: int):
        # root enters the namespace directly; anyone else through the user namespace that owns it
        self._enter = ["nsenter", f"--target={pid}", "--net"] + (
            [] if os.geteuid() == 0 else ["--user", "--preserve-credentials"])

    def _tc(self, *args: str) -> None:
        done = subprocess.run([*self._enter, "tc", *args], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=30)
        if done.returncode != 0:
            raise AssertionError(f"tc {' '.join(args)} failed (exit {done.returncode}): {done.stderr.strip()}")

    def cut(self, ports: Sequence[int], dev: str = "lo") -> None:
        self._tc("qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1")
        for classid in ("1:1", "1:2"):
            self._tc("class", "add", "dev", dev, "parent", "1:", "classid", classid, "htb", "rate", "10gbit",
                     "quantum", "60000")
        self._tc("qdisc", "add", "dev", dev, "parent", "1:2", "handle", "20:", "pfifo", "limit", "0")
        for port in ports:
            for direction in ("dport", "sport"):
                self._tc("filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match",
                         "ip", direction, str(port), "0xffff", "flowid", "1:2")

    def heal(self, dev: str = "lo") -> None:
        self._tc("qdisc", "del", "dev", dev, "root")


class Background:
    """A command (e.g. a launcher) running in its own session while a test goes on; its merged output read by a
    thread. `wait_for` synchronises on its lines; `close` kills its whole session if it still runs."""

    def __init__(self, argv: Sequence[str], cwd: Path) -> None:
        import threading

        self.proc = subprocess.Popen(list(argv), cwd=cwd, env=task_env(), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        self.pids: set[int] = set()       # every descendant seen while waiting
        self._reader = threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stdout.readline, "")),
                                        daemon=True)
        self._reader.start()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern, timeout: float, at_least: int = 0):
        """The first match of `pattern` (a compiled regex) in a line, whose group 1 (if any) is >= `at_least`."""
        deadline = time.monotonic() + timeout
        while True:
            self.pids.update(descendants(self.proc.pid))
            for line in list(self.lines):
                m = pattern.search(line)
                if m and (not m.groups() or int(m.group(1)) >= at_least):
                    return m
            if self.proc.poll() is not None or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        self._reader.join(2)
        state = f"exited {self.proc.returncode}" if self.proc.poll() is not None else f"still running after {timeout:g} s"
        raise AssertionError(f"no line matching {pattern.pattern!r} (>= {at_least}); {state}; output:\n"
                             + "".join(self.lines[-40:]))

    def wait(self, timeout: float) -> int:
        """Its exit status; fails (after killing its session) when it runs longer than `timeout` seconds."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.close()
            raise AssertionError(f"still running after {timeout:g} s:\n" + "".join(self.lines[-40:])) from None
        self._reader.join(10)
        return self.proc.returncode

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(30)


WORKER_STOPPED = re.compile(r"stopped on SIG[A-Z]+: after its running step \(global step (\d+)\)")


def steps_lost(log_dir: Path, saved: int) -> int:
    """After a stop whose checkpoint holds global step `saved`: the global steps applied beyond it. Each stopped
    non-chief logs the global step it read after its last step (`task.stop`); the chief's step lines are in it."""
    from psworker import events

    logs = {p.name: events.current_attempt(p.read_text()) for p in log_dir.glob("worker-*.log")}
    finals = [int(m) for name, text in logs.items() if name != "worker-0.log" for m in WORKER_STOPPED.findall(text)]
    chief_steps = [e.step for e in events.Step.finditer(logs["worker-0.log"])]
    assert len(finals) == len(logs) - 1 and chief_steps, logs   # every non-chief said where it stopped
    return max(0, max(finals + chief_steps) - saved)
