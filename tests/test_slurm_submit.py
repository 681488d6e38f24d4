"""`psworker slurm submit`: the batch script it writes, and submission to the real test Slurm
(tests/slurm_fixture.py)."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from psworker.cli import main
from psworker.errors import SubmitError, UsageError
from psworker.launcher.backends.slurm.job import submit
from psworker.launcher.backends.slurm.script import (SbatchOptions, check_nodes, check_time, sbatch_script,
                                                     write_sbatch_script)

SPEC = Path(__file__).resolve().parent.parent / "cluster_specs" / "local.yaml"
AWKWARD = "it's a \"dir\" with $HOME and `x`"


def _script_lines(path: Path) -> tuple[list[str], list[str]]:
    lines = path.read_text().splitlines()
    return [l for l in lines if l.startswith("#SBATCH ")], [l for l in lines if l.startswith("exec ")]


def test_dry_run_writes_a_readable_resubmittable_script(tmp_path, capsys):
    run_dir = tmp_path / "run"
    data_dir = tmp_path / AWKWARD
    rc = main(["slurm", "submit", str(SPEC), "--run_dir", str(run_dir), "--time", "0:10:00", "--partition", "debug",
               "--max_steps", "100", "--data_dir", str(data_dir), "--dry_run"])
    assert rc == 0
    script = run_dir / "psworker.sbatch"
    assert f"wrote {script}" in capsys.readouterr().out
    sbatch_lines, exec_lines = _script_lines(script)
    assert sbatch_lines == ["#SBATCH --job-name=psworker", "#SBATCH --ntasks=3", "#SBATCH --time=0:10:00",
                            "#SBATCH --partition=debug", f"#SBATCH --output={run_dir}/slurm-%j.out",
                            f"#SBATCH --chdir={run_dir}", "#SBATCH --signal=B:TERM@120"]
    assert len(exec_lines) == 1
    assert shlex.split(exec_lines[0]) == [
        "exec", sys.executable, "-m", "psworker", "slurm", "launch", str(run_dir / "submitted-spec.yaml"),
        "--run_dir", str(run_dir), "--port_base", "2222", "--max_steps", "100", "--train_dir", str(run_dir),
        "--data_dir", str(data_dir)]
    assert (run_dir / "submitted-spec.yaml").read_text() == SPEC.read_text()
    assert f"sbatch {run_dir}/psworker.sbatch" in script.read_text()
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


def test_submit_checks_values_before_queueing(tmp_path, capsys):
    assert main(["slurm", "submit", str(SPEC), "--run_dir", str(tmp_path / "r"), "--inject", "kill:nobody@x",
                 "--dry_run"]) == 2
    assert "kill:nobody@x" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
    assert main(["slurm", "submit", str(SPEC), "--run_dir", str(tmp_path / "r"), "--partition", "a b",
                 "--dry_run"]) == 2
    assert "argument --partition: 'a b': an #SBATCH value cannot be empty or hold whitespace" in capsys.readouterr().err
    assert main(["slurm", "submit", str(SPEC), "--max_steps", "-3", "--dry_run"]) == 2   # flags checked up front
    assert main(["slurm", "submit", str(SPEC), "--run_dir", str(tmp_path / "a b"), "--dry_run"]) == 2
    assert "--run_dir: '" in capsys.readouterr().err
    assert not (tmp_path / "r").exists() and not (tmp_path / "a b").exists()


def test_sbatch_options_check_their_values_as_the_flags_do(tmp_path):
    """A library caller of SbatchOptions meets the same checks as `slurm submit`'s flags."""
    with pytest.raises(UsageError, match=r"--nodes: '0' is not a node count"):
        sbatch_script(SbatchOptions(ntasks=3, nodes="0"), tmp_path, ["true"])
    with pytest.raises(UsageError, match=r"--time: '1h' is not a Slurm time limit"):
        sbatch_script(SbatchOptions(ntasks=3, time="1h"), tmp_path, ["true"])
    assert "#SBATCH --time=2-00:30:00" in sbatch_script(SbatchOptions(ntasks=3, time="2-00:30:00"), tmp_path,
                                                        ["true"])
    with pytest.raises(UsageError, match=r"--stop_warning_secs: 70000 is not in 0\.\.65535"):
        sbatch_script(SbatchOptions(ntasks=3, stop_warning_secs=70000), tmp_path, ["true"])
    assert "--signal" not in sbatch_script(SbatchOptions(ntasks=3, stop_warning_secs=0), tmp_path, ["true"])  # nor said
    assert "#SBATCH --signal=B:TERM@300\n" in sbatch_script(SbatchOptions(ntasks=3, stop_warning_secs=300), tmp_path,
                                                           ["true"])


def test_sbatch_accepts_the_written_script(slurm, tmp_path):
    run_dir = tmp_path / "run"
    assert main(["slurm", "submit", str(SPEC), "--run_dir", str(run_dir), "--time", "0:05:00", "--overcommit",
                 "--dry_run"]) == 0
    assert "#SBATCH --overcommit" in (run_dir / "psworker.sbatch").read_text()
    result = slurm.run(["sbatch", "--test-only", str(run_dir / "psworker.sbatch")], check=False)
    assert result.returncode == 0, result.stderr
    assert "to start at" in result.stderr


# Every form the checks take, and some they refuse; sbatch must agree. (Node-count lists, `1,3`, came with Slurm
# 23.02; Debian 12 has 22.05: the check takes only the forms every Slurm does.)
SBATCH_FORMS = [("1", "5"), ("1", "5:30"), ("1", "0:05:00"), ("1", "0-1"), ("1", "0-0:5"), ("1-1", "0-00:05:00"),
                ("1", "1:75"), ("1", "UNLIMITED"), ("1", "0"), ("1", "-1"), ("zero", "5"), ("1", "1h")]


def test_sbatch_agrees_with_the_nodes_and_time_checks(slurm, tmp_path):
    """`sbatch --test-only` takes every --nodes/--time value the checks take and refuses the others."""
    for n, (nodes, time) in enumerate(SBATCH_FORMS):
        ours = _accepted(nodes, time)
        script = tmp_path / f"{n}.sbatch"
        script.write_text(f"#!/bin/bash\n#SBATCH --ntasks=1\n#SBATCH --overcommit\n#SBATCH --nodes={nodes}\n"
                          f"#SBATCH --time={time}\n#SBATCH --output={tmp_path}/%j.out\ntrue\n")
        result = slurm.run(["sbatch", "--test-only", str(script)], check=False)
        assert (result.returncode == 0) == ours, (nodes, time, ours, result.stderr)


def _accepted(nodes: str, time: str) -> bool:
    try:
        check_nodes(nodes)
        check_time(time)
    except ValueError:
        return False
    return True


def test_submit_runs_the_inner_command_with_its_arguments_intact(slurm, tmp_path):
    """End to end: the script's quoted exec line reaches the program unchanged, and its output file appears."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    inner = [sys.executable, "-c", "import os, sys; print(repr(sys.argv[1:]), os.environ['SLURM_NTASKS'])",
             AWKWARD, "a b", "--x=1;rm -rf /"]
    script = write_sbatch_script(run_dir, SbatchOptions(ntasks=3, time="0:05:00", overcommit=True), inner)
    job_id = submit(script, env=slurm.env)
    assert job_id.isdigit()
    out = run_dir / f"slurm-{job_id}.out"
    slurm.wait_until(lambda: job_id not in slurm.jobs() and out.exists() and out.read_text(), 30,
                     f"job {job_id} finished with output in {out}")
    assert out.read_text().strip() == f"{[AWKWARD, 'a b', '--x=1;rm -rf /']!r} 3"


def test_submit_reports_sbatch_errors(slurm, tmp_path):
    script = write_sbatch_script(tmp_path, SbatchOptions(ntasks=1, partition="nosuchpartition"), ["true"])
    with pytest.raises(SubmitError, match="nosuchpartition|invalid partition"):
        submit(script, env=slurm.env)
    with pytest.raises(SubmitError, match="not found"):
        submit(script, sbatch=str(tmp_path / "no-sbatch"))


def test_layout_and_srun_steps_inside_a_real_allocation(slurm, tmp_path):
    """In a batch job of 3 tasks: the allocation read from its environment, TF's layout, one srun step per task
    on its node, each a separate step with its own name."""
    program = (
        "import os, subprocess, sys\n"
        "from psworker.launcher.backends.slurm.allocation import allocation_from_environ\n"
        "from psworker.launcher.backends.slurm.steps import srun_argv\n"
        "from psworker.spec.plan import layout, plan\n"
        "from psworker.spec import CountSpec\n"
        "nodes, counts = allocation_from_environ(os.environ)\n"
        "tasks = plan(layout(CountSpec((('ps', 1), ('worker', 2)), 8888), nodes, counts), 'unread.yaml')\n"
        "procs = [subprocess.Popen(srun_argv(t, ['bash', '-c', 'echo $SLURM_JOB_NAME $SLURMD_NODENAME "
        "$SLURM_STEP_ID']), stdout=subprocess.PIPE, text=True) for t in tasks]\n"
        "print(sorted(p.communicate()[0].split()[0] for p in procs), [p.returncode for p in procs])\n"
        "print([str(t.address) for t in tasks])\n")
    script = write_sbatch_script(tmp_path, SbatchOptions(ntasks=3, time="0:05:00", overcommit=True),
                                 [sys.executable, "-c", program])
    job_id = submit(script, env=dict(slurm.env, PYTHONPATH=str(Path(__file__).resolve().parent.parent)))
    out = tmp_path / f"slurm-{job_id}.out"
    slurm.wait_until(lambda: job_id not in slurm.jobs(), 60, f"job {job_id} finished")
    lines = out.read_text().splitlines()
    assert lines[-2] == "['psworker-ps-0', 'psworker-worker-0', 'psworker-worker-1'] [0, 0, 0]", out.read_text()
    node = slurm.node
    assert lines[-1] == repr([f"{node}:8888", f"{node}:8889", f"{node}:8890"])


def test_a_step_is_signalled_by_scancel_and_ends_with_its_srun(slurm, tmp_path):
    """What a Slurm process backend relies on: `scancel --signal=TERM JOB.STEP` reaches the task's own handler
    and srun exits with the task's status; killing srun (SIGKILL) ends its step and the task with it."""
    marker = f"psworker-test-{tmp_path.name}"
    program = (
        "import os, signal, subprocess, sys, time\n"
        "from psworker.launcher.backends.slurm.allocation import allocation_from_environ\n"
        "from psworker.launcher.backends.slurm.steps import parse_steps, signal_step_argv, srun_argv, steps_argv\n"
        "from psworker.spec.plan import layout, plan\n"
        "from psworker.spec import CountSpec\n"
        "tasks = plan(layout(CountSpec((('ps', 1), ('worker', 1)), 8888), *allocation_from_environ(os.environ)),\n"
        "             'unread.yaml')\n"
        "task = (\"import signal, sys, time\\n\"\n"
        "        \"signal.signal(signal.SIGTERM, lambda *a: (print('got TERM', flush=True), sys.exit(143)))\\n\"\n"
        "        \"print('up', flush=True)\\ntime.sleep(300)\")\n"
        f"procs = [subprocess.Popen(srun_argv(t, [sys.executable, '-c', task, {marker!r}]), stdout=subprocess.PIPE,\n"
        "                          text=True) for t in tasks]\n"
        "print([p.stdout.readline().strip() for p in procs], flush=True)\n"
        "steps = {name: step for step, name in parse_steps(subprocess.run(\n"
        "    steps_argv(os.environ['SLURM_JOB_ID']), capture_output=True, text=True).stdout)}\n"
        "print(sorted(steps), flush=True)\n"
        "subprocess.run(signal_step_argv(steps['psworker-ps-0']), check=True)\n"
        "print(repr(procs[0].stdout.read()), procs[0].wait(), flush=True)\n"
        "procs[1].kill()\n"
        "procs[1].wait()\n"
        "for _ in range(100):\n"
        "    left = [name for _, name in parse_steps(subprocess.run(\n"
        "        steps_argv(os.environ['SLURM_JOB_ID']), capture_output=True, text=True).stdout)]\n"
        "    if 'psworker-worker-0' not in left:\n"
        "        break\n"
        "    time.sleep(0.2)\n"
        "print(sorted(left), flush=True)\n")
    script = write_sbatch_script(tmp_path, SbatchOptions(ntasks=2, time="0:05:00", overcommit=True),
                                 [sys.executable, "-c", program])
    job_id = submit(script, env=dict(slurm.env, PYTHONPATH=str(Path(__file__).resolve().parent.parent)))
    out = tmp_path / f"slurm-{job_id}.out"
    slurm.wait_until(lambda: job_id not in slurm.jobs(), 90, f"job {job_id} finished")
    lines = [l for l in out.read_text().splitlines() if not l.startswith(("srun:", "slurmstepd"))]
    assert lines == ["['up', 'up']", "['batch', 'psworker-ps-0', 'psworker-worker-0']", "'got TERM\\n' 143",
                     "['batch']"], out.read_text()
    assert not [p for p in psutil.process_iter(["cmdline"]) if marker in (p.info["cmdline"] or [])
                and p.status() != psutil.STATUS_ZOMBIE]


def test_dry_run_of_a_count_spec_takes_its_counts_and_port(tmp_path):
    spec = SPEC.parent / "scheduled.yaml"          # ps: 2, worker: 4, port: 2222, train_dir set
    run_dir = tmp_path / "run"
    assert main(["slurm", "submit", str(spec), "--run_dir", str(run_dir), "--dry_run"]) == 0
    sbatch_lines, exec_lines = _script_lines(run_dir / "psworker.sbatch")
    assert "#SBATCH --ntasks=6" in sbatch_lines
    assert shlex.split(exec_lines[0])[7:] == ["--run_dir", str(run_dir), "--port_base", "2222"]   # spec's train_dir
    assert main(["slurm", "submit", str(spec), "--run_dir", str(run_dir), "--port_base", "3000", "--dry_run"]) == 0
    assert "--port_base 3000" in (run_dir / "psworker.sbatch").read_text()
