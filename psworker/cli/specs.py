"""`psworker validate`, `plan` and `tf-config`: commands that read a spec and start nothing."""

from __future__ import annotations

import argparse
import json
import sys

from psworker import events
from psworker.spec.fast_path import fast_path
from psworker.cli.flags import add_memory_limit_flag, add_model_flag, int_type, positive_float
from psworker.errors import EXIT_OK, EXIT_USAGE, PsworkerError, UsageError
from psworker.spec import ALL_JOBS, CountSpec, load_spec, merge_train

__all__ = ["cmd_plan", "cmd_tf_config", "cmd_validate", "plan_flags", "tf_config_flags", "validate_flags"]


def cmd_validate(args: argparse.Namespace) -> int:
    """`psworker validate SPEC...`: checks each file, prints OK lines, errors on stderr."""
    from psworker.spec.plan import task_counts

    failed = 0
    for path in args.specs:
        try:
            spec = load_spec(path, allow_counts=True)
        except PsworkerError as e:
            print(events.TaskError(str(e)).render(), file=sys.stderr, flush=True)
            failed += 1
            continue
        n = task_counts(spec)
        extra = "".join(f"{n[j]} {j}, " for j in ("chief", "evaluator") if n.get(j))
        elastic = f"; elastic: {spec.elastic.describe()}" if spec.elastic else ""
        print(f"OK {path} ({extra}{n['ps']} ps, {n['worker']} workers{elastic})")
    return EXIT_USAGE if failed else EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    """`psworker plan SPEC [--model NAME] [--hosts H,..]`: prints the task table (and the model's placement)."""
    from psworker.spec import plan as planning
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
    from psworker.train.devices import budget_line
    print(budget_line(spec))
    if args.model is not None or args.ps_memory_limit is not None:
        model = merge_train(spec.train, {"model": args.model}).model if args.model else spec.train.model
        from psworker.train import plan_report
        report = plan_report.placement_report(model, len(spec.ps), pack_transfers=fast_path(spec.train).pack)
        print()
        print(plan_report.describe(model, len(spec.ps), workers=len(spec.worker), step_rate=args.step_rate,
                                   bandwidth_gbps=args.bandwidth_gbps, report=report))
        sparse = plan_report.sparse_traffic_line(report, spec.train.batch_size, data_dir=args.data_dir,
                                                 rows_per_step=args.rows_per_step)
        if sparse:
            print(sparse)
        elif args.data_dir or args.rows_per_step:
            print(f"psworker: note: model {model} has no sparse table; --data_dir and --rows_per_step count the "
                  "rows of one", file=sys.stderr)
        if args.ps_memory_limit is not None:
            return _memory_fit(model, report, args.ps_memory_limit)
    return 0


def _memory_fit(model: str, report, limit: int) -> int:
    """`plan --ps_memory_limit`: each ps's need against the cap; exit 2 when one is over (naming the ps needed)."""
    from psworker.train import memory_plan

    fit = memory_plan.check(model, report.num_ps, limit, placed=memory_plan.placed_bytes(report))
    print()
    print("\n".join(memory_plan.describe(fit)))
    return EXIT_OK if fit.fits else EXIT_USAGE


def cmd_tf_config(args: argparse.Namespace) -> int:
    """`psworker tf-config SPEC --job J --task_index I`: prints that task's TF_CONFIG JSON."""
    from psworker.spec.interop import to_tf_config
    spec = load_spec(args.spec)
    print(json.dumps(to_tf_config(spec, args.job, args.task_index)))
    if spec.elastic is not None:
        print(f"psworker: the worker job is elastic ({spec.elastic.describe()}): the cluster lists all "
              f"{spec.elastic.max} reserved worker addresses", file=sys.stderr)
    return 0


def validate_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("specs", nargs="+", metavar="SPEC")


def plan_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", metavar="SPEC")
    add_model_flag(p, "also show how this model's variables are placed on the ps tasks, and the network load "
                      "they make")
    p.add_argument("--step_rate", type=positive_float, default=10.0, metavar="R",
                   help="with --model: steps/s of each worker for the network estimate (measured: the progress "
                        "line's 1/sec_per_batch; default 10)")
    p.add_argument("--bandwidth_gbps", type=positive_float, default=10.0, metavar="B",
                   help="with --model: each ps's link, Gbit/s each way (default 10)")
    p.add_argument("--data_dir", metavar="DIR",
                   help="with a sparse-table model: measure the distinct rows a step touches on these training "
                        "files (default: the most a batch can touch)")
    p.add_argument("--rows_per_step", type=int_type(1), metavar="N",
                   help="with a sparse-table model: assume a step touches N distinct rows")
    add_memory_limit_flag(p, "with the model (--model, else the spec's): whether each ps's variables and optimizer "
                             "slots, plus a bare ps's baseline, fit under SIZE (e.g. 1.5GB, 800MiB); if not, exit 2 "
                             "and the ps count the model needs")
    p.add_argument("--hosts", metavar="H1,H2,...", help="a count spec: lay the tasks out on these hosts "
                                                       "(default: placeholders node0, node1, ...)")
    p.add_argument("--tasks_per_node", type=int_type(1), default=1, metavar="INT",
                   help="a count spec: tasks on each host (default 1)")


def tf_config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", metavar="SPEC")
    p.add_argument("--job", required=True, choices=ALL_JOBS)
    p.add_argument("--task_index", required=True, type=int_type(0), metavar="INT")
