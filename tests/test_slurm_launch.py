"""`psworker slurm submit` + `psworker slurm launch` against the real one-node test Slurm (tests/slurm_fixture.py):
a whole job, an injected kill restarted as a new step, and `scancel` leaving nothing behind."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest
import yaml

from psworker.cli import main
from psworker.testing import checkpoint_step, processes_naming
from tests.cluster_utils import steps_lost
from tests.slurm_fixture import JOB_TIMEOUT_SECS, free_port_base, submit_counts, wait_done


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_submitted_job_trains_and_reports(slurm, monkeypatch, capsys, tmp_path):
    job_id, run_dir = submit_counts(slurm, monkeypatch, capsys, tmp_path, max_steps=200)
    out = wait_done(slurm, job_id, run_dir)
    assert "psworker: slurm launch exits with status 0" in out, out[-4000:]
    assert re.search(r"^psworker: precision @ 1 = ", out, re.MULTILINE), out[-4000:]
    assert len(set(re.findall(r"runs as Slurm step (\d+\.\d+)", out))) == 3, out[-4000:]
    assert checkpoint_step(run_dir) >= 200
    assert (run_dir / "cluster.yaml").exists() and (run_dir / "logs" / "worker-0.log").exists()
    assert main(["slurm", "status", str(run_dir), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["global_step"] >= 200 and status["tasks"]["worker:0"]["state"] == "done", status
    assert not processes_naming(run_dir)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_injected_kill_is_restarted_as_a_new_step(slurm, monkeypatch, capsys, tmp_path):
    job_id, run_dir = submit_counts(slurm, monkeypatch, capsys, tmp_path, "--inject", "kill:worker:1@step=60",
                              "--max_restarts", "1", "--restart_backoff_secs", "0.5", mode="sync", max_steps=200)
    out = wait_done(slurm, job_id, run_dir)
    assert "psworker: slurm launch exits with status 0" in out, out[-4000:]
    assert "restarting worker:1 (restart 1: injected kill:worker:1@step=60)" in out, out[-4000:]
    steps = re.findall(r"worker:1 runs as Slurm step (\d+\.\d+)", out)
    assert len(steps) == 2 and steps[0] != steps[1] and all(s.startswith(f"{job_id}.") for s in steps), out[-4000:]
    log = (run_dir / "logs" / "worker-1.log").read_text(errors="replace")
    assert "--- restart 1 (injected kill:worker:1@step=60)" in log
    assert checkpoint_step(run_dir) == 200
    assert not processes_naming(run_dir)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_scancel_mid_run_leaves_no_process(slurm, monkeypatch, capsys, tmp_path):
    job_id, run_dir = submit_counts(slurm, monkeypatch, capsys, tmp_path, max_steps=1_000_000)
    log = run_dir / "logs" / "worker-0.log"
    slurm.wait_until(lambda: log.exists() and re.search(r"^step \d+", log.read_text(errors="replace"), re.MULTILINE),
                     JOB_TIMEOUT_SECS, f"job {job_id} training ({log})")
    assert main(["slurm", "status", job_id, "--json"]) == 0       # a job id: found through scontrol's WorkDir
    status = json.loads(capsys.readouterr().out)
    assert status["tasks"]["worker:0"]["state"] == "training", status
    names = {a for p in processes_naming(run_dir) for a in p.cmdline() if a.startswith("--job-name=psworker-")}
    assert names == {f"--job-name=psworker-{t}" for t in ("ps-0", "worker-0", "worker-1")}, names
    slurm.run(["scancel", job_id])
    slurm.wait_until(lambda: job_id not in slurm.jobs(), 60, f"job {job_id} gone after scancel")
    deadline = time.monotonic() + 30
    while processes_naming(run_dir) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not processes_naming(run_dir), processes_naming(run_dir)
    assert not slurm.job_processes(), slurm.job_processes()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_time_limits_warning_saves_a_checkpoint(slurm, monkeypatch, capsys, tmp_path):
    """The sbatch script has Slurm send SIGTERM to the batch shell, the launcher, before the time limit
    (`--signal=B:TERM@120`); `scancel --batch --signal=TERM` sends the same now: the workers stop after their step,
    the chief writes a checkpoint, the ps stop after it, and the job's output ends with the step saved."""
    job_id, run_dir = submit_counts(slurm, monkeypatch, capsys, tmp_path, max_steps=1_000_000)
    assert "#SBATCH --signal=B:TERM@120" in (run_dir / "psworker.sbatch").read_text().splitlines()
    log = run_dir / "logs" / "worker-0.log"
    slurm.wait_until(lambda: log.exists() and re.search(r"^step [1-9]\d*", log.read_text(errors="replace"),
                                                        re.MULTILINE), JOB_TIMEOUT_SECS, f"job {job_id} training")
    slurm.run(["scancel", "--batch", "--signal=TERM", job_id])
    out = wait_done(slurm, job_id, run_dir)
    saved = re.search(r"^psworker: stopped; checkpoint of step ([\d,]+) saved in (.+); the same command goes on "
                      r"from it$", out, re.MULTILINE)
    assert saved and Path(saved.group(2)) == run_dir, out[-4000:]
    step = int(saved.group(1).replace(",", ""))
    assert checkpoint_step(run_dir) == step
    lost = steps_lost(run_dir / "logs", step)
    print(f"stop/resume: SIGTERM (Slurm's warning), slurm, async: checkpoint of step {step}, {lost} steps lost")
    assert lost == 0
    assert "psworker: slurm launch exits with status 143" in out, out[-4000:]
    assert "worker:0 (the chief) has exited" in (run_dir / "logs" / "ps-0.log").read_text(), out[-4000:]
    assert "sending SIGKILL" not in out, out[-4000:]
    assert not processes_naming(run_dir)
    assert not slurm.job_processes(), slurm.job_processes()


@pytest.mark.timeout(120)
def test_status_of_a_job_slurm_has_forgotten_comes_from_its_run_dir(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "runs" / "counts-20260101-000000"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "cluster.yaml").write_text(yaml.safe_dump({"cluster": {"ps": ["n1:2222"], "worker": ["n1:2223"]},
                                                          "train": {"max_steps": 100}}))
    (run_dir / "logs" / "worker-0.log").write_text("step 40, loss = 0.5 (100.0 examples/sec; 0.1 sec/batch)\n")
    (run_dir / "slurm-job-id").write_text("987654\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "no-such-slurm.conf"))   # scontrol fails: Slurm forgot the job
    assert main(["slurm", "status", "987654", "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["global_step"] == 40 and status["tasks"]["ps:0"]["state"] == "not started", status
    monkeypatch.setattr("psworker.launcher.backends.slurm.job.SCONTROL_TIMEOUT_SECS", 2.0)
    assert main(["slurm", "status", "123"]) == 2
    assert "pass its run dir instead" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_classic_tf1_script_runs_as_srun_steps(slurm, monkeypatch, capsys, tmp_path):
    """`psworker slurm submit SPEC -- COMMAND`: the user's script once per task, one srun step each, its flags filled
    in from the allocation's layout; the chief's exit ends the job; no step or process left."""
    script = Path(__file__).resolve().parent / "user_scripts" / "classic_tf1.py"
    checkpoints = tmp_path / "run" / "ckpt"
    job_id, run_dir = submit_counts(slurm, monkeypatch, capsys, tmp_path, "--", sys.executable, str(script),
                              "--ps_hosts={ps_hosts}", "--worker_hosts={worker_hosts}", "--job_name={job_name}",
                              "--task_index={task_index}", "--train_dir", str(checkpoints), "--max_steps", "200",
                              "--recovery_wait_secs", "1")
    out = wait_done(slurm, job_id, run_dir)
    assert "psworker: slurm launch exits with status 0" in out, out[-4000:]
    assert len(set(re.findall(r"runs as Slurm step (\d+\.\d+)", out))) == 3, out[-4000:]
    assert "[worker:0] worker 0 done" in out, out[-4000:]
    assert checkpoint_step(checkpoints) >= 200
    assert not processes_naming(run_dir)
    assert not slurm.job_processes(), slurm.job_processes()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_tf2_parameter_server_strategy_script_runs_as_srun_steps(slurm, monkeypatch, capsys, tmp_path):
    """`psworker slurm submit SPEC -- COMMAND` with a chief job: each srun step gets its task's TF_CONFIG; the chief
    coordinates, the ps and workers serve until the chief's exit ends the job (TFJob's rule); nothing is left."""
    script = Path(__file__).resolve().parent / "user_scripts" / "tf2_ps_strategy.py"
    spec = tmp_path / "pss.yaml"
    spec.write_text(yaml.safe_dump({"cluster": {"chief": 1, "ps": 1, "worker": 2}}))
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    run_dir = tmp_path / "run"
    rc = main(["slurm", "submit", str(spec), "--run_dir", str(run_dir), "--overcommit", "--time", "0:10:00",
               "--port_base", str(free_port_base(4)), "--", sys.executable, str(script)])
    out = capsys.readouterr().out
    assert rc == 0, out
    job_id = out.strip().splitlines()[-1]
    out = wait_done(slurm, job_id, run_dir)
    assert "psworker: slurm launch exits with status 0" in out, out[-4000:]
    assert len(set(re.findall(r"runs as Slurm step (\d+\.\d+)", out))) == 4, out[-4000:]
    assert "[chief:0] chief done: w = 3.00, b = 1.00" in out, out[-4000:]
    assert not processes_naming(run_dir)
    assert not slurm.job_processes(), slurm.job_processes()
