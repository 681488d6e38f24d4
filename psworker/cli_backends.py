"""The launcher commands: `psworker local`, `run`, `status`, `slurm submit|launch|status` and `ssh` (commands and
the scheduler parsers), and the launch flags `psworker slurm submit` passes through to `slurm launch`.

Each command builds one `LaunchConfig` (`cli_common.launch_config`) with its backend's name and hands it to
`psworker.launcher.launch.launch`: one launcher for every backend.
"""

from __future__ import annotations

import argparse
import json
import logging
import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

from psworker.cli_common import (add_launch_flags, add_status_flags, add_train_flags, launch_config, port_type,
                                 train_overrides, value_type)
from psworker.errors import UsageError
from psworker.spec import ClusterSpec, load_spec, merge_train

__all__ = ["add_slurm_parsers", "add_ssh_parser", "forwarded_launch_flags", "JOB_ID_FILE"]

log = logging.getLogger(__name__)

TENSORBOARD_PID_ENV = "PSWORKER_TENSORBOARD_PID"   # `local --tensorboard`: the server the launcher must stop
JOB_ID_FILE = "slurm-job-id"          # written into the run dir by `psworker slurm submit`
SCONTROL_TIMEOUT_SECS = 15.0          # scontrol retries a missing slurm.conf for a minute
# `psworker slurm submit` takes these launch flags and passes the ones given to `psworker slurm launch`.
FORWARDED = ("grace_period_secs", "max_restarts", "restart_backoff_secs", "stall_timeout_secs", "success_policy",
             "worker_exit_grace_secs")


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
    add_launch_flags(p.add_argument_group("supervision inside the job (passed to `psworker slurm launch`)"),
                             network=False)
    p.set_defaults(**{name: None for name in FORWARDED})


def cmd_local(args: argparse.Namespace) -> int:
    """`psworker local SPEC ...`: starts the whole cluster on this machine and supervises it."""
    spec = load_spec(args.spec)
    # No train_dir given: the backend makes a fresh runs/<spec>-<time> so that a rerun never resumes by surprise.
    spec = dataclasses.replace(spec, train=merge_train(spec.train, train_overrides(args),
                                                       num_workers=len(spec.worker)))
    tensorboard_pid = os.environ.get(TENSORBOARD_PID_ENV)
    if args.tensorboard is not None and tensorboard_pid is None:
        spec, tensorboard_pid = _start_tensorboard(args, spec)
    config = launch_config(args, spec)
    _isolate_network(args.network, args.argv)
    from psworker.launcher.launch import launch
    try:
        return launch(config)
    finally:
        if tensorboard_pid is not None:
            from psworker.launcher import tensorboard
            tensorboard.stop_pid(int(tensorboard_pid))


def _start_tensorboard(args: argparse.Namespace, spec: ClusterSpec) -> tuple[ClusterSpec, str]:
    """`local --tensorboard`: TensorBoard on the run dir, started on this host's network before the launcher moves
    into its private namespace (it keeps this pid, so TensorBoard stays its child and is stopped at the end)."""
    from psworker.launcher import tensorboard
    from psworker.launcher.local import default_train_dir

    if spec.train.train_dir is None:
        train_dir = str(default_train_dir(spec))
        print(f"psworker: train_dir is {train_dir}", flush=True)
        spec = dataclasses.replace(spec, train=dataclasses.replace(spec.train, train_dir=train_dir))
        if args.argv is not None:
            args.argv = [*args.argv, "--train_dir", train_dir]
    pid, url = tensorboard.start_detached(spec.train.train_dir, args.tensorboard)
    print(f"psworker: TensorBoard at {url} (127.0.0.1 only), for as long as the run lasts", flush=True)
    os.environ[TENSORBOARD_PID_ENV] = str(pid)
    return spec, str(pid)


def cmd_run(args: argparse.Namespace) -> int:
    """`psworker run SPEC [flags] -- COMMAND...`: runs COMMAND once per task of the spec and supervises them."""
    command = list(args.command)
    if not command:
        raise UsageError("psworker run needs a command after '--', e.g. psworker run SPEC -- python train.py")
    spec = load_spec(args.spec)
    if args.train_dir is not None:
        spec = dataclasses.replace(spec, train=merge_train(spec.train, {"train_dir": args.train_dir}))
    config = launch_config(args, spec, tuple(command))
    _isolate_network(args.network, args.argv)
    from psworker.launcher.launch import launch
    return launch(config)


def cmd_status(args: argparse.Namespace) -> int:
    """`psworker status RUN_DIR [--json]`: the status of a run, read from its cluster.yaml and task logs."""
    import datetime
    import time

    from psworker.launcher.status import read_run_dir, render

    status = read_run_dir(args.run_dir, now=time.time())
    silent = {name: t.last_output_at for name, t in status.tasks.items()
              if t.state not in ("done", "failed", "not started") and status.now - t.last_output_at >= args.silent_secs}
    if args.json:
        print(json.dumps({**status.as_dict(), "silent": sorted(silent)}, indent=2))
        return 0
    from rich.console import Console
    Console().print(render(status, args.silent_secs))
    for name, since in silent.items():
        stamp = datetime.datetime.fromtimestamp(since).strftime("%Y-%m-%d %H:%M:%S")
        print(f"silent: {name} since {stamp} ({status.now - since:.0f} s)")
    return 0


def _isolate_network(mode: str, argv: Optional[list[str]]) -> None:
    """`--network`: run the local cluster in a private network namespace (loopback only) where possible."""
    from psworker.launcher import netns

    if netns.inside() and netns.interfaces() == ["lo"]:
        netns.bring_up_loopback()
        log.info("network: private namespace, interfaces %s: the cluster's ports are unreachable from outside",
                 ", ".join(netns.interfaces()))
        return
    if mode == "host":
        log.warning("network: host; TensorFlow's unauthenticated servers listen on every interface of this host")
        return
    if argv is None:   # called as a library: replacing the caller's process is not ours to do
        if mode == "isolated":
            raise UsageError("--network isolated needs the psworker command itself (it re-executes in a namespace)")
        log.warning("network: not isolated (psworker.cli.main called in-process)")
        return
    if netns.available():
        netns.reexec_isolated(argv)
    if mode == "isolated":
        raise UsageError("--network isolated: cannot create a network namespace here (needs Linux, util-linux "
                         "'unshare' and user namespaces); use --network host on a firewalled machine")
    log.warning("network: no private namespace available (unshare not permitted); TensorFlow's unauthenticated "
                "servers listen on every interface of this host: firewall their ports")


def cmd_slurm_submit(args: argparse.Namespace) -> int:
    """`psworker slurm submit SPEC ...`: writes <run_dir>/psworker.sbatch and submits it with sbatch."""
    import shlex
    import shutil

    from psworker.plan import task_counts
    from psworker.schedulers import slurm

    spec = load_spec(args.spec, allow_counts=True)
    counts = task_counts(spec)
    overrides = train_overrides(args)
    merge_train(spec.train, overrides, num_workers=counts["worker"])   # bad flags fail here, not in the queue
    launch_flags = forwarded_launch_flags(args)
    port_base = slurm.count_spec(spec, args.port_base).port
    if args.run_dir:
        run_dir = Path(args.run_dir).resolve()
        _check_run_dir(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
    else:
        from psworker.launcher.local import default_train_dir
        run_dir = default_train_dir(spec).resolve()
        _check_run_dir(run_dir)
    spec_copy = run_dir / slurm.SUBMITTED_SPEC        # the job reads this copy: later edits do not change it
    shutil.copyfile(args.spec, spec_copy)
    for name in ("train_dir", "data_dir"):      # the job runs in run_dir: relative paths would move
        if overrides[name] is not None:
            overrides[name] = os.path.abspath(overrides[name])
    if spec.train.train_dir is None and overrides["train_dir"] is None:
        overrides["train_dir"] = str(run_dir)
    flags = [part for name, value in overrides.items() if value is not None for part in (f"--{name}", str(value))]
    flags += launch_flags
    options = slurm.SbatchOptions(ntasks=sum(counts.values()), job_name=args.job_name, nodes=args.nodes, time=args.time,
                                  partition=args.partition, account=args.account, output=args.output,
                                  overcommit=args.overcommit)
    inner = slurm.launch_argv(spec_copy, run_dir, python=args.python, port_base=port_base,
                              worker_flags=flags)
    described = ", ".join(f"{job}: {n}" for job, n in counts.items())
    script = slurm.write_sbatch_script(run_dir, options, inner, description=f"{args.spec} ({described})")
    if args.dry_run:
        print(f"wrote {script} (not submitted; submit with: sbatch {shlex.quote(str(script))})")
        return 0
    job_id = slurm.submit(script)
    (run_dir / JOB_ID_FILE).write_text(job_id + "\n")
    print(job_id)
    log.info("submitted %s as Slurm job %s; output in %s", script, job_id, run_dir)
    return 0



def _check_run_dir(run_dir: Path) -> None:
    """The run dir is the script's `#SBATCH --chdir`: one word, as every other #SBATCH value."""
    from psworker.schedulers import slurm
    try:
        slurm.check_sbatch_value(str(run_dir))
    except ValueError as e:
        raise UsageError(f"--run_dir: {e}") from None


def cmd_slurm_launch(args: argparse.Namespace) -> int:
    """`psworker slurm launch SPEC --run_dir D ...`: inside an allocation, runs every task as its own srun step."""
    from psworker.launcher.launch import launch
    from psworker.launcher.slurm import spec_for_allocation

    spec = spec_for_allocation(load_spec(args.spec, allow_counts=True), args.port_base, os.environ)
    run_dir = Path(args.run_dir or os.getcwd()).resolve()
    overrides = train_overrides(args)
    if spec.train.train_dir is None and overrides["train_dir"] is None:
        overrides["train_dir"] = str(run_dir)
    spec = dataclasses.replace(spec, train=merge_train(spec.train, overrides, num_workers=len(spec.worker)))
    config = dataclasses.replace(launch_config(args, spec), backend="slurm", train_dir=str(run_dir))
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
    return cmd_status(argparse.Namespace(run_dir=str(run_dir), json=args.json, silent_secs=args.silent_secs))


def cmd_ssh(args: argparse.Namespace) -> int:
    """`psworker ssh SPEC ...`: starts each task on the host its address names, over ssh, and supervises them."""
    from psworker.launcher.launch import launch

    spec = load_spec(args.spec)
    spec = dataclasses.replace(spec, train=merge_train(spec.train, train_overrides(args),
                                                       num_workers=len(spec.worker)))
    options = tuple(part for value in args.ssh_option for part in ("-o", value))
    backend_options = (("ssh_config", args.ssh_config), ("ssh_options", options), ("remote_dir", args.remote_dir))
    config = dataclasses.replace(launch_config(args, spec), backend="ssh", python=args.remote_python,
                                 backend_options=backend_options)
    return launch(config)


def add_slurm_parsers(sub: Any) -> None:
    """The `slurm` group: `submit`, `launch` and `status`."""
    slurm_parser = sub.add_parser("slurm", help="run a spec's cluster as a Slurm job",
                                  description="run a spec's cluster as a Slurm job")
    slurm_sub = slurm_parser.add_subparsers(dest="slurm_command", required=True, metavar="SLURM_COMMAND")
    p = slurm_sub.add_parser("submit", help="write a batch script for a spec into the run dir and submit it",
                             description="Writes <run_dir>/psworker.sbatch (#SBATCH lines, then the "
                                         "`psworker slurm launch` line it runs) and submits it with sbatch; "
                                         "prints the job id.")
    p.set_defaults(func=cmd_slurm_submit)
    p.add_argument("spec", metavar="SPEC", help="cluster spec: task counts (`ps: 1`), or addresses whose hosts are "
                                                "replaced by the allocation's nodes")
    _add_sbatch_flags(p)
    p.add_argument("--run_dir", help="shared directory for the script, the spec copy, logs and (by default) "
                                     "train_dir (default: a fresh runs/<spec>-<date>-<time>)")
    p.add_argument("--port_base", type=port_type(), default=None, metavar="PORT",
                   help="first port of the tasks on each node, +1 per further task there, as TensorFlow's "
                        "SlurmClusterResolver (default: the spec's cluster.port, else 2222)")
    p.add_argument("--python", default=sys.executable, help="interpreter the job runs (default: this one)")
    p.add_argument("--dry_run", action="store_true", help="write the script, do not submit it")
    add_train_flags(p)
    add_submit_launch_flags(p)

    slurm_parsers(slurm_sub)


def _add_sbatch_flags(p: argparse.ArgumentParser) -> None:
    """The `#SBATCH` flags of `slurm submit`, each value checked as Slurm reads it before the script is written."""
    from psworker.schedulers import slurm

    name = value_type(slurm.check_sbatch_value, "name")
    g = p.add_argument_group("Slurm job (#SBATCH lines; --ntasks is the spec's task count)")
    g.add_argument("--nodes", type=value_type(slurm.check_nodes, "nodes"), metavar="N|MIN-MAX",
                   help="node count or range, e.g. 2 or 2-4 (default: Slurm's)")
    g.add_argument("--time", type=value_type(slurm.check_time, "time"), metavar="TIME",
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


def slurm_parsers(slurm_sub: Any) -> None:
    """`slurm launch` and `slurm status` (`add_slurm_parsers` makes the group and `submit`)."""
    p = slurm_sub.add_parser("launch", help="inside an allocation: run every task of a spec as its own srun step",
                             description="Lays the spec's tasks out on the allocation's nodes (TensorFlow's "
                                         "SlurmClusterResolver rules), starts each as its own `srun` step and "
                                         "supervises them. Run by the batch script `psworker slurm submit` writes.")
    p.set_defaults(func=cmd_slurm_launch, launcher=True)
    p.add_argument("spec", metavar="SPEC", help="task counts (`ps: 1`), or addresses whose hosts are replaced")
    p.add_argument("--run_dir", help="shared directory for cluster.yaml and logs/ (default: the working directory)")
    p.add_argument("--port_base", type=port_type(), default=None, metavar="PORT",
                   help="first port on each node (default: the spec's cluster.port, else 2222)")
    add_launch_flags(p, network=False)
    add_train_flags(p)

    p = slurm_sub.add_parser("status", help="show the status of a Slurm job's run",
                             description="`psworker status` of the run dir of a job `psworker slurm submit` queued.")
    p.set_defaults(func=cmd_slurm_status)
    p.add_argument("job", metavar="JOBID|RUN_DIR")
    add_status_flags(p)


def add_ssh_parser(sub: Any) -> None:
    """`psworker ssh SPEC ...`."""
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
    add_launch_flags(p, network=False)
    add_train_flags(p)     # --train_dir: the run dir here (cluster.yaml, logs/) and the chief's on its host
