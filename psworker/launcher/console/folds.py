"""The routine lines that every task prints with its own numbers (`worker:7 is done (12 of 24)`, `last step done (131
local steps)`, `ps:2 at 127.0.0.1:41234 is up`), and the launcher's word that a task exited 0: on the console, the
lines of one kind that come within `FOLD_WINDOW_SECS` are one line, numbers as ranges (`[worker:0-23] last step done
(118-131 local steps)`, `psworker: ps:0-3, worker:0-23 exited: exit code 0`). Only these kinds fold: a warning, an
error, a non-zero exit never matches one. Each task's log keeps its own lines.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from psworker.launcher.console.lines import LOST_PS_TEXT, expand_tasks, format_tasks

__all__ = ["Fold", "FOLDS", "FOLD_WINDOW_SECS", "match", "fold_key", "renderer", "numbers_summary", "exited_0", "kind"]

# How long the console gathers one kind of routine line. A run's start and end spread each kind over a few seconds
# when 28 tasks share 2 cores (4 ps + 24 workers: 3 s for "worker:N is done", 2 s for "last step done", up to 10 s for
# "ps:N is up"); each task's other lines wait behind its own folded line, none longer than this.
FOLD_WINDOW_SECS = 4.0

_NUMBER = re.compile(r"\d+(?:\.\d+)?")
Line = tuple[str, re.Match]       # (the printing task, its line's match)


@dataclass(frozen=True)
class Fold:
    """One kind of routine line: `pattern` matches its text (as the console shows it, without the task prefix);
    `summary` makes one text of several tasks' lines (several of one task's too); `launcher`: the launcher's own line
    about a task, shown `psworker: ...` rather than `[task] ...`."""

    name: str
    pattern: re.Pattern
    summary: Callable[[Sequence[Line]], str]
    folded: re.Pattern             # what `summary` makes of several lines
    launcher: bool = False
    by_numbers: bool = False      # lines fold only with lines that differ from them in their numbers alone


def numbers_summary(lines: Sequence[Line]) -> str:
    """The lines' common text with each number that differs between them as `lowest-highest` (as printed)."""
    texts = [m.string for _, m in lines]
    parts = _NUMBER.split(texts[0])
    slots = [_NUMBER.findall(t) for t in texts]
    out = [parts[0]]
    for i, part in enumerate(parts[1:]):
        values = sorted({s[i] for s in slots}, key=float)
        out.append(values[0] if len(values) == 1 else f"{values[0]}-{values[-1]}")
        out.append(part)
    return "".join(out)


def _peers_up(lines: Sequence[Line]) -> str:
    peers = {m["peer"]: m["address"] for _, m in lines}
    if len(peers) == 1:
        (peer, address), = peers.items()
        return f"{peer} at {address} is up"
    return f"{format_tasks(peers)} are up"


def _workers_done(lines: Sequence[Line]) -> str:
    workers = sorted({int(m["worker"]) for _, m in lines})
    highest: dict[str, int] = {}            # per ps: the count of its latest line here
    for name, m in lines:
        highest[name] = max(highest.get(name, 0), int(m["count"]))
    counts = sorted(set(highest.values()))
    of = sorted({int(m["of"]) for _, m in lines})
    count = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    total = str(of[0]) if len(of) == 1 else f"{of[0]}-{of[-1]}"
    verb = "is" if len(workers) == 1 else "are"
    return f"{format_tasks(f'worker:{w}' for w in workers)} {verb} done ({count} of {total})"


def _lost_ps(lines: Sequence[Line]) -> str:
    return LOST_PS_TEXT.format(format_tasks({m["ps"] for _, m in lines}))


def _exited_0(lines: Sequence[Line]) -> str:
    return f"{format_tasks(name for name, _ in lines)} exited: exit code 0"


_TASKS = r"[a-z][a-z0-9_]*:\d[\d,-]*(?:, [a-z][a-z0-9_]*:\d[\d,-]*)*"
_RANGE = r"\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?"

FOLDS: tuple[Fold, ...] = (
    Fold("up", re.compile(r"(?P<peer>[a-z][a-z0-9_]*:\d+) at (?P<address>\S+) is up"), _peers_up,
         re.compile(rf"{_TASKS} are up")),
    Fold("done", re.compile(r"worker:(?P<worker>\d+) is done \((?P<count>\d+) of (?P<of>\d+)\)"), _workers_done,
         re.compile(rf"worker:[\d,-]+ (?:is|are) done \({_RANGE} of {_RANGE}\)")),
    Fold("last step", re.compile(r"last step done \(\d+ local steps\)"), numbers_summary,
         re.compile(rf"last step done \({_RANGE} local steps\)"), by_numbers=True),
    Fold("worker done", re.compile(r"done at global step \d+ after \d+ local steps in [\d.]+ s"), numbers_summary,
         re.compile(rf"done at global step {_RANGE} after {_RANGE} local steps in {_RANGE} s"), by_numbers=True),
    Fold("lost ps", re.compile(re.escape(LOST_PS_TEXT).replace(r"\{\}", r"(?P<ps>ps:\d+)")), _lost_ps,
         re.compile(re.escape(LOST_PS_TEXT).replace(r"\{\}", _TASKS))),
    Fold("exited 0", re.compile(r"[a-z][a-z0-9_]*:\d+ \(pid \d+\) exited: exit code 0"), _exited_0,
         re.compile(rf"{_TASKS} exited: exit code 0"), launcher=True),
)


def kind(text: str, launcher: bool = False) -> Optional[str]:
    """The name of the fold that a console text is a line of, or a summary of; None for any other text."""
    for fold in FOLDS:
        if fold.launcher == launcher and (fold.pattern.fullmatch(text) or fold.folded.fullmatch(text)):
            return fold.name
    return None


def match(text: str, launcher: bool = False) -> Optional[tuple[Fold, re.Match]]:
    """The fold that a console text (a task's, or with `launcher` the launcher's) belongs to, with its match."""
    for fold in FOLDS:
        if fold.launcher == launcher:
            m = fold.pattern.fullmatch(text)
            if m is not None:
                return fold, m
    return None


def fold_key(fold: Fold, text: str) -> str:
    """What the lines of one group share: the fold, and for a fold by numbers the text without them."""
    return f"\0{fold.name}" + (_NUMBER.sub("#", text) if fold.by_numbers else "")


def renderer(fold: Fold) -> Callable[[list[tuple[str, str]]], str]:
    """The console line of a group of `fold`'s (task name, text) lines: one line as printed, several as one summary
    prefixed with their tasks' range (the launcher's: `psworker: ` and the summary, which names them)."""

    def render(lines: list[tuple[str, str]]) -> str:
        names = [name for name, _ in lines]
        if len(lines) == 1:
            text = lines[0][1]
        else:
            text = fold.summary([(name, fold.pattern.fullmatch(t)) for name, t in lines])
        return f"psworker: {text}" if fold.launcher else f"[{format_tasks(names)}] {text}"

    return render


_EXITED_0 = re.compile(r"psworker: (?P<tasks>[a-z][^()]*?)(?: \(pid \d+\))? exited: exit code 0")


def exited_0(line: str) -> list[str]:
    """The tasks that one launcher console line says exited 0, folded (`psworker: ps:0, worker:0-23 exited: exit code
    0`) or not (`psworker: worker:3 (pid 41) exited: exit code 0`); [] for any other line."""
    m = _EXITED_0.fullmatch(line.rstrip("\r\n"))
    if m is None:
        return []
    try:
        return expand_tasks(m["tasks"])
    except ValueError:
        return []
