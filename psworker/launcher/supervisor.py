"""The run loop: starts every task through a `ProcessBackend`, copies its output, applies the run and restart
policy, injects faults, detects stalls, and stops everything at the end."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, TextIO

from psworker import events, stackdump
from psworker.launcher import watch
from psworker.launcher.elastic import ElasticWorkers
from psworker.launcher.inject import Fault
from psworker.launcher.output import OutputCopier
from psworker.launcher.backends.base import ProcessBackend
from psworker.launcher.backends.local import LocalBackend
from psworker.launcher.policy import ALL_WORKERS, SuccessPolicy
from psworker.launcher.progress import Progress
from psworker.launcher.report import RunResult, TaskExit, TaskFailure, describe_returncode
from psworker.launcher.rundir import task_log_name
from psworker.launcher.scale_inbox import ScaleInbox
from psworker.launcher.slot import SERVER_JOBS, Slot, TaskLike
from psworker.launcher.stacks import StackAsker
from psworker.spec import Elastic

__all__ = ["Supervisor", "SERVER_JOBS"]

logger = logging.getLogger(__name__)

POLL_INTERVAL_SECS = 0.1
STACK_FRAMES = 5                  # the report shows this many innermost frames of a stuck task's main thread
_READER_JOIN_SECS = 5.0
_EXIT_READER_WAIT_SECS = 0.5      # for a task's reader to reach the end of its output once the task has exited

# (task name, returncode, restarts so far) -> True to restart; a `delay(restarts)` method sets the backoff.
RestartDecider = Callable[[str, int, int], bool]


class Supervisor:
    """Starts one process per task, copies its output, applies the run policy, and stops everything.

    Use from one thread (plus `request_stop`, which is safe in a signal handler):

        with Supervisor(tasks, log_dir) as sup:     # starts the tasks; stops and reaps all on exit
            result = sup.wait()

    Run policy (`success`, as Kubeflow TFJob's): the run succeeds when every task of `done_jobs` has
    exited 0 (`all-workers`), or when the chief (`chief:0`, else `worker:0`) has (`chief-or-worker0`). The other
    `done_jobs` tasks then get `success.worker_exit_grace_secs` to exit by themselves (and to be restarted), the rest
    (servers) `ps_exit_grace_secs` after them; whoever is left is stopped and the run still succeeds. It fails
    when a task fails and is not restarted: a `done_jobs` task exits non-zero (also within its grace), a ps exits
    before success, or another task exits non-zero before success. Then every other task is stopped, and the
    first failure by time is the root cause.
    """

    def __init__(
        self,
        tasks: Sequence[TaskLike],
        log_dir: str | os.PathLike,
        *,
        console: Optional[TextIO] = None,
        console_filter: Optional[Callable[[str], Optional[str]]] = None,
        console_window_secs: float = 0.0,
        grace_period_secs: float = 10.0,
        ps_exit_grace_secs: float = 15.0,
        popen: Callable[..., subprocess.Popen] = subprocess.Popen,
        backend: Optional[ProcessBackend] = None,
        restart_policy: Optional[RestartDecider] = None,
        faults: Sequence[Fault] = (),
        stall_timeout_secs: Optional[float] = None,
        done_jobs: Optional[frozenset[str]] = None,
        success: SuccessPolicy = SuccessPolicy(ALL_WORKERS),
        stacks: Optional[StackAsker] = None,
        elastic: Optional[Elastic] = None,
        scale_inbox: Optional[ScaleInbox] = None,
    ) -> None:
        """Args:
            tasks: what to run, e.g. `psworker.plan.plan(...)`; names must be distinct.
            log_dir: where `<job>-<index>.log` go; created on start.
            console: where the `[job:index] `-prefixed copy goes; None: sys.stdout at construction.
            console_filter: maps a task's output line to what the console shows (None: nothing); None: all.
            console_window_secs: show a line that several tasks print within this window once (`[worker:0-7] `).
            grace_period_secs: between SIGTERM and SIGKILL when stopping.
            ps_exit_grace_secs: how long servers may take to exit by themselves once the run is done.
            popen: for the default local backend: starts a process (Popen's signature; tests swap it).
            backend: starts and signals the processes; None: `LocalBackend(popen=popen)`.
            restart_policy: None (a failure ends the run), or e.g. a `psworker.launcher.RestartPolicy`.
            faults: injected faults (`psworker.launcher.inject`).
            stall_timeout_secs: kill (then judge, maybe restart) a worker whose step has not moved this long.
            done_jobs: the jobs whose every task must exit 0 for success (default: all but ps).
            success: when the run has succeeded, and how long the other `done_jobs` tasks then get (default: all).
            stacks: how to ask a task for its Python stacks before it is killed as stalled or stopped
                (`psworker.launcher.stacks`); None: not asked.
            elastic: the worker job's elastic range: only `start` workers start, the others when scaled up
                (`scale`, or requests from `scale_inbox`); None: a fixed job, every task starts.
            scale_inbox: the run dir's `psworker scale` requests and state file (`psworker.launcher.scale_inbox`).
        """
        names = _distinct_names(tasks)
        self._log_dir = Path(log_dir)
        self._slots = {t.name: Slot(t, self._log_dir / task_log_name(t.name)) for t in tasks}
        self._grace = grace_period_secs
        self._ps_grace = ps_exit_grace_secs
        self._backend = backend if backend is not None else LocalBackend(popen=popen)
        self._restart_policy = restart_policy
        self._faults = list(faults)
        self._stall = stall_timeout_secs
        self._stacks = stacks
        self._done_jobs = done_jobs if done_jobs is not None else frozenset(t.job for t in tasks) - SERVER_JOBS
        self.progress = Progress(names)
        self._init_run_state(names, success)
        self._output = OutputCopier(console if console is not None else sys.stdout, console_filter,
                                    self.progress, window_secs=console_window_secs)
        self._elastic = None if elastic is None else ElasticWorkers(
            elastic, self._slots, self._backend, self.progress, lambda slot: self._spawn(slot, marker=None),
            scale_inbox)

    def _init_run_state(self, names: list[str], success: SuccessPolicy) -> None:
        self._lock = threading.RLock()
        self._started = False
        self._started_time = 0.0
        self._result: Optional[RunResult] = None
        self._failure: Optional[TaskFailure] = None
        self._deciding, self._worker_grace = success.deciding_task(names), success.worker_exit_grace_secs
        # When the run succeeded, until when the other workers and then the servers may exit by themselves, and why.
        self._done_at, self._workers_until, self._servers_until, self._done_reason = None, 0.0, None, ""
        self._stop_request: Optional[str] = None

    # -- introspection ------------------------------------------------------------------------------------

    log_dir = property(lambda self: self._log_dir)

    @property
    def result(self) -> Optional[RunResult]:
        """The result once the run has ended, else None."""
        return self._result

    @property
    def thread_errors(self) -> list[tuple[str, BaseException]]:
        """Errors raised in the log reader threads, as (task name, exception); `close()` raises the first."""
        return list(self._output.errors)

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
            self._started_time = time.time()
            self._log_dir.mkdir(parents=True, exist_ok=True)
            try:
                for slot in self._slots.values():
                    if self._elastic is None or self._elastic.starts_at_launch(slot):
                        self._spawn(slot, marker=None)
            except BaseException:
                self.stop("a task could not be started")
                raise
            if self._elastic is not None:
                self._elastic.launched()

    def poll(self) -> Optional[RunResult]:
        """Applies the run policy to what has exited, injects due faults, restarts tasks whose backoff is
        over. Returns the result once the run has ended, else None."""
        with self._lock:
            if self._result is not None:
                return self._result
            if not self._started:
                raise RuntimeError("Supervisor.poll() before start()")
            if self._stop_request is not None:
                return self.stop(self._stop_request)
            now = time.time()
            self._collect(now)
            self._watch(now)
            for slot in self._slots.values():
                if slot.restart_at is not None and now >= slot.restart_at and self._may_restart(slot, now):
                    slot.restart_at = None
                    self._restart(slot, slot.restart_cause)
            if self._elastic is not None:
                self._elastic.poll(training_over=self._done_at is not None)
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
        """Stops every task (SIGTERM, `grace_period_secs`, then SIGKILL, via the backend) and reaps all.

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
        if self._output.errors:
            name, err = self._output.errors[0]
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

    # -- fault injection and restarts by hand ---------------------------------------------------------------

    def scale(self, workers: int) -> str:
        """Sets an elastic job's worker count: the lowest reserved workers start, or the highest running ones (never
        worker 0) are asked to leave. Returns the console line.

        Raises:
            ValueError: the job is not elastic, `workers` is outside min..max, or training is over.
        """
        with self._lock:
            if self._elastic is None:
                raise ValueError("the job is not elastic")
            return self._elastic.scale(workers, "by hand", training_over=self._done_at is not None)

    def members(self) -> Optional[dict]:
        """An elastic job's membership (`Membership.summary()`: how many workers run, the target, each state's
        indices); None for a fixed job."""
        with self._lock:
            return None if self._elastic is None else self._elastic.members.summary()

    def kill_task(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Sends `sig` to task `name` and its children. Its exit then goes through the run policy at the next
        poll, unless `start_task` restarts it first."""
        with self._lock:
            slot = self._slot(name)
            if not slot.running:
                raise RuntimeError(f"kill_task: {name} is not running")
            logger.info("sending %s to %s (pid %d)", signal.Signals(sig).name, name, slot.popen.pid)
            self._backend.signal(slot.popen, sig)

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
            slot.restart_at = None
            self._restart(slot, f"start_task after {describe_returncode(slot.returncode)}")

    # -- internals ----------------------------------------------------------------------------------------

    def _slot(self, name: str) -> Slot:
        try:
            return self._slots[name]
        except KeyError:
            raise KeyError(f"no task {name!r}; tasks are {', '.join(self._slots)}") from None

    def _spawn(self, slot: Slot, marker: Optional[events.Restart]) -> None:
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"           # lines reach the log as printed; task.env may override
        env.update(dict(slot.task.env))
        log = slot.open_log(marker)
        try:
            popen = self._backend.start(slot.task, env)
        except BaseException:
            log.close()
            raise
        slot.new_attempt(popen)
        self.progress.started(slot.name, slot.restarts, slot.started_at)
        slot.reader = threading.Thread(target=self._output.pump, args=(slot.name, popen.stdout, log, slot.tail,
                                                                         slot.task, popen.pid),
                                       name=f"psworker-log-{slot.name}", daemon=True)
        slot.reader.start()
        logger.debug("started %s (pid %d): %s", slot.name, popen.pid, " ".join(slot.task.argv))

    def _collect(self, now: float) -> None:
        """Records the exit of every task that has exited (an injected `exit` fault sets the code judged)."""
        for slot in self._slots.values():
            if slot.running:
                returncode = slot.popen.poll()
                if returncode is not None:
                    if slot.forced_code is not None:
                        returncode = slot.forced_code
                    slot.returncode, slot.ended_at = returncode, now
                    if slot.reader is not None:     # its last lines before the word that it exited
                        slot.reader.join(_EXIT_READER_WAIT_SECS)
                    text = f"{slot.name} (pid {slot.popen.pid}) exited: {slot.cause or describe_returncode(returncode)}"
                    if not self._output.exited(slot.name, text):
                        logger.info("%s", text)

    def _watch(self, now: float) -> None:
        watch.resume_stopped(self._slots.values(), self._backend, self.progress, now)
        watch.fire_faults(self._slots, self._faults, self._backend, self.progress, now - self._started_time, now)
        if self._stall and self._done_at is None:     # after success the stragglers have their grace
            watch.kill_stalled(self._slots.values(), self._backend, self.progress, self._stall, now, self._stacks)
            watch.kill_after_stacks(self._slots.values(), self._backend)

    def _decide(self, now: float) -> Optional[RunResult]:
        slots = list(self._slots.values())
        done = self._succeeded(slots)
        servers = [s for s in slots if s.task.job in SERVER_JOBS]
        # A ps exits by itself only once training is over: with the chief done too, late workers are stopped.
        over = (not done and servers and all(s.returncode == 0 and not s.stopped for s in servers)
                and any(getattr(s.task, "is_chief", False) and s.returncode == 0 for s in slots))
        if over and self._done_at is None:
            self._done_at = self._workers_until = now
            self._done_reason = "the chief and every ps exited 0: training is over"
            logger.warning("%s; stopping the other tasks", self._done_reason)
        done = done or bool(over)
        for slot in slots:
            if slot.popen is None or slot.running or slot.judged:
                continue
            slot.judged = True
            member = self._member_exit(slot, over or done)
            if member == "":
                continue
            reason = member or (None if over else self._judge(slot, done))
            if reason is None:
                self.progress.set_state(slot.name, "done" if slot.returncode == 0 else "exited")
                continue
            if member is None and self._would_restart(slot):
                policy = self._restart_policy
                delay = policy.delay(slot.restarts) if hasattr(policy, "delay") else 0.0
                slot.restart_cause = slot.cause or describe_returncode(slot.returncode)
                slot.restart_at = now + delay
                logger.warning("%s %s; restart %d in %.1f s", slot.name, reason, slot.restarts + 1, delay)
                self.progress.set_state(slot.name, f"restarting {slot.restarts + 1}")
                continue
            self.progress.set_state(slot.name, "failed")
            if self._failure is None or slot.ended_at < self._failure.at:
                self._failure = self._make_failure(slot, reason)
        if self._failure is not None:
            return self._finish(False, f"{self._failure.name} failed")
        return self._drain(slots, now) if done else None

    def _would_restart(self, slot: Slot) -> bool:
        policy = self._restart_policy
        return policy is not None and policy(slot.name, slot.returncode, slot.restarts)

    def _member_exit(self, slot: Slot, over: bool) -> Optional[str]:
        """An elastic job's worker exit through membership first (`ElasticWorkers.exited`): None to judge it as
        usual, "" when it left, else why the run fails."""
        if self._elastic is None or slot.task.job != "worker":
            return None
        return self._elastic.exited(slot, restarting=not over and self._would_restart(slot), training_over=over)

    def _succeeded(self, slots: list[Slot]) -> bool:
        """Whether the success policy holds: the deciding task, else every `done_jobs` task, has exited 0 (in an
        elastic job, every worker that joined and did not leave)."""
        deciding = self._slots.get(self._deciding) if self._deciding else None
        if deciding is not None:
            return deciding.returncode == 0
        counted = [s for s in slots if self._elastic is None or self._elastic.counts_for_success(s)]
        return all(s.returncode == 0 for s in counted if s.task.job in self._done_jobs)

    def _drain(self, slots: list[Slot], now: float) -> Optional[RunResult]:
        """After success: the other `done_jobs` tasks get the worker grace to exit by themselves, then the others
        (servers) the ps grace. Whoever is left after that is stopped, and the run has still succeeded."""
        workers = [s.name for s in slots if s.task.job in self._done_jobs and (s.running or s.restart_at is not None)]
        if self._done_at is None:
            self._done_at, self._workers_until = now, now + self._worker_grace
            self._done_reason = (f"{self._deciding} exited 0" if self._deciding
                                 else f"every {'/'.join(sorted(self._done_jobs))} task exited 0")
            if workers:
                logger.info("%s: the run has succeeded; the other workers (%s) get %g s to exit by themselves",
                            self._done_reason, ", ".join(workers), self._worker_grace)
        if workers:
            if now < self._workers_until:
                return None
            logger.warning("%s still running %g s after the run succeeded (%s)", ", ".join(workers),
                           self._workers_until - self._done_at, self._done_reason)
            return self._finish(True, self._done_reason)
        if self._servers_until is None:
            self._servers_until = now + self._ps_grace
            logger.debug("the run is done; giving servers %.1f s to exit", self._ps_grace)
        if not any(s.running for s in slots) or now >= self._servers_until:
            return self._finish(True, self._done_reason)
        return None

    def _may_restart(self, slot: Slot, now: float) -> bool:
        """No restarts once the run has succeeded, but of the `done_jobs` tasks within their grace."""
        return self._done_at is None or (slot.task.job in self._done_jobs and now < self._workers_until)

    def _judge(self, slot: Slot, done: bool) -> Optional[str]:
        """Why this exit fails the run, or None if it does not."""
        described = slot.cause or describe_returncode(slot.returncode)
        if slot.task.job in self._done_jobs:
            return None if slot.returncode == 0 else f"ended ({described})" if slot.cause else f"exited with {described}"
        if done:
            if slot.returncode != 0:
                logger.warning("%s exited with %s after the run was done", slot.name, described)
            return None
        if slot.returncode == 0 and slot.task.job not in SERVER_JOBS:
            return None
        return f"exited ({described}) while workers were still running"

    def _make_failure(self, slot: Slot, reason: str) -> TaskFailure:
        slot.reader.join(2.0)               # let it copy the last lines (EOF follows the exit)
        logger.error("%s %s", slot.name, reason)
        tail = tuple(slot.tail)
        if any(stackdump.is_dump_line(line) for line in tail):     # a dump fills it: the lines around the dump
            tail = _tail_without_stacks(slot.log_path, len(tail))
        said = events.last(events.TaskError, list(slot.tail))     # its own error line, for the report's first
        return TaskFailure(slot.name, slot.returncode, tail, slot.ended_at, reason,
                           error=said.message if said else "")

    def _restart(self, slot: Slot, cause: str) -> None:
        self._backend.signal(slot.popen, signal.SIGKILL)    # stragglers of the old attempt
        if slot.reader is not None:
            slot.reader.join(_READER_JOIN_SECS)
        slot.restarts += 1
        slot.causes.append(cause)
        logger.warning("restarting %s (restart %d: %s)", slot.name, slot.restarts, cause)
        self._spawn(slot, marker=events.Restart.now(slot.restarts, cause))

    def _finish(self, ok: bool, reason: str) -> RunResult:
        procs = [s.popen for s in self._slots.values() if s.popen is not None]
        running = [s for s in self._slots.values() if s.running]
        if running and self._stacks is not None:
            self._stacks.ask_all(running, self._backend, f"stopping: {reason}")
        for slot in running:
            slot.stopped = True
            self.progress.set_state(slot.name, "stopped")
        if running:
            logger.info("stopping %s (%s)", ", ".join(s.name for s in running), reason)
        self._backend.stop(procs, self._grace)
        for slot in running:
            code = slot.popen.poll()
            slot.returncode = code if code is not None else -int(signal.SIGKILL)
            slot.ended_at = time.time()
        for slot in self._slots.values():
            if slot.reader is not None:
                slot.reader.join(_READER_JOIN_SECS)
                if slot.reader.is_alive():
                    logger.error("the log reader of %s did not finish", slot.name)
        self._output.close()
        failed = self._failure.name if self._failure is not None else None
        exits = {s.name: TaskExit(s.name, s.returncode, s.started_at, s.ended_at, str(s.log_path), s.restarts,
                                  s.stopped, tuple(s.causes),
                                  _innermost_frames(s.log_path) if s.stopped or s.name == failed else ())
                 for s in self._slots.values() if s.popen is not None}
        self._result = RunResult(ok, exits, self._failure, reason)
        if self._elastic is not None:
            self._elastic.finish("succeeded" if ok else f"failed: {reason}")
        if self._output.errors:
            logger.error("%d error(s) while copying task output; the first: %r",
                         len(self._output.errors), self._output.errors[0][1])
        return self._result


def _current_attempt(log_path: Path) -> str:
    try:
        return events.current_attempt(log_path.read_text(errors="replace"))
    except OSError:
        return ""


def _innermost_frames(log_path: Path) -> tuple[str, ...]:
    """The innermost frames of the main thread in the last stack dump of the task's current attempt, if any."""
    dump = stackdump.last_dump(_current_attempt(log_path))
    return () if dump is None else dump.innermost(STACK_FRAMES)


def _tail_without_stacks(log_path: Path, count: int) -> tuple[str, ...]:
    """The last `count` non-blank lines of the task's current attempt that are no stack dump's."""
    lines = [line for line in _current_attempt(log_path).splitlines()
             if line.strip() and not stackdump.is_dump_line(line)]
    return tuple(lines[-count:])


def _distinct_names(tasks: Sequence[TaskLike]) -> list[str]:
    """The tasks' names, in order; ValueError when two tasks share one."""
    names = [t.name for t in tasks]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"duplicate task names: {', '.join(duplicates)}")
    return names
