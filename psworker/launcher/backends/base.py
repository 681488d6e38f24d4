"""What every backend is: the `ProcessBackend` the supervisor drives (start a Task, signal it, stop them all) and
the `Backend` base class, which places a run's tasks and holds the one teardown (SIGCONT and SIGTERM, a grace
period, the hard end, reap). A backend supplies only what differs: where its tasks run, how to start one, signal it,
end it for good and confirm that it ended.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable, ClassVar, ContextManager, Mapping, Optional, Protocol, Sequence, TextIO

from psworker.deadline import poll_until
from psworker.launcher.children import die_with_parent
from psworker.launcher.rundir import SPEC_FILE
from psworker.spec.plan import Task
from psworker.spec import ClusterSpec, CountSpec

__all__ = ["Backend", "ProcessBackend", "REAP_TIMEOUT_SECS", "die_with_parent"]

logger = logging.getLogger(__name__)

REAP_TIMEOUT_SECS = 10.0          # after the hard end; only a process stuck in the kernel takes longer
_STOP_POLL_SECS = 0.05


class ProcessBackend(Protocol):
    """Starts task processes and signals or stops them. Handles are `subprocess.Popen`-like: `pid`, `stdout` (a
    binary stream of the task's merged stdout and stderr), `poll()`, `wait(timeout)`."""

    def start(self, task: Task, env: Mapping[str, str]) -> subprocess.Popen:
        """Starts one task (its argv and where it runs come from `task`); its output comes back on `stdout`."""

    def signal(self, proc: subprocess.Popen, sig: int) -> None:
        """Sends `sig` to the task and everything it started (no error if it is gone)."""

    def stop(self, procs: Sequence[subprocess.Popen], grace_secs: float) -> None:
        """Ends every task in `procs` and what they started: SIGTERM, `grace_secs`, the hard end, reap."""

    def exit_cause(self, proc: subprocess.Popen, returncode: int) -> Optional[str]:
        """Why the task ended, where the backend knows more than `returncode`; else None."""


def popen_task(popen: Callable[..., subprocess.Popen], argv: Sequence[str], env: Mapping[str, str], *,
               before_exec: Optional[Callable[[], None]] = None) -> subprocess.Popen:
    """Starts `argv` as every backend starts its local end: stdin closed, stdout and stderr merged into one pipe,
    its own session (process group == pid), dying with the launcher; `before_exec` runs first in the child (e.g.
    joining a memory cgroup, `cgroups.MemoryCgroup.joiner`)."""
    dying = die_with_parent()
    preexec = dying if before_exec is None else _in_turn(before_exec, dying)
    return popen(list(argv), env=dict(env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                 stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=preexec)


def _in_turn(*steps: Optional[Callable[[], None]]) -> Callable[[], None]:
    def run() -> None:
        for step in steps:
            if step is not None:
                step()
    return run


class Backend(ABC):
    """One way to run a spec's tasks. The launch skeleton (`psworker.launcher.launch`) calls, in order:
    `place` (where every task runs; fails before anything is written), `session` (around the whole run),
    `spec_path` (where the tasks read cluster.yaml), `prepare` (after cluster.yaml is written), `banner`, then the
    supervisor drives `start`, `signal` and `stop`; `outputs_dir` names the checkpoints in the report."""

    Options: ClassVar[type]           # the backend's frozen options dataclass
    HARD_END: ClassVar[str] = "sending SIGKILL"   # the teardown's warning: what `kill` does, in words
    LOCAL_PIDS: ClassVar[bool] = False     # the tasks' pids are this machine's (py-spy can read their stacks)

    def __init__(self, options: Any = None, *, python: str = sys.executable) -> None:
        """Args:
            options: an instance of this backend's `Options` (None: its defaults).
            python: the interpreter that runs psworker's own tasks, where they run.
        """
        self.options = options if options is not None else self.Options()
        self.python = python

    # -- placing the run -------------------------------------------------------------------------------------

    @abstractmethod
    def place(self, spec: ClusterSpec | CountSpec, run_dir: Path) -> ClusterSpec:
        """The spec with every task's real address (and `train.train_dir` set). Raises before anything starts."""

    def session(self, run_dir: Path, console: TextIO) -> ContextManager[None]:
        """What surrounds the whole run on this backend (default: nothing)."""
        return contextlib.nullcontext()

    def spec_path(self, run_dir: Path) -> str:
        """Where the tasks read the run's cluster.yaml."""
        return str(run_dir / SPEC_FILE)

    def prepare(self, spec: ClusterSpec, text: str) -> None:
        """Called once `text` (the dumped `spec`) is in the run dir's cluster.yaml (default: nothing more)."""

    @abstractmethod
    def banner(self, tasks: Sequence[Task], log_dir: Path) -> str:
        """The line that says what starts where."""

    def outputs_dir(self, spec: ClusterSpec, run_dir: Path) -> Path:
        """Where the chief's checkpoints and export are."""
        return Path(spec.train.train_dir or run_dir)

    def exit_cause(self, proc: subprocess.Popen, returncode: int) -> Optional[str]:
        """Why the task ended, where the backend knows more than its exit code (e.g. the kernel killed it over its
        memory limit); None (the default): the exit code says it all."""
        return None

    # -- processes ---------------------------------------------------------------------------------------------

    @abstractmethod
    def start(self, task: Task, env: Mapping[str, str]) -> subprocess.Popen:
        """Starts one task (see `ProcessBackend.start`)."""

    @abstractmethod
    def signal(self, proc: subprocess.Popen, sig: int) -> None:
        """Sends `sig` to the task (see `ProcessBackend.signal`)."""

    def terminate(self, procs: Sequence[subprocess.Popen]) -> None:
        """Asks every running task to exit: SIGCONT (a stopped task acts on SIGTERM only once resumed), SIGTERM."""
        for p in procs:
            if p.poll() is None:
                self.signal(p, signal.SIGCONT)
                self.signal(p, signal.SIGTERM)

    def alive(self, procs: Sequence[subprocess.Popen]) -> list[str]:
        """What is still running of `procs`, in words for the warning (empty once all have ended)."""
        return [f"pid {p.pid}" for p in procs if p.poll() is None]

    def kill(self, procs: Sequence[subprocess.Popen]) -> None:
        """Ends every task of `procs` that is still running, at once."""
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()

    def stop(self, procs: Sequence[subprocess.Popen], grace_secs: float) -> None:
        """The one teardown: `terminate`, up to `grace_secs` for everything to end, then `kill`, then reap."""
        started = time.monotonic()
        self.terminate(procs)
        poll_until(lambda: not self.alive(procs), grace_secs, since=started, interval=_STOP_POLL_SECS)
        left = self.alive(procs)
        if left:
            logger.warning("still running %.1f s after SIGTERM, %s: %s", grace_secs, self.HARD_END, ", ".join(left))
            self.kill(procs)
        for p in procs:
            if p.poll() is None:
                try:
                    p.wait(REAP_TIMEOUT_SECS)
                except subprocess.TimeoutExpired:
                    logger.error("pid %d survived the hard end", p.pid)
