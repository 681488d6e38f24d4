"""Seconds from each worker's TensorFlow import to its first step (issue #9, goal 6), checkouts side by side.

Each run starts 1 ps + 2 workers (as `psworker local` does) from each variant's checkout in turn, `--runs` times,
and reads the workers' "TensorFlow imported" and "first step done" log lines (as `lifecycle.py`). With
`--chief_last` each variant also runs a second arrangement: ps:0 and worker:1 first, and the chief only once
worker:1 waits for its model, so that the chief's path is timed without two other processes starting beside it.

    python benchmarks/first_step.py --runs 6 --data_dir /tmp/cifar
    python benchmarks/first_step.py before=/work/wt-before after=. --runs 6 --chief_last

Prints the medians with their samples, then a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RUN_ONE = r'''
import json, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, "benchmarks")
import lifecycle
from psworker.testing import LocalCluster, log_time

model, steps, data_dir, chief_last = sys.argv[1], int(sys.argv[2]), sys.argv[3] or None, sys.argv[4] == "1"
workdir = Path(tempfile.mkdtemp(prefix="psworker-first-step-")) / "c"
if not chief_last:
    run = lifecycle.run_cluster("async", workdir, max_steps=steps, batch_size=64, model=model, data_dir=data_dir)
    print("RESULT", json.dumps(run.after_import_s))
    sys.exit(0)
workdir.mkdir(parents=True)
train = dict(model=model, max_steps=steps, batch_size=64, data_dir=data_dir, log_every_steps=10)
with LocalCluster(workdir, train=train, start=False) as cluster:
    cluster.start("ps:0", "worker:1")
    deadline = time.monotonic() + 300
    while "waiting for the chief's model" not in cluster.log("worker:1"):
        if time.monotonic() > deadline:
            sys.exit("worker:1 did not start waiting for the chief within 300 s:\n" + cluster.tails())
        time.sleep(0.2)
    time.sleep(1.0)   # its input warm-up
    cluster.start("worker:0")
    codes = cluster.wait_exits(600)
    if set(codes.values()) != {0}:
        sys.exit(f"failed: {codes}\n" + cluster.tails())
    log = cluster.log("worker:0")
    took = log_time(lifecycle.FIRST_STEP.search(log).group(0)) - log_time(lifecycle.IMPORTED.search(log).group(0))
print("RESULT", json.dumps({"worker:0": round(took, 3)}))
'''


def run_once(checkout: str, args, chief_last: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=checkout, TF_CPP_MIN_LOG_LEVEL="2")
    out = subprocess.run([sys.executable, "-c", RUN_ONE, args.model, str(args.max_steps), args.data_dir or "",
                          "1" if chief_last else "0"], cwd=checkout, env=env, capture_output=True, text=True,
                         timeout=args.timeout)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"{checkout}: run failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("variants", nargs="*", default=[f"this={Path(__file__).resolve().parent.parent}"],
                   help="NAME=CHECKOUT (default: this checkout)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--model", default="cifar10", choices=["cifar10", "mlp"])
    p.add_argument("--max_steps", type=int, default=40)
    p.add_argument("--data_dir", help="CIFAR-10 records (default: a synthetic set in a temporary folder)")
    p.add_argument("--chief_last", action="store_true", help="also time the chief started after the others")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    p.add_argument("--quick", action="store_true", help="one run of the MLP, 10 steps (for tests/test_benchmarks.py)")
    args = p.parse_args(argv)
    if args.quick:
        args.runs, args.model, args.max_steps = 1, "mlp", 10
    variants = []
    for text in args.variants:
        name, sep, checkout = text.partition("=")
        if not sep or not (Path(checkout) / "psworker" / "__init__.py").is_file():
            p.error(f"{text!r}: expected NAME=CHECKOUT, a psworker source tree")
        variants.append((name, str(Path(checkout).resolve())))
    arrangements = [False, True] if args.chief_last else [False]
    samples: dict = {}
    with tempfile.TemporaryDirectory(prefix="psworker-first-step-") as tmp:
        if args.model == "cifar10" and args.data_dir is None:
            args.data_dir = str(Path(tmp) / "data")
            subprocess.run([sys.executable, "-m", "psworker", "data", "cifar10-synthetic", "--data_dir", args.data_dir],
                           env=dict(os.environ, PYTHONPATH=variants[0][1]), check=True, capture_output=True,
                           timeout=300)
        for i in range(args.runs):
            for name, checkout in variants:
                for last in arrangements:
                    for worker, secs in run_once(checkout, args, last).items():
                        key = f"{name} {worker}" + (" (started last)" if last else "")
                        samples.setdefault(key, []).append(secs)
                        print(f"run {i + 1}: {key}: {secs:.3f} s", flush=True)
    print(f"\n{args.model}: seconds from the TF import to the first step, median of {args.runs} (samples)")
    for key, values in samples.items():
        print(f"  {key:<40}{statistics.median(values):>7.3f}  " + ", ".join(f"{v:.3f}" for v in values))
    print(json.dumps({"model": args.model, "runs": args.runs, "samples": samples,
                      "median": {k: statistics.median(v) for k, v in samples.items()}}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
