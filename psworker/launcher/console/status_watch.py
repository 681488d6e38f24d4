"""`psworker status RUN_DIR`: one view of a run read from its run dir (a task table and the lines below it, or
JSON), and `--watch`: that view refreshed until the run ends or its launcher is gone (Ctrl-C ends it too)."""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path
from typing import Optional, TextIO

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from psworker.launcher.console.status import RunStatus, gone_line, plain_line, read_run_dir, render

__all__ = ["footer", "show", "silent_tasks", "watch"]


def _console(out: Optional[TextIO]) -> Console:
    """A rich console on `out`; off a terminal as wide as the table needs (rich's default there is 80 columns)."""
    console = Console(file=out)
    return console if console.is_terminal else Console(file=out, width=200)


def silent_tasks(s: RunStatus, silent_secs: float) -> dict[str, float]:
    """The running tasks whose log has not grown for `silent_secs`, with when it last did (none once it is over)."""
    if s.over:
        return {}
    return {name: t.last_output_at for name, t in s.tasks.items()
            if t.state.live and s.now - t.last_output_at >= silent_secs}


def footer(s: RunStatus, silent_secs: float) -> list[str]:
    """The lines under the task table: silent tasks, the launcher gone, how the run ended, its final evaluation."""
    lines = []
    for name, since in silent_tasks(s, silent_secs).items():
        stamp = datetime.datetime.fromtimestamp(since).strftime("%Y-%m-%d %H:%M:%S")
        lines.append(f"silent: {name} since {stamp} ({s.now - since:.0f} s)")
    gone = gone_line(s)
    if gone is not None:
        lines.append(gone)
    if s.ended is not None:
        lines.append(f"ended: the run {s.ended.describe()}")
    if s.precision is not None:
        lines.append(f"final evaluation: {s.precision.summary}")
    return lines


def _view(s: RunStatus, silent_secs: float) -> Group:
    return Group(render(s, silent_secs), *(Text(line) for line in footer(s, silent_secs)))


def show(run_dir: str, as_json: bool, silent_secs: float, out: Optional[TextIO] = None) -> RunStatus:
    """Prints the status of the run in `run_dir` once (a table and its footer, or JSON); returns it."""
    s = read_run_dir(Path(run_dir), now=time.time())
    if as_json:
        doc = {**s.as_dict(), "silent": sorted(silent_tasks(s, silent_secs)), "gone": gone_line(s)}
        print(json.dumps(doc, indent=2), file=out, flush=True)
    else:
        _print(s, silent_secs, out)
    return s


def _print(s: RunStatus, silent_secs: float, out: Optional[TextIO]) -> None:
    """The view, its footer lines as they are (a pipe's reader greps them whole)."""
    _console(out).print(render(s, silent_secs))
    for line in footer(s, silent_secs):
        print(line, file=out, flush=True)


def _done(s: RunStatus) -> bool:
    """Nothing more to watch: the run is over, or (no launcher known: tasks started by other means) no task runs."""
    return s.over or (s.launcher is None and not any(t.state.live for t in s.tasks.values()))


def watch(run_dir: str, every_secs: float, silent_secs: float, out: Optional[TextIO] = None,
          live: Optional[bool] = None) -> int:
    """Refreshes the status of `run_dir` every `every_secs` until `_done`: in place on a terminal (`live` None:
    when `out` is one), else one `plain_line` per refresh and the whole view at the end. Returns 0 (also on
    Ctrl-C)."""
    console = _console(out)
    live = console.is_terminal if live is None else live
    try:
        if live:
            with Live(console=console, auto_refresh=False, transient=False) as view:
                while True:
                    s = read_run_dir(Path(run_dir), now=time.time())
                    view.update(_view(s, silent_secs), refresh=True)
                    if _done(s):
                        return 0
                    time.sleep(every_secs)
        while True:
            s = read_run_dir(Path(run_dir), now=time.time())
            if _done(s):
                _print(s, silent_secs, out)
                return 0
            print(plain_line(s), file=out, flush=True)
            time.sleep(every_secs)
    except KeyboardInterrupt:
        print(file=out, flush=True)
        return 0
