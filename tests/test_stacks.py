"""The stacks of a stuck task: faulthandler's dump parsed back (`psworker.stackdump`, on real dumps), and the
launcher asking a task for them before it kills a stalled one or stops those left
(`psworker.launcher.supervise.stacks`):
by SIGUSR1 for psworker's tasks, by py-spy for a user's program, over fake tasks (no TensorFlow) and through
`psworker run`; then on real psworker tasks, a worker stalled by a stopped ps, locally and under the real Slurm
(a failed ssh run's teardown: tests/test_ssh_launch.py; a step timeout's dump: tests/test_sync.py)."""

from __future__ import annotations

import faulthandler
import gc
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

import pytest

from psworker import events, stackdump
from psworker.launcher.supervise import stacks
from psworker.launcher.console.report import format_report
from psworker.launcher.supervise.supervisor import Supervisor
from psworker.testing import ProgramTask, assert_processes_gone, processes_naming
from tests.cluster_utils import REPO, run_launcher
from tests.fake_tasks.fakes import HERE, fake, drive_until, wait_for

STUCK = str(HERE / "stuck.py")
WAIT = 60.0                       # for any one event of a fake task on a loaded machine


def _blocked_in_helper(release: threading.Event, started: threading.Event) -> None:
    started.set()
    release.wait()


def _real_dump(depth: int = 0) -> str:
    """faulthandler's dump of this process (this thread `depth` frames deeper), with a helper thread blocked."""
    if depth:
        return _real_dump(depth - 1)
    release, started = threading.Event(), threading.Event()
    helper = threading.Thread(target=_blocked_in_helper, args=(release, started), name="helper")
    helper.start()
    started.wait(10)
    try:
        with tempfile.TemporaryFile("w+") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
            f.seek(0)
            return f.read()
    finally:
        release.set()
        helper.join(10)


def test_a_real_dump_parses_back_with_its_main_thread_last():
    text = _real_dump()
    [dump] = stackdump.parse_dumps(text)
    assert len(dump.threads) >= 2, text
    main = dump.main_thread
    assert main is dump.threads[-1] and main.current, text
    assert [f.function for f in main.frames[:2]] == ["_real_dump",
                                                     "test_a_real_dump_parses_back_with_its_main_thread_last"]
    assert main.frames[0].file == __file__ and isinstance(main.frames[0].line, int)
    assert dump.is_complete, text           # ends at the program's entry (pytest's `<module>` or runpy's)
    helper = next(t for t in dump.threads if any(f.function == "_blocked_in_helper" for f in t.frames))
    assert helper.entry == "_bootstrap" and not helper.current
    assert dump.innermost(2) == (f"_real_dump (tests/test_stacks.py:{main.frames[0].line})",
                                 f"test_a_real_dump_parses_back_with_its_main_thread_last "
                                 f"(tests/test_stacks.py:{main.frames[1].line})")
    assert stackdump.parse_dumps(dump.render()) == [dump]
    assert all(stackdump.is_dump_line(line) for line in text.splitlines() if line.strip())


def test_a_stack_cut_at_100_frames_is_not_complete_and_dumps_split_at_other_lines():
    deep = _real_dump(depth=120)
    [dump] = stackdump.parse_dumps(deep)
    assert dump.main_thread.cut and not dump.is_complete
    assert dump.innermost(3) == tuple(f"_real_dump (tests/test_stacks.py:{f.line})"
                                      for f in dump.main_thread.frames[:3])
    shallow = _real_dump()
    log = f"step 3, loss = 1.0\n{deep}\n2026-12-01 12:00:00,000 INFO psworker: between\n{shallow}\nstep 4\n"
    first, second = stackdump.parse_dumps(log)
    assert first.main_thread.cut and second.is_complete
    assert stackdump.last_dump(log) == second
    assert stackdump.last_dump("no dump here\n") is None
    # another thread's line written into the dump (and into the frame it landed in) does not split it
    lines = shallow.splitlines()
    main_frames = stackdump.last_dump(shallow).main_thread.frames
    for at in (len(lines) - 2, len(lines) - 3):     # behind a `<module>` frame too (one of pytest's, or an import's)
        foreign = lines[at][:12] + "I0000 00:00:1796162606.276844 10754 port.cc:153] oneDNN ops"
        [whole] = stackdump.parse_dumps("\n".join(lines[:at] + [foreign] + lines[at + 1:]) + "\nstep 5\n")
        assert whole.is_complete and len(whole.main_thread.frames) == len(main_frames) - 1


def test_a_dump_taken_while_the_garbage_collector_runs_and_one_of_the_current_thread_only():
    """faulthandler marks the signal's thread `Garbage-collecting` when the collector runs (tasks under load hit
    it during TensorFlow's import); `Stack` heads a dump without `all_threads`."""
    with tempfile.TemporaryFile("w+") as f:
        def dump_once(phase, info):
            if phase == "start" and not f.tell():
                faulthandler.dump_traceback(file=f, all_threads=True)
        gc.callbacks.append(dump_once)
        try:
            gc.collect(0)   # the youngest generation: a full collection took 42 s late in a suite's process
        finally:
            gc.callbacks.remove(dump_once)
        faulthandler.dump_traceback(file=f, all_threads=False)
        f.seek(0)
        text = f.read()
    assert "\n  Garbage-collecting\n" in text, text
    during_gc, alone = stackdump.parse_dumps(text)
    assert [f.function for f in during_gc.main_thread.frames[:2]] == [
        "dump_once", "test_a_dump_taken_while_the_garbage_collector_runs_and_one_of_the_current_thread_only"]
    assert during_gc.is_complete and alone.is_complete and len(alone.threads) == 1
    assert alone.main_thread.frames[0].function == "test_a_dump_taken_while_the_garbage_collector_runs_and_one_of_" \
                                                   "the_current_thread_only"
    # blank lines separate the threads' blocks when the process has more than one (other tests' threads in a suite)
    assert not [line for line in text.splitlines() if line.strip() and not stackdump.is_dump_line(line)], text


def test_a_task_dumps_again_and_again_while_waiting_in_c_and_its_threads_run_python():
    """`stackdump.dump_on_signal`, as psworker's tasks install it: every SIGUSR1 writes a whole dump while the main
    thread waits in C with the GIL released (a handler run by the main thread would never write one) and other
    threads push and pop frames (faulthandler's own handler reads them unlocked: CI saw a task end mid-dump)."""
    proc = subprocess.Popen([sys.executable, str(HERE / "churning.py")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True)
    reader.start()
    try:
        assert proc.stdout.readline() == "ready\n", "".join(lines)
        for asked in range(1, 31):
            proc.send_signal(stackdump.SIGNAL)
            wait_for(lambda: len(stackdump.parse_dumps("".join(lines))) >= asked or proc.poll() is not None,
                     WAIT, f"dump {asked} of churning.py")
            assert proc.poll() is None, f"it ended ({proc.returncode}) at dump {asked}:\n" + "".join(lines)[-3000:]
    finally:
        proc.kill()
        proc.wait()
        reader.join(WAIT)
    dumps = stackdump.parse_dumps("".join(lines))
    assert len(dumps) == 30 and all(d.is_complete for d in dumps), "".join(lines)[-3000:]
    for dump in dumps:
        assert [f.function for f in dump.main_thread.frames] == ["wait_in_c", "<module>"], dump.render()
        assert len(dump.threads) == 5 and sum(t.current for t in dump.threads) == 1, dump.render()


def test_lines_of_the_protocol_render_and_parse_back():
    ready = events.StacksReady(4242)
    assert events.StacksReady.parse(ready.render() + "\n") == ready
    asked = events.StacksRequested.now("worker:1", "stalled: step 40 unchanged for 20 s", "SIGUSR1")
    assert events.StacksRequested.parse(asked.render()) == asked
    assert list(events.StacksRequested.finditer(f"x\n{asked.render()}\n")) == [asked]
    assert stackdump.is_dump_line(ready.render())
    # a Python traceback's frame lines (with a comma) stay on the console; a dump's go to the log only
    assert not stackdump.is_dump_line('  File "train.py", line 3, in main')
    assert stackdump.is_dump_line('  File "train.py", line 3 in main')


def test_the_wait_for_a_dump_ends_at_its_main_thread_or_once_the_log_is_quiet(tmp_path):
    log = tmp_path / "worker-0.log"
    log.write_text("step 1\n")
    offset = stacks.log_offset(log)
    wait = stacks.DumpWait(log, offset, deadline=100.0)
    assert wait.over(now=1.0) is None                       # nothing yet
    with open(log, "a") as f:
        f.write(_real_dump(depth=120))                      # cut at 100 frames: its end cannot be told
    assert wait.over(now=2.0) is None                       # the log just grew
    assert wait.over(now=2.0 + stacks.QUIET_SECS) == "dumped"
    # a log that ends mid-line (its task died mid-dump, or the read caught a write half-done): however quiet, a
    # cut line is not the dump's end
    partial = stacks.DumpWait(log, stacks.log_offset(log), deadline=100.0)
    dump = _real_dump()
    cut = dump.rindex("  File ") + len("  File ")
    with open(log, "a") as f:
        f.write(dump[:cut])
    assert partial.over(now=1.0) is None and partial.over(now=1.0 + 10 * stacks.QUIET_SECS) is None
    with open(log, "a") as f:
        f.write(dump[cut:])
    assert partial.over(now=30.0) == "dumped"               # the rest arrived: its main thread ends it
    complete = stacks.DumpWait(log, stacks.log_offset(log), deadline=100.0)
    with open(log, "a") as f:
        f.write(_real_dump())
    assert complete.over(now=1.0) == "dumped"               # ends at the program's entry: at once
    late = stacks.DumpWait(log, stacks.log_offset(log), deadline=5.0)
    assert late.over(now=4.0) is None and late.over(now=5.0) == "timed out"


def _py_spy() -> str:
    found = stacks.for_run(own_tasks=False, local=True).py_spy
    if found is None:
        pytest.skip("py-spy is not installed (pip install 'psworker[stacks]'; the test extra has it)")
    return found


def test_py_spys_dump_of_a_real_program_reads_as_faulthandlers():
    proc = subprocess.Popen([sys.executable, STUCK, "--no-handler"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("step 0") and proc.stdout.readline() == "ready\n"
        out = subprocess.run([_py_spy(), "dump", "--json", "--pid", str(proc.pid)], capture_output=True, text=True,
                             timeout=WAIT, check=True).stdout
    finally:
        proc.kill()
        proc.wait()
    dump = stackdump.from_py_spy(out, proc.pid)
    assert [f.function for f in dump.main_thread.frames if f.file.endswith("stuck.py")] == [
        "wait_for_the_ps", "train", "<module>"]
    assert dump.is_complete and len(dump.threads) == 2
    assert stackdump.parse_dumps(dump.render()) == [dump]
    with pytest.raises(ValueError, match="py-spy's JSON"):
        stackdump.from_py_spy("Error: permission denied", proc.pid)


# The supervisor's own grace periods: a task asked for its stacks at the end has its full time to answer.
GRACES = {"grace_period_secs": 10.0, "ps_exit_grace_secs": 15.0}


def _run(make_supervisor, tasks, log_dir, asker, **kwargs) -> tuple[Supervisor, set[int]]:
    sup = make_supervisor(tasks, start=True, log_dir=log_dir, stacks=asker, **GRACES, **kwargs)
    return sup, set(sup.pids().values())


def _log(sup: Supervisor, name: str) -> str:
    return sup.log_path(name).read_text()


def _frames(text: str) -> list[str]:
    return [f.function for f in stackdump.last_dump(text).main_thread.frames if f.file.endswith("stuck.py")]


def test_a_stalled_task_is_asked_for_its_stacks_then_killed_and_the_report_shows_where(tmp_path, make_supervisor):
    tasks = [fake("ps", 0, "stuck", "--steps", "0"), fake("worker", 0, "stuck", "--steps", "3")]
    sup, pids = _run(make_supervisor, tasks, tmp_path / "logs", stacks.StackAsker(by_signal=True),
                     stall_timeout_secs=2.0)
    try:
        result = sup.wait(WAIT)
    finally:
        sup.close()
    worker, ps = result.exits["worker:0"], result.exits["ps:0"]
    log = (tmp_path / "logs" / "worker-0.log").read_text()
    asked = re.search(r"^--- stacks of worker:0 asked for by SIGUSR1 \(stalled: step 2 unchanged for \d+ s\) "
                      r"at \S+ ---$", log, re.MULTILINE)
    assert asked and _frames(log[asked.end():]) == ["wait_for_the_ps", "train", "<module>"], log
    assert stackdump.last_dump(log[asked.end():]).is_complete
    assert worker.returncode == -signal.SIGKILL and result.failure.name == "worker:0"
    assert [s.split(" (")[0] for s in worker.stack[2:]] == ["wait_for_the_ps", "train", "<module>"]
    report = format_report(result)
    assert (f"--- where worker:0 was: its main thread, innermost frame first (every thread's stack: {worker.log_path}) "
            f"---\n  wait (") in report, report
    assert re.search(r"^  wait_for_the_ps \(fake_tasks/stuck\.py:\d+\)$", report, re.MULTILINE), report
    assert "lines of worker:0, stack dumps left out" in report and "\n  step 2, loss = 1.00\n" in report, report
    # the ps was left: stopped at the end, asked first; it went on after its dump until SIGTERM
    assert ps.stopped and ps.returncode == -signal.SIGTERM, ps
    ps_log = (tmp_path / "logs" / "ps-0.log").read_text()
    assert "stacks of ps:0 asked for by SIGUSR1 (stopping: worker:0 failed)" in ps_log, ps_log
    assert ps.stack and "was in wait (" in report
    assert_processes_gone(pids)


def test_teardown_asks_only_tasks_that_can_answer(tmp_path, make_supervisor):
    """A task that has printed nothing yet (its handler may not be in place: the signal would kill it) is not
    asked; one that has exited is not either; the one that answers goes on until SIGTERM."""
    silent = ProgramTask("worker", 1, (sys.executable, "-c", "import time; time.sleep(600)"))
    tasks = [fake("ps", 0, "stuck"), silent, fake("worker", 0, "echo_exit", "0")]
    sup, pids = _run(make_supervisor, tasks, tmp_path / "logs", stacks.StackAsker(by_signal=True))
    try:
        drive_until(sup, lambda: "ready" in _log(sup, "ps:0") and "worker:0" not in sup.pids(), WAIT,
                   "ps:0 ready and worker:0 exited")
        result = sup.stop("stopped by the test")
    finally:
        sup.close()
    assert_processes_gone(pids)
    logs = {name: (tmp_path / "logs" / f"{name.replace(':', '-')}.log").read_text() for name in result.exits}
    assert result.exits["ps:0"].returncode == -signal.SIGTERM and _frames(logs["ps:0"])[0] == "wait_for_the_ps"
    assert result.exits["worker:1"].returncode == -signal.SIGTERM, "a silent task was sent SIGUSR1"
    assert "stacks of" not in logs["worker:1"] and "stacks of" not in logs["worker:0"], logs
    assert not result.exits["worker:0"].stopped and result.exits["worker:0"].stack == ()


def test_a_users_program_is_dumped_by_py_spy_or_told_how(tmp_path, make_supervisor):
    """SIGUSR1 would kill a program without a handler: py-spy dumps it into its log instead; without py-spy the
    log says how to get the stacks."""
    tasks = [fake("ps", 0, "stuck", "--no-handler"), fake("worker", 0, "stuck", "--no-handler")]
    for name, asker in (("spy", stacks.StackAsker(py_spy=_py_spy())), ("none", stacks.StackAsker())):
        sup, pids = _run(make_supervisor, tasks, tmp_path / name / "logs", asker)
        try:
            drive_until(sup, lambda: all("ready" in _log(sup, t.name) for t in tasks), WAIT, "both tasks ready")
            result = sup.stop("stopped by the test")
        finally:
            sup.close()
        assert_processes_gone(pids)
        log = (tmp_path / name / "logs" / "worker-0.log").read_text()
        assert result.exits["worker:0"].returncode == -signal.SIGTERM, log
        if name == "spy":
            assert "stacks of worker:0 asked for by py-spy (stopping: stopped by the test)" in log, log
            assert _frames(log) == ["wait_for_the_ps", "train", "<module>"], log
        else:
            pid = re.search(r"py-spy dump --pid (\d+) ---$", log, re.MULTILINE)
            assert pid and "not taken (stopping: stopped by the test): to see them, pip install py-spy" in log, log
            assert stackdump.last_dump(log) is None


def test_psworker_run_reports_where_a_stalled_users_program_was(tmp_path):
    """The whole path: `psworker run` with py-spy beside its Python; the stalled worker's report names its frames."""
    _py_spy()
    spec = tmp_path / "c.yaml"
    spec.write_text("cluster: {ps: ['localhost:auto'], worker: ['localhost:auto']}\n")
    run = run_launcher([str(spec), "--train_dir", str(tmp_path / "run"), "--console", "plain", "--max_restarts", "0",
                        "--stall_timeout_secs", "3", "--", sys.executable, STUCK, "--no-handler", "--steps", "2"],
                       cwd=tmp_path, timeout=120, command="run")
    assert run.returncode == 128 + signal.SIGKILL, run.output
    log = tmp_path / "run" / "logs" / "worker-0.log"
    assert re.search(rf"--- where worker:0 was: its main thread, innermost frame first \(every thread's stack: "
                     rf"\S*{re.escape(str(log))}\) ---\n(  .*\n)*  wait_for_the_ps \(fake_tasks/stuck\.py:\d+\)\n",
                     run.output), run.output
    assert "Thread 0x" not in run.output, "the console shows the dump (it belongs in the log)"
    assert "asked for by py-spy (stalled: step 1 unchanged for" in log.read_text()
    assert_processes_gone(run.pids)


# -- real psworker tasks ------------------------------------------------------------------------------------------

# The ps is stopped from the start (an injected SIGSTOP), so the workers wait for it and print no step line: the
# stall timeout asks each for its stacks, then kills it; with no restart the run fails on the first one. A task says
# it can dump (its first line) well within the timeout; where it is then (TensorFlow's import or the wait for the ps)
# is either way (_check_stalled_worker_report).
STALL = ("--max_steps", "1000000", "--stall_timeout_secs", "6", "--max_restarts", "0",
         "--inject", "stop:ps:0@time=0,for=600")
REPORT = re.compile(r"^--- where (worker:\d) was: its main thread, innermost frame first \(every thread's stack: "
                    r"(\S+)\) ---\n((?:  \S.*\n)+)", re.MULTILINE)


def _check_stalled_worker_report(output: str) -> None:
    """The report names the stalled worker's innermost frames and its log, which holds the whole dump: asked for
    by SIGUSR1 at the stall, the main thread in psworker's worker (importing TensorFlow or waiting for the ps)."""
    report = REPORT.search(output)
    assert report, output[-4000:]
    worker, log_path, frames = report.groups()
    assert len(frames.splitlines()) == 5 and all(re.fullmatch(r"  \S+ \(.+:\d+\)", f) for f in frames.splitlines())
    log = open(log_path).read()
    asked = re.search(rf"^--- stacks of {worker} asked for by SIGUSR1 \(stalled: no step line for \d+ s\) at \S+ ---$",
                      log, re.MULTILINE)
    assert asked, log[-3000:]
    dump = stackdump.last_dump(log[asked.end():])
    assert dump is not None, log[-3000:]
    main = dump.main_thread
    if main.cut:        # deeper than faulthandler's 100 frames: in TensorFlow's import, on a loaded machine
        assert any(f.file.startswith("<frozen importlib.") for f in main.frames), dump.render()
    else:
        assert dump.is_complete and any(f.file.endswith("psworker/task/main.py") and f.function == "run_worker"
                                        for f in main.frames), dump.render()
    assert frames.splitlines() == [f"  {f}" for f in dump.innermost(5)]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_real_stalled_worker_reports_where_it_was(tmp_path):
    run = run_launcher([str(REPO / "cluster_specs" / "local.yaml"), "--train_dir", str(tmp_path / "t"), "--console", "plain",
                        *STALL], cwd=tmp_path, timeout=300)
    assert run.returncode == 128 + signal.SIGKILL, run.output[-4000:]
    _check_stalled_worker_report(run.output)
    assert "Thread 0x" not in run.output and "most recent call first" not in run.output
    assert_processes_gone(run.pids, timeout=30)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_under_slurm_a_stalled_worker_is_asked_through_its_step(slurm, monkeypatch, capsys, tmp_path):
    """`scancel --signal=USR1 JOB.STEP` reaches the task; its dump comes back through srun's output into its log.
    The ps is stopped at time 0, when squeue may list its step before its slurmstepd takes signals: the job's
    `scancel` (first on its PATH) answers each step's first signal as Slurm then does, then runs the real one."""
    from tests.slurm_fixture import submit_counts, wait_done

    shims = tmp_path / "shims"
    shims.mkdir()
    (shims / "scancel").write_text(f"""#!/bin/sh
if mkdir "{shims}/refused-$2" 2>/dev/null; then
  echo "scancel: error: Kill job error on job step id $2: Invalid job id specified" >&2; exit 1
fi
echo "$*" >> "{shims}/delivered"
exec {shutil.which("scancel")} "$@"
""")
    (shims / "scancel").chmod(0o755)
    monkeypatch.setenv("PATH", f"{shims}{os.pathsep}{os.environ['PATH']}")
    job_id, run_dir = submit_counts(slurm, monkeypatch, capsys, tmp_path, *STALL[2:], max_steps=1_000_000)
    out = wait_done(slurm, job_id, run_dir)
    assert "psworker: slurm launch exits with status 137" in out, out[-4000:]
    assert "Invalid job id" not in out, out[-4000:]
    delivered = (shims / "delivered").read_text().splitlines()
    assert delivered[0].startswith("--signal=STOP ") and (shims / f"refused-{delivered[0].split()[1]}").is_dir()
    _check_stalled_worker_report(out)
    left = processes_naming(str(run_dir))      # this run's only: other runs' sruns may share the machine
    assert not left, [p.cmdline() for p in left]

