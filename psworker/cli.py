"""The `psworker` command line: parses flags in `main()` and hands one config object to each layer.

Heavy modules (TensorFlow, the trainer, backends) are imported inside the commands that need them, so
`validate`, `plan` and `tf-config` stay fast.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any, Callable, Optional

from psworker.cli_backends import cmd_local, cmd_run, cmd_status
from psworker.cli_common import (add_cluster_flags, add_launch_flags, add_model_flag, add_status_flags, add_train_flags,
                                 int_type, port_type, positive_float, train_config)
from psworker import events
from psworker.errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE, PsworkerError, UsageError
from psworker.spec import ALL_JOBS, ClusterSpec, CountSpec, TrainConfig, load_spec, merge_train

log = logging.getLogger(__name__)


LOG_FORMAT = events.LOG_FORMAT
# `psworker data NAME`: NAME -> function in psworker.data.cifar10_files taking (data_dir). One registry.
DATASETS = {"cifar10": "download_and_extract", "cifar10-synthetic": "write_synthetic"}


def _resolve(job: str, args: argparse.Namespace) -> tuple[ClusterSpec, int]:
    from psworker.interop import resolve_cluster
    return resolve_cluster(job, spec_path=args.spec_path, ps_hosts=args.ps_hosts,
                           worker_hosts=args.worker_hosts, job_name=args.job_name,
                           task_index=args.task_index, environ=os.environ)


# -------------------------------------------------------------------------------------------- commands

def cmd_validate(args: argparse.Namespace) -> int:
    """`psworker validate SPEC...`: checks each file, prints OK lines, errors on stderr."""
    failed = 0
    for path in args.specs:
        try:
            spec = load_spec(path, allow_counts=True)
        except PsworkerError as e:
            _print_error(e)
            failed += 1
            continue
        from psworker.plan import task_counts
        n = task_counts(spec)
        extra = "".join(f"{n[j]} {j}, " for j in ("chief", "evaluator") if n.get(j))
        print(f"OK {path} ({extra}{n['ps']} ps, {n['worker']} workers)")
    return EXIT_USAGE if failed else EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    """`psworker plan SPEC [--model NAME] [--hosts H,..]`: prints the task table (and the model's placement)."""
    from psworker import plan as planning
    spec = load_spec(args.spec, allow_counts=True)
    if isinstance(spec, CountSpec):
        hosts = (planning.placeholder_hosts(planning.nodes_needed(spec, args.tasks_per_node)) if args.hosts is None
                 else [h.strip() for h in args.hosts.split(",")])
        laid_out = planning.layout(spec, hosts, args.tasks_per_node)
        print(planning.format_layout(spec, laid_out, hosts, args.tasks_per_node, args.spec))
        spec = laid_out
    elif args.hosts is not None:
        raise UsageError("--hosts lays out task counts (`ps: 2`); this spec lists addresses already")
    elif spec.chief or spec.evaluator:
        from psworker.launcher.command import format_command_plan
        print(format_command_plan(spec))
        return 0
    else:
        print(planning.format_plan(spec, planning.plan(spec, args.spec)))
    if args.model is not None:
        model = merge_train(spec.train, {"model": args.model}).model
        from psworker.train import report
        print()
        print(report.describe(model, len(spec.ps), workers=len(spec.worker), step_rate=args.step_rate,
                              bandwidth_gbps=args.bandwidth_gbps))
    return 0


def cmd_tf_config(args: argparse.Namespace) -> int:
    """`psworker tf-config SPEC --job J --task_index I`: prints that task's TF_CONFIG JSON."""
    from psworker.interop import to_tf_config
    print(json.dumps(to_tf_config(load_spec(args.spec), args.job, args.task_index)))
    return 0


def cmd_ps(args: argparse.Namespace) -> int:
    """`psworker ps ...`: runs one parameter server."""
    spec, index = _resolve("ps", args)
    if args.workers_gone_timeout_secs <= 0:
        raise UsageError(f"--workers_gone_timeout_secs must be > 0, got {args.workers_gone_timeout_secs:g}")
    if args.rejoin_grace_secs is not None and args.rejoin_grace_secs < 0:
        raise UsageError(f"--rejoin_grace_secs must be >= 0, got {args.rejoin_grace_secs:g}")
    from psworker.task import main
    return main.run_ps(spec, index, keep_running=args.keep_ps_running,
                       workers_gone_timeout_secs=args.workers_gone_timeout_secs,
                       rejoin_grace_secs=args.rejoin_grace_secs,
                       allow_public_bind=args.allow_public_bind)


def cmd_worker(args: argparse.Namespace) -> int:
    """`psworker worker ...`: runs one training worker (worker 0 is the chief)."""
    spec, index = _resolve("worker", args)
    config = train_config(spec, args)
    from psworker.task import main
    return main.run_worker(spec, index, config, allow_public_bind=args.allow_public_bind)


def cmd_data(args: argparse.Namespace) -> int:
    """`psworker data NAME --data_dir D`: downloads or writes a data set."""
    from psworker.data import cifar10_files
    getattr(cifar10_files, DATASETS[args.name])(args.data_dir)
    log.info("%s ready in %s", args.name, args.data_dir)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """`psworker eval --train_dir D ...`: evaluates the latest (or every new) checkpoint."""
    checked = merge_train(TrainConfig(), {"model": args.model, "batch_size": args.batch_size,
                                          "train_dir": args.train_dir, "data_dir": args.data_dir})
    from psworker.train.evaluate import run_eval
    # --model not given: run_eval takes it from the cluster.yaml a local run leaves in the train dir.
    return run_eval(train_dir=checked.train_dir, data_dir=args.data_dir, model_name=args.model and checked.model,
                    once=args.once, eval_interval_secs=args.eval_interval_secs,
                    batch_size=None if args.batch_size is None else checked.batch_size)


def cmd_export(args: argparse.Namespace) -> int:
    """`psworker export --train_dir D [--checkpoint C] [--model M]`: writes a SavedModel; prints its path."""
    checked = merge_train(TrainConfig(), {"model": args.model, "train_dir": args.train_dir})
    from psworker.train.export import run_export
    print(run_export(train_dir=checked.train_dir, checkpoint=args.checkpoint, model_name=args.model and checked.model,
                     export_base=args.export_dir), flush=True)
    return 0


def cmd_tensorboard(args: argparse.Namespace) -> int:
    """`psworker tensorboard --logdir D [--port P]`: serves D on 127.0.0.1 until Ctrl-C."""
    import signal
    import time

    from psworker.launcher import tensorboard
    # SIGTERM ends the command like Ctrl-C, through serve()'s exit, which stops TensorBoard.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    with tensorboard.serve(args.logdir, args.port) as url:
        print(f"psworker: TensorBoard at {url}", flush=True)
        while True:
            time.sleep(3600)


# ---------------------------------------------------------------------------------------------- parser

def build_parser() -> argparse.ArgumentParser:
    """Builds the argument parser (no side effects; called by `main`)."""
    parser = argparse.ArgumentParser(
        prog="psworker", description="Parameter-server clusters for TensorFlow: validate specs, start ps and worker "
                                     "tasks locally, over SSH, on Slurm or Kubernetes; train, evaluate, export.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    add = _adder(sub)
    _add_spec_commands(add)

    p = add("ps", cmd_ps, "run one parameter server task")
    p.set_defaults(task_process=True)
    add_cluster_flags(p)
    p.add_argument("--keep_ps_running", action="store_true",
                   help="keep serving after the workers finish (default: exit once every worker is done)")
    p.add_argument("--rejoin_grace_secs", type=float, default=None, metavar="FLOAT",
                   help="once some worker is done, how long a non-chief worker that went away without saying so "
                        "may take to come back before it counts as done (default 30: a restart by hand, by a pod's "
                        "controller or by Slurm; the launcher passes its longest backoff plus 60). The chief never "
                        "counts as done until it says so: its final checkpoint is outstanding")
    p.add_argument("--workers_gone_timeout_secs", type=float, default=300.0, metavar="FLOAT",
                   help="when every worker has gone away without saying it is done (crashed), or the others are "
                        "done and the chief has, exit with an error (170) after this long instead of serving forever "
                        "(default 300); workers never seen get at least the spec's startup_timeout_secs, and if the "
                        "spec's train_dir shows training complete (a ps restarted after the end) the ps exits 0")

    p = add("worker", cmd_worker, "run one worker task (worker 0 is the chief)")
    p.set_defaults(task_process=True)
    add_cluster_flags(p)
    add_train_flags(p)

    p = add("local", cmd_local, "run a whole spec's cluster on this machine")
    p.add_argument("spec", metavar="SPEC")
    add_launch_flags(p)
    add_train_flags(p)
    p.add_argument("--tensorboard", nargs="?", type=port_type(free_ok=True), const=0, default=None, metavar="PORT",
                   help="serve the run dir with TensorBoard on 127.0.0.1 while the run lasts and print its URL "
                        "(PORT default: a free one)")

    p = add("run", cmd_run, "run your own distributed-TensorFlow script once per task of a spec "
                            "(TF_CONFIG and classic flags filled in)")
    p.add_argument("spec", metavar="SPEC")
    add_launch_flags(p)
    p.add_argument("--train_dir", default=None,
                   help="the run directory (cluster.yaml, logs/); default: a fresh runs/<spec>-<time>")
    p.epilog = ("after '--': the program and its arguments; {job_name} {task_index} {ps_hosts} {worker_hosts} "
                "are replaced per task, e.g. psworker run SPEC -- python train.py --job_name={job_name}")
    p.set_defaults(command=[])

    p = add("status", cmd_status, "show the status of a run from its run directory (started by any backend)")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's train_dir (holds cluster.yaml and logs/)")
    add_status_flags(p)

    _add_model_commands(add)
    from psworker import cli_backends, cli_k8s
    cli_backends.add_slurm_parsers(sub)
    cli_backends.add_ssh_parser(sub)
    cli_k8s.add_k8s_parsers(sub)
    return parser


Adder = Callable[[str, Callable[[argparse.Namespace], int], str], argparse.ArgumentParser]


def _adder(sub: Any) -> Adder:
    """`add(name, func, help)`: a subcommand parser that runs `func`."""
    def add(name: str, func: Callable[[argparse.Namespace], int], help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(func=func)
        return p
    return add


def _add_spec_commands(add: Adder) -> None:
    """`validate`, `plan` and `tf-config`: commands that read a spec and start nothing."""
    p = add("validate", cmd_validate, "check cluster spec files")
    p.add_argument("specs", nargs="+", metavar="SPEC")

    p = add("plan", cmd_plan, "show the tasks a spec starts and how to start them by hand")
    p.add_argument("spec", metavar="SPEC")
    add_model_flag(p, "also show how this model's variables are placed on the ps tasks, and the network load "
                      "they make")
    p.add_argument("--step_rate", type=positive_float, default=10.0, metavar="R",
                   help="with --model: steps/s of each worker for the network estimate (measured: the progress "
                        "line's 1/sec_per_batch; default 10)")
    p.add_argument("--bandwidth_gbps", type=positive_float, default=10.0, metavar="B",
                   help="with --model: each ps's link, Gbit/s each way (default 10)")
    p.add_argument("--hosts", metavar="H1,H2,...", help="a count spec: lay the tasks out on these hosts "
                                                       "(default: placeholders node0, node1, ...)")
    p.add_argument("--tasks_per_node", type=int_type(1), default=1, metavar="INT",
                   help="a count spec: tasks on each host (default 1)")

    p = add("tf-config", cmd_tf_config, "print one task's TF_CONFIG JSON")
    p.add_argument("spec", metavar="SPEC")
    p.add_argument("--job", required=True, choices=ALL_JOBS)
    p.add_argument("--task_index", required=True, type=int_type(0), metavar="INT")


def _add_model_commands(add: Adder) -> None:
    """`data`, `eval`, `export` and `tensorboard`: data sets and what a run leaves in its train_dir."""
    p = add("data", cmd_data, "download or write a data set")
    p.add_argument("name", choices=list(DATASETS), metavar="NAME", help=", ".join(DATASETS))
    p.add_argument("--data_dir", required=True)

    p = add("eval", cmd_eval, "evaluate checkpoints from a train_dir")
    p.add_argument("--train_dir", required=True)
    p.add_argument("--data_dir", default=None)
    add_model_flag(p, "registered model (default: the one in <train_dir>/cluster.yaml, else mlp)")
    p.add_argument("--once", action="store_true", help="evaluate the latest checkpoint once and exit")
    p.add_argument("--eval_interval_secs", type=positive_float, default=60.0, metavar="SECS",
                   help="without --once: how often to look for a new checkpoint (default 60)")
    p.add_argument("--batch_size", type=int_type(1), default=None, metavar="INT",
                   help="examples per eval batch (default: the evaluator's)")

    p = add("export", cmd_export, "export a checkpoint as a SavedModel into <train_dir>/export/<global_step>")
    p.add_argument("--train_dir", required=True)
    p.add_argument("--checkpoint", default=None, help="a checkpoint prefix (default: the latest in --train_dir)")
    add_model_flag(p, "registered model (default: the one in <train_dir>/cluster.yaml, else mlp)")
    p.add_argument("--export_dir", default=None, help="parent of the <global_step> directory "
                                                      "(default: <train_dir>/export)")

    p = add("tensorboard", cmd_tensorboard, "serve a run dir with TensorBoard on 127.0.0.1 until Ctrl-C")
    p.add_argument("--logdir", required=True)
    p.add_argument("--port", type=port_type(free_ok=True), default=6006,
                   help="the port on 127.0.0.1 (default 6006; 0: a free one)")


def _configure_logging(args: argparse.Namespace) -> None:
    """Task commands log with timestamps (their output is a log file); launchers talk to a person."""
    if args.func in (cmd_local, cmd_run) or getattr(args, "launcher", False):
        from psworker.launcher.console import PeopleFormatter
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(PeopleFormatter())
        logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, handlers=[handler])
    else:
        logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stderr)


def _print_error(exc: BaseException) -> None:
    """The one place that reports an error to a person: `psworker: error: MESSAGE` on stderr."""
    print(events.TaskError(str(exc)).render(), file=sys.stderr, flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    """Runs the `psworker` command line.

    A task process (`psworker ps|worker` run as a command) leaves through `task.main.exit_now` right here, after
    flushing: TensorFlow's threads can keep a normal interpreter exit waiting on a dead peer.

    Args:
        argv: arguments without the program name (default: `sys.argv[1:]`).

    Returns:
        The exit status: 0 on success, the error's `exit_code` (see `psworker.errors`), 130 on Ctrl-C.
    """
    parser = build_parser()
    given = sys.argv[1:] if argv is None else list(argv)
    command: list[str] = []
    if given[:1] == ["run"] and "--" in given:     # `psworker run SPEC [flags] -- COMMAND...`: COMMAND is not ours
        at = given.index("--")
        given, command = given[:at], given[at + 1:]
    try:
        args = parser.parse_args(given)
    except SystemExit as e:  # --help or a usage error already printed by argparse
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 2
    args.argv = sys.argv[1:] if argv is None else None   # None: called in-process, never re-exec
    task_process = getattr(args, "task_process", False)
    if args.func is cmd_run:
        args.command = command
    _configure_logging(args)
    try:
        code = int(args.func(args) or 0)
    except PsworkerError as e:
        _print_error(e)
        code = e.exit_code
    except KeyboardInterrupt:
        print("psworker: interrupted", file=sys.stderr, flush=True)
        code = 130
    except Exception:  # noqa: BLE001 - a bug: its traceback, then the same prompt exit for a task process
        if not task_process:
            raise
        log.exception("psworker %s failed", args.command)
        code = EXIT_FAILED
    if task_process and args.argv is not None:
        from psworker.task.main import exit_now

        exit_now(code)
    return code


__all__ = ["main", "build_parser", "DATASETS"]
