"""Lifecycle benchmark: a local 1 ps + 2 worker cluster, async and sync, side by side with one process.

Measures, from the task processes' own logs and their exit times (polled every 10 ms):
- first step: from the end of a worker's TensorFlow import (its "TensorFlow imported" log line) to its first
  finished step (issue #9, goal 6: <= 1 s); also from the process's start minus the import time, which adds the
  interpreter's start and psworker's own imports (~0.1 s alone, more while three processes start on 2 cores);
- exit: from the final training step (the last worker's) to the exit of each process, ps included;
- throughput: global steps/s and examples/s from the moment both workers train to the final step;
- the same model and batch trained in this process without servers, and the ratios;
- timeouts: how long after its start (minus TF import) a worker without its ps exits (`--startup_timeout_secs 3`),
  and how long after its only worker was killed a ps exits (`--workers_gone_timeout_secs 3`).

Goals (printed as OK/OVER, never asserted by the tests): a worker exits within `WORKER_EXIT_GOAL_S` of the last
step, a ps within `PS_EXIT_GOAL_S`; a timeout of T s ends the task within T + `TIMEOUT_SLACK_S`.

Prints a table, then as its LAST line one JSON object (keys: first_step_s, exit_s, async_steps_per_s,
sync_steps_per_s, inprocess_steps_per_s, ...).

    python benchmarks/lifecycle.py [--max_steps 1500] [--batch_size 64] [--model mlp] [--modes async,sync]
    python benchmarks/lifecycle.py --quick      # async only, 20 steps (tests/test_benchmarks.py)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))   # run from a checkout without installing

from psworker import events  # noqa: E402
from psworker.testing import LocalCluster, log_time  # noqa: E402

WORKER_EXIT_GOAL_S = 1.0
PS_EXIT_GOAL_S = 2.0
FIRST_STEP_GOAL_S = 1.0   # issue #9, goal 6: from the end of the TF import
TIMEOUT_SLACK_S = 3.0

IMPORTED = re.compile(r"^.*TensorFlow imported in ([0-9.]+) s$", re.MULTILINE)
FIRST_STEP = re.compile(r"^.*first step done at global step (\d+)$", re.MULTILINE)
LAST_STEP = re.compile(r"^.*last step done.*$", re.MULTILINE)
DONE = re.compile(r"done at global step (\d+) after (\d+) local steps")


@dataclass
class ClusterRun:
    mode: str
    first_step_s: dict[str, float]      # worker -> seconds from start to first step, minus TF import
    after_import_s: dict[str, float]    # worker -> seconds from the end of its TF import to its first step
    import_s: dict[str, float]
    exit_s: dict[str, float]            # process -> seconds from the final step to its exit
    steps_per_s: float
    examples_per_s: float
    final_step: int
    wall_s: float


def run_cluster(mode: str, workdir: Path, *, max_steps: int, batch_size: int, model: str, num_workers: int = 2,
                data_dir: Optional[str] = None) -> ClusterRun:
    """Starts ps:0 and the workers together (as `psworker local` does) and measures them."""
    workdir.mkdir(parents=True)
    train = dict(model=model, mode=mode, max_steps=max_steps, batch_size=batch_size, data_dir=data_dir,
                 log_every_steps=max(1, max_steps // 4))
    began = time.time()
    with LocalCluster(workdir, num_workers=num_workers, train=train) as cluster:
        codes = cluster.wait_exits(600)
        failed = {n: code for n, code in codes.items() if code != 0}
        if failed:
            raise SystemExit(f"{mode} run failed: {failed}\n{cluster.tails(failed)}")
        workers = {n: cluster.log(n) for n in cluster.names if n.startswith("worker")}
        started_at, exited_at = dict(cluster.started_at), dict(cluster.exited_at)

    imported = {n: IMPORTED.search(log) for n, log in workers.items()}
    imports = {n: float(m.group(1)) for n, m in imported.items()}
    firsts = {n: FIRST_STEP.search(log) for n, log in workers.items()}
    first_at = {n: log_time(m.group(0)) for n, m in firsts.items()}
    first_step_s = {n: round(first_at[n] - started_at[n] - imports[n], 3) for n in workers}
    after_import_s = {n: round(first_at[n] - log_time(imported[n].group(0)), 3) for n in workers}
    final_at = max(log_time(LAST_STEP.search(log).group(0)) for log in workers.values())
    exit_s = {n: round(at - final_at, 3) for n, at in exited_at.items()}
    final_step = max(int(DONE.search(log).group(1)) for log in workers.values())
    # Throughput once both workers train: from the later first step (and the global step it saw) to the final step.
    later = max(first_at, key=first_at.get)
    start_step = int(firsts[later].group(1))
    steps_per_s = (final_step - start_step) / max(final_at - first_at[later], 1e-9)
    per_step = batch_size * (len(workers) if mode == "sync" else 1)   # sync: a global step averages every batch
    return ClusterRun(mode, first_step_s, after_import_s, imports, exit_s, steps_per_s, steps_per_s * per_step, final_step,
                      time.time() - began)


def run_timeouts(workdir: Path) -> dict[str, float]:
    """Seconds from start to exit of a worker whose ps never comes (startup timeout 3 s), and seconds from killing
    the only worker to the exit of its ps (workers-gone timeout 3 s)."""
    out = {}
    with LocalCluster(workdir / "startup", args={"worker:1": ["--set", "startup_timeout_secs=3"]}, start=False) as c:
        c.start("worker:1")
        c.wait_exit("worker:1", 120)
        took = c.exited_at["worker:1"] - c.started_at["worker:1"] - _import_s(c, "worker:1")
        out["startup_timeout_3s"] = round(took, 3)
    with LocalCluster(workdir / "gone", num_workers=1, train=dict(max_steps=1_000_000, log_every_steps=50),
                      args={"ps:0": ["--workers_gone_timeout_secs", "3"]}) as c:
        c.wait_for_log("worker:0", events.Step, 180)
        c.kill("worker:0")
        killed = c.exited_at["worker:0"]
        c.wait_exit("ps:0", 120)
        out["workers_gone_timeout_3s"] = round(c.exited_at["ps:0"] - killed, 3)
    return out


def _import_s(cluster: LocalCluster, name: str) -> float:
    match = IMPORTED.search(cluster.log(name))
    return float(match.group(1)) if match else 0.0


def run_in_process(*, steps: int, batch_size: int, model: str, data_dir: Optional[str] = None) -> float:
    """Global steps/s of the same model and batch in this process, without servers."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    from psworker import models
    from psworker.spec import TrainConfig
    from psworker.tf_import import import_tensorflow
    from psworker.train.graph import train_in_process

    import_tensorflow().compat.v1.disable_eager_execution()   # without Keras and scikit-learn, as a task
    seconds, n = train_in_process(models.get(model), TrainConfig(model=model, batch_size=batch_size, data_dir=data_dir),
                                  steps=steps)
    return n / seconds


def summary(runs: list[ClusterRun], inprocess: float, timeouts: dict[str, float], args) -> dict:
    """The JSON line: the worst first step and exit over the modes run, each mode's rates and the timeouts."""
    out = {
        "first_step_s": max(v for r in runs for v in r.first_step_s.values()),
        "first_step_after_import_s": max(v for r in runs for v in r.after_import_s.values()),
        "exit_s": max(v for r in runs for v in r.exit_s.values()),
        "inprocess_steps_per_s": round(inprocess, 2),
        "first_step_s_by_mode": {r.mode: r.first_step_s for r in runs},
        "exit_s_by_mode": {r.mode: r.exit_s for r in runs},
        "timeouts_s": timeouts,
        "model": args.model, "batch_size": args.batch_size, "max_steps": args.max_steps,
    }
    for r in runs:
        out.update({f"{r.mode}_steps_per_s": round(r.steps_per_s, 2), f"{r.mode}_examples_per_s":
                    round(r.examples_per_s, 1), f"{r.mode}_vs_inprocess": round(r.steps_per_s / inprocess, 3)})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max_steps", type=int, default=1500)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--model", default="mlp")
    p.add_argument("--workdir", default=None, help="default: a fresh temporary directory")
    p.add_argument("--data_dir", default=None, help="cifar10: its records (default: a synthetic set in --workdir)")
    p.add_argument("--modes", default="async,sync", help="comma-separated: async, sync")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="async only, 1 worker, 20 steps (seconds, for "
                                                        "tests/test_benchmarks.py)")
    args = p.parse_args(argv)
    if args.quick:
        args.max_steps, args.modes, args.workers = 20, "async", 1
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="psworker-lifecycle-"))

    if args.model == "cifar10" and args.data_dir is None:   # a small synthetic set in the real record format
        from psworker.data import cifar10_files

        args.data_dir = str(workdir / "cifar10-data")
        cifar10_files.write_synthetic(args.data_dir)
    runs = [run_cluster(mode, workdir / mode, max_steps=args.max_steps, batch_size=args.batch_size, model=args.model,
                        num_workers=args.workers, data_dir=args.data_dir)
            for mode in args.modes.split(",")]
    inprocess = run_in_process(steps=args.max_steps, batch_size=args.batch_size, model=args.model,
                               data_dir=args.data_dir)
    timeouts = run_timeouts(workdir / "timeouts")

    print(f"psworker lifecycle benchmark: {args.model}, batch {args.batch_size}, {args.max_steps} steps, "
          f"1 ps + {args.workers} worker(s) on {os.cpu_count()} cores; logs in {workdir}")
    print(f"{'':<36}" + "".join(f"{r.mode:>10}" for r in runs))
    names = [f"worker:{i}" for i in range(args.workers)]
    rows = [*[(f"first step after TF import, {n}", lambda r, n=n: r.after_import_s[n]) for n in names],
            *[(f"  (from start - import, {n} (s))", lambda r, n=n: r.first_step_s[n]) for n in names],
            *[(f"  (TF import, {n} (s))", lambda r, n=n: r.import_s[n]) for n in names],
            *[(f"exit (s) after last step, {n}", lambda r, n=n: r.exit_s[n]) for n in names + ["ps:0"]],
            ("final global step", lambda r: r.final_step),
            ("global steps/s", lambda r: round(r.steps_per_s, 1)),
            ("examples/s", lambda r: round(r.examples_per_s)),
            ("vs in-process steps/s", lambda r: f"{r.steps_per_s / inprocess:.2f}x"),
            ("wall (s)", lambda r: round(r.wall_s, 1))]
    for label, get in rows:
        print(f"{label:<36}" + "".join(f"{get(r)!s:>10}" for r in runs))
    print(f"{'in-process steps/s':<36}{inprocess:>10.1f}  ({inprocess * args.batch_size:.0f} examples/s)")
    for r in runs:
        for name, secs in sorted(r.exit_s.items()):
            goal = PS_EXIT_GOAL_S if name.startswith("ps") else WORKER_EXIT_GOAL_S
            print(f"goal {r.mode} exit {name} <= {goal:g} s: {secs:.3f} s {'OK' if secs <= goal else 'OVER'}")
    for r in runs:
        worst = max(r.after_import_s.values())
        print(f"goal {r.mode} first step <= {FIRST_STEP_GOAL_S:g} s after TF import: {worst:.3f} s "
              f"{'OK' if worst <= FIRST_STEP_GOAL_S else 'OVER'}")
    for name, secs in timeouts.items():
        print(f"goal {name} <= {3 + TIMEOUT_SLACK_S:g} s: {secs:.3f} s "
              f"{'OK' if 3 <= secs <= 3 + TIMEOUT_SLACK_S else 'OVER'}")
    print(json.dumps(summary(runs, inprocess, timeouts, args), sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
