"""The console at the end of a large run: the routine lines that every task prints with its own numbers are one line
per kind (`[worker:0-23] last step done (118-131 local steps)`, `psworker: ps:0-3, worker:0-23 exited: exit code 0`);
warnings, errors and non-zero exits never fold; each task's lines keep their order."""

from __future__ import annotations

import random
import re

import pytest

from psworker.launcher.console import folds
from psworker.launcher.console.lines import LineGrouper, TaskTokens, expand_tasks, normalise

PS, WORKERS = 4, 24
WINDOW = 0.5


def add(g: LineGrouper, name: str, text: str, now: float, launcher: bool = False) -> list[str]:
    """What OutputCopier does with one line (a task's, or the launcher's word about it)."""
    found = folds.match(text, launcher)
    if found is not None:
        return g.add(name, text, folds.fold_key(found[0], text), now, hold=folds.FOLD_WINDOW_SECS,
                     render=folds.renderer(found[0]))
    job, _, index = name.partition(":")
    return g.add(name, text, normalise(text, TaskTokens(job, int(index))), now)


def end_of_run(rng: random.Random) -> list[tuple[float, str, str, bool]]:
    """The end of a 4 ps + 24 worker run as its tasks print it (times within 3 s, in a random order): each worker's
    last step and done lines, each ps's `worker:N is done (k of 24)` as the workers' tokens reach it, the launcher's
    exit 0 of each task."""
    lines = []
    finish = {w: rng.uniform(0.0, 2.0) for w in range(WORKERS)}
    for w, t in finish.items():
        local = rng.randint(118, 131)
        lines.append((t, f"worker:{w}", f"last step done ({local} local steps)", False))
        lines.append((t + 0.05, f"worker:{w}", f"done at global step {3000 + rng.randint(0, 9)} after {local} local "
                                               f"steps in {rng.uniform(40, 50):.1f} s", False))
        lines.append((t + 0.3, f"worker:{w}", f"worker:{w} (pid {1000 + w}) exited: exit code 0", True))
    for p in range(PS):
        order = sorted(finish, key=lambda w: finish[w] + rng.uniform(0.1, 0.4))
        for k, w in enumerate(order, 1):
            lines.append((finish[w] + 0.1 + 0.01 * k, f"ps:{p}", f"worker:{w} is done ({k} of {WORKERS})", False))
        lines.append((2.8, f"ps:{p}", "every worker is done; exiting", False))
        lines.append((3.0, f"ps:{p}", f"ps:{p} (pid {900 + p}) exited: exit code 0", True))
    return sorted(lines, key=lambda x: x[0])


def replay(lines: list[tuple[float, str, str, bool]], window: float = WINDOW) -> list[tuple[str, float]]:
    """The console lines and when each came out, with a flusher that wakes when the next group is due."""
    g, shown = LineGrouper(window), []

    def flush(until: float) -> None:
        while g.next_due() is not None and g.next_due() <= until:
            at = g.next_due()
            shown.extend((line, at) for line in g.due(at))

    for t, name, text, launcher in lines:
        flush(t)
        shown.extend((line, t) for line in add(g, name, text, t, launcher))
    flush(float("inf"))
    assert g.next_due() is None
    return shown


def test_the_end_of_a_4_ps_24_worker_run_is_a_line_per_kind():
    shown = [line for line, _ in replay(end_of_run(random.Random(5)))]
    assert len(shown) == 6, shown
    assert shown[-1] == "psworker: ps:0-3 exited: exit code 0", shown           # after their own lines
    assert "[ps:0-3] every worker is done; exiting" in shown
    assert "psworker: worker:0-23 exited: exit code 0" in shown
    assert "[ps:0-3] worker:0-23 are done (24 of 24)" in shown
    last = next(line for line in shown if "last step done" in line)
    assert re.fullmatch(r"\[worker:0-23\] last step done \(1[12]\d-1[23]\d local steps\)", last), last
    done = next(line for line in shown if "done at global step" in line)
    assert re.fullmatch(r"\[worker:0-23\] done at global step 300\d-300\d after 1[12]\d-1[23]\d local steps in "
                        r"4\d\.\d-(4\d\.\d|50\.0) s", done), done


@pytest.mark.parametrize("texts, expected", [
    (["last step done (131 local steps)", "last step done (118 local steps)", "last step done (120 local steps)"],
     "last step done (118-131 local steps)"),
    (["done at global step 3000 after 9 local steps in 40.3 s", "done at global step 3000 after 12 local steps in "
      "9.8 s"], "done at global step 3000 after 9-12 local steps in 9.8-40.3 s"),
])
def test_numbers_that_differ_become_ranges_and_equal_ones_stay(texts, expected):
    pattern = folds.match(texts[0])[0].pattern
    assert folds.numbers_summary([("worker:0", pattern.fullmatch(t)) for t in texts]) == expected


@pytest.mark.parametrize("lines, expected", [
    ([("worker:0", "ps:0 at 127.0.0.1:5 is up"), ("worker:1", "ps:0 at 127.0.0.1:5 is up")],
     "[worker:0-1] ps:0 at 127.0.0.1:5 is up"),
    ([("worker:0", "ps:0 at h:5 is up"), ("worker:0", "ps:1 at h:6 is up"), ("worker:2", "ps:1 at h:6 is up")],
     "[worker:0,2] ps:0-1 are up"),
    ([("ps:0", "worker:3 is done (1 of 4)"), ("ps:1", "worker:3 is done (1 of 4)"),
      ("ps:1", "worker:2 is done (2 of 4)")], "[ps:0-1] worker:2-3 are done (1-2 of 4)"),
    ([("ps:0", "worker:3 is done (4 of 4)"), ("ps:1", "worker:3 is done (4 of 4)")],
     "[ps:0-1] worker:3 is done (4 of 4)"),
    ([("worker:2", "worker:2 (pid 7) exited: exit code 0")], "psworker: worker:2 (pid 7) exited: exit code 0"),
    ([("worker:2", "worker:2 (pid 7) exited: exit code 0"), ("ps:0", "ps:0 (pid 5) exited: exit code 0")],
     "psworker: ps:0, worker:2 exited: exit code 0"),
])
def test_each_folds_summary(lines, expected):
    launcher = "exited" in lines[0][1]
    fold = folds.match(lines[0][1], launcher)[0]
    assert folds.renderer(fold)(lines) == expected
    text = expected.partition("] ")[2] if expected.startswith("[") else expected.removeprefix("psworker: ")
    assert folds.kind(text, launcher) == fold.name


@pytest.mark.parametrize("text, launcher", [
    ("warning: worker:3 is done (1 of 4)", False),
    ("error: last step done (3 local steps)", False),
    ("worker:3 (pid 41) exited: exit code 1", True),
    ("worker:3 (pid 41) exited: killed by SIGKILL", True),
    ("worker:3 (pid 41) exited: injected kill:worker:3@step=5", True),
    ("step 120, loss = 0.42 (1830.2 examples/sec; 0.035 sec/batch)", False),
    ("worker:3 (pid 41) exited: exit code 0", False),                 # only the launcher's own line folds
])
def test_failures_and_other_lines_never_fold(text, launcher):
    assert folds.match(text, launcher) is None
    assert folds.kind(text, launcher) is None


def test_a_failure_among_the_routine_lines_comes_out_at_once_and_alone():
    g = LineGrouper(WINDOW)
    add(g, "worker:0", "last step done (100 local steps)", 0.0)
    add(g, "worker:1", "last step done (101 local steps)", 0.1)
    assert add(g, "worker:2", "error: the chief's session failed", 0.2) == []
    assert g.due(0.7) == ["[worker:2] error: the chief's session failed"]         # the window of a warning, not 4 s
    assert g.due(folds.FOLD_WINDOW_SECS) == ["[worker:0-1] last step done (100-101 local steps)"]


def test_launcher_lines_read_back():
    assert folds.exited_0("psworker: ps:0-1, worker:0-2 exited: exit code 0") == [
        "ps:0", "ps:1", "worker:0", "worker:1", "worker:2"]
    assert folds.exited_0("psworker: worker:3 (pid 41) exited: exit code 0") == ["worker:3"]
    assert folds.exited_0("psworker: worker:3 (pid 41) exited: exit code 1") == []
    assert folds.exited_0("psworker: stopping worker:1 exited: exit code 0") == []


def test_random_ends_lose_no_task_keep_each_tasks_order_and_hold_nothing_past_the_fold_window():
    rng = random.Random(23)
    for _ in range(50):
        lines = end_of_run(rng)
        shown = replay(lines)
        assert len(shown) <= 12, [s for s, _ in shown]    # 6 kinds, each split at most once by a 4 s window
        sent: dict[str, list[tuple[str, float]]] = {}
        for t, name, text, launcher in lines:
            sent.setdefault(name, []).append((folds.kind(text, launcher) or text, t))
        got: dict[str, list[tuple[str, float]]] = {}
        for line, at in shown:
            if line.startswith("psworker: "):
                names, text, launcher = folds.exited_0(line), line.removeprefix("psworker: "), True
            else:
                prefix, text = re.fullmatch(r"\[([^\]]+)\] (.*)", line).groups()
                names, launcher = expand_tasks(prefix), False
            for name in names:
                got.setdefault(name, []).append((folds.kind(text, launcher) or text, at))
        for name, mine in sent.items():
            # the same kinds in the same order; a run of one kind's lines is one line, or more once a window ends
            assert _dedup([k for k, _ in got[name]]) == _dedup([k for k, _ in mine]), (name, mine, got[name])
            assert len(got[name]) <= len(mine)
            # every line came out within the fold window (a line of its kind shown in it)
            for k, t in mine:
                assert any(k == k2 and t <= at <= t + folds.FOLD_WINDOW_SECS + 1e-9 for k2, at in got[name]), \
                    (name, k, t, got[name])


def _dedup(kinds: list[str]) -> list[str]:
    return [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
