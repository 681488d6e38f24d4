"""The one helper for tests that run real task processes (real `tf.train.Server`s on loopback ports).

Every process started here is in its own process group and is killed when the test ends; every wait has a
timeout whose message includes the tail of the task's log.
"""

from __future__ import annotations

import datetime
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import psutil
import yaml

from psworker.launcher.ports import pick_free_ports

REPO = Path(__file__).resolve().parent.parent
LAUNCH = REPO / "launch"


def write_spec(path: Path, *, num_ps: int = 1, num_workers: int = 2, **train) -> Path:
    """Writes a spec with fixed free loopback ports and the given `train` settings; returns its path."""
    ports = pick_free_ports(num_ps + num_workers)
    doc = {
        "cluster": {
            "ps": [f"127.0.0.1:{p}" for p in ports[:num_ps]],
            "worker": [f"127.0.0.1:{p}" for p in ports[num_ps:]],
        },
        "train": train,
    }
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def task_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


@dataclass
class TaskProcess:
    name: str
    proc: subprocess.Popen
    log_path: Path
    started_at: float = 0.0   # time.time() just before the process was started

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log().splitlines()[-n:])

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} did not exit within {timeout:g} s; last lines:\n{self.tail()}") from None

    def wait_for(self, pattern: str, timeout: float, *, count: int = 1) -> re.Match:
        """Waits until the log has `count` matches of the regex `pattern`; returns the last of them.

        Fails (with the log's tail) after `timeout` seconds, or as soon as the process exits without them.
        """
        deadline = time.monotonic() + timeout
        while True:
            matches = list(re.finditer(pattern, self.log(), re.MULTILINE))
            if len(matches) >= count:
                return matches[count - 1]
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited ({self.proc.returncode}) before logging {pattern!r}; "
                                     f"last lines:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name} did not log {pattern!r} within {timeout:g} s; last lines:\n"
                                     f"{self.tail()}")
            time.sleep(0.1)


@dataclass
class Cluster:
    """Task processes started by a test; `stop_all()` (called by the fixture) kills whatever is left."""

    workdir: Path
    tasks: dict[str, TaskProcess] = field(default_factory=dict)
    all_pids: set[int] = field(default_factory=set)

    def start(self, job: str, index: int, args: Sequence[str], *, via_script: bool = False,
              env: Optional[dict[str, str]] = None, name: Optional[str] = None) -> TaskProcess:
        """Starts `psworker <job> ARGS` (or `launch/start_<job>.sh ARGS`) with output to a log file."""
        name = name or f"{job}:{index}"
        if via_script:
            argv = [str(LAUNCH / f"start_{job}.sh"), *args]
        else:
            argv = [sys.executable, "-m", "psworker", job, *args]
        log_path = self.workdir / f"{name.replace(':', '-')}.log"
        started_at = time.time()
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env or task_env(PSWORKER_PYTHON=sys.executable), cwd=self.workdir,
                                    start_new_session=True)
        task = TaskProcess(name, proc, log_path, started_at)
        self.tasks[name] = task
        self.all_pids.add(proc.pid)
        return task

    def wait_all(self, timeout: float) -> dict[str, int]:
        deadline = time.monotonic() + timeout
        return {name: t.wait(max(0.1, deadline - time.monotonic())) for name, t in self.tasks.items()}

    def wait_exits(self, timeout: float, names: Optional[Sequence[str]] = None) -> dict[str, tuple[int, float]]:
        """Waits for the named tasks (default: all) to exit; returns `{name: (returncode, time.time() of exit)}`.

        Exits are polled every 10 ms, so the times are good to about that. Fails with the tails of the logs of the
        tasks still running after `timeout` seconds.
        """
        pending = list(names if names is not None else self.tasks)
        seen: dict[str, tuple[int, float]] = {}
        deadline = time.monotonic() + timeout
        while pending:
            for name in list(pending):
                code = self.tasks[name].proc.poll()
                if code is not None:
                    seen[name] = (code, time.time())
                    pending.remove(name)
            if pending and time.monotonic() > deadline:
                tails = "\n".join(f"--- {n}:\n{self.tasks[n].tail()}" for n in pending)
                raise AssertionError(f"still running after {timeout:g} s: {', '.join(pending)}\n{tails}")
            time.sleep(0.01)
        return seen

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        task = self.tasks[name]
        os.killpg(task.proc.pid, sig)
        task.proc.wait(timeout=30)

    def stop_all(self) -> None:
        for task in self.tasks.values():
            if task.proc.poll() is None:
                try:
                    os.killpg(task.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                task.proc.wait(timeout=30)


_LOG_TIME = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")


def log_time(line: str) -> float:
    """The `time.time()` of a task's log line (`2026-11-30 16:46:33,807 INFO ...`, local time, millisecond)."""
    match = _LOG_TIME.search(line)
    assert match, f"no timestamp in {line!r}"
    stamp = datetime.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S")
    return stamp.timestamp() + int(match.group(2)) / 1000.0


def assert_no_processes(pids, timeout: float = 10.0) -> None:
    """Fails unless every pid in `pids` is gone (zombies count as gone) within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    alive: list[int] = []
    while time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        if not alive:
            return
        time.sleep(0.1)
    raise AssertionError(f"processes still alive: {alive}")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def descendants(pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


@dataclass
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


def checkpoint_step(train_dir: Path) -> int:
    """The global step stored in `train_dir`'s latest checkpoint (read with `tf.train.load_checkpoint`)."""
    import tensorflow as tf

    path = tf.train.latest_checkpoint(str(train_dir))
    assert path, f"no checkpoint in {train_dir}: {sorted(p.name for p in Path(train_dir).iterdir())}"
    return int(tf.train.load_checkpoint(path).get_tensor("global_step"))
