"""Test-only helpers beside `psworker.testing` (which starts and watches the clusters): the repository's paths,
the start scripts, and running the `psworker local` launcher itself to the end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import psutil

from psworker.plan import Task

REPO = Path(__file__).resolve().parent.parent
LAUNCH = REPO / "launch"


def task_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def launch_script(task: Task, extra: Sequence[str]) -> list[str]:
    """For `LocalCluster(argv=...)`: starts the task through `launch/start_<job>.sh`, as on a real host."""
    return [str(LAUNCH / f"start_{task.job}.sh"), *task.argv[task.argv.index("--spec"):], *extra]


def descendants(pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


@dataclass(frozen=True)
class LauncherRun:
    """What `run_launcher` saw: the exit status, the whole console output, every descendant pid it ever had."""

    returncode: int
    output: str
    pids: set[int]


def run_launcher(args: Sequence[str], cwd: Path, timeout: float, on_line=None, command: str = "local") -> LauncherRun:
    """Runs `psworker COMMAND ARGS` (`local` by default) to the end (killing its process group after `timeout` seconds, then failing).

    Args:
        args: arguments after `psworker local`.
        cwd: working directory.
        timeout: seconds; the failure message holds the last output lines.
        on_line: optional `callback(lines, proc) -> bool` polled while it runs; once it returns True it is not
            called again (e.g. to send a signal once training has started).
    """
    import threading

    proc = subprocess.Popen([sys.executable, "-m", "psworker", command, *args], cwd=cwd, env=task_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    pids: set[int] = set()
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None:
            pids.update(descendants(proc.pid))
            if on_line is not None and on_line(lines, proc):
                on_line = None
            if time.monotonic() > deadline:
                raise AssertionError(f"launcher still running after {timeout:g} s:\n" + "".join(lines[-40:]))
            time.sleep(0.2)
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=30)
    return LauncherRun(proc.returncode, "".join(lines), pids)


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
