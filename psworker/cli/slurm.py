"""`psworker slurm submit|launch|status`: queue a spec's cluster as a Slurm job, run it inside the allocation
(the slurm backend), and show a job's run."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from psworker.cli.flags import (COMMAND_EPILOG, add_launch_flags, add_status_flags, add_train_flags, launch_config,
                                port_type, train_overrides, value_type, with_train_flags)
from psworker.cli.preflight import check_training
from psworker.launcher.backends.slurm import script as sched
from psworker.spec import load_spec

__all__ = ["cmd_slurm_launch", "cmd_slurm_status", "cmd_slurm_submit", "launch_flags", "status_flags",
           "submit_flags"]

# `slurm submit` takes these launch flags (default None there) and the job's `slurm launch` gets the ones given.
FORWARDED = ("grace_period_secs", "max_restarts", "restart_backoff_secs", "stall_timeout_secs", "success_policy",
             "worker_exit_grace_secs", "metrics_port", "metrics_host", "metrics_stall_secs", "metrics_linger_secs")


def cmd_slurm_submit(args: argparse.Namespace) -> int:
    """`psworker slurm submit SPEC ... [-- COMMAND...]`: writes <run_dir>/psworker.sbatch and submits it."""
    from psworker.launcher.backends.slurm.job import JobLaunch, SubmitConfig, submit_job

    sbatch = sched.SbatchOptions(job_name=args.job_name, nodes=args.nodes, time=args.time, partition=args.partition,
                                 account=args.account, output=args.output, overcommit=args.overcommit,
                                 stop_warning_secs=args.stop_warning_secs)
    launch = JobLaunch(**{name: getattr(args, name) for name in FORWARDED}, faults=tuple(args.inject),
                       verbose=args.verbose, metrics_allow_public_bind=args.metrics_allow_public_bind,
                       command=tuple(args.user_command))
    if not args.user_command:     # refused here rather than once the job has waited in the queue
        check_training(with_train_flags(load_spec(args.spec, allow_counts=True), args), data_here=False)
    train = tuple((name, value) for name, value in train_overrides(args).items() if value is not None)
    job_id = submit_job(SubmitConfig(spec_path=args.spec, sbatch=sbatch, run_dir=args.run_dir, train=train,
                                     launch=launch, port_base=args.port_base, python=args.python,
                                     dry_run=args.dry_run))
    if job_id is not None:
        print(job_id)
    return 0


def cmd_slurm_launch(args: argparse.Namespace) -> int:
    """`psworker slurm launch SPEC --run_dir D ... [-- COMMAND...]`: inside an allocation, runs every task
    (psworker's, or COMMAND) as its own srun step."""
    from psworker.launcher.backends.slurm.backend import SlurmOptions
    from psworker.launcher.launch import launch

    spec = with_train_flags(load_spec(args.spec, allow_counts=True), args)
    if not args.user_command:
        check_training(spec, data_here=False)
    run_dir = str(Path(args.run_dir or os.getcwd()).resolve())
    code = launch(launch_config(args, spec, SlurmOptions(port_base=args.port_base), command=args.user_command,
                                run_dir=run_dir))
    print(f"psworker: slurm launch exits with status {code}", flush=True)   # the job's output file says how it ended
    return code


def cmd_slurm_status(args: argparse.Namespace) -> int:
    """`psworker slurm status JOBID|RUN_DIR`: `psworker status` of the job's run dir."""
    from psworker.cli.launchers import show_status
    from psworker.launcher.backends.slurm.job import run_dir_of_job

    target = args.job
    run_dir = Path(target) if not target.isdigit() or Path(target).is_dir() else run_dir_of_job(target)
    return show_status(str(run_dir), args.json, args.silent_secs, args.watch)


def _port_base_flag(p: argparse.ArgumentParser, help_: str) -> None:
    p.add_argument("--port_base", type=port_type(), default=None, metavar="PORT", help=help_)


def _sbatch_flags(p: argparse.ArgumentParser) -> None:
    """The `#SBATCH` flags of `slurm submit`, each value checked as Slurm reads it before the script is written."""
    name = value_type(sched.check_sbatch_value, "name")
    g = p.add_argument_group("Slurm job (#SBATCH lines; --ntasks is the spec's task count)")
    g.add_argument("--nodes", type=value_type(sched.check_nodes, "nodes"), metavar="N|MIN-MAX",
                   help="node count or range, e.g. 2 or 2-4 (default: Slurm's)")
    g.add_argument("--time", type=value_type(sched.check_time, "time"), metavar="TIME",
                   help="time limit: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS, e.g. 1:00:00 "
                        "(default: the partition's)")
    g.add_argument("--partition", type=name, metavar="NAME",
                   help="partition to queue in (default: the cluster's default)")
    g.add_argument("--account", type=name, metavar="NAME", help="account to charge (default: your default one)")
    g.add_argument("--output", type=name, metavar="FILE",
                   help="Slurm's output file (default: <run_dir>/slurm-%%j.out)")
    g.add_argument("--job_name", type=name, default="psworker", metavar="NAME",
                   help="the job's name in squeue (default: psworker)")
    g.add_argument("--overcommit", action="store_true",
                   help="allow more tasks than allocated CPUs (one CPU per task otherwise)")
    g.add_argument("--stop_warning_secs", type=int, default=sched.DEFAULT_STOP_WARNING_SECS, metavar="SECS",
                   help="#SBATCH --signal=B:TERM@SECS: this long before the time limit the launcher gets SIGTERM; "
                        "the chief then writes a checkpoint and the job stops (default "
                        f"{sched.DEFAULT_STOP_WARNING_SECS}; 0: no warning)")


def submit_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", metavar="SPEC", help="cluster spec: task counts (`ps: 1`), or addresses whose hosts are "
                                                "replaced by the allocation's nodes")
    _sbatch_flags(p)
    p.add_argument("--run_dir", help="shared directory for the script, the spec copy, logs and (by default) "
                                     "train_dir (default: a fresh runs/<spec>-<date>-<time>)")
    _port_base_flag(p, "first port of the tasks on each node, +1 per further task there, as TensorFlow's "
                       "SlurmClusterResolver (default: the spec's cluster.port, else 2222)")
    p.add_argument("--python", default=sys.executable, help="interpreter the job runs (default: this one)")
    p.add_argument("--dry_run", action="store_true", help="write the script, do not submit it")
    add_train_flags(p)
    add_launch_flags(p.add_argument_group("supervision inside the job (passed to `psworker slurm launch`)"),
                     network=False)
    p.set_defaults(**{name: None for name in FORWARDED})
    p.epilog = COMMAND_EPILOG


def launch_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", metavar="SPEC", help="task counts (`ps: 1`), or addresses whose hosts are replaced")
    p.add_argument("--run_dir", help="shared directory for cluster.yaml and logs/ (default: the working directory)")
    _port_base_flag(p, "first port on each node (default: the spec's cluster.port, else 2222)")
    add_launch_flags(p, network=False)
    add_train_flags(p)
    p.epilog = COMMAND_EPILOG


def status_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", metavar="JOBID|RUN_DIR")
    add_status_flags(p)
