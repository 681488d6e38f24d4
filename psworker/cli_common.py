"""Flags and config objects that several `psworker` commands share: train settings, cluster sources, launch
options. Parsing only; no command runs here."""

from __future__ import annotations

import argparse
from typing import Any

from psworker.errors import UsageError
from psworker.spec import TRAIN_FIELDS, TRAIN_TYPES, ClusterSpec, TrainConfig, merge_train


def add_train_flags(p: argparse.ArgumentParser) -> None:
    """Adds one flag per TrainConfig field (default None: the spec's value stands)."""
    g = p.add_argument_group("training settings (override the spec's train section)")
    defaults = TrainConfig()
    for name in TRAIN_FIELDS:
        kind, _ = TRAIN_TYPES[name]
        g.add_argument(f"--{name}", default=None, metavar=kind.__name__.upper(),
                       help=f"built-in default: {getattr(defaults, name)}")


def train_overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name) for name in TRAIN_FIELDS}


def add_cluster_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster (one of: --spec, --ps_hosts/--worker_hosts, env PSWORKER_SPEC, "
                             "env TF_CONFIG)")
    g.add_argument("--spec", dest="spec_path", help="cluster spec YAML file")
    g.add_argument("--ps_hosts", help="comma-separated host:port list of the ps job")
    g.add_argument("--worker_hosts", help="comma-separated host:port list of the worker job")
    g.add_argument("--job_name", help="must match the command (ps or worker) when given")
    g.add_argument("--task_index", type=int, help="this task's index within its job")
    p.add_argument("--allow_public_bind", action="store_true",
                   help="serve even when this task's host resolves to a public IP address (TensorFlow's servers are "
                        "unauthenticated; the default refuses)")


def train_config(spec: ClusterSpec, args: argparse.Namespace) -> TrainConfig:
    return merge_train(spec.train, train_overrides(args), num_workers=len(spec.worker))


def launch_config(args: argparse.Namespace, spec: ClusterSpec, command: tuple[str, ...] = ()):
    """The one `LaunchConfig` of `psworker local` and `psworker run`."""
    from psworker.launcher.launch import LaunchConfig
    from psworker.launcher.policy import RestartPolicy

    for flag in ("grace_period_secs", "restart_backoff_secs"):
        if getattr(args, flag) < 0:
            raise UsageError(f"--{flag} must be >= 0, got {getattr(args, flag):g}")
    if args.max_restarts < 0:
        raise UsageError(f"--max_restarts must be >= 0, got {args.max_restarts}")
    if args.stall_timeout_secs is not None and args.stall_timeout_secs <= 0:
        raise UsageError(f"--stall_timeout_secs must be > 0, got {args.stall_timeout_secs:g}")
    policy = RestartPolicy(max_restarts=args.max_restarts, backoff_secs=args.restart_backoff_secs)
    return LaunchConfig(spec=spec, command=command, policy=policy, injections=tuple(args.inject),
                        stall_timeout_secs=args.stall_timeout_secs, network=args.network, verbose=args.verbose,
                        live=False if args.no_live else None, grace_period_secs=args.grace_period_secs,
                        ps_exit_grace_secs=1.0 if command else 15.0)


def add_launch_flags(p: argparse.ArgumentParser, network: bool = True) -> None:
    """Flags shared by the launchers (`local`, `run`, `ssh`, `slurm launch`): supervision, restarts, fault
    injection, console; `--network` only where the cluster runs on this machine."""
    p.add_argument("--grace_period_secs", type=float, default=10.0,
                   help="after a failure or Ctrl-C, how long tasks get to exit before SIGKILL")
    p.add_argument("--max_restarts", type=int, default=0, metavar="N",
                   help="restart a task whose exit is retryable (killed by a signal, exit code >= 128, e.g. 170 "
                        "for a peer gone) up to N times; other exits fail the run at once (default 0)")
    p.add_argument("--restart_backoff_secs", type=float, default=1.0, metavar="SECS",
                   help="wait before the first restart of a task, doubled for each next one, +-20%% jitter "
                        "(default 1)")
    p.add_argument("--stall_timeout_secs", type=float, default=None, metavar="SECS",
                   help="kill (and restart under --max_restarts) a worker whose step line has not shown a new "
                        "global step for this long (default: off)")
    p.add_argument("--inject", action="append", default=[], metavar="FAULT",
                   help="inject a fault, repeatable: kill:worker:1@step=300, kill:ps:0@time=20, "
                        "stop:worker:1@step=200,for=10, exit:worker:0@step=100,code=143")
    if network:
        p.add_argument("--network", choices=("auto", "isolated", "host"), default="auto",
                       help="isolated: run the cluster in a private network namespace where only loopback exists "
                            "(TensorFlow's servers listen on every interface otherwise); auto (default): isolated "
                            "when this machine allows it; host: no isolation")
    else:
        p.set_defaults(network="host")
    p.add_argument("--verbose", action="store_true",
                   help="show every line the tasks print (default: psworker's own lines, steps, warnings and "
                        "errors; the full output is always in <train_dir>/logs/)")
    p.add_argument("--no_live", action="store_true",
                   help="plain periodic status lines even on a terminal (no live view)")


def add_status_flags(p: argparse.ArgumentParser) -> None:
    """The options of `psworker status` and `psworker slurm status`."""
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--silent_secs", type=float, default=60.0,
                   help="call a running task silent when its log has not grown for this long (default 60)")


__all__ = ["add_train_flags", "train_overrides", "add_cluster_flags", "train_config", "launch_config",
           "add_launch_flags", "add_status_flags"]
