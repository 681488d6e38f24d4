"""The console at scale: a line that several tasks print within a short window is shown once, prefixed with the
tasks' range (`[worker:0-23] ...`); each task's log file keeps its own complete lines."""

from __future__ import annotations

import io
import random
import re
from pathlib import Path

import pytest

from psworker.launcher.console.lines import (LineGrouper, TaskTokens, by_task, expand_tasks, for_console, format_tasks,
                                       normalise, render_group)
from psworker.launcher.console import folds
from psworker.launcher.backends.local import LocalBackend
from psworker.launcher.console.folds import exited_0
from psworker.launcher.console.output import GROUP_WINDOW_SECS
from psworker.launcher.supervise.supervisor import Supervisor
from psworker.testing import assert_processes_gone, write_spec
from tests.cluster_utils import run_launcher
from psworker.testing import ProgramTask, drive_until
from tests.fake_tasks.fakes import HERE

W3 = TaskTokens("worker", 3, "127.0.0.1", 42105, 22438)

# -- normalise, ranges, rendering ---------------------------------------------------------------------------


@pytest.mark.parametrize("line, expected", [
    ("worker:3 serving at grpc://127.0.0.1:42105", "<task> serving at grpc://<address>"),
    ("listening on localhost:42105 and [::1]:42105", "listening on <address> and <address>"),
    ("started as pid 22438.", "started as pid <pid>."),
    ("child 22438 exited", "child <pid> exited"),
    ("PID=991 ready", "PID=<pid> ready"),                        # a pid after `pid`, e.g. a remote one
    ("/job:worker/replica:0/task:3/device:CPU:0", "/job:worker/replica:0/task:<index>/device:CPU:0"),
    ("/job:worker/task:3", "/job:worker/task:<index>"),
    # other tasks, other ports, bare numbers and look-alikes stay
    ("ps:0 at 127.0.0.1:36675 is up", "ps:0 at 127.0.0.1:36675 is up"),
    ("worker:31 /job:worker/task:31 /job:ps/task:3", "worker:31 /job:worker/task:31 /job:ps/task:3"),
    ("step 3, loss = 0.42 (22438.0 examples/sec; 0.003 sec/batch)",
     "step 3, loss = 0.42 (22438.0 examples/sec; 0.003 sec/batch)"),
    ("port 421050, 10.0.0.1:42105, 1.22438, myworker:3", "port 421050, 10.0.0.1:42105, 1.22438, myworker:3"),
])
def test_normalise_replaces_only_the_tasks_own_tokens(line, expected):
    assert normalise(line, W3) == expected


def test_lines_of_two_tasks_that_differ_only_in_their_own_tokens_compare_equal():
    w5 = TaskTokens("worker", 5, "node-b", 2222, 700)
    assert (normalise("worker:3 serving at grpc://127.0.0.1:42105 (pid 22438)", W3)
            == normalise("worker:5 serving at grpc://node-b:2222 (pid 700)", w5))
    assert normalise("step 3, loss = 0.5", W3) != normalise("step 5, loss = 0.5", w5)


def test_tokens_of_a_planned_task():
    from psworker.spec.addresses import Address
    from psworker.spec.plan import Task

    task = Task("worker", 2, Address("node-a", 2223), False, ("python",), ())
    assert TaskTokens.of(task, 41) == TaskTokens("worker", 2, "node-a", 2223, 41)
    assert TaskTokens.of(Task("ps", 0, Address("::1", 2222), False, (), ())).host == "[::1]"


@pytest.mark.parametrize("names, text", [
    (["worker:0", "worker:1", "worker:2", "worker:3", "worker:5", "worker:7", "worker:8", "worker:9"],
     "worker:0-3,5,7-9"),
    (["worker:7", "ps:1", "worker:0", "ps:0"] + [f"worker:{i}" for i in range(1, 7)], "ps:0-1, worker:0-7"),
    (["chief:0", "worker:2", "worker:4"], "chief:0, worker:2,4"),
    (["worker:11", "worker:10"], "worker:10-11"),
])
def test_task_ranges_and_back(names, text):
    assert format_tasks(names) == text
    assert sorted(expand_tasks(text)) == sorted(names)


def test_expand_tasks_refuses_what_is_not_a_range():
    for bad in ("worker", "worker:a", "worker:1-", "ps:0,worker:1"):
        with pytest.raises(ValueError):
            expand_tasks(bad)


def test_each_tasks_lines_read_back_from_a_console():
    console = ("psworker: starting 3 tasks\n[ps:0, worker:0-1] towers: 1 on /cpu:0\n[worker:1] step 5\n"
               "[worker:0] [not a prefix] text\n[INFO] x\n")
    assert by_task(console) == {"ps:0": ["towers: 1 on /cpu:0"],
                                "worker:0": ["towers: 1 on /cpu:0", "[not a prefix] text"],
                                "worker:1": ["towers: 1 on /cpu:0", "step 5"]}


def test_a_group_shows_one_tasks_text_the_shared_text_or_the_neutral_form():
    key = "<task> serving at grpc://<address>"
    w0, w1 = ("worker:0", "worker:0 serving at grpc://h:1"), ("worker:1", "worker:1 serving at grpc://h:2")
    assert render_group([w0], key) == "[worker:0] worker:0 serving at grpc://h:1"
    assert render_group([("worker:1", "waiting"), ("worker:0", "waiting")], "waiting") == "[worker:0-1] waiting"
    assert render_group([w0, w1], key) == "[worker:0-1] <task> serving at grpc://<address>"


# -- the windowed grouper, on the caller's clock ------------------------------------------------------------


def add(grouper: LineGrouper, name: str, text: str, now: float) -> list[str]:
    job, _, index = name.partition(":")
    return grouper.add(name, text, normalise(text, TaskTokens(job, int(index))), now)


def test_lines_within_the_window_wait_for_it_to_end_and_come_out_once():
    g = LineGrouper(0.5)
    assert add(g, "worker:0", "waiting for the chief's model", 10.0) == []
    assert add(g, "worker:2", "waiting for the chief's model", 10.2) == []
    assert add(g, "worker:1", "waiting for the chief's model", 10.45) == []
    assert g.next_due() == 10.5
    assert g.due(10.49) == []
    assert g.due(10.5) == ["[worker:0-2] waiting for the chief's model"]
    assert g.next_due() is None and g.drain() == []


def test_a_line_after_the_window_starts_a_new_group():
    g = LineGrouper(0.5)
    add(g, "worker:0", "towers: 1 on /cpu:0", 0.0)
    assert add(g, "worker:1", "towers: 1 on /cpu:0", 0.6) == ["[worker:0] towers: 1 on /cpu:0"]
    assert g.drain() == ["[worker:1] towers: 1 on /cpu:0"]


def test_each_tasks_order_is_kept():
    g = LineGrouper(0.5)
    add(g, "worker:0", "x", 0.0)
    add(g, "worker:0", "y", 0.1)
    add(g, "worker:1", "y", 0.2)     # joins worker:0's y
    add(g, "worker:1", "x", 0.3)     # must follow worker:1's y: a group of its own, not worker:0's x
    add(g, "worker:0", "x", 0.35)    # worker:0 printed x again: after its y, so it joins worker:1's x
    assert g.due(1.0) == ["[worker:0] x", "[worker:0-1] y", "[worker:0-1] x"]


def test_a_tasks_lines_are_released_when_its_output_ends():
    g = LineGrouper(0.5)
    add(g, "worker:0", "a", 0.0)
    add(g, "worker:1", "a", 0.1)
    add(g, "worker:1", "b", 0.2)
    add(g, "worker:2", "c", 0.3)
    assert g.release("worker:1") == ["[worker:0-1] a", "[worker:1] b"]      # and what came before them
    assert g.release("worker:1") == [] and g.release("worker:9") == []
    assert g.drain() == ["[worker:2] c"]


def test_a_line_without_a_key_is_never_grouped_and_waits_only_for_its_own_tasks_lines_before_it():
    g = LineGrouper(0.5)
    add(g, "worker:0", "waiting", 0.0)
    add(g, "worker:1", "waiting", 0.05)
    assert g.add("worker:1", "step 5", None, 0.1) == []         # behind its own waiting line, to keep the order
    assert g.add("worker:2", "step 5", None, 0.2) == ["[worker:2] step 5"]    # nothing of worker:2's waits
    assert g.next_due() == 0.5
    assert g.due(0.5) == ["[worker:0-1] waiting", "[worker:1] step 5"]
    assert g.add("worker:1", "step 6", None, 0.6) == ["[worker:1] step 6"]


def test_step_lines_differ_and_a_window_of_0_holds_nothing():
    g = LineGrouper(0.5)
    add(g, "worker:0", "step 20, loss = 0.5 (10.0 examples/sec; 0.1 sec/batch)", 0.0)
    add(g, "worker:1", "step 21, loss = 0.5 (10.0 examples/sec; 0.1 sec/batch)", 0.0)
    assert len(g.drain()) == 2
    g = LineGrouper(0.0)
    assert add(g, "worker:0", "a", 5.0) == ["[worker:0] a"]
    assert add(g, "worker:1", "a", 5.0) == ["[worker:1] a"]


def test_random_schedules_lose_nothing_delay_nothing_past_the_window_and_keep_each_tasks_order():
    rng = random.Random(17)
    for _ in range(200):
        window = rng.choice([0.0, 0.2, 0.5])
        g = LineGrouper(window)
        now, sent, shown = 0.0, {}, []           # sent: task -> [(text, time)]; shown: (line, time)

        def flusher(until: float) -> None:       # wakes when the oldest group is due, as OutputCopier's does
            while g.next_due() is not None and g.next_due() <= until:
                at = g.next_due()
                shown.extend((line, at) for line in g.due(at))

        for _ in range(rng.randint(1, 60)):
            now += rng.choice([0.0, 0.01, 0.1, 0.3, 0.7])
            flusher(now)
            name = f"{rng.choice(['ps', 'worker'])}:{rng.randint(0, 5)}"
            text = f"line {rng.randint(0, 3)}"
            sent.setdefault(name, []).append((text, now))
            shown += [(line, now) for line in add(g, name, text, now)]
        flusher(now + window)
        assert g.next_due() is None
        got: dict[str, list[tuple[str, float]]] = {}
        for line, at in shown:
            prefix, text = re.fullmatch(r"\[([^\]]+)\] (.*)", line).groups()
            for name in expand_tasks(prefix):
                got.setdefault(name, []).append((text, at))
        assert sorted(got) == sorted(sent)
        for name, lines in sent.items():
            assert [text for text, _ in got[name]] == [text for text, _ in lines]
            assert all(at - t0 <= window + 1e-9 for (_, at), (_, t0) in zip(got[name], lines))


# -- through the supervisor: real processes, real pipes, real log files -------------------------------------


def chorus(job: str, index: int, *args: str) -> ProgramTask:
    import sys

    address = f"127.0.0.1:{41000 + 100 * (job == 'ps') + index}"
    argv = (sys.executable, str(HERE / "chorus.py"), job, str(index), address, *args)
    return ProgramTask(job, index, argv, address=address)


def same_lines(console_lines: list[str], log: Path, tokens: TaskTokens) -> None:
    """The console showed exactly the lines of the task's log that the console shows, in order (compared with the
    task's own tokens replaced, as a grouped line shows them); its routine lines (`folds`) as lines of their kind."""
    shown = [text for text in (for_console(line) for line in log.read_text().splitlines()) if text is not None]
    expected = [normalise(text, tokens) for text in shown if folds.kind(text) is None]
    assert [normalise(text, tokens) for text in console_lines if folds.kind(text) is None] == expected, \
        (log, console_lines)
    kinds = [folds.kind(text) for text in shown if folds.kind(text) is not None]
    on_console = [folds.kind(text) for text in console_lines if folds.kind(text) is not None]
    assert _runs(on_console) == _runs(kinds) and len(on_console) <= len(kinds), (log, console_lines)


def _runs(kinds: list[str]) -> list[str]:
    return [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]


def test_24_tasks_printing_the_same_start_up_lines_show_each_line_once(tmp_path):
    hold = tmp_path / "hold"
    tasks = [chorus("worker", i, "--hold", str(hold)) for i in range(24)]
    logs = [tmp_path / "logs" / f"worker-{i}.log" for i in range(24)]
    console = io.StringIO()
    # The window outlasts the start-up, however slowly 24 processes start on a loaded machine: the groups are
    # released once the tasks' output ends (test_grouped_lines_come_out_while_the_tasks_run: the real window).
    with Supervisor(tasks, tmp_path / "logs", backend=LocalBackend(), console=console, console_filter=for_console,
                    console_window_secs=3600.0, ps_exit_grace_secs=0.2) as sup:
        drive_until(sup, lambda: all(log.exists() and log.read_text().count("\n") == 5 for log in logs), 180,
                   "every task's 5 lines in its log")
        assert console.getvalue() == ""          # all held for their window
        hold.touch()
        result = sup.wait(timeout=60)
    assert result.ok, (result.reason, console.getvalue())
    lines = console.getvalue().splitlines()
    assert lines[:4] == ["[worker:0-23] towers: 1 on /cpu:0 (no GPU visible)",
                         "[worker:0-23] <task> serving at grpc://<address> (pid <pid>)",
                         "[worker:0-23] variables of /job:worker/replica:0/task:<index> on /job:ps/replica:0/task:0",
                         "[worker:0-23] waiting for the chief's model on the ps tasks"], console.getvalue()
    # the launcher's word that each exited 0: folded, each task named once
    exits = [line for line in lines if line.startswith("psworker: ")]
    assert sorted(n for line in exits for n in exited_0(line)) == sorted(t.name for t in tasks), console.getvalue()
    # step lines are never grouped, not even identical ones: each is its own task's progress
    assert sorted(line for line in lines[4:] if line not in exits) == sorted(f"[worker:{i}] step 100, loss = 0.50 (100.0 examples/sec; 0.010 sec/batch)"
                                       for i in range(24)), console.getvalue()
    pids = set()
    for task in tasks:
        log = (tmp_path / "logs" / f"worker-{task.index}.log").read_text().splitlines()
        assert len(log) == 5 and log[0] == "towers: 1 on /cpu:0 (no GPU visible)", log
        m = re.fullmatch(rf"worker:{task.index} serving at grpc://{task.address} \(pid (\d+)\)", log[1])
        assert m, log
        pids.add(int(m.group(1)))
        assert log[2] == f"variables of /job:worker/replica:0/task:{task.index} on /job:ps/replica:0/task:0"
        assert log[4].startswith("step 100, loss = "), log
    assert len(pids) == 24
    assert_processes_gone(pids)


def test_grouped_lines_come_out_while_the_tasks_run(tmp_path):
    """With the launcher's window, lines reach the console while every task still runs (not at the end), each
    task's lines in order and none lost: 2 ps and 2 workers print at once (a barrier), then wait for `hold`."""
    ready, go, hold = tmp_path / "ready", tmp_path / "go", tmp_path / "hold"
    ready.mkdir()
    tasks = [chorus(job, i, "--ready", str(ready), "--go", str(go), "--hold", str(hold))
             for job in ("ps", "worker") for i in range(2)]
    console = io.StringIO()
    with Supervisor(tasks, tmp_path / "logs", backend=LocalBackend(), console=console, console_filter=for_console,
                    console_window_secs=GROUP_WINDOW_SECS, done_jobs=frozenset({"ps", "worker"})) as sup:
        drive_until(sup, lambda: len(list(ready.iterdir())) == len(tasks), 120, "every task to reach the barrier")
        go.touch()
        drive_until(sup, lambda: all(len(by_task(console.getvalue()).get(t.name, ())) == 5 for t in tasks), 60,
                   f"every task's 5 lines on the console while it runs; console so far:\n{console.getvalue()}")
        assert len(sup.pids()) == len(tasks)           # nobody has exited yet: the window released them
        hold.touch()
        result = sup.wait(timeout=60)
    assert result.ok, (result.reason, console.getvalue())
    shown = by_task(console.getvalue())
    for task in tasks:
        same_lines(shown[task.name], tmp_path / "logs" / f"{task.job}-{task.index}.log", TaskTokens.of(task))


# -- a real cluster: 2 ps + 8 workers ------------------------------------------------------------------------

STARTUP = {   # lines every worker prints at start-up (the chief does not wait for its own model)
    "towers": re.compile(r"towers: \d+ on "),
    "serving": re.compile(r"(worker:\d+|<task>) serving at grpc://"),
    "waiting": re.compile(r"waiting for the chief's model on the ps tasks$"),
}


@pytest.mark.slow
def test_a_real_cluster_of_2_ps_and_8_workers_shows_repeated_lines_once(tmp_path):
    """Start-up lines shown once per group; the routine lines of each task's end (and of the ps tasks coming up)
    folded, every task in them; every other line of each task as its log has it, in order."""
    train_dir = tmp_path / "train"
    spec = write_spec(tmp_path / "cluster.yaml", num_ps=2, num_workers=8, max_steps=100, batch_size=16,
                      log_every_steps=20, train_dir=str(train_dir))
    run = run_launcher([str(spec), "--train_dir", str(train_dir)], cwd=tmp_path, timeout=420)
    assert run.returncode == 0, run.output[-4000:]
    assert_processes_gone(run.pids)
    shown, lines = by_task(run.output), run.output.splitlines()
    from psworker.spec import load_spec
    loaded = load_spec(train_dir / "cluster.yaml")
    workers, ps = [f"worker:{i}" for i in range(8)], ["ps:0", "ps:1"]
    for job, addresses in (("worker", loaded.worker), ("ps", loaded.ps)):
        for i, a in enumerate(addresses):
            same_lines(shown[f"{job}:{i}"], train_dir / "logs" / f"{job}-{i}.log", TaskTokens(job, i, a.host, a.port))
    grouped = [line for line in lines if re.match(r"\[worker:\d+[-,]", line)]
    for what, pattern in STARTUP.items():
        expected = workers[1:] if what == "waiting" else workers
        holders = [n for n in expected if sum(bool(pattern.match(t)) for t in shown[n]) == 1]
        assert holders == expected, (what, run.output[-6000:])
    assert any(any(p.match(line.partition("] ")[2]) for p in STARTUP.values()) for line in grouped), \
        run.output[-6000:]
    for kind in ("up", "last step", "worker done"):       # in each worker's lines, folded or not
        assert [n for n in workers if any(folds.kind(t) == kind for t in shown[n])] == workers, (kind, lines)
    for name in ps:                                        # each ps heard from every worker
        said = [m for t in shown[name] for m in [re.fullmatch(r"(worker:[\d,-]+) (?:is|are) done .*", t)] if m]
        assert sorted({n for m in said for n in expand_tasks(m.group(1))}) == sorted(workers), (name, lines)
        assert len(said) < len(workers), (name, lines)         # a ps's lines folded
    exits = [line for line in lines if exited_0(line)]
    assert sorted(n for line in exits for n in exited_0(line)) == sorted(ps + workers), lines
    assert len(exits) < len(ps + workers), lines
