"""Interleaved A/B of psworker clusters: checkouts, sync against async, thread-pool settings, side by side in one run.

Each variant is `NAME=CHECKOUT[:key=value...]`:
  - CHECKOUT: a psworker source tree (e.g. a `git worktree` of the commit before a change; `.` for this one);
  - `mode=sync|async` (default async);
  - `threads=PS_INTRA/PS_INTER/WORKER_INTRA/WORKER_INTER` (0 = TensorFlow's default): set in every task's server
    `ConfigProto` by a benchmark-only `sitecustomize.py` (written to a temporary folder, as peers.py does);
  - `grpc=NAME=VALUE,...`: gRPC channel arguments for every task, through TensorFlow's `TF_GRPC_DEFAULT_OPTIONS`.

    python benchmarks/compare.py before=/work/wt-before after=. --shapes 1,2 --repeat 2
    python benchmarks/compare.py async=. sync=.:mode=sync --shapes 2 --repeat 2
    python benchmarks/compare.py default=. ps1=.:threads=1/1/0/0 --shapes 1,2
    python benchmarks/compare.py default=. tput=.:grpc=grpc.optimization_target=throughput
    python benchmarks/compare.py before=/work/wt-before after=. --model criteo --criteo_dir /tmp/criteo \
        --shapes 1 --batch_size 256 --steps 120 --repeat 5

Rates are examples/s after the warm-up, from the workers' summaries (peers.py's `steady_rate`); a sync global step
counts every aggregated worker's batch. Runs are interleaved (each repeat runs every variant once) and the median of
--repeat is printed per shape and variant, with its samples, then a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import peers

SITECUSTOMIZE = '''\
"""Benchmark-only thread pools (written by benchmarks/compare.py)."""
import os

_spec = os.environ.get("PSWORKER_BENCH_THREADS")
if _spec:
    ps_intra, ps_inter, w_intra, w_inter = (int(x) for x in _spec.split("/"))
    from psworker.train import devices

    _worker, _ps = devices.server_config, devices.ps_server_config

    def server_config(*args, **kwargs):
        config = _worker(*args, **kwargs)
        config.intra_op_parallelism_threads, config.inter_op_parallelism_threads = w_intra, w_inter
        return config

    def ps_server_config(*args, **kwargs):
        config = _ps(*args, **kwargs)
        config.intra_op_parallelism_threads, config.inter_op_parallelism_threads = ps_intra, ps_inter
        return config

    devices.server_config, devices.ps_server_config = server_config, ps_server_config
'''

QUICK = {"model": "mlp", "shapes": "1", "steps": 10, "mlp_factor": 3, "intervals": 3, "repeat": 1}
REPO = Path(__file__).resolve().parent.parent


def parse_variant(text: str) -> dict:
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise ValueError(f"{text!r}: expected NAME=CHECKOUT[:key=value...]")
    checkout, *options = rest.split(":")
    variant = {"name": name, "checkout": str(Path(checkout).resolve()), "mode": "async", "threads": "", "grpc": ""}
    for option in options:
        key, _, value = option.partition("=")
        if key == "mode" and value in ("async", "sync"):
            variant["mode"] = value
        elif key == "threads" and len(value.split("/")) == 4 and all(v.isdigit() for v in value.split("/")):
            variant["threads"] = value
        elif key == "grpc" and value and all("=" in arg for arg in value.split(",")):
            variant["grpc"] = value
        else:
            raise ValueError(f"{text!r}: unknown option {option!r} (mode=async|sync, threads=A/B/C/D, "
                             "grpc=NAME=VALUE,...)")
    if not (Path(variant["checkout"]) / "psworker" / "__init__.py").is_file():
        raise ValueError(f"{text!r}: {variant['checkout']} holds no psworker package")
    return variant


def run_variant(variant: dict, model: str, workers: int, args, workdir: Path, site_dir: Path, tag: str) -> dict:
    """One `psworker local` run of `variant` (from its own checkout), via peers.py's runner: its `examples_per_sec`,
    and its held-out `auc` where the model prints one (criteo)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PSWORKER_BENCH_THREADS=variant["threads"])
    if variant["grpc"]:
        env["TF_GRPC_DEFAULT_OPTIONS"] = variant["grpc"]
    env["PYTHONPATH"] = os.pathsep.join([variant["checkout"], str(site_dir)]
                                        + [p for p in [os.environ.get("PYTHONPATH")] if p])
    out = peers.psworker_run(model, workers, ema="shipped", args=args, workdir=workdir, site_dir=site_dir, tag=tag,
                             mode=variant["mode"], env=env, num_ps=args.ps)
    rate = out["examples_per_sec"] * (workers if variant["mode"] == "sync" else 1)
    return {"examples_per_sec": rate, **({"auc": out["auc"]} if "auc" in out else {})}


def _report(args, shapes: list, variants: list, samples: dict, aucs: dict) -> None:
    """The table of medians (x the first variant of each shape), with the AUCs where runs printed one, then JSON."""
    medians = {k: statistics.median(xs) for k, xs in samples.items()}
    print(f"\n{args.model}, {args.ps} ps, batch {args.batch_size} per worker, {os.cpu_count()} CPUs, median of "
          f"{args.repeat}; examples/s (x the first variant of the same shape)")
    for workers in shapes:
        base = medians[f"{workers}w {variants[0]['name']}"]
        for v in variants:
            key = f"{workers}w {v['name']}"
            print(f"  {key:<28}{medians[key]:>10.0f}  ({medians[key] / base:.2f}x)  samples "
                  + ", ".join(f"{x:.0f}" for x in samples[key])
                  + (f"; AUC median {statistics.median(aucs[key]):.4f}: " + ", ".join(f"{a:.4f}" for a in aucs[key])
                     if key in aucs else ""))
    print(json.dumps({"model": args.model, "steps": args.steps, "repeat": args.repeat, "variants": variants,
                      "samples": samples, "median": medians, "auc": aucs}, sort_keys=True))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("variants", nargs="*", help="NAME=CHECKOUT[:mode=sync][:threads=A/B/C/D][:grpc=NAME=VALUE,...]")
    p.add_argument("--model", default="cnn", choices=["cnn", "mlp", "criteo"])
    p.add_argument("--shapes", default="1,2", help="workers per cluster (--ps each), comma-separated")
    p.add_argument("--ps", type=int, default=1, help="ps tasks per cluster")
    p.add_argument("--steps", type=int, default=200, help="CNN global steps per run (MLP: x --mlp_factor; criteo: x "
                                                          "--criteo_factor)")
    p.add_argument("--mlp_factor", type=int, default=10)
    p.add_argument("--criteo_factor", type=int, default=5)
    p.add_argument("--criteo_dir", help="criteo: Criteo-format day files (`psworker data criteo-synthetic`)")
    p.add_argument("--intervals", type=int, default=5, help="summaries per worker and run")
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--learning_rate", type=float, default=0.1)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--data_dir", help="CIFAR-10 records (default: synthetic, in a temporary folder)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    p.add_argument("--quick", action="store_true", help=f"seconds, for tests/test_benchmarks.py: {QUICK}; variants "
                                                        "default to this checkout, async and sync")
    args = p.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
        args.variants = args.variants or [f"async={REPO}", f"sync={REPO}:mode=sync"]
    if not args.variants:
        p.error("give at least one variant, NAME=CHECKOUT[:key=value...]")
    try:
        variants = [parse_variant(v) for v in args.variants]
    except ValueError as exc:
        p.error(str(exc))
    if args.model == "criteo" and not args.criteo_dir:
        p.error("--model criteo needs --criteo_dir (psworker data criteo-synthetic --data_dir DIR)")
    shapes = [int(s) for s in args.shapes.split(",") if s]
    if not shapes or min(shapes) < 1 or args.ps < 1:
        p.error("--shapes takes worker counts of 1 or more (in-process runs: benchmarks/peers.py), --ps 1 or more")
    samples: dict = {}
    aucs: dict = {}
    with tempfile.TemporaryDirectory(prefix="psworker-compare-") as tmp:
        workdir = Path(tmp)
        site_dir = workdir / "site"
        site_dir.mkdir()
        (site_dir / "sitecustomize.py").write_text(SITECUSTOMIZE)
        if args.data_dir is None and args.model == "cnn":
            args.data_dir = str(workdir / "data")
            peers._run([sys.executable, "-m", "psworker", "data", "cifar10-synthetic", "--data_dir", args.data_dir],
                       dict(os.environ, PYTHONPATH=variants[0]["checkout"]), 300, "writing synthetic CIFAR-10")
        n = 0
        for _ in range(args.repeat):
            for workers in shapes:
                for v in variants:
                    n += 1
                    out = run_variant(v, args.model, workers, args, workdir, site_dir, f"run{n}")
                    rate = out["examples_per_sec"]
                    samples.setdefault(f"{workers}w {v['name']}", []).append(rate)
                    if "auc" in out:
                        aucs.setdefault(f"{workers}w {v['name']}", []).append(out["auc"])
                    print(f"[{time.strftime('%H:%M:%S')}] {args.model} {workers}w {v['name']}: {rate:.0f} examples/s"
                          + (f", AUC {out['auc']:.4f}" if "auc" in out else ""), flush=True)
    _report(args, shapes, variants, samples, aucs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
