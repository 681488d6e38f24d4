"""The real launcher over real TensorFlow tasks (1 ps + 2 workers, the MLP on digits), for what the fake tasks
cover elsewhere: the SIGSTOP straggler, time-triggered kills, stall detection, the live view and the plain status
lines, `--network isolated`, and SIGTERM, SIGINT and SIGKILL to the launcher with no process left after each.

Three runs, one per signal, each checking several things while it trains, synchronised on the console's lines.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from typing import Optional, Sequence

import psutil
import pytest

from psworker import events
from psworker.launcher import netns
from psworker.testing import assert_processes_gone, port_listening
from tests.cluster_utils import REPO, Launcher
from tests.conftest import skip_or_fail

pytestmark = pytest.mark.slow

SPEC = str(REPO / "cluster_specs" / "local.yaml")
ENDLESS = "1000000"          # max_steps: these runs end by a signal from the test


def _status(pid: int) -> Optional[str]:
    try:
        return psutil.Process(pid).status()
    except psutil.Error:
        return None


def _steps(lines: Sequence[str], task: str) -> list[int]:
    """`task`'s global steps in its console step lines (on a terminal one may follow the live view's last row on
    one line: it is read from its console prefix on)."""
    found = (events.parse_step(line[line.rfind(f"[{task}] "):]) for line in lines if f"[{task}] " in line)
    return [r.step.step for r in found if r is not None and r.task == task]


def _listening_ports(pid: int) -> set[int]:
    """TCP ports in LISTEN state in the network namespace of `pid` (its /proc/PID/net/tcp and tcp6)."""
    ports = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for row in f.read().splitlines()[1:]:
                local, state = row.split()[1], row.split()[3]
                if state == "0A":
                    ports.add(int(local.rsplit(":", 1)[1], 16))
    return ports


def test_sigterm_ends_a_run_with_a_straggler_a_timed_kill_and_status_lines(tmp_path, launcher):
    """`--network isolated`: the tasks' ports listen only inside the run's namespace. `stop:worker:0`: the chief is
    SIGSTOPped, then resumes and trains on. `kill:worker:1@time=6`: killed on time, restarted, trains again. Off a
    terminal, plain status lines name every task and steps the workers reported. SIGTERM: exit 143, nothing left."""
    if not netns.available():
        skip_or_fail("netns", "no network namespace here (needs Linux, util-linux unshare, user namespaces)")
    train_dir = tmp_path / "t"
    run = launcher(SPEC, "--train_dir", str(train_dir), "--max_steps", ENDLESS, "--log_every_steps", "20",
                   "--network", "isolated", "--max_restarts", "1", "--grace_period_secs", "5",
                   "--inject", "kill:worker:1@time=6", "--inject", "stop:worker:0@step=100,for=4")
    stop_line = r"injecting stop:worker:0@step=100,for=4 at global step (\d+)"
    resumed_line = r"injected fault over: SIGCONT to worker:0"
    seen_stopped: list[int] = []

    def watch_the_straggler() -> None:   # while the chief is meant to be stopped, is its process stopped?
        if run.find(stop_line) and not run.find(resumed_line):
            pid = run.task_pids().get("worker:0")
            if pid and _status(pid) == psutil.STATUS_STOPPED:
                seen_stopped.append(pid)

    def everything_seen() -> bool:
        restarted = run.find(r"restarting worker:1 \(restart 1: injected kill:worker:1@time=6\)")
        resumed = run.find(resumed_line)
        return bool(restarted and run.find(r"^\[worker:1\] step \d+", restarted[0])
                    and resumed and run.find(r"^\[worker:0\] step \d+", resumed[0])
                    and run.find(r"^psworker: status: step [1-9]\d*/"))

    run.wait_until(everything_seen, "a restarted worker:1 and a resumed chief training, and a status line",
                   each_poll=watch_the_straggler)
    _assert_isolated(run, train_dir)
    assert run.end(signal.SIGTERM) == 143, run.tail()
    lines = run.snapshot()
    assert_processes_gone(run.pids, timeout=30)

    assert run.find(r"^psworker: network: private namespace, interfaces lo\b"), run.tail()
    kill = run.find(r"injecting kill:worker:1@time=6 at global step \d+, ([\d.]+) s after start")
    assert kill and float(kill[1].group(1)) >= 6.0, run.tail()
    assert run.find(r"worker:1 \(pid \d+\) exited: injected kill:worker:1@time=6", kill[0]), run.tail()

    assert seen_stopped, "worker:0 was never seen in the stopped state while its injected stop lasted"
    at, stopped = run.find(stop_line)
    resumed_at = run.find(resumed_line, at)[0]
    first_after = run.find(r"^\[worker:0\] step (\d+)", resumed_at)[1]
    assert int(first_after.group(1)) > int(stopped.group(1)), "the chief did not train on after its SIGCONT"

    status = [line for line in lines if line.startswith("psworker: status: ")]
    for line in status:
        _assert_status_line(line, lines)
    assert "launcher received SIGTERM" in "\n".join(lines), run.tail()


def _assert_isolated(run: Launcher, train_dir: Path) -> None:
    """Every task's port listens in the run's own network namespace, and nothing answers it from the test's."""
    from psworker.spec import load_spec

    spec = load_spec(train_dir / "cluster.yaml")
    ports = {f"{job}:{i}": a.port for job in ("ps", "worker") for i, a in enumerate(spec.addresses(job))}
    pids = run.task_pids()
    assert sorted(pids) == sorted(ports), (pids, ports)
    here = os.stat("/proc/self/ns/net").st_ino
    for name, pid in pids.items():
        assert os.stat(f"/proc/{pid}/ns/net").st_ino != here, f"{name} runs in the test's network namespace"
        assert ports[name] in _listening_ports(pid), f"{name} does not listen on {ports[name]} in its namespace"
    answered = [name for name, port in ports.items() if port_listening(port)]
    assert not answered, f"reachable from outside the run's network namespace: {answered}"


def _assert_status_line(line: str, lines: Sequence[str]) -> None:
    """`psworker: status: step S/M, [epoch E, ]R examples/s, loss L, eta T; ps:0 running, worker:0 training @K, ...`
    (the epoch with dealt shards): every task, in a known state; each `@K` a step that task reported."""
    m = re.fullmatch(rf"psworker: status: step (\d+)/{ENDLESS}, (?:epoch [\d.]+(?: of \d+)?, )?(\d+|-) examples/s, "
                     r"loss ([\d.]+|-), eta ([\d:]+|-); (.*)", line)
    assert m, line
    tasks = dict(re.fullmatch(r"(\w+:\d) (.*)", part).groups() for part in m.group(5).split(", "))
    assert sorted(tasks) == ["ps:0", "worker:0", "worker:1"], line
    for name, rest in tasks.items():
        state = re.fullmatch(r"(starting|running|training|done|stopped|stopped \(injected\)|restarting \d+|failed|"
                             r"exited)(?: @(\d+))?", rest)
        assert state, f"{name}: {rest!r} in {line}"
        if state.group(2) is not None:
            assert int(state.group(2)) in _steps(lines, name), f"{name} never reported step {state.group(2)}: {line}"
    if int(m.group(1)) > 0:
        assert int(m.group(1)) in _steps(lines, "worker:0") + _steps(lines, "worker:1"), line


def test_sigint_ends_a_run_whose_stalled_workers_are_being_restarted(tmp_path, launcher):
    """The ps is SIGSTOPped from the start: the workers wait for it and print no step line, so the stall timeout
    kills them and they restart. SIGINT then: exit 130, and every task, the stopped ps included, is gone.

    (A stall after training has started is the same check on a step that stopped moving, covered over fake tasks:
    here the start-up of real tasks on a loaded machine would have to fit in the timeout.)"""
    run = launcher(SPEC, "--train_dir", str(tmp_path / "t"), "--max_steps", ENDLESS, "--stall_timeout_secs", "5",
                   "--max_restarts", "3", "--grace_period_secs", "5", "--inject", "stop:ps:0@time=0,for=600")
    stopped_at, _ = run.wait_for(r"injecting stop:ps:0@time=0,for=600 at global step 0", "the ps stopped")
    at, stall = run.wait_for(r"(worker:\d) stalled: no step line for (\d+) s; killing it", "a stalled worker killed",
                             after=stopped_at)
    worker = stall.group(1)
    run.wait_for(rf"restarting {worker} \(restart 1: stalled: no step line for", f"{worker} restarted", after=at)
    ps = run.task_pids()["ps:0"]
    assert _status(ps) == psutil.STATUS_STOPPED, f"ps:0 is {_status(ps)}, not stopped"
    assert run.end(signal.SIGINT) == 130, run.tail()
    assert_processes_gone(run.pids, timeout=30)
    assert int(stall.group(2)) >= 5, stall.group(0)
    assert run.find(rf"{worker} \(pid \d+\) exited: stalled: no step line", at), run.tail()
    assert not _steps(run.snapshot(), "worker:0") + _steps(run.snapshot(), "worker:1"), run.tail()
    assert "launcher received SIGINT" in "\n".join(run.snapshot()), run.tail()
    assert run.find(r"^--- tasks ---$") and run.find(r"^\s*ps:0\s+stopped by launcher"), run.tail()
    assert run.find(r"^psworker: task logs in .*/logs/, checkpoints and summaries in .*/t/$"), run.tail()
    # the chief never trained: nothing saved on the stop, and the line says what the same command does
    assert run.find(r"^psworker: stopped; worker:0 wrote no checkpoint on the stop \(.+\); no checkpoint in .*/t: "
                    r"the same command starts afresh$"), run.tail()
    if netns.available():   # --network auto: isolated where it can be (required on CI: the SIGTERM test)
        assert run.find(r"^psworker: network: private namespace, interfaces lo\b"), run.tail()
    else:
        assert run.find(r"^psworker: warning: network: no private namespace available"), run.tail()


def test_sigkill_to_the_launcher_takes_its_tasks_with_it(tmp_path, launcher):
    """On a terminal the live view shows the global step and a row per task, with steps the workers reported; the
    launcher killed outright (no handler runs) leaves no task behind: each dies with it (PR_SET_PDEATHSIG)."""
    run = launcher(SPEC, "--train_dir", str(tmp_path / "t"), "--max_steps", ENDLESS, "--log_every_steps", "20",
                   tty=True)

    def shown(pattern: str) -> set[int]:
        return {int(m.group(1)) for m in (re.match(pattern, line) for line in run.snapshot()) if m}

    def live_view_agrees_with_the_step_lines() -> bool:
        lines = run.snapshot()
        reported = {w: set(_steps(lines, w)) for w in ("worker:0", "worker:1")}
        rows = {w: shown(rf"\s*{w}\s+training\s+(\d+)\s+0\b") for w in reported}
        return (all(rows[w] & reported[w] for w in reported)
                and bool(shown(rf"\s*step (\d+)/{ENDLESS}\s") & (reported["worker:0"] | reported["worker:1"])))

    run.wait_until(live_view_agrees_with_the_step_lines, "a live view showing both workers training at steps they "
                                                         "reported")
    assert shown(r"\s*ps:0\s+running\s+-\s+(0)\b"), run.tail()
    tasks = run.task_pids()
    assert sorted(tasks) == ["ps:0", "worker:0", "worker:1"], tasks
    assert run.end(signal.SIGKILL) == -signal.SIGKILL
    assert_processes_gone(run.pids, timeout=30)
