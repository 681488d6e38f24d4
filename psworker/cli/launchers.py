"""`psworker local`, `run`, `ssh` and `status`: each builds one `LaunchConfig` with its backend's typed options
and hands it to `psworker.launcher.launch.launch`."""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from psworker.cli.flags import (COMMAND_EPILOG, add_launch_flags, add_memory_limit_flag, add_status_flags,
                                add_train_flags, launch_config, port_type, value_type, with_train_flags)
from psworker.cli.preflight import check_training
from psworker.errors import UsageError
from psworker.spec import ClusterSpec, load_spec

__all__ = ["check_memory_plan", "cmd_local", "cmd_run", "cmd_ssh", "cmd_status", "local_flags", "run_flags",
           "show_status", "ssh_flags", "status_flags"]


def _reexec_argv(args: argparse.Namespace) -> Optional[tuple[str, ...]]:
    """The command line to re-execute in a network namespace; None when called in-process (`main(argv)`)."""
    return None if args.argv is None else tuple(args.argv)


def cmd_local(args: argparse.Namespace) -> int:
    """`psworker local SPEC ...`: starts the whole cluster on this machine and supervises it."""
    from psworker.launcher.backends.local import LocalOptions
    from psworker.launcher.launch import launch

    backend = LocalOptions(network=args.network, reexec_argv=_reexec_argv(args), tensorboard_port=args.tensorboard,
                           ps_link_rate_bps=args.ps_link_rate, ps_memory_limit_bytes=args.ps_memory_limit)
    spec = with_train_flags(load_spec(args.spec), args)
    check_training(spec, data_here=True)
    if args.ps_memory_limit is not None:
        check_memory_plan(spec, args.ps_memory_limit)
    return launch(launch_config(args, spec, backend))


def check_memory_plan(spec: ClusterSpec, limit: int) -> None:
    """`--ps_memory_limit`: refuses (exit 2) before anything starts where this machine cannot cap a ps, or where a
    ps of the model's placement would not fit under the cap (`train.memory_plan`). It builds the model's graph, so
    it runs here, in the CLI (the launcher never imports train/), once: not again in a re-executed launcher."""
    from psworker import memory
    from psworker.cli.quiet import cpp_chatter_hidden
    from psworker.launcher import netns
    from psworker.launcher.backends.local import memory_cap_possible
    from psworker.train import memory_plan

    if netns.inside():
        return
    memory_cap_possible()
    with cpp_chatter_hidden():       # TensorFlow's C++ start-up lines, as `plan` hides them
        fit = memory_plan.require(spec.train.model, len(spec.ps), limit)
    print(f"psworker: --ps_memory_limit {memory.format_size(limit)}: the fullest ps needs "
          f"{memory.format_size(max(fit.needs_per_ps))} by the fitted model (`psworker plan --ps_memory_limit` "
          "gives each ps's)",
          flush=True)


def cmd_run(args: argparse.Namespace) -> int:
    """`psworker run SPEC [flags] -- COMMAND...`: runs COMMAND once per task of the spec and supervises them."""
    from psworker.launcher.backends.local import LocalOptions
    from psworker.launcher.launch import launch

    if not args.user_command:
        raise UsageError("psworker run needs a command after '--', e.g. psworker run SPEC -- python train.py")
    backend = LocalOptions(network=args.network, reexec_argv=_reexec_argv(args))
    spec = with_train_flags(load_spec(args.spec), args)
    return launch(launch_config(args, spec, backend, command=args.user_command))


def cmd_ssh(args: argparse.Namespace) -> int:
    """`psworker ssh SPEC ... [-- COMMAND...]`: starts each task (psworker's, or COMMAND) on the host its address
    names, over ssh, and supervises them."""
    from psworker.launcher.backends.ssh.backend import SshOptions
    from psworker.launcher.launch import launch

    backend = SshOptions(ssh_config=args.ssh_config, ssh_options=tuple(args.ssh_option), remote_dir=args.remote_dir)
    spec = with_train_flags(load_spec(args.spec), args)
    if not args.user_command:
        check_training(spec, data_here=False)
    return launch(launch_config(args, spec, backend, command=args.user_command, python=args.remote_python))


def show_status(run_dir: str, as_json: bool, silent_secs: float, watch_secs: Optional[float] = None) -> int:
    """Prints the status of the run in `run_dir` (a table, then the lines about it; or JSON); with `watch_secs`,
    refreshed that often until the run ends (`psworker.launcher.console.status_watch`)."""
    from psworker.launcher.console import status_watch

    if watch_secs is not None and not as_json:
        return status_watch.watch(run_dir, watch_secs, silent_secs)
    status_watch.show(run_dir, as_json, silent_secs)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """`psworker status RUN_DIR [--json] [--watch [SECS]]`: the status of a run, read from its run dir."""
    if args.watch is not None and args.json:
        raise UsageError("--watch and --json do not go together: --json prints one snapshot, for scripts")
    return show_status(args.run_dir, args.json, args.silent_secs, args.watch)


def local_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", metavar="SPEC")
    add_launch_flags(p)
    add_train_flags(p)
    p.add_argument("--tensorboard", nargs="?", type=port_type(free_ok=True), const=0, default=None, metavar="PORT",
                   help="serve the run dir with TensorBoard on 127.0.0.1 while the run lasts and print its URL "
                        "(PORT default: a free one)")
    from psworker.launcher.shaping import parse_rate
    p.add_argument("--ps_link_rate", type=value_type(parse_rate, "rate"), default=None, metavar="RATE",
                   help="rehearse a cluster whose ps hosts have this link: in the run's private network namespace "
                        "each ps port is shaped to RATE per direction with tc, e.g. 100mbit, 1gbit, 10gbit "
                        "(tc's units); the report gives the bytes each ps moved (docs/performance.md: picking RATE)")
    add_memory_limit_flag(p, "cap each ps's memory at SIZE (e.g. 1.5GB, 800MiB) in a cgroup v1 memory cgroup of its "
                             "own: refused before anything starts where the model's variables on a ps (as placed, "
                             "with their optimizer slots) plus a bare ps's baseline exceed it; a ps over it is "
                             "killed by the kernel, and the report says so; the run ends with each ps's peak")


def run_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", metavar="SPEC")
    add_launch_flags(p)
    p.add_argument("--train_dir", default=None,
                   help="the run directory (cluster.yaml, logs/); default: a fresh runs/<spec>-<time>")
    p.epilog = ("after '--': the program and its arguments; {job_name} {task_index} {ps_hosts} {worker_hosts} "
                "{train_dir} are replaced per task, e.g. psworker run SPEC -- python train.py --job_name={job_name} "
                "--checkpoint_dir={train_dir}")


def ssh_flags(p: argparse.ArgumentParser) -> None:
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
    p.epilog = COMMAND_EPILOG


def status_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's train_dir (holds cluster.yaml and logs/)")
    add_status_flags(p)
