"""Status of a run for people: a live view while `psworker local|run` supervises (rich, on a terminal), plain
periodic lines elsewhere (CI, pipes), and `psworker status RUN_DIR` for a run started anywhere, read from
`<run_dir>/cluster.yaml` and `<run_dir>/logs/<job>-<index>.log` (step lines and restart markers)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, TextIO

from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table

from psworker import events
from psworker.launcher.console.progress import Progress, TaskProgress
from psworker.states import TaskState
from psworker.launcher import runstate
from psworker.launcher.console import runread
from psworker.launcher.rundir import LOG_SUBDIR, SPEC_FILE, RunEnd, read_elastic_state, read_end, task_log_name
from psworker.launcher.runstate import LauncherState
from psworker.spec.plan import chief_name

__all__ = ["RunStatus", "gone_line", "live_view", "plain_line", "read_run_dir", "render"]


@dataclasses.dataclass(frozen=True)
class RunStatus:
    """One view of a run: its tasks' progress, the global step, max_steps if known, and the rate."""

    tasks: dict[str, TaskProgress]
    global_step: int
    max_steps: Optional[int]
    steps_per_sec: Optional[float]
    now: float
    workers: Optional[tuple[int, int]] = None    # an elastic job's (running, target) worker counts
    ended: Optional[RunEnd] = None               # how the run ended, as its launcher recorded (None: not yet/unknown)
    precision: Optional[events.Precision] = None   # the chief's last evaluation (AucResult: a click-through model's)
    launcher: Optional[LauncherState] = None     # `psworker status`: the run's launcher (None: none known)
    checkpoint_step: Optional[int] = None        # ... the step of the newest checkpoint

    @property
    def over(self) -> bool:
        """The run has ended, or its launcher is gone: nothing will change any more."""
        return self.ended is not None or (self.launcher is not None and bool(self.launcher.gone))

    @property
    def examples_per_sec(self) -> Optional[float]:
        rates = [t.examples_per_sec for t in self.tasks.values()
                 if t.examples_per_sec and t.state == TaskState.TRAINING]
        return sum(rates) if rates else None

    @property
    def loss(self) -> Optional[float]:
        latest = max((t for t in self.tasks.values() if t.loss is not None), key=lambda t: t.step_moved_at,
                     default=None)
        return latest.loss if latest else None

    @property
    def epoch(self) -> Optional[tuple[float, Optional[int]]]:
        """Dealt shards: `(epoch, num_epochs)` of the furthest step line that showed one."""
        shown = [(t.epoch, t.num_epochs) for t in self.tasks.values() if t.epoch is not None]
        return max(shown, key=lambda e: e[0]) if shown else None

    @property
    def eta_secs(self) -> Optional[float]:
        if not self.max_steps or not self.steps_per_sec or self.over:
            return None
        return max(self.max_steps - self.global_step, 0) / self.steps_per_sec

    def as_dict(self) -> dict[str, Any]:
        return {"global_step": self.global_step, "max_steps": self.max_steps, "steps_per_sec": self.steps_per_sec,
                "workers": None if self.workers is None else {"running": self.workers[0], "target": self.workers[1]},
                "examples_per_sec": self.examples_per_sec, "loss": self.loss, "eta_secs": self.eta_secs,
                "epoch": None if self.epoch is None else {"epoch": self.epoch[0], "of": self.epoch[1]},
                "tasks": {n: {**dataclasses.asdict(t), "silent_secs": round(self.now - t.last_output_at, 1)}
                          for n, t in self.tasks.items()},
                "ended": None if self.ended is None else dataclasses.asdict(self.ended),
                "launcher": None if self.launcher is None else {"pid": self.launcher.pid, "host": self.launcher.host,
                                                                "gone": self.launcher.gone or None},
                "checkpoint_step": self.checkpoint_step,
                "precision": None if self.precision is None else {
                    **({"auc": self.precision.auc, "logloss": self.precision.logloss}
                       if isinstance(self.precision, events.AucResult) else {"precision": self.precision.precision}),
                    "examples": self.precision.examples, "global_step": self.precision.global_step}}


class _Rate:
    """Global steps per second since the first step seen."""

    def __init__(self) -> None:
        self._first: Optional[tuple[float, int]] = None

    def __call__(self, now: float, step: int) -> Optional[float]:
        if self._first is None and step > 0:
            self._first = (now, step)
        if self._first is None or now <= self._first[0] or step <= self._first[1]:
            return None
        return (step - self._first[1]) / (now - self._first[0])


def _num(value: Optional[float], fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _eta(secs: Optional[float]) -> str:
    return "-" if secs is None else time.strftime("%H:%M:%S", time.gmtime(secs)) if secs >= 3600 else \
        f"{int(secs) // 60}:{int(secs) % 60:02d}"


def _workers(s: RunStatus) -> str:
    """`workers 2 (target 4)` for an elastic job, else empty."""
    return "" if s.workers is None else f"workers {s.workers[0]} (target {s.workers[1]})"


def _epoch(s: RunStatus) -> str:
    """`epoch 1.37 of 3` (dealt shards), else empty."""
    if s.epoch is None:
        return ""
    return f"epoch {s.epoch[0]:.2f}" + ("" if s.epoch[1] is None else f" of {s.epoch[1]}")


def _step_of(s: RunStatus) -> str:
    """`step 600/600`: the global step, never shown past max_steps (async workers may push it a step or two past,
    as they finish the steps they had begun)."""
    if not s.max_steps:
        return f"step {s.global_step}"
    return f"step {min(s.global_step, s.max_steps)}/{s.max_steps}"


def plain_line(s: RunStatus) -> str:
    """One line for logs and pipes."""
    workers = f"{_workers(s)}, " if s.workers else ""
    tasks = ", ".join(f"{n} {t.label}" + (f" @{t.step}" if t.step is not None else "") for n, t in s.tasks.items())
    epoch = f"{_epoch(s)}, " if s.epoch else ""
    rate = _num(s.examples_per_sec, '.0f')
    return (f"psworker: status: {_step_of(s)}, {epoch}{workers}{rate} examples/s, "
            f"loss {_num(s.loss, '.3f')}, eta {_eta(s.eta_secs)}; {tasks}")


def render(s: RunStatus, silent_after_secs: Optional[float] = None) -> Group:
    """A progress bar line and a task table (rich renderables); with `silent_after_secs` (`psworker status`), a
    "silent" column: how long each running task has printed nothing, once that is at least so long. The live view
    has none: in a run of seconds it would stay empty, and a ps prints nothing while it serves."""
    head = Table.grid(padding=(0, 1))
    bar = ProgressBar(total=s.max_steps or None, completed=min(s.global_step, s.max_steps or s.global_step), width=30)
    head.add_row(_step_of(s), bar, f"eta {_eta(s.eta_secs)}", f"{_num(s.steps_per_sec, '.1f')} steps/s",
                 f"{_num(s.examples_per_sec, '.0f')} examples/s", f"loss {_num(s.loss, '.3f')}", _epoch(s),
                 _workers(s))
    table = Table(box=None, padding=(0, 2), show_edge=False)
    detail = silent_after_secs is not None
    columns = ("task", "state", "last step", "restarts") + (("end", "pid", "host") if detail else ())
    columns += ("silent",) if detail and not s.over else ()
    for col in columns:
        table.add_column(col)
    for name, t in s.tasks.items():
        quiet = s.now - t.last_output_at
        row = [name, t.label, "-" if t.step is None else str(t.step), str(t.restarts)]
        if detail:
            row += [t.exit or "", "" if t.pid is None else str(t.pid), t.host or ""]
            row += [] if s.over else [f"{quiet:.0f} s" if quiet >= silent_after_secs and t.state.active else ""]
        table.add_row(*row)
    return Group(head, table)


def gone_line(s: RunStatus) -> Optional[str]:
    """`the launcher (pid N on HOST) is gone; the run did not end cleanly; the last checkpoint is step N`, and
    which tasks still run without it; None while it runs or after it recorded the run's end."""
    if s.ended is not None or s.launcher is None or not s.launcher.gone:
        return None
    checkpoint = "no checkpoint" if s.checkpoint_step is None else f"the last checkpoint is step {s.checkpoint_step:,}"
    here = socket.gethostname()
    left = [f"{n} (pid {t.pid})" for n, t in s.tasks.items() if t.state.live and t.pid is not None and t.host == here]
    away = [f"{n} (pid {t.pid} on {t.host})" for n, t in s.tasks.items()
            if t.state.live and t.pid is not None and t.host != here]
    tasks = (f"; still running without it: {', '.join(left)}" if left else "; none of its tasks runs here" if away
             else "; none of its tasks runs")
    tasks += f"; on other hosts, maybe still running: {', '.join(away)}" if away else ""
    why = "" if s.launcher.gone == runstate.PROCESS_GONE else f" ({s.launcher.gone})"
    return f"the launcher ({s.launcher.describe()}) is gone{why}; the run did not end cleanly; {checkpoint}{tasks}"


class _LiveConsole(io.TextIOBase):
    """A text stream that prints whole lines above a rich Live view."""

    def __init__(self, live: Live) -> None:
        self._live = live

    def write(self, text: str) -> int:
        self._live.console.print(text.rstrip("\n"), markup=False, highlight=False, soft_wrap=True)
        return len(text)

    def flush(self) -> None:
        pass


@contextlib.contextmanager
def live_view(config: Any, tasks: Sequence[Any], console: TextIO) -> Iterator[tuple[TextIO, Any]]:
    """While inside: a live view (terminal, `config.live` not False) or plain status lines every
    `config.status_every_secs` (otherwise; none with `config.live` False). Yields (the console to copy task output to,
    `attach(progress)` to call once the supervisor's Progress exists)."""
    max_steps = None if config.command else config.spec.train.max_steps
    holder: dict[str, Progress] = {}
    rate = _Rate()

    def status() -> Optional[RunStatus]:
        progress = holder.get("p")
        if progress is None:
            return None
        now, step = time.time(), progress.global_step()
        return RunStatus(progress.snapshot(), step, max_steps, rate(now, step), now, progress.workers())

    isatty = getattr(console, "isatty", lambda: False)()
    if config.live is None and isatty or config.live:
        class _View:
            def __rich__(self) -> Any:
                s = status()
                return render(s) if s is not None else "starting..."

        consoles = (sys.stderr, sys.stdout)      # before Live replaces them with its own
        with Live(_View(), console=Console(file=console), refresh_per_second=2, transient=False) as live, \
                _logging_to(_LiveConsole(live), consoles):
            yield _LiveConsole(live), lambda p: holder.setdefault("p", p)
        return
    stop = threading.Event()

    def plain() -> None:
        while not stop.wait(config.status_every_secs):
            s = status()
            if s is not None:
                with contextlib.suppress(Exception):
                    print(plain_line(s), file=console, flush=True)

    thread = threading.Thread(target=plain, name="psworker-status", daemon=True)
    if config.live is None:
        thread.start()
    try:
        yield console, lambda p: holder.setdefault("p", p)
    finally:
        stop.set()
        if thread.is_alive():
            thread.join(5.0)


@contextlib.contextmanager
def _logging_to(stream: TextIO, consoles: Sequence[TextIO]) -> Iterator[None]:
    """The root logger's handlers that write to one of `consoles` write to `stream` while inside (so they print
    above a live view). `consoles`: sys.stderr and sys.stdout as they were before rich's Live replaced them."""
    import logging

    handlers = [h for h in logging.getLogger().handlers
                if isinstance(h, logging.StreamHandler) and any(h.stream is c for c in consoles)]
    old = [h.setStream(stream) for h in handlers]
    try:
        yield
    finally:
        for h, s in zip(handlers, old):
            h.setStream(s)


def _state_after(event: Optional[events.Event], state: TaskState) -> TaskState:
    """A task's state once its log has shown `event`: done, failed, or as it was."""
    if isinstance(event, (events.WorkerDone, events.FoundComplete)) or (
            isinstance(event, events.PsDone) and not event.still_serving):
        return TaskState.DONE
    if isinstance(event, (events.TaskError, events.Traceback)):
        return TaskState.FAILED
    return state


def read_run_dir(run_dir: Path, now: Optional[float] = None) -> RunStatus:
    """The status of a run from its directory: every task of `cluster.yaml`, from its log file (a missing log
    means the task never started; a log's modification time is when the task was last heard of).

    Raises:
        SpecError: no readable cluster.yaml in `run_dir`.
    """
    from psworker.spec import load_spec

    spec = load_spec(Path(run_dir) / SPEC_FILE)
    names = [f"{j}:{i}" for j in spec.jobs() for i in range(len(spec.addresses(j)))]
    chief = chief_name(names) or "worker:0"
    progress, precision = Progress(names), None
    now = time.time() if now is None else now
    texts: dict[str, tuple[str, float]] = {}        # each task's log, and when it was last written
    for name in names:
        log = Path(run_dir) / LOG_SUBDIR / task_log_name(name)
        if not log.exists():
            progress.set_state(name, TaskState.NOT_STARTED)
            continue
        heard = log.stat().st_mtime
        restarts, state = 0, TaskState.RUNNING
        texts[name] = (log.read_text(encoding="utf-8", errors="replace"), heard)
        for line in texts[name][0].splitlines():
            event = events.parse_line(line)
            if isinstance(event, (events.Restart, events.NewRun)):   # a new attempt, or a new run on an old log
                restarts, state = getattr(event, "number", 0), TaskState.RUNNING
            progress.record(name, event, heard)
            state = _state_after(event, state)
            if name == chief and isinstance(event, (events.Precision, events.AucResult)):
                precision = event
        progress.started(name, restarts, heard)        # restarts, and the time it was last heard of
        if state == TaskState.RUNNING and progress.snapshot()[name].step is not None:
            state = TaskState.TRAINING
        progress.set_state(name, state)
    workers = _members_into(progress, run_dir) if spec.elastic is not None else None
    launcher_doc, records = runstate.read_tasks(Path(run_dir))
    launcher = runstate.launcher_state(Path(run_dir), launcher_doc, now)     # before ended.json: see there
    end = read_end(Path(run_dir))
    tasks = runread.settle_tasks(progress.snapshot(), records, end is not None, launcher)
    rate = runread.steps_per_sec(texts[n] for n in names if n.partition(":")[0] in ("worker", "chief") and n in texts)
    checkpoint = runstate.checkpoint_step(Path(spec.train.train_dir or run_dir), texts.get(chief, ("",))[0])
    step = max(progress.global_step(), checkpoint or 0)    # step lines come every N steps; a save can be newer
    return RunStatus(tasks, step, spec.train.max_steps, rate, now, workers, end, precision, launcher, checkpoint)


def _members_into(progress: Progress, run_dir: Path) -> Optional[tuple[int, int]]:
    """An elastic job's membership from the launcher's state file into `progress` (workers that are reserved,
    leaving or left say so); returns (running, target), None without a state file."""
    members = (read_elastic_state(run_dir) or {}).get("members")
    if not isinstance(members, dict):
        return None
    for state in (TaskState.RESERVED, TaskState.LEAVING, TaskState.LEFT):
        for index in members.get(state, ()):
            progress.set_state(f"worker:{index}", state)
    return int(members.get("workers", 0)), int(members.get("target", 0))
