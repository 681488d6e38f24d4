"""The batch job of the slurm backend: `submit_job` copies the spec into the run dir, writes
`<run_dir>/psworker.sbatch` (`script`: its `#SBATCH` lines, then the `psworker slurm launch` line that runs the
slurm backend inside the allocation) and queues it (`submit`: `sbatch`); `run_dir_of_job` finds a queued job's run
dir again (`scontrol`)."""

from __future__ import annotations

import dataclasses
import logging
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Union

from psworker.errors import SubmitError, UsageError
from psworker.launcher.backends.slurm.allocation import count_spec
from psworker.launcher.backends.slurm.script import (SUBMITTED_SPEC, SbatchOptions, check_sbatch_value, launch_argv,
                                                     write_sbatch_script)
from psworker.launcher.inject import Fault
from psworker.launcher.rundir import fresh_run_dir
from psworker.spec.plan import task_counts, with_train
from psworker.spec import TRAIN_FIELDS, load_spec
from psworker.spec.train_config import setting_argv

__all__ = ["JOB_ID_FILE", "JobLaunch", "SubmitConfig", "run_dir_of_job", "submit", "submit_job"]

logger = logging.getLogger(__name__)

JOB_ID_FILE = "slurm-job-id"          # written into the run dir by `submit_job`
SCONTROL_TIMEOUT_SECS = 15.0          # scontrol retries a missing slurm.conf for a minute


@dataclass(frozen=True)
class JobLaunch:
    """The supervision settings the job's `psworker slurm launch` gets; None: its default."""

    grace_period_secs: Optional[float] = None
    max_restarts: Optional[int] = None
    restart_backoff_secs: Optional[float] = None
    stall_timeout_secs: Optional[float] = None
    success_policy: Optional[str] = None
    worker_exit_grace_secs: Optional[float] = None
    metrics_port: Optional[int] = None     # the launcher's /metrics, on the job's first node
    metrics_host: Optional[str] = None
    metrics_stall_secs: Optional[float] = None
    metrics_linger_secs: Optional[float] = None
    faults: tuple[Fault, ...] = ()
    verbose: bool = False
    metrics_allow_public_bind: bool = False
    command: tuple[str, ...] = ()        # the user's program, run once per task instead of psworker's trainer

    def argv(self) -> list[str]:
        """As `psworker slurm launch` arguments (those left at their default are left out)."""
        settings = [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)
                    if f.name not in ("faults", "verbose", "metrics_allow_public_bind", "command")]
        flags = [part for name, value in settings if value is not None
                 for part in ((f"--{name}", str(value)) if name in _FLAGS else ("--set", f"{name}={value}"))]
        flags += [part for fault in self.faults for part in ("--inject", fault.text)]
        flags += ["--console", "verbose"] if self.verbose else []
        flags += ["--set", "metrics_allow_public_bind=true"] if self.metrics_allow_public_bind else []
        return flags + (["--", *self.command] if self.command else [])


_FLAGS = ("max_restarts", "stall_timeout_secs", "metrics_port")    # the rest are `--set NAME=VALUE` settings


@dataclass(frozen=True)
class SubmitConfig:
    """Everything `psworker slurm submit` needs, built once by the CLI."""

    spec_path: str
    sbatch: SbatchOptions                  # `ntasks` None: the spec's task count
    run_dir: Optional[str] = None          # None: a fresh runs/<spec>-<time> here
    train: tuple[tuple[str, str], ...] = ()   # training settings given on the command line (name, value as given)
    launch: JobLaunch = field(default_factory=JobLaunch)
    port_base: Optional[int] = None
    python: str = sys.executable
    dry_run: bool = False


def _checked(run_dir: Path) -> Path:
    """The run dir is the script's `#SBATCH --chdir`: one word, as every other #SBATCH value."""
    try:
        check_sbatch_value(str(run_dir))
    except ValueError as e:
        raise UsageError(f"--run_dir: {e}") from None
    return run_dir


def _job_run_dir(config: SubmitConfig, spec) -> Path:
    """The job's run dir, absolute: the one given (checked before it is made), else a fresh one (never the
    spec's train_dir: the checkpoints may live apart from the job's script and logs)."""
    if config.run_dir:
        run_dir = _checked(Path(config.run_dir).resolve())
        run_dir.mkdir(parents=True, exist_ok=True)
        return run_dir
    return _checked(fresh_run_dir(spec).resolve())


def _train_flags(config: SubmitConfig, spec, run_dir: Path) -> list[str]:
    """The training settings given, as flags for the job; paths made absolute (the job runs in the run dir), and
    `--train_dir` the run dir when neither the spec nor the command line names one."""
    given = dict(config.train)
    train = {name: given.get(name) for name in TRAIN_FIELDS}     # the flags in the order `--help` lists them
    for name in ("train_dir", "data_dir"):
        if train.get(name) is not None:
            train[name] = os.path.abspath(train[name])
    if spec.train.train_dir is None and train.get("train_dir") is None:
        train["train_dir"] = str(run_dir)
    return [part for name, value in train.items() if value is not None for part in setting_argv(name, value)]


def submit_job(config: SubmitConfig) -> Optional[str]:
    """Writes `<run_dir>/psworker.sbatch` for the spec and submits it (not with `dry_run`).

    Returns:
        The Slurm job id (also written to `<run_dir>/slurm-job-id`), or None for a dry run.

    Raises:
        SpecError, UsageError: the spec or a setting is bad (before anything is queued). SubmitError: sbatch failed.
    """
    spec = load_spec(config.spec_path, allow_counts=True)
    counts = task_counts(spec)
    with_train(spec, dict(config.train))        # bad settings fail here, not once queued
    port_base = count_spec(spec, config.port_base).port
    run_dir = _job_run_dir(config, spec)
    spec_copy = run_dir / SUBMITTED_SPEC              # the job reads this copy: later edits do not change it
    shutil.copyfile(config.spec_path, spec_copy)
    inner = launch_argv(spec_copy, run_dir, python=config.python, port_base=port_base,
                        worker_flags=_train_flags(config, spec, run_dir) + config.launch.argv())
    described = ", ".join(f"{job}: {n}" for job, n in counts.items())
    options = dataclasses.replace(config.sbatch, ntasks=sum(counts.values()))
    script = write_sbatch_script(run_dir, options, inner, description=f"{config.spec_path} ({described})")
    if config.dry_run:
        print(f"wrote {script} (not submitted; submit with: sbatch {shlex.quote(str(script))})")
        return None
    job_id = submit(script)
    (run_dir / JOB_ID_FILE).write_text(job_id + "\n")
    logger.info("submitted %s as Slurm job %s; output in %s", script, job_id, run_dir)
    return job_id


def submit(script: Union[str, os.PathLike], *, sbatch: str = "sbatch", env: Optional[Mapping[str, str]] = None,
           timeout: float = 60.0) -> str:
    """Submits a batch script with `sbatch --parsable SCRIPT` and returns the job id.

    Raises:
        SubmitError: sbatch is missing, failed (its message is included) or did not answer within `timeout`.
    """
    argv = [sbatch, "--parsable", os.fspath(script)]
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                                env=None if env is None else dict(env), stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise SubmitError(f"{sbatch}: not found; is this a Slurm login node?") from None
    except subprocess.TimeoutExpired:
        raise SubmitError(f"{shlex.join(argv)}: no answer within {timeout:g} s (is slurmctld up?)") from None
    if result.returncode != 0:
        raise SubmitError(f"{shlex.join(argv)} exited {result.returncode}: {result.stderr.strip()}")
    job_id = result.stdout.strip().split(";")[0]     # --parsable: "ID" or "ID;CLUSTER"
    if not job_id.isdigit():
        raise SubmitError(f"{shlex.join(argv)}: unexpected answer {result.stdout.strip()!r}")
    return job_id


def run_dir_of_job(job_id: str) -> Path:
    """The run dir of a job `submit_job` queued: a `runs/*/slurm-job-id` here naming it, else the job's working
    directory while Slurm still lists it.

    Raises:
        UsageError: neither knows the job.
    """
    for marker in Path("runs").glob(f"*/{JOB_ID_FILE}"):
        if marker.read_text().strip() == job_id:
            return marker.parent
    try:
        result = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                                timeout=SCONTROL_TIMEOUT_SECS, stdin=subprocess.DEVNULL)
        for word in result.stdout.split() if result.returncode == 0 else ():
            if word.startswith("WorkDir="):
                return Path(word.split("=", 1)[1])
    except (OSError, subprocess.TimeoutExpired):
        pass
    raise UsageError(f"Slurm job {job_id}: no runs/*/{JOB_ID_FILE} here names it and Slurm does not list it "
                     f"(any more); pass its run dir instead")
