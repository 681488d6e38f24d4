"""The run loop: starts every task through a `ProcessBackend`, copies its output, carries out the run policy's
decisions (`psworker.launcher.supervise.run_policy`: restart, fail, drain, succeed), injects faults, detects stalls, and
stops everything at the end."""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, TextIO

from psworker.deadline import poll_until
from psworker.launcher import runstate
from psworker.launcher.supervise import outcome, run_policy, watch
from psworker.launcher.supervise.attempts import Attempts
from psworker.launcher.supervise.by_hand import ByHand
from psworker.launcher.elastic import membership
from psworker.launcher.elastic.workers import ElasticWorkers
from psworker.launcher.inject import Fault
from psworker.launcher.console.output import OutputCopier
from psworker.launcher.backends.base import ProcessBackend
from psworker.launcher.policy import ALL_WORKERS, SuccessPolicy
from psworker.launcher.console.progress import Progress
from psworker.states import RunState, TaskState
from psworker.launcher.supervise.rollback import Rollbacks
from psworker.launcher.console.report import RunResult, TaskFailure
from psworker.launcher.rundir import task_log_name
from psworker.launcher.elastic.scale_inbox import ScaleInbox
from psworker.launcher.supervise.run_policy import (SERVER_JOBS, Ending, Fail, Restart, RestartRule, Rules, Settled,
                                                    TaskView)
from psworker.launcher.supervise.slot import Slot, TaskLike, distinct_names
from psworker.launcher.supervise.stacks import StackAsker
from psworker.spec import Elastic

__all__ = ["Supervisor"]

logger = logging.getLogger(__name__)

POLL_INTERVAL_SECS = 0.1


class Supervisor(ByHand):
    """Starts one process per task, copies its output, applies the run policy, and stops everything.

    Use from one thread (plus `request_stop`, which is safe in a signal handler):

        with Supervisor(tasks, log_dir, backend=LocalBackend()) as sup:   # starts the tasks; stops, reaps all on exit
            result = sup.wait()

    The run policy (`success`, `done_jobs`, the graces, `restart_policy`) is `psworker.launcher.supervise.run_policy`'s:
    it decides, this carries it out. When a task fails and is not restarted, every other task is stopped, and the first
    failure by time is the root cause.

    Args:
        tasks: what to run, e.g. `psworker.spec.plan.plan(...)`; names must be distinct.
        log_dir: where `<job>-<index>.log` go; created on start.
        backend: starts and signals the processes (e.g. `psworker.launcher.backends.local.LocalBackend()`).
        console: where the `[job:index] `-prefixed copy goes; None: sys.stdout at construction.
        console_filter: maps a task's output line and name to what the console shows (None: nothing); None: all.
        console_window_secs: show a line that several tasks print within this window once (`[worker:0-7] `).
        grace_period_secs: between SIGTERM and SIGKILL when stopping.
        ps_exit_grace_secs: how long servers may take to exit by themselves once the run is done.
        restart_policy: None (a failure ends the run), or e.g. a `psworker.launcher.policy.RestartPolicy`.
        faults: injected faults (`psworker.launcher.inject`).
        stall_timeout_secs: kill (then judge, maybe restart) a worker whose step has not moved this long.
        done_jobs: the jobs whose every task must exit 0 for success (default: all but ps).
        success: when the run has succeeded, and how long the other `done_jobs` tasks then get (default: all).
        stacks: how to ask a task for its Python stacks before it is killed as stalled or stopped
            (`psworker.launcher.supervise.stacks`); None: not asked.
        elastic: the worker job's elastic range: only `start` workers start, the others when scaled up
            (`scale`, or requests from `scale_inbox`); None: a fixed job, every task starts.
        scale_inbox: the run dir's `psworker scale` requests and state file
            (`psworker.launcher.elastic.scale_inbox`).
        run_dir: where to keep `tasks.json`, each task's pid, host, state and exit (`launcher.runstate`).
        stop_save_secs: how long a stop by `request_stop` gives the chief to save before the ps go; 0: no wait.
    """

    _result: Optional[RunResult]
    _failure: Optional[TaskFailure]
    _stop_request: Optional[str]

    def __init__(
        self,
        tasks: Sequence[TaskLike],
        log_dir: str | os.PathLike,
        *,
        backend: ProcessBackend,
        console: Optional[TextIO] = None,
        console_filter: Optional[Callable[[str, str], Optional[str]]] = None,
        console_window_secs: float = 0.0,
        grace_period_secs: float = 10.0,
        ps_exit_grace_secs: float = 15.0,
        restart_policy: Optional[RestartRule] = None,
        faults: Sequence[Fault] = (),
        stall_timeout_secs: Optional[float] = None,
        done_jobs: Optional[frozenset[str]] = None,
        success: SuccessPolicy = SuccessPolicy(ALL_WORKERS),
        stacks: Optional[StackAsker] = None,
        elastic: Optional[Elastic] = None,
        scale_inbox: Optional[ScaleInbox] = None,
        run_dir: Optional[str | os.PathLike] = None,
        stop_save_secs: float = 0.0,
    ) -> None:
        names = distinct_names(tasks)
        self._log_dir = Path(log_dir)
        self._slots = {t.name: Slot(t, self._log_dir / task_log_name(t.name)) for t in tasks}
        self._backend = backend
        self._grace = grace_period_secs
        self._stall = stall_timeout_secs
        self._stacks = stacks
        self._faults = list(faults)
        self._rules = Rules(done_jobs if done_jobs is not None else frozenset(t.job for t in tasks) - SERVER_JOBS,
                            success.deciding_task(names), success.worker_exit_grace_secs, ps_exit_grace_secs,
                            restart_policy)
        self.progress = Progress(names)
        self._lock = threading.RLock()
        self._started = False
        self._started_time = 0.0
        self._stop_request = None
        self._hard_stop = False
        self._stop_save_secs = stop_save_secs
        self._result = None
        self._failure = None
        self._ending = Ending()     # once succeeded, its drain
        self._rollbacks = Rollbacks()
        self._taskfile = None if run_dir is None else runstate.TaskFile(Path(run_dir))
        self._output = OutputCopier(console if console is not None else sys.stdout, console_filter,
                                    self.progress, window_secs=console_window_secs, on_event=self._rollbacks.seen)
        self._attempts = Attempts(self._slots, backend, self._output, self.progress)
        self._elastic = None if elastic is None else ElasticWorkers(
            elastic, self._slots, self._backend, self.progress, self._attempts.spawn, scale_inbox)

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

    def ended_attempts(self) -> dict[str, tuple[tuple, Optional[tuple]]]:
        """Per task, the (exit code, cause) of each attempt restarted, and of the current one once ended (else None);
        read without the lock, for /metrics (`launcher/metrics.py`)."""
        return {n: (tuple(s.exits), None if s.returncode is None else (s.returncode, s.cause))
                for n, s in list(self._slots.items())}

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
                        self._attempts.spawn(slot)
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
                return self.stop(self._stop_request, save=True)
            now = time.time()
            self._attempts.collect(now)
            self._watch(now)
            for slot in self._slots.values():
                if (slot.restart_at is not None and now >= slot.restart_at
                        and run_policy.may_restart(self._view(slot), self._rules, self._ending, now)):
                    slot.restart_at = None
                    self._restart(slot, slot.restart_cause)
            if self._elastic is not None:
                self._elastic.poll(training_over=self._ending.begun)
            result = self._decide(now)
            self._publish()
            return result

    def wait(self, timeout: Optional[float] = None) -> RunResult:
        """Polls until the run ends.

        Raises:
            TimeoutError: not ended after `timeout` seconds; the tasks keep running (call `stop`).
        """
        result = poll_until(self.poll, math.inf if timeout is None else timeout, interval=POLL_INTERVAL_SECS)
        if result is None:
            raise TimeoutError(f"run not finished after {timeout} s; still running: {', '.join(self.pids()) or 'none'}")
        return result

    def request_stop(self, reason: str, *, hard: bool = False) -> None:
        """Asks the next `poll`/`wait` to stop the run, the workers first (`stop_save_secs`); `hard` (a second
        Ctrl-C): at once, also while that stop waits for the workers. Takes no lock: a signal handler may call it."""
        if self._stop_request is None:
            self._stop_request = reason
        self._hard_stop = self._hard_stop or hard

    def stop(self, reason: str = "stopped", *, save: bool = False) -> RunResult:
        """Stops every task (SIGTERM, `grace_period_secs`, then SIGKILL, via the backend) and reaps all; `save`:
        the workers first, given `stop_save_secs` to exit (the chief writes a checkpoint) while the ps serve on.

        Returns the run's result: the one already reached, else a not-ok result with `reason`.
        """
        with self._lock:
            if self._result is not None:
                return self._result
            self._attempts.collect(time.time())
            return self._finish(False, reason, save=save)

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

    # -- internals ----------------------------------------------------------------------------------------

    def _slot(self, name: str) -> Slot:
        try:
            return self._slots[name]
        except KeyError:
            raise KeyError(f"no task {name!r}; tasks are {', '.join(self._slots)}") from None

    def _restart(self, slot: Slot, cause: str) -> None:
        if slot.task.job in SERVER_JOBS:        # its variables are gone: the chief's next session says what it cost
            self._rollbacks.ps_restarted(slot.name, self.progress.global_step())
        self._attempts.restart(slot, cause)

    def _publish(self) -> None:
        if self._taskfile is not None:
            local = getattr(self._backend, "LOCAL_PIDS", False)
            self._taskfile.publish(runstate.task_records(self._slots.values(), self.progress, local))

    def _watch(self, now: float) -> None:
        watch.resume_stopped(self._slots.values(), self._backend, self.progress, now)
        watch.fire_faults(self._slots, self._faults, self._backend, self.progress, now - self._started_time, now)
        if self._stall and not self._ending.begun:     # after success the stragglers have their grace
            watch.kill_stalled(self._slots.values(), self._backend, self.progress, self._stall, now, self._stacks)
            watch.kill_after_stacks(self._slots.values(), self._backend)

    def _view(self, slot: Slot) -> TaskView:
        return slot.view(counts=self._elastic is None or self._elastic.counts_for_success(slot))

    def _decide(self, now: float) -> Optional[RunResult]:
        """Puts every new exit through the run policy and carries out its verdicts, then ends or drains the run."""
        views = {name: self._view(slot) for name, slot in self._slots.items()}
        done = run_policy.succeeded(list(views.values()), self._rules)
        over = not done and run_policy.training_over(list(views.values()))
        if over and not self._ending.begun:
            self._ending = run_policy.start_ending(self._ending, now)
            logger.warning("%s; stopping the other tasks", self._ending.reason)
        for slot in self._slots.values():
            if slot.popen is None or slot.running or slot.judged:
                continue
            slot.judged = True
            self._carry_out(slot, self._verdict(views[slot.name], done or over, over), now)
        if self._failure is not None:
            return self._finish(False, f"{self._failure.name} failed")
        return self._drain(now) if done or over else None

    def _verdict(self, view: TaskView, done: bool, over: bool) -> run_policy.Verdict:
        """The run policy's verdict on an exit; an elastic job's worker exit goes through membership first."""
        member = membership.STILL_MEMBER
        if self._elastic is not None and view.job == "worker":
            restarting = not done and run_policy.restartable(view, self._rules)
            member = self._elastic.exited(self._slots[view.name], restarting=restarting, training_over=done)
        return run_policy.verdict(view, self._rules, done, over, member)

    def _carry_out(self, slot: Slot, verdict: run_policy.Verdict, now: float) -> None:
        if isinstance(verdict, Settled):
            if verdict.note:
                logger.warning("%s %s", slot.name, verdict.note)
            if verdict.state is not None:
                self.progress.set_state(slot.name, verdict.state)
        elif isinstance(verdict, Restart):
            slot.restart_cause, slot.restart_at = verdict.cause, now + verdict.delay
            logger.warning("%s %s; restart %d in %.1f s", slot.name, verdict.reason, slot.restarts + 1, verdict.delay)
            self.progress.set_state(slot.name, TaskState.RESTARTING)
        else:
            assert isinstance(verdict, Fail)
            self.progress.set_state(slot.name, TaskState.FAILED)
            if self._failure is None or slot.ended_at < self._failure.at:
                self._failure = outcome.task_failure(slot, verdict.reason)
                logger.error("%s %s", slot.name, verdict.reason)

    def _drain(self, now: float) -> Optional[RunResult]:
        """After success: `run_policy.drain` says when the run finishes; this says so and finishes it."""
        views = [self._view(slot) for slot in self._slots.values()]
        before = self._ending
        self._ending, finish = run_policy.drain(views, self._rules, before, now)
        workers = ", ".join(run_policy.stragglers(views, self._rules))
        if not before.begun and workers:
            logger.info("%s: the run has succeeded; the other workers (%s) get %g s to exit by themselves",
                        self._ending.reason, workers, self._rules.worker_grace)
        if finish and workers:
            logger.warning("%s still running %g s after the run succeeded (%s)", workers,
                           self._ending.workers_until - self._ending.at, self._ending.reason)
        elif before.servers_until is None and self._ending.servers_until is not None:
            logger.debug("the run is done; giving servers %.1f s to exit", self._rules.ps_grace)
        return self._finish(True, self._ending.reason) if finish else None

    def _finish(self, ok: bool, reason: str, save: bool = False) -> RunResult:
        if save and self._stop_save_secs > 0 and not self._hard_stop:
            self._attempts.stop_workers_first(reason, self._stop_save_secs, self._grace, lambda: self._hard_stop)
        quiet = self._hard_stop or self._stop_request is not None   # a person's stop: nothing went wrong, no stacks
        self._attempts.stop_all(reason, 0.0 if self._hard_stop else self._grace, None if quiet else self._stacks)
        failed = self._failure.name if self._failure is not None else None
        self._result = RunResult(ok, outcome.task_exits(self._slots.values(), failed), self._failure, reason)
        self._publish()
        if self._elastic is not None:
            self._elastic.finish(RunState.SUCCEEDED if ok else f"{RunState.FAILED}: {reason}")
        if self._output.errors:
            logger.error("%d error(s) while copying task output; the first: %r",
                         len(self._output.errors), self._output.errors[0][1])
        return self._result

