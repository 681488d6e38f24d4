"""The `psworker` command line: parses flags in `main()` and hands one config object to each layer.

Heavy modules (TensorFlow, the trainer, backends) are imported inside the commands that need them, so
`validate`, `plan` and `tf-config` stay fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from typing import Any, Callable, Optional

from psworker.errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE, PsworkerError, UsageError
from psworker.spec import (ALL_JOBS, JOBS, TRAIN_FIELDS, TRAIN_TYPES, ClusterSpec, CountSpec, TrainConfig, load_spec,
                           merge_train)

log = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# `psworker data NAME`: NAME -> function in psworker.data.cifar10_files taking (data_dir). One registry.
DATASETS = {"cifar10": "download_and_extract", "cifar10-synthetic": "write_synthetic"}


# --------------------------------------------------------------------------------------------- helpers

def _add_train_flags(p: argparse.ArgumentParser) -> None:
    """Adds one flag per TrainConfig field (default None: the spec's value stands)."""
    g = p.add_argument_group("training settings (override the spec's train section)")
    defaults = TrainConfig()
    for name in TRAIN_FIELDS:
        kind, _ = TRAIN_TYPES[name]
        g.add_argument(f"--{name}", default=None, metavar=kind.__name__.upper(),
                       help=f"built-in default: {getattr(defaults, name)}")


def _train_overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name) for name in TRAIN_FIELDS}


def _add_cluster_flags(p: argparse.ArgumentParser) -> None:
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


def _resolve(job: str, args: argparse.Namespace) -> tuple[ClusterSpec, int]:
    from psworker.interop import resolve_cluster
    return resolve_cluster(job, spec_path=args.spec_path, ps_hosts=args.ps_hosts,
                           worker_hosts=args.worker_hosts, job_name=args.job_name,
                           task_index=args.task_index, environ=os.environ)


def _train_config(spec: ClusterSpec, args: argparse.Namespace) -> TrainConfig:
    return merge_train(spec.train, _train_overrides(args), num_workers=len(spec.worker))


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
    from psworker.task import main
    return main.run_ps(spec, index, keep_running=args.keep_ps_running,
                       workers_gone_timeout_secs=args.workers_gone_timeout_secs,
                       allow_public_bind=args.allow_public_bind)


def cmd_worker(args: argparse.Namespace) -> int:
    """`psworker worker ...`: runs one training worker (worker 0 is the chief)."""
    spec, index = _resolve("worker", args)
    config = _train_config(spec, args)
    from psworker.task import main
    return main.run_worker(spec, index, config, allow_public_bind=args.allow_public_bind)


def _launch_config(args: argparse.Namespace, spec: ClusterSpec, command: tuple[str, ...] = ()):
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


def cmd_local(args: argparse.Namespace) -> int:
    """`psworker local SPEC ...`: starts the whole cluster on this machine and supervises it."""
    spec = load_spec(args.spec)
    # No train_dir given: the backend makes a fresh runs/<spec>-<time> so that a rerun never resumes by surprise.
    spec = dataclasses.replace(spec, train=merge_train(spec.train, _train_overrides(args),
                                                       num_workers=len(spec.worker)))
    config = _launch_config(args, spec)
    _isolate_network(args.network, args.argv)
    from psworker.launcher.launch import launch
    return launch(config)


def cmd_run(args: argparse.Namespace) -> int:
    """`psworker run SPEC [flags] -- COMMAND...`: runs COMMAND once per task of the spec and supervises them."""
    command = list(args.command)
    if not command:
        raise UsageError("psworker run needs a command after '--', e.g. psworker run SPEC -- python train.py")
    spec = load_spec(args.spec)
    if args.train_dir is not None:
        spec = dataclasses.replace(spec, train=merge_train(spec.train, {"train_dir": args.train_dir}))
    config = _launch_config(args, spec, tuple(command))
    _isolate_network(args.network, args.argv)
    from psworker.launcher.launch import launch
    return launch(config)


def cmd_status(args: argparse.Namespace) -> int:
    """`psworker status RUN_DIR [--json]`: the status of a run, read from its cluster.yaml and task logs."""
    import datetime
    import time

    from psworker.launcher.status import read_run_dir, render

    if args.silent_secs <= 0:
        raise UsageError(f"--silent_secs must be > 0, got {args.silent_secs:g}")
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


def cmd_data(args: argparse.Namespace) -> int:
    """`psworker data NAME --data_dir D`: downloads or writes a data set."""
    from psworker.data import cifar10_files
    getattr(cifar10_files, DATASETS[args.name])(args.data_dir)
    log.info("%s ready in %s", args.name, args.data_dir)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """`psworker eval --train_dir D ...`: evaluates the latest (or every new) checkpoint."""
    if args.eval_interval_secs <= 0:
        raise UsageError(f"--eval_interval_secs must be > 0, got {args.eval_interval_secs:g}")
    checked = merge_train(TrainConfig(), {"model": args.model, "batch_size": args.batch_size,
                                          "train_dir": args.train_dir, "data_dir": args.data_dir})
    from psworker.train.evaluate import run_eval
    # --model not given: run_eval takes it from the cluster.yaml a local run leaves in the train dir.
    return run_eval(train_dir=checked.train_dir, data_dir=args.data_dir, model_name=args.model and checked.model,
                    once=args.once, eval_interval_secs=args.eval_interval_secs,
                    batch_size=None if args.batch_size is None else checked.batch_size)


def cmd_slurm_submit(args: argparse.Namespace) -> int:
    """`psworker slurm submit SPEC ...`: writes <run_dir>/psworker.sbatch and submits it with sbatch."""
    import shlex
    import shutil
    from pathlib import Path

    from psworker.schedulers import slurm

    from psworker.plan import task_counts

    spec = load_spec(args.spec, allow_counts=True)
    counts = task_counts(spec)
    overrides = _train_overrides(args)
    merge_train(spec.train, overrides, num_workers=counts["worker"])   # bad flags fail here, not in the queue
    if args.port_base is not None and not 1 <= args.port_base <= 65535:
        raise UsageError(f"--port_base must be within 1-65535, got {args.port_base}")
    port_base = slurm.count_spec(spec, args.port_base).port
    launch_ready = "launch" in args.slurm_commands
    if not (args.dry_run or launch_ready):
        raise UsageError("`psworker slurm launch`, which the job runs, is not implemented yet (issue #8): use "
                         "--dry_run to write the batch script without submitting it")
    if args.run_dir:
        run_dir = Path(args.run_dir).resolve()
        run_dir.mkdir(parents=True, exist_ok=True)
    else:
        from psworker.launcher.local import default_train_dir
        run_dir = default_train_dir(spec).resolve()
    spec_copy = run_dir / slurm.SUBMITTED_SPEC        # the job reads this copy: later edits do not change it
    shutil.copyfile(args.spec, spec_copy)
    for name in ("train_dir", "data_dir"):      # the job runs in run_dir: relative paths would move
        if overrides[name] is not None:
            overrides[name] = os.path.abspath(overrides[name])
    if spec.train.train_dir is None and overrides["train_dir"] is None:
        overrides["train_dir"] = str(run_dir)
    flags = [part for name, value in overrides.items() if value is not None for part in (f"--{name}", str(value))]
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
    print(job_id)
    log.info("submitted %s as Slurm job %s; output in %s", script, job_id, run_dir)
    return 0



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


# ------------------------------------------------------------------------------------------ k8s commands

def cmd_k8s_manifest(args: argparse.Namespace) -> int:
    """`psworker k8s manifest SPEC --image IMAGE ...`: writes the run's Kubernetes objects as YAML."""
    from psworker.k8s import manifests as k8s
    from psworker.plan import task_counts
    spec = load_spec(args.spec, allow_counts=True)
    train = merge_train(spec.train, _train_overrides(args), num_workers=task_counts(spec)["worker"])
    options = k8s.K8sOptions(
        name=args.name or k8s.run_name(args.spec), image=args.image, namespace=args.namespace, flavor=args.flavor,
        port=args.port, cpu=args.cpu, memory=args.memory, train_dir_volume=args.train_dir_volume,
        retries=args.retries, cluster_domain=args.cluster_domain)
    text = k8s.to_yaml(k8s.manifests(dataclasses.replace(spec, train=train), options))
    if args.output in (None, "-"):
        sys.stdout.write(text)
    else:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
        log.info("wrote %s (%s flavor, run %s)", args.output, options.flavor, options.name)
    return 0


def cmd_k8s_apply(args: argparse.Namespace) -> int:
    """`psworker k8s apply FILE`: creates or updates the objects of a manifest file."""
    import yaml

    from psworker.k8s import live
    try:
        with open(args.file, encoding="utf-8") as f:
            objects = [o for o in yaml.safe_load_all(f) if o]
    except (OSError, yaml.YAMLError) as e:
        raise UsageError(f"{args.file}: cannot read the manifest: {e}") from None
    for applied in live.apply(live.connect(args.context), objects):
        print(f"applied {applied}")
    return 0


def cmd_k8s_status(args: argparse.Namespace) -> int:
    """`psworker k8s status NAME`: one line per task pod."""
    from psworker.k8s import live
    print(live.format_status(live.status(live.connect(args.context), args.name, args.namespace)))
    return 0


def cmd_k8s_logs(args: argparse.Namespace) -> int:
    """`psworker k8s logs NAME [--job J] [--task_index I]`: each pod's log, prefixed `[worker:1] `."""
    from psworker.k8s import live
    for task, text in live.logs(live.connect(args.context), args.name, args.namespace, args.job, args.task_index,
                                args.tail):
        for line in text.splitlines():
            print(f"[{task}] {line}")
    return 0


def cmd_k8s_delete(args: argparse.Namespace) -> int:
    """`psworker k8s delete NAME`: deletes every object labelled with the run."""
    from psworker.k8s import live
    for gone in live.delete(live.connect(args.context), args.name, args.namespace):
        print(f"deleted {gone}")
    return 0


def _add_k8s_parsers(sub: Any) -> None:
    """The `psworker k8s ...` command group."""
    from psworker.k8s.manifests import FLAVORS
    group = sub.add_parser("k8s", help="run on Kubernetes: write manifests, apply, status, logs, delete",
                           description="run on Kubernetes: write manifests, apply, status, logs, delete")
    k8s_sub = group.add_subparsers(dest="k8s_command", required=True, metavar="K8S_COMMAND")

    p = k8s_sub.add_parser("manifest", help="write a spec's Kubernetes objects as YAML")
    p.set_defaults(func=cmd_k8s_manifest)
    p.add_argument("spec", metavar="SPEC")
    p.add_argument("--image", required=True, help="a container image with psworker installed (see Dockerfile)")
    p.add_argument("--name", help="the run's name (default: from the spec file name)")
    p.add_argument("--namespace", default="default")
    p.add_argument("--flavor", choices=list(FLAVORS), default="plain",
                   help="tfjob: Kubeflow TFJob; plain: Service + Indexed Jobs (default); jobset: JobSet")
    p.add_argument("--port", type=int, help="every task's gRPC port (default: the spec's port, else 2222)")
    p.add_argument("--cpu", help="CPU request per task, e.g. 2")
    p.add_argument("--memory", help="memory request and limit per task, e.g. 4Gi")
    p.add_argument("--train_dir_volume", metavar="CLAIM",
                   help="PersistentVolumeClaim mounted at --train_dir on workers (default: an emptyDir, lost "
                        "with the pod)")
    p.add_argument("--retries", type=int, default=3,
                   help="restarts of a task after a retryable exit (128-255) before the run fails (default 3)")
    p.add_argument("--cluster_domain", default="cluster.local",
                   help="the cluster's DNS domain, in the pods' names (plain, jobset; default cluster.local)")
    p.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    _add_train_flags(p)

    p = k8s_sub.add_parser("apply", help="create or update a manifest file's objects")
    p.set_defaults(func=cmd_k8s_apply)
    p.add_argument("file", metavar="FILE")
    for name, func, help_ in (("status", cmd_k8s_status, "show each task pod of a run"),
                              ("logs", cmd_k8s_logs, "print a run's task logs"),
                              ("delete", cmd_k8s_delete, "delete every object of a run")):
        p = k8s_sub.add_parser(name, help=help_)
        p.set_defaults(func=func)
        p.add_argument("name", metavar="NAME", help="the run's name")
        p.add_argument("--namespace", default="default")
        if name == "logs":
            p.add_argument("--job", choices=JOBS)
            p.add_argument("--task_index", type=int)
            p.add_argument("--tail", type=int, metavar="LINES")
    for p in k8s_sub.choices.values():
        p.add_argument("--context", help="kubeconfig context (default: the current one)")


# ---------------------------------------------------------------------------------------------- parser

def _add_launch_flags(p: argparse.ArgumentParser) -> None:
    """Flags shared by `local` and `run`: supervision, restarts, fault injection, console."""
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
    p.add_argument("--network", choices=("auto", "isolated", "host"), default="auto",
                   help="isolated: run the cluster in a private network namespace where only loopback exists "
                        "(TensorFlow's servers listen on every interface otherwise); auto (default): isolated "
                        "when this machine allows it; host: no isolation")
    p.add_argument("--verbose", action="store_true",
                   help="show every line the tasks print (default: psworker's own lines, steps, warnings and "
                        "errors; the full output is always in <train_dir>/logs/)")
    p.add_argument("--no_live", action="store_true",
                   help="plain periodic status lines even on a terminal (no live view)")


def build_parser() -> argparse.ArgumentParser:
    """Builds the argument parser (no side effects; called by `main`)."""
    parser = argparse.ArgumentParser(prog="psworker", description="Parameter-server clusters for TensorFlow: validate specs, start ps and worker tasks, train, evaluate.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, func: Callable[[argparse.Namespace], int], help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(func=func)
        return p

    p = add("validate", cmd_validate, "check cluster spec files")
    p.add_argument("specs", nargs="+", metavar="SPEC")

    p = add("plan", cmd_plan, "show the tasks a spec starts and how to start them by hand")
    p.add_argument("spec", metavar="SPEC")
    p.add_argument("--model", help="also show how this model's variables are placed on the ps tasks, and the "
                                   "network load they make")
    p.add_argument("--step_rate", type=float, default=10.0, metavar="R",
                   help="with --model: steps/s of each worker for the network estimate (measured: the progress "
                        "line's 1/sec_per_batch; default 10)")
    p.add_argument("--bandwidth_gbps", type=float, default=10.0, metavar="B",
                   help="with --model: each ps's link, Gbit/s each way (default 10)")
    p.add_argument("--hosts", metavar="H1,H2,...", help="a count spec: lay the tasks out on these hosts "
                                                       "(default: placeholders node0, node1, ...)")
    p.add_argument("--tasks_per_node", type=int, default=1, metavar="INT",
                   help="a count spec: tasks on each host (default 1)")

    p = add("tf-config", cmd_tf_config, "print one task's TF_CONFIG JSON")
    p.add_argument("spec", metavar="SPEC")
    p.add_argument("--job", required=True, choices=ALL_JOBS)
    p.add_argument("--task_index", required=True, type=int)

    p = add("ps", cmd_ps, "run one parameter server task")
    p.set_defaults(task_process=True)
    _add_cluster_flags(p)
    p.add_argument("--keep_ps_running", action="store_true",
                   help="keep serving after the workers finish (default: exit once every worker is done)")
    p.add_argument("--workers_gone_timeout_secs", type=float, default=300.0, metavar="FLOAT",
                   help="when every worker has been seen and then all have gone away without saying they are done "
                        "(crashed), exit with an error after this long instead of serving forever (default 300)")

    p = add("worker", cmd_worker, "run one worker task (worker 0 is the chief)")
    p.set_defaults(task_process=True)
    _add_cluster_flags(p)
    _add_train_flags(p)

    p = add("local", cmd_local, "run a whole spec's cluster on this machine")
    p.add_argument("spec", metavar="SPEC")
    _add_launch_flags(p)
    _add_train_flags(p)

    p = add("run", cmd_run, "run your own distributed-TensorFlow script once per task of a spec "
                            "(TF_CONFIG and classic flags filled in)")
    p.add_argument("spec", metavar="SPEC")
    _add_launch_flags(p)
    p.add_argument("--train_dir", default=None,
                   help="the run directory (cluster.yaml, logs/); default: a fresh runs/<spec>-<time>")
    p.epilog = ("after '--': the program and its arguments; {job_name} {task_index} {ps_hosts} {worker_hosts} "
                "are replaced per task, e.g. psworker run SPEC -- python train.py --job_name={job_name}")
    p.set_defaults(command=[])

    p = add("status", cmd_status, "show the status of a run from its run directory (started by any backend)")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's train_dir (holds cluster.yaml and logs/)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--silent_secs", type=float, default=60.0,
                   help="call a running task silent when its log has not grown for this long (default 60)")

    p = add("data", cmd_data, "download or write a data set")
    p.add_argument("name", choices=list(DATASETS), metavar="NAME", help=", ".join(DATASETS))
    p.add_argument("--data_dir", required=True)

    p = add("eval", cmd_eval, "evaluate checkpoints from a train_dir")
    p.add_argument("--train_dir", required=True)
    p.add_argument("--data_dir", default=None)
    p.add_argument("--model", default=None,
                   help="registered model (default: the one in <train_dir>/cluster.yaml, else mlp)")
    p.add_argument("--once", action="store_true", help="evaluate the latest checkpoint once and exit")
    p.add_argument("--eval_interval_secs", type=float, default=60.0)
    p.add_argument("--batch_size", default=None, metavar="INT", help="default: the evaluator's")
    slurm_parser = add("slurm", None, "run a spec's cluster as a Slurm job")
    slurm_sub = slurm_parser.add_subparsers(dest="slurm_command", required=True, metavar="SLURM_COMMAND")
    p = slurm_sub.add_parser("submit", help="write a batch script for a spec into the run dir and submit it",
                             description="Writes <run_dir>/psworker.sbatch (#SBATCH lines, then the "
                                         "`psworker slurm launch` line it runs) and submits it with sbatch; "
                                         "prints the job id.")
    p.set_defaults(func=cmd_slurm_submit)
    p.add_argument("spec", metavar="SPEC", help="cluster spec: task counts (`ps: 1`), or addresses whose hosts are "
                                                "replaced by the allocation's nodes")
    g = p.add_argument_group("Slurm job (#SBATCH lines; --ntasks is the spec's task count)")
    g.add_argument("--nodes", help="node count or range, e.g. 2 or 2-4 (default: Slurm's)")
    g.add_argument("--time", help="time limit, e.g. 1:00:00 (default: the partition's)")
    g.add_argument("--partition")
    g.add_argument("--account")
    g.add_argument("--output", help="Slurm's output file (default: <run_dir>/slurm-%%j.out)")
    g.add_argument("--job_name", default="psworker")
    g.add_argument("--overcommit", action="store_true",
                   help="allow more tasks than allocated CPUs (one CPU per task otherwise)")
    p.add_argument("--run_dir", help="shared directory for the script, the spec copy, logs and (by default) "
                                     "train_dir (default: a fresh runs/<spec>-<date>-<time>)")
    p.add_argument("--port_base", type=int, default=None,
                   help="first port of the tasks on each node, +1 per further task there, as TensorFlow's "
                        "SlurmClusterResolver (default: the spec's cluster.port, else 2222)")
    p.add_argument("--python", default=sys.executable, help="interpreter the job runs (default: this one)")
    p.add_argument("--dry_run", action="store_true", help="write the script, do not submit it")
    _add_train_flags(p)
    slurm_parser.set_defaults(slurm_commands=tuple(slurm_sub.choices))

    p = add("export", cmd_export, "export a checkpoint as a SavedModel into <train_dir>/export/<global_step>")
    p.add_argument("--train_dir", required=True)
    p.add_argument("--checkpoint", default=None, help="a checkpoint prefix (default: the latest in --train_dir)")
    p.add_argument("--model", default=None,
                   help="registered model (default: the one in <train_dir>/cluster.yaml, else mlp)")
    p.add_argument("--export_dir", default=None, help="parent of the <global_step> directory "
                                                      "(default: <train_dir>/export)")

    p = add("tensorboard", cmd_tensorboard, "serve a run dir with TensorBoard on 127.0.0.1 until Ctrl-C")
    p.add_argument("--logdir", required=True)
    p.add_argument("--port", type=int, default=6006, help="default 6006; 0 picks a free port")

    _add_k8s_parsers(sub)
    return parser


def _configure_logging(args: argparse.Namespace) -> None:
    """Task commands log with timestamps (their output is a log file); launchers talk to a person."""
    if args.func in (cmd_local, cmd_run):
        from psworker.launcher.console import PeopleFormatter
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(PeopleFormatter())
        logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, handlers=[handler])
    else:
        logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stderr)


def _print_error(exc: BaseException) -> None:
    """The one place that reports an error to a person: `psworker: error: MESSAGE` on stderr."""
    print(f"psworker: error: {exc}", file=sys.stderr, flush=True)


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
