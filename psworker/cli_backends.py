"""The command lines of the remote backends: `psworker slurm launch`, `psworker slurm status` and `psworker ssh`
(parsers and commands), and the launch flags `psworker slurm submit` passes through to `slurm launch`.

Each command builds one `LaunchConfig` (as `psworker local` does, `cli._launch_config`) with its backend's name and
hands it to `psworker.launcher.launch.launch`: one launcher for every backend.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from psworker.errors import UsageError
from psworker.spec import load_spec, merge_train

__all__ = ["add_slurm_parsers", "add_ssh_parser", "forwarded_launch_flags", "JOB_ID_FILE"]

JOB_ID_FILE = "slurm-job-id"          # written into the run dir by `psworker slurm submit`
SCONTROL_TIMEOUT_SECS = 15.0          # scontrol retries a missing slurm.conf for a minute
# `psworker slurm submit` takes these launch flags and passes the ones given to `psworker slurm launch`.
FORWARDED = ("grace_period_secs", "max_restarts", "restart_backoff_secs", "stall_timeout_secs")


def _cli() -> Any:
    from psworker import cli
    return cli


def forwarded_launch_flags(args: argparse.Namespace) -> list[str]:
    """The launch flags given to `slurm submit`, as `slurm launch` arguments (defaults are left out)."""
    flags = [part for name in FORWARDED if getattr(args, name) is not None
             for part in (f"--{name}", str(getattr(args, name)))]
    from psworker.launcher.inject import parse_fault
    for fault in args.inject:
        parse_fault(fault)               # a bad fault fails here, not in the queue
    flags += [part for fault in args.inject for part in ("--inject", fault)]
    return flags + (["--verbose"] if args.verbose else [])


def add_submit_launch_flags(p: argparse.ArgumentParser) -> None:
    """The launch flags on `slurm submit` (default None there: only those given reach the script)."""
    _cli()._add_launch_flags(p.add_argument_group("supervision inside the job (passed to `psworker slurm launch`)"),
                             network=False)
    p.set_defaults(**{name: None for name in FORWARDED})


def cmd_slurm_launch(args: argparse.Namespace) -> int:
    """`psworker slurm launch SPEC --run_dir D ...`: inside an allocation, runs every task as its own srun step."""
    from psworker.launcher.launch import launch
    from psworker.launcher.slurm import spec_for_allocation

    cli = _cli()
    if args.port_base is not None and not 1 <= args.port_base <= 65535:
        raise UsageError(f"--port_base must be within 1-65535, got {args.port_base}")
    spec = spec_for_allocation(load_spec(args.spec, allow_counts=True), args.port_base, os.environ)
    run_dir = Path(args.run_dir or os.getcwd()).resolve()
    overrides = cli._train_overrides(args)
    if spec.train.train_dir is None and overrides["train_dir"] is None:
        overrides["train_dir"] = str(run_dir)
    spec = dataclasses.replace(spec, train=merge_train(spec.train, overrides, num_workers=len(spec.worker)))
    config = dataclasses.replace(cli._launch_config(args, spec), backend="slurm", train_dir=str(run_dir))
    code = launch(config)
    print(f"psworker: slurm launch exits with status {code}", flush=True)   # the job's output file says how it ended
    return code


def _run_dir_of_job(job_id: str) -> Path:
    """The run dir of a job `psworker slurm submit` queued: a `runs/*/slurm-job-id` here naming it, else the job's
    working directory while Slurm still lists it."""
    for marker in Path("runs").glob(f"*/{JOB_ID_FILE}"):
        if marker.read_text().strip() == job_id:
            return marker.parent
    try:
        result = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                                timeout=SCONTROL_TIMEOUT_SECS, stdin=subprocess.DEVNULL)
        for field in result.stdout.split() if result.returncode == 0 else ():
            if field.startswith("WorkDir="):
                return Path(field.split("=", 1)[1])
    except (OSError, subprocess.TimeoutExpired):
        pass
    raise UsageError(f"Slurm job {job_id}: no runs/*/{JOB_ID_FILE} here names it and Slurm does not list it "
                     f"(any more); pass its run dir instead")


def cmd_slurm_status(args: argparse.Namespace) -> int:
    """`psworker slurm status JOBID|RUN_DIR`: `psworker status` of the job's run dir."""
    target = args.job
    run_dir = Path(target) if not target.isdigit() or Path(target).is_dir() else _run_dir_of_job(target)
    return _cli().cmd_status(argparse.Namespace(run_dir=str(run_dir), json=args.json, silent_secs=args.silent_secs))


def cmd_ssh(args: argparse.Namespace) -> int:
    """`psworker ssh SPEC ...`: starts each task on the host its address names, over ssh, and supervises them."""
    from psworker.launcher.launch import launch

    cli = _cli()
    spec = load_spec(args.spec)
    spec = dataclasses.replace(spec, train=merge_train(spec.train, cli._train_overrides(args),
                                                       num_workers=len(spec.worker)))
    options = tuple(part for value in args.ssh_option for part in ("-o", value))
    backend_options = (("ssh_config", args.ssh_config), ("ssh_options", options), ("remote_dir", args.remote_dir))
    config = dataclasses.replace(cli._launch_config(args, spec), backend="ssh", python=args.remote_python,
                                 backend_options=backend_options)
    return launch(config)


def add_slurm_parsers(slurm_sub: Any) -> None:
    """`slurm launch` and `slurm status` (the `slurm` group and `submit` are in `cli.build_parser`)."""
    cli = _cli()
    p = slurm_sub.add_parser("launch", help="inside an allocation: run every task of a spec as its own srun step",
                             description="Lays the spec's tasks out on the allocation's nodes (TensorFlow's "
                                         "SlurmClusterResolver rules), starts each as its own `srun` step and "
                                         "supervises them. Run by the batch script `psworker slurm submit` writes.")
    p.set_defaults(func=cmd_slurm_launch, launcher=True)
    p.add_argument("spec", metavar="SPEC", help="task counts (`ps: 1`), or addresses whose hosts are replaced")
    p.add_argument("--run_dir", help="shared directory for cluster.yaml and logs/ (default: the working directory)")
    p.add_argument("--port_base", type=int, default=None,
                   help="first port on each node (default: the spec's cluster.port, else 2222)")
    cli._add_launch_flags(p, network=False)
    cli._add_train_flags(p)

    p = slurm_sub.add_parser("status", help="show the status of a Slurm job's run",
                             description="`psworker status` of the run dir of a job `psworker slurm submit` queued.")
    p.set_defaults(func=cmd_slurm_status)
    p.add_argument("job", metavar="JOBID|RUN_DIR")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--silent_secs", type=float, default=60.0,
                   help="call a running task silent when its log has not grown for this long (default 60)")


def add_ssh_parser(sub: Any) -> None:
    """`psworker ssh SPEC ...`."""
    cli = _cli()
    p = sub.add_parser("ssh", help="run a spec's cluster on the hosts its addresses name, over ssh",
                       description="Checks every host (ssh BatchMode, in parallel) before starting anything, writes "
                                   "the spec on each host, starts each task over its own ssh connection and "
                                   "supervises them; a task dies with its connection.")
    p.set_defaults(func=cmd_ssh, launcher=True)
    p.add_argument("spec", metavar="SPEC", help="a spec whose addresses name the hosts, with fixed ports")
    p.add_argument("--ssh_option", action="append", default=[], metavar="OPT",
                   help="an ssh -o option, repeatable, e.g. --ssh_option Port=2200")
    p.add_argument("--ssh_config", metavar="FILE", help="ssh client config file (ssh -F; default: ssh's own)")
    p.add_argument("--remote_python", default=sys.executable,
                   help="the interpreter on the hosts, with psworker installed (default: this one's path)")
    p.add_argument("--remote_dir", metavar="DIR",
                   help="directory on every host for cluster.yaml, the tasks' working directory (default: the "
                        "run dir's absolute path)")
    cli._add_launch_flags(p, network=False)
    cli._add_train_flags(p)     # --train_dir: the run dir here (cluster.yaml, logs/) and the chief's on its host
