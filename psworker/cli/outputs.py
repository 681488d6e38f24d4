"""`psworker data`, `eval`, `export` and `tensorboard`: data sets, and what a run leaves in its train_dir."""

from __future__ import annotations

import argparse
import sys

from psworker.cli.flags import add_model_flag, int_type, port_type, positive_float
from psworker.spec import TrainConfig, merge_train
from psworker.tf_import import import_tensorflow

__all__ = ["DATASETS", "cmd_data", "cmd_eval", "cmd_export", "cmd_tensorboard", "data_flags", "eval_flags",
           "export_flags", "tensorboard_flags"]

# `psworker data NAME`: NAME -> "module:function" taking (data_dir, **options). One registry.
DATASETS = {"cifar10": "psworker.data.cifar10_files:download_and_extract",
            "cifar10-synthetic": "psworker.data.cifar10_files:write_synthetic",
            "criteo-synthetic": "psworker.data.criteo_synthetic:write_synthetic"}
# The flags only criteo-synthetic takes: flag -> its keyword.
_CRITEO_OPTIONS = {"days": "days", "rows_per_day": "rows_per_day", "max_cardinality": "max_cardinality",
                   "gzip": "compress", "seed": "seed"}


def cmd_data(args: argparse.Namespace) -> int:
    """`psworker data NAME --data_dir D [criteo-synthetic's options]`: downloads or writes a data set."""
    import importlib

    from psworker.errors import UsageError
    given = {flag: getattr(args, flag) for flag in _CRITEO_OPTIONS}
    options = {_CRITEO_OPTIONS[flag]: v for flag, v in given.items() if v is not None and v is not False}
    if options and args.name != "criteo-synthetic":
        raise UsageError(f"--{', --'.join(k for k, v in _CRITEO_OPTIONS.items() if v in options)}: only "
                         f"criteo-synthetic takes these options")
    module, _, function = DATASETS[args.name].partition(":")
    getattr(importlib.import_module(module), function)(args.data_dir, **options)
    print(f"psworker: {args.name} ready in {args.data_dir}", flush=True)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """`psworker eval --train_dir D ...`: evaluates the latest (or every new) checkpoint."""
    checked = merge_train(TrainConfig(), {"model": args.model, "batch_size": args.batch_size,
                                          "train_dir": args.train_dir, "data_dir": args.data_dir})
    import_tensorflow()
    from psworker.train.evaluate import run_eval
    # --model not given: run_eval takes it from the cluster.yaml a local run leaves in the train dir.
    return run_eval(train_dir=checked.train_dir, data_dir=args.data_dir, model_name=args.model and checked.model,
                    once=args.once, eval_interval_secs=args.eval_interval_secs,
                    batch_size=None if args.batch_size is None else checked.batch_size)


def cmd_export(args: argparse.Namespace) -> int:
    """`psworker export --train_dir D [--checkpoint C] [--model M]`: writes a SavedModel; prints its path."""
    checked = merge_train(TrainConfig(), {"model": args.model, "train_dir": args.train_dir})
    import_tensorflow()
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


def data_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", choices=list(DATASETS), metavar="NAME", help=", ".join(DATASETS))
    p.add_argument("--data_dir", required=True)
    criteo = p.add_argument_group("criteo-synthetic")
    criteo.add_argument("--days", type=int_type(2), default=None, metavar="N",
                        help="day_N files to write; the last is the held-out split (default 3)")
    criteo.add_argument("--rows_per_day", type=int_type(1), default=None, metavar="N",
                        help="lines per day file (default 4000)")
    criteo.add_argument("--max_cardinality", type=int_type(1), default=None, metavar="N",
                        help="distinct values per categorical column at most (Criteo's own counts below it; "
                             "default 10000; 10000000 for Criteo's full sizes)")
    criteo.add_argument("--gzip", action="store_true", help="write day_N.gz")
    criteo.add_argument("--seed", type=int_type(0), default=None, metavar="N", help="random seed (default 0)")


def eval_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--train_dir", required=True)
    p.add_argument("--data_dir", default=None)
    add_model_flag(p, "registered model (default: the one in <train_dir>/cluster.yaml, else mlp)")
    p.add_argument("--once", action="store_true", help="evaluate the latest checkpoint once and exit")
    p.add_argument("--eval_interval_secs", type=positive_float, default=60.0, metavar="SECS",
                   help="without --once: how often to look for a new checkpoint (default 60)")
    p.add_argument("--batch_size", type=int_type(1), default=None, metavar="INT",
                   help="examples per eval batch (default: the evaluator's)")


def export_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--train_dir", required=True)
    p.add_argument("--checkpoint", default=None, help="a checkpoint prefix (default: the latest in --train_dir)")
    add_model_flag(p, "registered model (default: the one in <train_dir>/cluster.yaml, else mlp)")
    p.add_argument("--export_dir", default=None, help="parent of the <global_step> directory "
                                                      "(default: <train_dir>/export)")


def tensorboard_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--logdir", required=True)
    p.add_argument("--port", type=port_type(free_ok=True), default=6006,
                   help="the port on 127.0.0.1 (default 6006; 0: a free one)")
