"""Start a real local cluster from a test: real task processes, real `tf.train.Server`s on loopback ports.

Like TensorFlow's `multi_process_runner`, for psworker's between-graph clusters, and a thin layer over the
launcher's `Supervisor` (its logs, `kill_task`, `start_task`, and its teardown: SIGTERM, grace, SIGKILL):

    from psworker.testing import LocalCluster

    def test_my_model_trains(tmp_path):
        with LocalCluster(tmp_path, num_ps=1, num_workers=2, train={"model": "my_model", "max_steps": 100}) as c:
            assert c.wait_exits(timeout=300) == {"ps:0": 0, "worker:0": 0, "worker:1": 0}
            assert checkpoint_step(c.train_dir) == 100

Every wait takes a timeout and fails with `ClusterTimeout` (an `AssertionError`) that shows the tail of the logs.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Mapping, Optional, Sequence, Union

import psutil
import yaml

from psworker import events
from psworker.deadline import WaitTimeout, poll_until, wait_for
from psworker.spec.plan import Task, plan
from psworker.launcher.backends.local import LocalBackend
from psworker.launcher.ports import pick_free_ports
from psworker.spec import ClusterSpec, load_spec
from psworker.launcher.rundir import LOG_SUBDIR, SPEC_FILE, task_log_name
from psworker.launcher.supervise.supervisor import Supervisor

STEP_LINE = events.Step.regex                                # a worker's progress line (global step)
POLL_SECS = 0.05
GRACE_PERIOD_SECS = 5.0                                      # teardown: SIGTERM, then SIGKILL after this long
LOG_TAIL_LINES = 30


@dataclasses.dataclass(frozen=True)
class ProgramTask:
    """Any program as a task of a `Supervisor`: what it reads from `psworker.spec.plan.Task`."""

    job: str
    index: int
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    is_chief: bool = False
    address: str = ""             # host:port, for programs that print their own

    @property
    def name(self) -> str:
        return f"{self.job}:{self.index}"


class ClusterTimeout(AssertionError):
    """A wait on the cluster ran out of time; the message holds the tail of the relevant logs."""


class TaskExited(AssertionError):
    """A task exited while a test waited for it to log something."""


def write_spec(path: Union[str, os.PathLike], *, num_ps: int = 1, num_workers: int = 2, **train) -> Path:
    """Writes a spec with free fixed loopback ports and the given `train` settings; returns its path."""
    ports = pick_free_ports(num_ps + num_workers)
    doc = {"cluster": {"ps": [f"127.0.0.1:{p}" for p in ports[:num_ps]],
                       "worker": [f"127.0.0.1:{p}" for p in ports[num_ps:]]},
           "train": train}
    path = Path(path)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


class LocalCluster:
    """The tasks of one spec, run as local processes under a `Supervisor`; `close()` ends every one of them.

    Args:
        workdir: where the spec (when written here), `logs/` and the console copy go.
        spec: an existing spec file with fixed ports; None: writes `workdir/cluster.yaml` from `num_ps`,
            `num_workers` and `train` (with `train_dir` defaulting to `workdir/train`).
        num_ps, num_workers, train: the cluster to write when `spec` is None.
        args: extra command-line arguments per task name, e.g. `{"ps:1": ["--keep_ps_running"]}`.
        argv: maps a planned `Task` (and its extra args) to the command to run instead of
            `python -m psworker JOB ...`, e.g. a start script.
        env: extra environment variables for every task.
        start: start every task now (ps first); False: call `start(...)` yourself.
    """

    def __init__(self, workdir: Union[str, os.PathLike], spec: Union[str, os.PathLike, None] = None, *,
                 num_ps: int = 1, num_workers: int = 2, train: Optional[Mapping] = None,
                 args: Optional[Mapping[str, Sequence[str]]] = None,
                 argv: Optional[Callable[[Task, Sequence[str]], Sequence[str]]] = None,
                 env: Optional[Mapping[str, str]] = None, start: bool = True) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        if spec is None:
            settings = {"train_dir": str(self.workdir / "train"), **dict(train or {})}
            spec = write_spec(self.workdir / SPEC_FILE, num_ps=num_ps, num_workers=num_workers, **settings)
        self.spec_path = Path(spec)
        self.spec: ClusterSpec = load_spec(self.spec_path)
        self.log_dir = self.workdir / LOG_SUBDIR
        self.log_dir.mkdir(parents=True, exist_ok=True)
        extra = dict(args or {})
        self._tasks: dict[str, Task] = {}
        for task in plan(self.spec, self.spec_path, extra_env={"PSWORKER_PYTHON": sys.executable, **dict(env or {})}):
            more = tuple(extra.pop(task.name, ()))
            command = tuple(argv(task, more)) if argv else (*task.argv, *more)
            self._tasks[task.name] = dataclasses.replace(task, argv=command)
        if extra:
            raise ValueError(f"args for unknown tasks: {', '.join(extra)}; tasks are {', '.join(self._tasks)}")
        self._console = open(self.workdir / "console.log", "a")
        self._supervisors: dict[str, Supervisor] = {}
        self.pids: set[int] = set()         # every pid any task ever had (for `assert_processes_gone`)
        self.started_at: dict[str, float] = {}
        self.exited_at: dict[str, float] = {}
        if start:
            self.start()

    # -- lifecycle ----------------------------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        """Every task's name, ps first: `["ps:0", "worker:0", "worker:1"]`."""
        return list(self._tasks)

    @property
    def train_dir(self) -> Optional[Path]:
        return Path(self.spec.train.train_dir) if self.spec.train.train_dir else None

    def start(self, *names: str) -> None:
        """Starts the named tasks (default: every task not started yet), in plan order."""
        names = names or tuple(n for n in self._tasks if n not in self._supervisors)
        for name in names:
            if name in self._supervisors:
                raise RuntimeError(f"{name} was already started; use restart()")
        tasks = [self._tasks[n] for n in self._tasks if n in names]
        sup = Supervisor(tasks, self.log_dir, backend=LocalBackend(), console=self._console,
                         grace_period_secs=GRACE_PERIOD_SECS)
        now = time.time()
        sup.start()
        for task in tasks:
            self._supervisors[task.name] = sup
            self.started_at[task.name] = now
        self.pids.update(sup.pids().values())

    def kill(self, name: str, sig: int = signal.SIGKILL, *, timeout: float = 30.0) -> int:
        """Sends `sig` to task `name`'s process group and waits for it to exit; returns its return code."""
        self._sup(name).kill_task(name, sig)
        return self.wait_exit(name, timeout)

    def send_signal(self, name: str, sig: int) -> None:
        """Sends `sig` to task `name`'s process group without waiting (SIGSTOP/SIGCONT: hold a task still)."""
        self._sup(name).kill_task(name, sig)

    def restart(self, name: str) -> None:
        """Starts task `name` again (same address and log file, after a restart marker line)."""
        sup = self._sup(name)
        self.exited_at.pop(name, None)
        self.started_at[name] = time.time()
        sup.start_task(name)
        self.pids.update(sup.pids().values())

    def close(self) -> None:
        """Stops every task still running (SIGTERM, grace, SIGKILL) and reaps them all."""
        try:
            for sup in {id(s): s for s in self._supervisors.values()}.values():
                sup.stop("test cluster closed")
        finally:
            self._console.close()

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- logs ---------------------------------------------------------------------------------------------

    def log_path(self, name: str) -> Path:
        return self.log_dir / task_log_name(self._tasks[name].name)

    def log(self, name: str, *, current: bool = False) -> str:
        """Task `name`'s log; with `current`, only what its latest (re)start wrote."""
        path = self.log_path(name)
        text = path.read_text(errors="replace") if path.exists() else ""
        return events.current_attempt(text) if current else text

    def tail(self, name: str, n: int = LOG_TAIL_LINES) -> str:
        return "\n".join(self.log(name).splitlines()[-n:])

    def tails(self, names: Optional[Iterable[str]] = None) -> str:
        return "\n".join(f"--- {n}:\n{self.tail(n)}" for n in (names or self._supervisors))

    def steps(self, name: str, *, current: bool = False) -> list[int]:
        """The global steps of task `name`'s progress lines, in order."""
        return [e.step for e in events.Step.finditer(self.log(name, current=current))]

    # -- waits --------------------------------------------------------------------------------------------

    def wait_for_log(self, name: str, pattern: Union[str, re.Pattern, type[events.Event]], timeout: float, *,
                     count: int = 1, current: bool = False) -> re.Match:
        """Waits until task `name`'s log has `count` matches of the regex `pattern` (multiline; an event kind, e.g.
        `events.FirstStep`: its lines); returns the last.

        Raises:
            ClusterTimeout: not within `timeout` seconds.
            TaskExited: the task exited first without them.
        """
        regex = (re.compile(pattern, re.MULTILINE) if isinstance(pattern, str)
                 else pattern.regex if isinstance(pattern, type) else pattern)

        def found() -> Optional[re.Match]:
            matches = list(regex.finditer(self.log(name, current=current)))
            if len(matches) >= count:
                return matches[count - 1]
            code = self._poll(name)
            if code is None:
                return None
            matches = list(regex.finditer(self.log(name, current=current)))
            if len(matches) >= count:
                return matches[count - 1]
            raise TaskExited(f"{name} exited ({code}) before logging {regex.pattern!r}:\n{self.tail(name)}")

        match = poll_until(found, timeout, interval=POLL_SECS)
        if match is None:
            raise ClusterTimeout(f"{name} did not log {regex.pattern!r} {count}x within {timeout:g} s:\n"
                                 f"{self.tail(name)}")
        return match

    def wait_for_step(self, step: int, timeout: float, name: str = "worker:0") -> int:
        """Waits until task `name` logs a progress line at global step `step` or later; returns that step."""
        def reached() -> int:
            return max(self.steps(name), default=-1)

        def there() -> bool:
            if reached() >= step:
                return True
            if self._poll(name) is not None:
                raise TaskExited(f"{name} exited before global step {step} (reached {reached()}):\n{self.tail(name)}")
            return False

        if not poll_until(there, timeout, interval=POLL_SECS):
            raise ClusterTimeout(f"{name} did not reach global step {step} within {timeout:g} s "
                                 f"(reached {reached()}):\n{self.tail(name)}")
        return reached()

    def wait_exit(self, name: str, timeout: float) -> int:
        """Waits for task `name` to exit; returns its return code (negative: killed by that signal)."""
        return self.wait_exits(timeout, [name])[name]

    def wait_exits(self, timeout: float, names: Optional[Iterable[str]] = None) -> dict[str, int]:
        """Waits for the named tasks (default: every started one) to exit; returns `{name: return code}`.

        Exits are polled every 10 ms (`exited_at` holds their times).
        """
        pending = list(names or self._supervisors)
        codes: dict[str, int] = {}

        def all_exited() -> bool:
            for name in list(pending):
                code = self._poll(name)
                if code is not None:
                    codes[name] = code
                    pending.remove(name)
            return not pending

        if not poll_until(all_exited, timeout, interval=0.01):
            raise ClusterTimeout(f"still running after {timeout:g} s: {', '.join(pending)}\n{self.tails(pending)}")
        return codes

    def exit_codes(self) -> dict[str, int]:
        """`{name: return code}` of every started task that has exited (its latest run)."""
        return {n: c for n in self._supervisors if (c := self._poll(n)) is not None}

    # -- internals ----------------------------------------------------------------------------------------

    def _sup(self, name: str) -> Supervisor:
        if name not in self._tasks:
            raise KeyError(f"no task {name!r}; tasks are {', '.join(self._tasks)}")
        if name not in self._supervisors:
            raise RuntimeError(f"{name} was never started")
        return self._supervisors[name]

    def _poll(self, name: str) -> Optional[int]:
        """The return code of task `name` once it has exited, else None (records the exit time)."""
        try:
            code = self._sup(name).wait_task(name, timeout=0)
        except TimeoutError:
            return None
        if name not in self.exited_at:
            self.exited_at[name] = time.time()
            self._settle(name)
        return code

    def _settle(self, name: str, quiet_secs: float = 0.1, timeout: float = 2.0) -> None:
        """Lets the supervisor's reader copy a task's last lines: waits until its log stops growing."""
        path, seen = self.log_path(name), {"size": -1, "since": time.monotonic()}

        def quiet() -> bool:
            size = path.stat().st_size if path.exists() else 0
            if size != seen["size"]:
                seen.update(size=size, since=time.monotonic())
            return time.monotonic() - seen["since"] >= quiet_secs

        poll_until(quiet, timeout, interval=0.02)     # still growing at the timeout: the caller reads what is there


def checkpoint_step(train_dir: Union[str, os.PathLike]) -> int:
    """The global step stored in `train_dir`'s latest checkpoint."""
    import tensorflow as tf

    path = tf.train.latest_checkpoint(str(train_dir))
    if not path:
        raise AssertionError(f"no checkpoint in {train_dir}: {sorted(p.name for p in Path(train_dir).iterdir())}")
    return int(tf.train.load_checkpoint(path).get_tensor("global_step"))


def processes_naming(marker: Union[str, os.PathLike]) -> list[psutil.Process]:
    """Live (not zombie) processes whose command line contains `marker`, e.g. a run's directory: the tasks of that
    run, however they were started (srun steps, ssh sessions), and no other run's."""
    marker, found = str(marker), []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if marker in " ".join(p.info["cmdline"] or []) and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.NoSuchProcess:
            continue
    return found


def drive_until(sup: Supervisor, predicate: Callable[[], object], timeout: float, what: str = "condition") -> object:
    """Runs a supervisor's loop (`sup.poll()`) until `predicate` holds; fails if the run ends first or after
    `timeout` seconds. A test drives the loop itself to act between two of its decisions (e.g. let a ps exit only
    once the supervisor has seen the chief's exit)."""
    def check() -> object:
        result = sup.poll()
        if result is not None:
            raise AssertionError(f"the run ended ({result.reason}) before {what}")
        return predicate()

    return wait_for(check, timeout, what, error=ClusterTimeout)


def port_listening(port: int, host: str = "127.0.0.1", timeout: float = 2.0) -> bool:
    """Whether something accepts TCP connections on `host:port` now."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.settimeout(timeout)
        return sock.connect_ex((host, port)) == 0


def gone(pid: int) -> bool:
    """True when `pid` no longer runs (a zombie counts as gone: it runs no code and holds no port)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def assert_processes_gone(pids: Iterable[int], timeout: float = 10.0) -> None:
    """Fails unless every pid in `pids` is gone (zombies count as gone) within `timeout` seconds."""
    pids = list(pids)
    try:
        wait_for(lambda: all(gone(p) for p in pids), timeout, "the processes to end", interval=0.1)
    except WaitTimeout:
        raise ClusterTimeout(f"processes still alive after {timeout:g} s: {[p for p in pids if not gone(p)]}") from None


def console_steps(text: str) -> list[tuple[str, int]]:
    """`(task, global step)` of every step line in a console's text (`[worker:0] step 120, loss = ...`), in order."""
    return [(r.task, r.step.step) for r in events.step_records(text) if r.task]


def log_time(line: str) -> float:
    """The `time.time()` of a task's log line (`2026-11-30 16:46:33,807 INFO ...`, local time, millisecond)."""
    at = events.log_time(line)
    if at is None:
        raise ValueError(f"no timestamp in {line!r}")
    return at


__all__ = ["LocalCluster", "ClusterTimeout", "TaskExited", "write_spec", "checkpoint_step", "processes_naming",
           "assert_processes_gone", "console_steps", "gone", "log_time", "drive_until", "port_listening", "ProgramTask",
           "STEP_LINE"]
