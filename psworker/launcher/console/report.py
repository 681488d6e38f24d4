"""What a run ends with: one `TaskExit` per task, the root-cause `TaskFailure`, and the report for people."""

from __future__ import annotations

import datetime
import signal
from dataclasses import dataclass
from typing import Iterable, Optional

from psworker.errorfile import ErrorRecord
from psworker.launcher.console.lines import for_console
from psworker.launcher.policy import is_retryable

__all__ = ["RunResult", "TaskExit", "TaskFailure", "describe_returncode", "exit_status", "format_report",
           "restart_hint", "success_line"]


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
    restart_causes: tuple[str, ...] = ()   # why each restart happened, in order
    stack: tuple[str, ...] = ()     # a stopped or failed task: its main thread's innermost frames, from the last
                                    # stack dump in its log (`psworker.stackdump`), innermost first


@dataclass(frozen=True)
class TaskFailure:
    """The root cause of a failed run: the first task, by time, that failed."""

    name: str
    returncode: int
    log_tail: tuple[str, ...]       # the last lines of its output (current attempt)
    at: float
    reason: str = ""
    error: str = ""                 # its own error message: its error record's, else its `psworker: error:` line
    record: Optional[ErrorRecord] = None    # the failure as the task wrote it (`psworker.errorfile`), if it did
    error_file: str = ""            # where it wrote it


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


def success_line(result: RunResult, done_jobs: Iterable[str], seconds: float) -> str:
    """The first line after a successful run: `psworker: all 2 workers finished in 31.2 s` when every task of
    `done_jobs` exited 0 by itself, else the exit that decided and the tasks the launcher stopped after it."""
    done = sorted(set(done_jobs))
    finishers = [e for name, e in result.exits.items() if name.partition(":")[0] in done]
    if all(e.returncode == 0 and not e.stopped for e in finishers):
        what = f"all {len(finishers)} workers" if done == ["worker"] else f"every {'/'.join(done)} task"
        return f"psworker: {what} finished in {seconds:.1f} s"
    stopped = ", ".join(name for name, e in result.exits.items() if e.stopped) or "nothing"
    return f"psworker: run succeeded in {seconds:.1f} s ({result.reason}); the launcher stopped {stopped}"


def _failure_lines(result: RunResult, f: TaskFailure) -> list[str]:
    """The first failing task: its exit and its own error message, where it was (its main thread's innermost frames,
    when its log holds a stack dump), then its error record (`psworker.errorfile`), or without one its last log
    lines."""
    at = datetime.datetime.fromtimestamp(f.at).strftime("%H:%M:%S.%f")[:-3]
    lines = [f"psworker: run failed: {f.name} {f.reason or describe_returncode(f.returncode)} "
             f"(first failure, at {at})" + (f": {f.error}" if f.error else "")]
    log_path = result.exits[f.name].log_path if f.name in result.exits else "?"
    stack = result.exits[f.name].stack if f.name in result.exits else ()
    if stack:
        lines.append(f"--- where {f.name} was: its main thread, innermost frame first (every thread's stack: "
                     f"{log_path}) ---")
        lines.extend(f"  {frame}" for frame in stack)
    if f.record is not None:
        lines.append(f"--- {f.name}'s error: {f.record.describe()} ({f.error_file}; full log: {log_path}) ---")
        lines.extend(f"  {line}" for line in f.record.traceback)
        return lines
    tail = [line for line in f.log_tail if for_console(line) is not None]    # TensorFlow's own lines stay in the log
    left_out = ", ".join((["stack dumps"] if stack else []) + (["TensorFlow's lines"] if len(tail) < len(f.log_tail)
                                                                else []))
    without = f", {left_out} left out" if left_out else ""
    lines.append(f"--- last {len(tail)} lines of {f.name}{without} (full log: {log_path}) ---")
    lines.extend(f"  {line}" for line in tail)
    if not tail:
        lines.append("  (no output)")
    return lines


def format_report(result: RunResult) -> str:
    """A report for people: the first failure (`_failure_lines`), then one row per task with its exit, its restarts
    (and their causes) and, for a stopped task, its innermost frame."""
    lines = []
    if result.ok:
        lines.append("psworker: run succeeded" + (f" ({result.reason})" if result.reason else ""))
    elif result.failure is not None:
        lines.extend(_failure_lines(result, result.failure))
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
        restarts = f", {e.restarts} restart{'s' if e.restarts != 1 else ''}" if e.restarts else ""
        took = f"{e.ended_at - e.started_at:.1f} s{restarts}"
        lines.append(f"  {name:<{width}}  {status}  [{took}]  {e.log_path}")
        lines.extend(f"  {'':<{width}}    restart {i}: {cause}" for i, cause in enumerate(e.restart_causes, 1))
        if e.stack and (result.failure is None or name != result.failure.name):
            lines.append(f"  {'':<{width}}    was in {e.stack[0]} (every thread's stack in its log)")
    return "\n".join(lines)


SUGGESTED_RESTARTS = 3
_COMES_BACK = {"ps": "the chief then restores the last checkpoint (the steps since are given up)",
               "chief": "it goes on from the model the ps tasks hold",
               "worker": "it rejoins at the ps tasks' global step (nothing is given up)"}


def restart_hint(result: RunResult, max_restarts: int, chief: Optional[str]) -> Optional[str]:
    """How the run could have survived its first failure, when a restart would have: the task died of a signal or
    a retryable exit (`policy.is_retryable`) and `--max_restarts` was 0 or used up. None otherwise (a bug, bad
    input: a restart fails the same way)."""
    f = result.failure
    if f is None or not is_retryable(f.returncode):
        return None
    died = f.reason or describe_returncode(f.returncode)
    used = result.exits[f.name].restarts if f.name in result.exits else 0
    if max_restarts and used < max_restarts:
        return None
    role = "chief" if f.name == chief else f.name.partition(":")[0]
    back = _COMES_BACK.get(role, "it comes back at the same address")
    if not max_restarts:
        return (f"hint: {f.name} {died}: an exit the launcher retries with --max_restarts N (default 0), e.g. "
                f"--max_restarts {SUGGESTED_RESTARTS}: it is started again at the same address, {back}, and the run "
                f"goes on")
    return (f"hint: {f.name} {died} after its {used} restart{'s' if used != 1 else ''} (--max_restarts "
            f"{max_restarts}): a larger --max_restarts lets it come back again")
