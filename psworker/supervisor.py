"""Runs a cluster's tasks as local subprocesses: per-task logs, a prefixed console copy, policy, shutdown."""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import datetime
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Protocol, Sequence, TextIO

import psutil

__all__ = [
    "RestartPolicy",
    "RunResult",
    "Supervisor",
    "TaskExit",
    "TaskFailure",
    "describe_returncode",
    "exit_status",
    "format_report",
    "stop_on_signals",
]

logger = logging.getLogger(__name__)

SERVER_JOBS = frozenset({"ps"})   # serve until stopped; every other job must exit 0 for the run to succeed
LOG_TAIL_LINES = 20
POLL_INTERVAL_SECS = 0.1
_REAP_TIMEOUT_SECS = 5.0          # after SIGKILL; only a process stuck in the kernel takes longer
_READER_JOIN_SECS = 5.0
_PR_SET_PDEATHSIG = 1

# (task name, returncode, restarts so far) -> True to start the task again instead of failing the run.
RestartPolicy = Callable[[str, int, int], bool]


class TaskLike(Protocol):
    """What the supervisor needs from a `psworker.plan.Task`."""

    @property
    def name(self) -> str: ...
    @property
    def job(self) -> str: ...
    @property
    def index(self) -> int: ...
    @property
    def argv(self) -> Sequence[str]: ...
    @property
    def env(self) -> Sequence[tuple[str, str]]: ...


@dataclass(frozen=True)
class TaskExit:
    """How one task ended. `stopped`: the supervisor ended it (TERM, then KILL); it did not exit itself."""

    name: str
    returncode: int                 # negative: killed by that signal (subprocess convention)
    started_at: float               # time.time() of the last (re)start
    ended_at: float
    log_path: str
    restarts: int
    stopped: bool = False


@dataclass(frozen=True)
class TaskFailure:
    """The root cause of a failed run: the first task, by time, that failed."""

    name: str
    returncode: int
    log_tail: tuple[str, ...]       # the last LOG_TAIL_LINES lines of its output (current segment)
    at: float
    reason: str = ""


@dataclass(frozen=True)
class RunResult:
    """The outcome of a run, one `TaskExit` per task name."""

    ok: bool
    exits: dict[str, TaskExit]
    failure: Optional[TaskFailure]
    reason: str = ""                # why the run ended, for people


def describe_returncode(returncode: int) -> str:
    """`"exit code 3"` or `"killed by SIGKILL"` for a subprocess return code."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def exit_status(returncode: int) -> int:
    """A shell-style exit status for a subprocess return code: 128 + N for signal N, 1 for a 0 that failed."""
    if returncode < 0:
        return 128 - returncode
    return returncode or 1


def format_report(result: RunResult) -> str:
    """A report for people: the first failing task, its exit, its last log lines, then one row per task."""
    lines = []
    if result.ok:
        lines.append("psworker: run succeeded" + (f" ({result.reason})" if result.reason else ""))
    elif result.failure is not None:
        f = result.failure
        at = datetime.datetime.fromtimestamp(f.at).strftime("%H:%M:%S.%f")[:-3]
        lines.append(f"psworker: run failed: {f.name} {f.reason or describe_returncode(f.returncode)} "
                     f"(first failure, at {at})")
        log_path = result.exits[f.name].log_path if f.name in result.exits else "?"
        lines.append(f"--- last {len(f.log_tail)} lines of {f.name} (full log: {log_path}) ---")
        lines.extend(f"  {line}" for line in f.log_tail)
        if not f.log_tail:
            lines.append("  (no output)")
    else:
        lines.append("psworker: run stopped" + (f" ({result.reason})" if result.reason else ""))
    lines.append("--- tasks ---")
    width = max((len(name) for name in result.exits), default=4)
    for name, e in result.exits.items():
        status = describe_returncode(e.returncode)
        if e.stopped:
            status = f"stopped by launcher ({status})"
        if result.failure is not None and name == result.failure.name:
            status += "  <-- first failure"
        restarts = f", {e.restarts} restarts" if e.restarts else ""
        took = f"{e.ended_at - e.started_at:.1f} s{restarts}"
        lines.append(f"  {name:<{width}}  {status}  [{took}]  {e.log_path}")
    return "\n".join(lines)


@dataclass(eq=False)
class _Slot:
    """One task's mutable runtime state (private to the supervisor)."""

    task: Any
    log_path: Path
    popen: Optional[subprocess.Popen] = None
    reader: Optional[threading.Thread] = None
    tail: collections.deque = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=LOG_TAIL_LINES))
    started_at: float = 0.0
    ended_at: Optional[float] = None
    returncode: Optional[int] = None
    judged: bool = False            # its exit has been through the run policy
    stopped: bool = False
    restarts: int = 0

    @property
    def name(self) -> str:
        return self.task.name

    @property
    def running(self) -> bool:
        return self.popen is not None and self.returncode is None


def _make_preexec() -> Optional[Callable[[], None]]:
    """On Linux, a preexec_fn that makes the child die by SIGKILL when the launcher dies (even by SIGKILL).

    PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, so start tasks from the thread that
    lives as long as the run (the supervisor does so from whichever thread calls start/poll/start_task).
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl   # looked up before fork: the child only calls it
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:      # the launcher died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def _live_group_members(pgids: set[int]) -> dict[int, list[int]]:
    """The non-zombie processes in each of the process groups `pgids`."""
    found: dict[int, list[int]] = {}
    live = set()
    for pgid in pgids:
        try:
            os.killpg(pgid, 0)
            live.add(pgid)
        except ProcessLookupError:
            pass
        except PermissionError:
            live.add(pgid)
    if not live:
        return found
    for proc in psutil.process_iter():
        try:
            pgid = os.getpgid(proc.pid)
            if pgid in live and proc.status() != psutil.STATUS_ZOMBIE:
                found.setdefault(pgid, []).append(proc.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return found


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Supervisor:
    """Starts one subprocess per task, copies its output, applies the run policy, and stops everything.

    Use from one thread (plus `request_stop`, which is safe in a signal handler):

        with Supervisor(tasks, log_dir) as sup:     # starts the tasks; stops and reaps all on exit
            result = sup.wait()

    Run policy: the run succeeds when every non-ps task has exited 0; the ps tasks then get
    `ps_exit_grace_secs` to exit by themselves before they are stopped. It fails when any task exits non-zero
    (or by a signal), or a ps task exits while others still run: every other task is stopped, and the first
    failure by time is the root cause. With `restart_policy`, a failed task may be started again instead.
    """

    def __init__(
        self,
        tasks: Sequence[TaskLike],
        log_dir: str | os.PathLike,
        *,
        console: Optional[TextIO] = None,
        console_filter: Optional[Callable[[str], Optional[str]]] = None,
        grace_period_secs: float = 10.0,
        ps_exit_grace_secs: float = 15.0,
        popen: Callable[..., subprocess.Popen] = subprocess.Popen,
        restart_policy: Optional[RestartPolicy] = None,
    ) -> None:
        """Args:
            tasks: what to run, e.g. `psworker.plan.plan(...)`; names must be distinct.
            log_dir: where `<job>-<index>.log` go; created on start.
            console: where the `[job:index] `-prefixed copy goes; None: sys.stdout at construction.
            console_filter: maps a task's output line to what the console shows (None: nothing); None: all.
            grace_period_secs: between SIGTERM and SIGKILL when stopping.
            ps_exit_grace_secs: how long ps tasks may take to exit by themselves after the workers succeeded.
            popen: starts a process, with subprocess.Popen's signature (injected so tests may swap it).
            restart_policy: None (a failure ends the run) or a `RestartPolicy`.
        """
        names = [t.name for t in tasks]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"duplicate task names: {', '.join(duplicates)}")
        self._log_dir = Path(log_dir)
        self._slots = {t.name: _Slot(t, self._log_dir / f"{t.job}-{t.index}.log") for t in tasks}
        self._console = console if console is not None else sys.stdout
        self._console_filter = console_filter
        self._console_lock = threading.Lock()
        self._grace = grace_period_secs
        self._ps_grace = ps_exit_grace_secs
        self._popen = popen
        self._restart_policy = restart_policy
        self._lock = threading.RLock()
        self._started = False
        self._result: Optional[RunResult] = None
        self._failure: Optional[TaskFailure] = None
        self._drain_deadline: Optional[float] = None
        self._stop_request: Optional[str] = None
        self._thread_errors: list[tuple[str, BaseException]] = []

    # -- introspection ------------------------------------------------------------------------------------

    @property
    def log_dir(self) -> Path:
        return self._log_dir

    @property
    def result(self) -> Optional[RunResult]:
        """The result once the run has ended, else None."""
        return self._result

    @property
    def thread_errors(self) -> list[tuple[str, BaseException]]:
        """Errors raised in the log reader threads, as (task name, exception); `close()` raises the first."""
        return list(self._thread_errors)

    def log_path(self, name: str) -> Path:
        return self._slot(name).log_path

    def pids(self) -> dict[str, int]:
        """The pid of every task that has not been seen to exit."""
        with self._lock:
            return {s.name: s.popen.pid for s in self._slots.values() if s.running}

    def restarts(self, name: str) -> int:
        return self._slot(name).restarts

    # -- lifecycle ----------------------------------------------------------------------------------------

    def start(self) -> None:
        """Starts every task. On an error starting one, stops those already started and re-raises."""
        with self._lock:
            if self._started:
                raise RuntimeError("Supervisor.start() was already called")
            self._started = True
            self._log_dir.mkdir(parents=True, exist_ok=True)
            try:
                for slot in self._slots.values():
                    self._spawn(slot, marker=None)
            except BaseException:
                self.stop("a task could not be started")
                raise

    def poll(self) -> Optional[RunResult]:
        """Applies the run policy to what has exited. Returns the result once the run has ended, else None."""
        with self._lock:
            if self._result is not None:
                return self._result
            if not self._started:
                raise RuntimeError("Supervisor.poll() before start()")
            if self._stop_request is not None:
                return self.stop(self._stop_request)
            now = time.time()
            self._collect(now)
            return self._decide(now)

    def wait(self, timeout: Optional[float] = None) -> RunResult:
        """Polls until the run ends.

        Raises:
            TimeoutError: not ended after `timeout` seconds; the tasks keep running (call `stop`).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            result = self.poll()
            if result is not None:
                return result
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"run not finished after {timeout} s; still running: "
                                   f"{', '.join(self.pids()) or 'none'}")
            time.sleep(POLL_INTERVAL_SECS)

    def request_stop(self, reason: str) -> None:
        """Asks the next `poll`/`wait` to stop the run. Takes no lock, so a signal handler may call it."""
        self._stop_request = reason

    def stop(self, reason: str = "stopped") -> RunResult:
        """Stops every task (SIGTERM to its process group, `grace_period_secs`, then SIGKILL) and reaps all.

        Returns the run's result: the one already reached, else a not-ok result with `reason`.
        """
        with self._lock:
            if self._result is not None:
                return self._result
            self._collect(time.time())
            return self._finish(False, reason)

    def close(self) -> None:
        """Stops the run if it has not ended, then raises the first error from a log reader thread, if any."""
        self.stop("supervisor closed")
        if self._thread_errors:
            name, err = self._thread_errors[0]
            raise RuntimeError(f"copying the output of {name} failed: {err!r}") from err

    def __enter__(self) -> "Supervisor":
        if not self._started:
            self.start()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:                           # do not mask the exception in flight
            self.stop(f"launcher error: {exc_type.__name__}")

    # -- fault injection and restarts -------------------------------------------------------------------

    def kill_task(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Sends `sig` to the process group of task `name` (fault injection). Its exit then goes through the
        run policy at the next poll, unless `start_task` restarts it first."""
        with self._lock:
            slot = self._slot(name)
            if not slot.running:
                raise RuntimeError(f"kill_task: {name} is not running")
            logger.info("sending %s to %s (pid %d)", signal.Signals(sig).name, name, slot.popen.pid)
            _signal_group(slot.popen.pid, sig)

    def wait_task(self, name: str, timeout: float) -> int:
        """Waits for task `name` to exit and returns its return code, without applying the run policy.

        Raises:
            TimeoutError: still running after `timeout` seconds.
        """
        slot = self._slot(name)
        if slot.popen is None:
            raise RuntimeError(f"wait_task: {name} was never started")
        try:
            slot.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"{name} still running after {timeout} s") from None
        with self._lock:
            self._collect(time.time())
            return slot.returncode

    def start_task(self, name: str) -> None:
        """Starts task `name` again after it exited: its log gets a marker line and a new segment, and its
        restart counter goes up. The old exit is not counted as a failure.

        Raises:
            RuntimeError: the run has ended, or the task is still running (kill it and `wait_task` first).
        """
        with self._lock:
            if self._result is not None:
                raise RuntimeError(f"start_task({name}): the run has already ended")
            slot = self._slot(name)
            self._collect(time.time())
            if slot.running:
                raise RuntimeError(f"start_task({name}): it is still running")
            self._restart(slot)

    # -- internals ----------------------------------------------------------------------------------------

    def _slot(self, name: str) -> _Slot:
        try:
            return self._slots[name]
        except KeyError:
            raise KeyError(f"no task {name!r}; tasks are {', '.join(self._slots)}") from None

    def _spawn(self, slot: _Slot, marker: Optional[str]) -> None:
        task = slot.task
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"           # lines reach the log as printed; task.env may override
        env.update(dict(task.env))
        log = open(slot.log_path, "ab")
        try:
            if marker is None and slot.log_path.stat().st_size > 0:
                marker = f"new run of {slot.name}"
            if marker is not None:
                stamp = datetime.datetime.now().isoformat(timespec="milliseconds")
                log.write(f"===== psworker: {marker} at {stamp} =====\n".encode())
                log.flush()
            popen = self._popen(
                list(task.argv),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_make_preexec(),
            )
        except BaseException:
            log.close()
            raise
        slot.popen = popen
        slot.started_at = time.time()
        slot.ended_at = slot.returncode = None
        slot.judged = slot.stopped = False
        slot.tail = collections.deque(maxlen=LOG_TAIL_LINES)
        slot.reader = threading.Thread(
            target=self._pump, args=(slot.name, popen.stdout, log, slot.tail),
            name=f"psworker-log-{slot.name}", daemon=True)
        slot.reader.start()
        logger.debug("started %s (pid %d): %s", slot.name, popen.pid, " ".join(task.argv))

    def _pump(self, name: str, stream: Any, log: Any, tail: collections.deque) -> None:
        """Reader thread: every line to the log file (flushed) and, prefixed, to the console."""
        prefix = f"[{name}] "
        log_ok = console_ok = True
        try:
            for raw in iter(stream.readline, b""):
                if not raw.endswith(b"\n"):
                    raw += b"\n"
                text = raw.decode("utf-8", "replace").rstrip("\r\n")
                tail.append(text)
                if log_ok:
                    try:
                        log.write(raw)
                        log.flush()
                    except Exception as err:    # keep draining the pipe so the task never blocks on it
                        log_ok = False
                        self._thread_error(name, err)
                shown = text if self._console_filter is None else self._console_filter(text)
                if console_ok and shown is not None:
                    try:
                        with self._console_lock:
                            self._console.write(prefix + shown + "\n")
                            self._console.flush()
                    except Exception as err:   # e.g. `psworker local ... | head`: not worth failing a run for
                        console_ok = False
                        logger.warning("console copy of %s stopped (%r); its full log is still written", name, err)
        except Exception as err:
            self._thread_error(name, err)
        finally:
            for f in (stream, log):
                with contextlib.suppress(Exception):
                    f.close()

    def _thread_error(self, name: str, err: BaseException) -> None:
        logger.error("copying the output of %s failed", name, exc_info=err)
        self._thread_errors.append((name, err))

    def _collect(self, now: float) -> None:
        """Records the exit of every task that has exited."""
        for slot in self._slots.values():
            if slot.running:
                returncode = slot.popen.poll()
                if returncode is not None:
                    slot.returncode, slot.ended_at = returncode, now
                    logger.info("%s (pid %d) exited: %s", slot.name, slot.popen.pid,
                                describe_returncode(returncode))

    def _decide(self, now: float) -> Optional[RunResult]:
        slots = list(self._slots.values())
        workers_done = all(s.returncode == 0 for s in slots if s.task.job not in SERVER_JOBS)
        for slot in slots:
            if slot.popen is None or slot.running or slot.judged:
                continue
            slot.judged = True
            reason = self._judge(slot, workers_done)
            if reason is None:
                continue
            policy = self._restart_policy
            if policy is not None and policy(slot.name, slot.returncode, slot.restarts):
                logger.warning("%s %s; restarting it (restart %d)", slot.name, reason, slot.restarts + 1)
                self._restart(slot)
                continue
            if self._failure is None or slot.ended_at < self._failure.at:
                self._failure = self._make_failure(slot, reason)
        if self._failure is not None:
            return self._finish(False, f"{self._failure.name} failed")
        if workers_done:
            if self._drain_deadline is None:
                self._drain_deadline = now + self._ps_grace
                logger.debug("all workers succeeded; giving ps tasks %.1f s to exit", self._ps_grace)
            if not any(s.running for s in slots) or now >= self._drain_deadline:
                return self._finish(True, "all workers exited 0")
        return None

    def _judge(self, slot: _Slot, workers_done: bool) -> Optional[str]:
        """Why this exit fails the run, or None if it does not."""
        described = describe_returncode(slot.returncode)
        if slot.task.job not in SERVER_JOBS:
            return None if slot.returncode == 0 else f"exited with {described}"
        if workers_done:
            if slot.returncode != 0:
                logger.warning("%s exited with %s after the workers succeeded", slot.name, described)
            return None
        return f"exited ({described}) while workers were still running"

    def _make_failure(self, slot: _Slot, reason: str) -> TaskFailure:
        if slot.reader is not None:         # let it copy the last lines (EOF follows the exit)
            slot.reader.join(2.0)
        logger.error("%s %s", slot.name, reason)
        return TaskFailure(slot.name, slot.returncode, tuple(slot.tail), slot.ended_at, reason)

    def _restart(self, slot: _Slot) -> None:
        pgid = slot.popen.pid
        _signal_group(pgid, signal.SIGKILL)    # stragglers of the old attempt
        if slot.reader is not None:
            slot.reader.join(_READER_JOIN_SECS)
        slot.restarts += 1
        self._spawn(slot, marker=f"restart {slot.restarts} of {slot.name}")

    def _finish(self, ok: bool, reason: str) -> RunResult:
        self._stop_all(reason)
        exits = {
            s.name: TaskExit(s.name, s.returncode, s.started_at, s.ended_at, str(s.log_path), s.restarts,
                             s.stopped)
            for s in self._slots.values() if s.popen is not None
        }
        self._result = RunResult(ok, exits, self._failure, reason)
        if self._thread_errors:
            logger.error("%d error(s) while copying task output; the first: %r",
                         len(self._thread_errors), self._thread_errors[0][1])
        return self._result

    def _stop_all(self, reason: str) -> None:
        """SIGTERM to every task's process group and known descendants, grace, SIGKILL, reap, join readers."""
        slots = [s for s in self._slots.values() if s.popen is not None]
        running = [s for s in slots if s.running]
        pgids = {s.popen.pid for s in slots}    # new session: pgid == pid; exited ones may leave stragglers
        descendants: list[psutil.Process] = []
        for slot in running:
            slot.stopped = True
            with contextlib.suppress(psutil.Error):
                descendants += psutil.Process(slot.popen.pid).children(recursive=True)
        members = _live_group_members(pgids)
        if running or members:
            logger.info("stopping %s (%s)", ", ".join(s.name for s in running) or "stragglers", reason)
        for pgid in members:
            _signal_group(pgid, signal.SIGTERM)
        for proc in descendants:                # also those that left the group (setsid)
            with contextlib.suppress(psutil.Error):
                proc.terminate()

        deadline = time.monotonic() + self._grace
        while True:
            self._collect(time.time())
            members = _live_group_members(pgids)
            strays = [p for p in descendants if _alive(p)]
            if not members and not strays and not any(s.running for s in slots):
                break
            if time.monotonic() >= deadline:
                names = [s.name for s in slots if s.running or s.popen.pid in members]
                logger.warning("still alive %.1f s after SIGTERM, sending SIGKILL: %s",
                               self._grace, ", ".join(names) or f"pids {[p.pid for p in strays]}")
                for pgid in members:
                    _signal_group(pgid, signal.SIGKILL)
                for proc in strays:
                    with contextlib.suppress(psutil.Error):
                        proc.kill()
                break
            time.sleep(0.05)

        for slot in slots:
            if slot.running:
                try:
                    slot.returncode = slot.popen.wait(_REAP_TIMEOUT_SECS)
                except subprocess.TimeoutExpired:
                    logger.error("%s (pid %d) survived SIGKILL", slot.name, slot.popen.pid)
                    slot.returncode = -int(signal.SIGKILL)
                slot.ended_at = time.time()
        for slot in slots:
            if slot.reader is not None:
                slot.reader.join(_READER_JOIN_SECS)
                if slot.reader.is_alive():
                    logger.error("the log reader of %s did not finish", slot.name)


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class SignalCatcher:
    """Filled in by `stop_on_signals`: the first signal received, or None."""

    signum: Optional[int] = None


@contextlib.contextmanager
def stop_on_signals(sup: Supervisor, signals: Sequence[int] = (signal.SIGINT, signal.SIGTERM)
                    ) -> Iterator[SignalCatcher]:
    """While inside, `signals` make `sup.wait()` stop every task and return; the old handlers return after.

    Outside the main thread (where Python cannot install handlers) it installs nothing.
    """
    caught = SignalCatcher()
    if threading.current_thread() is not threading.main_thread():
        yield caught
        return

    def handler(signum: int, frame: Any) -> None:
        if caught.signum is None:
            caught.signum = signum
        sup.request_stop(f"launcher received {signal.Signals(signum).name}")

    previous = {}
    try:
        for sig in signals:
            previous[sig] = signal.signal(sig, handler)
        yield caught
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
