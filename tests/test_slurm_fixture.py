"""The test Slurm itself (tests/slurm_fixture.py): jobs run, finish and are cancelled with nothing left behind."""

from __future__ import annotations


import psutil
import pytest

from psworker.launcher.backends.slurm.allocation import expand_hostlist
from psworker.testing import gone


def test_srun_runs_three_tasks_on_the_node(slurm):
    result = slurm.run(["srun", "-n", "3", "--overcommit", "hostname"], timeout=60)
    assert result.stdout.split() == [slurm.node] * 3


@pytest.mark.slow
def test_sbatch_wait_runs_a_script_to_its_end(slurm, tmp_path):
    """sbatch --wait polls slurmctld every ~10 s: slow by Slurm's design, not the job's."""
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\necho \"job $SLURM_JOB_ID on $SLURM_JOB_NODELIST tasks $SLURM_NTASKS\"\n")
    out = tmp_path / "job.out"
    result = slurm.run(["sbatch", "--wait", "--parsable", f"--output={out}", "-n", "2", str(script)], timeout=90)
    job_id = result.stdout.strip()
    assert out.read_text() == f"job {job_id} on {slurm.node} tasks 2\n"


def test_scancel_leaves_no_process(slurm, tmp_path):
    job_id = slurm.run(["sbatch", "--parsable", f"--output={tmp_path}/out", "--wrap", "sleep 300"]).stdout.strip()

    def sleeping() -> list[psutil.Process]:
        return [p for p in slurm.job_processes() if p.name() == "sleep"]

    slurm.wait_until(sleeping, 30, f"job {job_id}'s sleep running")
    started = slurm.job_processes()
    slurm.run(["scancel", job_id])

    # Both: `job_processes` finds the cluster's processes by what they hold (environment, spool socket, files under
    # its root); the processes seen before the scancel are also watched themselves, whatever they still hold.
    slurm.wait_until(lambda: not slurm.job_processes() and all(gone(p.pid) for p in started), 30,
                     f"every process of job {job_id} gone after scancel")
    slurm.wait_until(lambda: job_id not in slurm.jobs(), 30, f"job {job_id} out of squeue")


@pytest.mark.parametrize("hostlist", ["node[01-03,07]", "n[1-2],m5,o[3-4,6,7-9]", "rack[1-2]-n[1-2]", "x[098-101]"])
def test_expand_hostlist_agrees_with_scontrol(slurm, hostlist):
    result = slurm.run(["scontrol", "show", "hostnames", hostlist])
    assert expand_hostlist(hostlist) == result.stdout.split()
