"""Every benchmark is a tested command: each file in benchmarks/ runs its `--quick` mode (seconds, tiny steps and
data) as a real subprocess, and its figure lines must show sane numbers, so a change that breaks a benchmark fails
here. `pytest -k benchmark` runs them all (ids `benchmark-NAME`); the figures themselves come from full runs."""

from __future__ import annotations

import inspect
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from tests.conftest import skip_or_fail

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"
NUM = r"(-?[\d,]*\.?\d+(?:e[-+]?\d+)?)"    # a figure: every captured number must be finite and > 0
JOBS = int(os.environ.get("PSWORKER_BENCHMARK_JOBS", "3"))   # quick runs at once


@dataclass(frozen=True)
class Case:
    """A benchmark's quick run: its extra arguments, the figure lines it must print (each a regex whose groups are
    figures that must be positive), its time bound and what it needs (`None`, or a `conftest.COMPONENTS` name)."""

    figures: tuple[str, ...]
    args: tuple[str, ...] = ()
    timeout: float = 240.0
    needs: str | None = None
    last_json: Callable[[dict], bool] | None = None    # a test of the JSON object on the last line


CASES: dict[str, Case] = {
    "cifar10": Case((rf"^1 ps \+ 1 worker \(async\)\s+{NUM}\s+{NUM}\s+worker:0 {NUM}",
                     rf"^one process, no servers \(fed by the pipeline\)\s+{NUM}")),
    "checkpoint_check": Case((rf"^checkpoint {NUM} MB: cheap check {NUM} ms, full check {NUM} ms, restore {NUM} ms",)),
    "console_lines": Case((rf"^{NUM} console lines, exit 0, ",)),
    "stacks": Case((rf"^stop 2 live tasks, asked\s+median\s+{NUM} ms",
                    rf"^stop 2 live tasks, not asked\s+median\s+{NUM} ms",
                    r"^asking adds -?\d+ ms \(median\): (?:OK|OVER)")),
    # its seconds may print 0.0: the backup worker's steps need not wait, and the console can bring every line at once
    "straggler": Case((rf"^with stop:worker:1@step=10,for=1: [\d.]+ s of training to step {NUM}",)),
    "dealt": Case(tuple(rf"^round 0 {s}: {NUM} global steps/s" for s in ("static", "dealt"))),
    "elastic": Case((rf"^\| 1 \| {NUM} \| 1.00 \|", rf"^\| 2 \| {NUM} \| {NUM} \|")),
    "first_step": Case((rf"^  this worker:0\s+{NUM}  ", rf"^  this worker:1\s+{NUM}  ")),
    "lifecycle": Case((rf"^final global step\s+{NUM}$", rf"^global steps/s\s+{NUM}$",
                       rf"^in-process steps/s\s+{NUM}  \({NUM} examples/s\)$",
                       rf"^goal startup_timeout_3s <= 6 s: {NUM} s ",
                       rf"^goal workers_gone_timeout_3s <= 6 s: {NUM} s ")),
    "ps_memory": Case((rf"^ps:0: anonymous memory peak {NUM} MiB, page cache peak \d+ MiB",
                       rf"--ps_memory_limit 1.0 GiB \(1,024 MiB\) per ps; peak memory .*: ps:0 {NUM} MiB / "
                       rf"{NUM} MiB"),
                      needs="memcg"),
    "response_times": Case((rf"^grpc: 5 probes of a live server\s+{NUM}\s+{NUM}",
                            rf"^session: give up after max_wait 1.5 s\s+{NUM}\s+{NUM}",
                            rf"^ssh: check 4 hosts, 2 refused\s+{NUM}\s+{NUM}",
                            rf"^psworker ssh: refused host, until exit\s+{NUM}\s+{NUM}"), needs="sshd"),
    "dealt_straggler": Case((rf"^round 0 dealt: max/min updates per example {NUM} \(\d+ / \d+\), steps .*, "
                             rf"speed ratio {NUM}$",)),
    "staged_loss": Case(tuple(rf"^rate 0.1 {v}\s+mean loss last 3 steps {NUM}"
                              for v in ("plain", "staged", "delayed"))),
    "transfer_floor": Case((rf"^{NUM} MB each way per step: cluster {NUM} CPU-ms per step, one process {NUM}; ",)),
    "peers": Case((rf"^mlp\s+psworker\s+{NUM}$", rf"^mlp\s+pss\s+{NUM}$", rf"^mlp\s+psworker / pss\s+{NUM}x$")),
    # per task 14 states and 7 restart classes; per worker its step, examples/s, seconds since its step, stalled; the
    # last exit codes of the 2 tasks restarted; the run's 5 states and its 7 gauges
    "metrics_overhead": Case((rf"^metrics: launcher CPU {NUM} s off, {NUM} s on \(scraped every 1 s\): [-+][0-9.]+% of "
                              rf"the run's {NUM} CPU-s \(1 ps \+ 2 step-printing scripts, medians of 1; goal < 1%: "
                              rf"(?:OK|OVER)\); scrape at 4 ps \+ 24 workers: {NUM} ms median, {NUM} ms worst, "
                              rf"{NUM} series",),
                             last_json=lambda f: f["scrapes_during_runs"] >= 1
                             and f["scrape_series"] == 28 * (14 + 7) + 24 * 4 + 2 + 5 + 7),
    "in_flight": Case(tuple(rf"^\s+{t}\s+{k}\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}$"
                            for t in ("unpacked", "packed") for k in (1, 2, 3))),
    "profile_step": Case((rf"^  MonitoredSession \+ TrainLoopHook\s+{NUM}\s+{NUM}\s+{NUM}$",
                          rf"^CPU per step, worker \+ ps, against in-process: {NUM} / {NUM} ms = {NUM}x",
                          rf"^traced step \(FULL_TRACE, bare session\): wall {NUM} ms",
                          rf"^  worker: pull variables from ps \(RecvTensor\)\s+{NUM}$")),
    "overlap": Case((rf"^in-process\s+{NUM}\s+{NUM}\s+1.00\s+1$",
                     rf"^1x1\s+staged\s+{NUM}\s+{NUM}\s+{NUM}\s+1$",
                     # CPU per process: ps:0's and worker:0's, the last two columns (the launcher's, and an
                     # 'other' column where one was seen, may be 0)
                     rf"^CPU-s per 1,000 examples, per process \(medians\)\n.* ps:0\s+worker:0\n"
                     rf"1x1\s+staged(?:\s+[\d.]+)*\s+{NUM}\s+{NUM}$")),
    "compare": Case((rf"^  1w async\s+{NUM}  \(1.00x\)  samples {NUM}$",
                     rf"^  1w sync\s+{NUM}  \({NUM}x\)  samples {NUM}$")),
    # its seconds may print 0.00 as straggler's do (one burst of step lines at 40 steps)
    "sync_backup": Case(tuple(rf"^run 0 {n}: [\d.]+ s of training to step {NUM} \(" for n in ("base", "new")),
                        last_json=lambda f: len(f["runs"]["base"]) == len(f["runs"]["new"]) == 1),
    "sparse_apply": Case(tuple(rf"^  {v}\s+-?[\d.]+ CPU-us per update, feed subtracted \({NUM} with it\)$"
                               for v in ("TF ResourceSparseApplyAdagrad", "psworker gathered_adagrad",
                                         "the same in its row_lock")),
                         last_json=lambda f: f["max_abs_diff"] < 1e-5),
    "criteo_input": Case(tuple(rf"^  {v}\s+{NUM} CPU-us per batch,\s+{NUM} wall-us$"
                               for v in (r"psworker \(numpy, hashed once\)", r"pss_peer \(strings, tf.data\)")),
                         last_json=lambda f: f["args"]["batches"] == 20),
    "pss_peer": Case((rf"^pss mlp 1 ps \+ 1 worker\(s\): {NUM} examples/s \({NUM} steps/s\)",
                      r'"link_bytes": \[\[[1-9]'), needs="netns"),
}


def _no_sshd() -> str | None:
    from psworker.testing_sshd import why_no_sshd

    reason = why_no_sshd()
    return reason and f"no sshd: {reason}"


def _no_memcg() -> str | None:
    from psworker.launcher.cgroups import unavailable

    reason = unavailable()
    return reason and f"no memory cgroup here: {reason}"


def _no_netns() -> str | None:
    from psworker.launcher import netns, shaping

    return shaping.missing_tool() or (None if netns.available() else "no network namespace here")


# what a case needs -> why it is missing here (None: present)
MISSING = {"sshd": _no_sshd, "memcg": _no_memcg, "netns": _no_netns}
# a file of benchmarks/ without a case here, with why: only imported by others, or run by a test of its own
ELSEWHERE: dict[str, str] = {"ps_memory_model": "tests/test_ps_memory_model.py runs its --quick and checks its fit"}


def test_every_benchmark_has_a_case() -> None:
    """A new file in benchmarks/ gets a case here (or names the test that runs it)."""
    files = {p.stem for p in BENCHMARKS.glob("*.py")}
    assert files - ELSEWHERE.keys() - CASES.keys() == set(), "benchmarks without a quick case"
    assert all((REPO / test.split()[0]).is_file() for test in ELSEWHERE.values())
    assert set(CASES) <= files


def _figures(name: str, case: Case, out: str) -> list[float]:
    found = []
    for figure in case.figures:
        m = re.search(figure, out, re.MULTILINE)
        assert m, f"{name} --quick printed no line like {figure!r}:\n{out[-4000:]}"
        found += [float(g.replace(",", "")) for g in m.groups() if g is not None]
    return found


@dataclass(frozen=True)
class QuickRun:
    """What one quick run left: its exit code (None: ended at its time bound), its output (stderr included), and
    its wall and CPU seconds (user + system, its reaped descendants included)."""

    returncode: int | None
    output: str
    wall_s: float
    cpu_s: float


class QuickRuns:
    """The selected cases' quick runs, `JOBS` at a time in threads (most of a quick run waits: process start-ups,
    the servers' handshakes, timeouts that are the figure), each in its own process group, ended at `close()`."""

    def __init__(self, names: list[str], workdir: Path) -> None:
        self._workdir, self._procs = workdir, []
        self._pool = ThreadPoolExecutor(JOBS, thread_name_prefix="benchmark")
        self.runs: dict[str, Future] = {n: self._pool.submit(self._run, n) for n in names}

    def _run(self, name: str) -> QuickRun:
        case, cwd = CASES[name], self._workdir / name
        cwd.mkdir()
        env = dict(os.environ, PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="2", TMPDIR=str(cwd))
        began = time.monotonic()
        proc = subprocess.Popen([sys.executable, str(BENCHMARKS / f"{name}.py"), "--quick", *case.args], cwd=cwd,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        self._procs.append(proc)
        reaped, late = threading.Event(), threading.Event()
        timer = threading.Timer(case.timeout, _end_group, (proc.pid, reaped, late, cwd))
        timer.start()
        try:
            out = proc.stdout.read()
            _, status, usage = os.wait4(proc.pid, 0)   # not Popen.wait: the rusage is the figure's CPU
        finally:
            reaped.set()
            timer.cancel()
            timer.join(120)   # a time bound that fired ends the run's strays first
        proc.returncode = os.waitstatus_to_exitcode(status)
        return QuickRun(None if late.is_set() else proc.returncode, out, time.monotonic() - began,
                        usage.ru_utime + usage.ru_stime)

    def close(self) -> None:
        for run in self.runs.values():
            run.cancel()
        for proc in list(self._procs):
            if proc.returncode is None:
                _end_group(proc.pid, threading.Event(), threading.Event(), self._workdir)
        self._pool.shutdown(wait=True)


def _end_group(pid: int, reaped: threading.Event, late: threading.Event, workdir: Path) -> None:
    """Ends a quick run: SIGTERM to its process group (a launcher stops its tasks), SIGKILL if it is not reaped
    within 30 s, then whatever it started in a session of its own (a launcher, its tasks, servers: found by their
    command line or folder under `workdir`); `late` tells its reader why it ended."""
    late.set()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            break
        if reaped.wait(30):
            break
    _end_strays(str(workdir))


def _end_strays(workdir: str) -> None:
    import psutil

    strays = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and (workdir in " ".join(p.cmdline()) or p.cwd().startswith(workdir)):
                strays.append(p)
        except psutil.Error:
            continue
    for p in strays:
        p.terminate()
    _, alive = psutil.wait_procs(strays, timeout=30)
    for p in alive:
        p.kill()
    psutil.wait_procs(alive, timeout=10)


@pytest.fixture(scope="session")
def quick_runs(request, tmp_path_factory):
    """Starts every selected case's quick run at once (`JOBS` at a time); a case needing what is missing is left
    out (its test skips, or fails under PSWORKER_REQUIRE)."""
    names = [item.callspec.params["name"] for item in request.session.items
             if getattr(item, "originalname", None) == "test_benchmark_quick"]
    runs = QuickRuns([n for n in names if not (CASES[n].needs and MISSING[CASES[n].needs]())],
                     tmp_path_factory.mktemp("benchmarks"))
    yield runs.runs
    runs.close()
    done = {n: r.result() for n, r in runs.runs.items() if r.done() and not r.cancelled() and r.exception() is None}
    if done:   # each run's wall and CPU seconds, shown past pytest's output capture
        report = request.config.pluginmanager.get_plugin("terminalreporter")
        with request.config.pluginmanager.get_plugin("capturemanager").global_and_fixture_disabled():
            report.write_line(f"\nbenchmark quick runs ({JOBS} at a time): wall s, CPU s")
            for name, run in sorted(done.items(), key=lambda kv: -kv[1].cpu_s):
                report.write_line(f"  {name:<18}{run.wall_s:7.1f}{run.cpu_s:8.1f}")
            report.write_line(f"  {'(sum)':<18}{sum(r.wall_s for r in done.values()):7.1f}"
                              f"{sum(r.cpu_s for r in done.values()):8.1f}")


@pytest.mark.parametrize("name", sorted(CASES), ids=lambda n: f"benchmark-{n}")
def test_benchmark_quick(name: str, quick_runs: dict[str, Future]) -> None:
    """`python benchmarks/NAME.py --quick` exits 0 and prints its figure lines with positive, finite numbers."""
    case = CASES[name]
    reason = case.needs and MISSING[case.needs]()
    if reason:
        skip_or_fail(case.needs, reason)
    done = quick_runs[name].result()
    assert done.returncode is not None, f"{name} --quick ran past {case.timeout:.0f} s:\n{done.output[-4000:]}"
    assert done.returncode == 0, f"{name} --quick exited {done.returncode}:\n{done.output[-4000:]}"
    figures = _figures(name, case, done.output)
    assert figures and all(math.isfinite(f) and f > 0 for f in figures), (name, figures, done.output[-2000:])
    if case.last_json is not None:
        last = json.loads(done.output.strip().splitlines()[-1])
        assert case.last_json(last), (name, last)


# a benchmark command in the README or docs/: in a code block's line or an inline code span, environment first
SHOWN = re.compile(r"(?:^|\s)((?:[A-Z_]+=\S+ )*)python3? (benchmarks/(\w+)\.py\b[^`\n#]*)")
PLACEHOLDERS = ("[", "<", "...")    # a usage line, not a command


def shown_benchmark_commands() -> list[tuple[str, str, list[str]]]:
    """(where, benchmark, argv) of every benchmark command the README and docs show (figures name them); argv
    starts with the environment's assignments."""
    found = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        lines = [line for _, body in re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)
                 for line in body.replace("\\\n", " ").splitlines()]
        spans = re.findall(r"`([^`]*)`", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M))
        for snippet in lines + [s.replace("\n", " ") for s in spans]:
            m = SHOWN.search(snippet)
            if m and not any(p in m.group(2) for p in PLACEHOLDERS):
                found.append((f"{path.relative_to(REPO)}: python {m.group(2).strip()}", m.group(3),
                              shlex.split(m.group(1)) + shlex.split(m.group(2))[1:]))
    return found


class _Parsed(Exception):
    """Raised in place of running a benchmark once its command line parsed."""


def test_the_docs_show_benchmark_commands_that_exist():
    shown = {name for _, name, _ in shown_benchmark_commands()}
    assert len(shown) >= 15, sorted(shown)
    assert shown <= {p.stem for p in BENCHMARKS.glob("*.py")}, sorted(shown - {p.stem for p in BENCHMARKS.glob("*.py")})


@pytest.mark.parametrize("where, name, argv", shown_benchmark_commands(), ids=lambda v: v if isinstance(v, str) and
                         v.startswith(("README", "docs")) else "")
def test_every_shown_benchmark_command_parses(where, name, argv, monkeypatch, capsys, tmp_path):
    """As the benchmark parses it (its own argparse; ps_memory.py's arguments are `psworker local`'s), stopped
    before it runs anything: a flag renamed or dropped fails here, not when someone re-makes a figure."""
    env = dict(a.split("=", 1) for a in argv if re.match(r"^[A-Z_]+=", a))
    argv = argv[len(env):]
    if name == "ps_memory":   # psworker local's command line, checked as tests/test_docs.py checks one
        from tests.test_docs import test_every_shown_command_parses

        test_every_shown_command_parses(where, env, ["local", *argv], tmp_path, monkeypatch)
        return
    import argparse
    import runpy

    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        parse(self, args, namespace)
        raise _Parsed()

    module = runpy.run_path(str(BENCHMARKS / f"{name}.py"), run_name=f"benchmark_{name}")
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "argv", [f"benchmarks/{name}.py", *argv])
    main = module["main"]
    takes_argv = any(p.default is inspect.Parameter.empty for p in inspect.signature(main).parameters.values())
    with pytest.raises(_Parsed):
        try:
            main(argv) if takes_argv else main()
        except SystemExit as exc:
            pytest.fail(f"{where}: exit {exc.code}: {capsys.readouterr().err.strip()[-2000:]}")
