"""Staged variables and the transfer dtype (issue 19, item 3), side by side: `psworker local` variants, interleaved.

Not a test: run it by hand, e.g.

    python benchmarks/overlap.py --ps_link_rate 100mbit --shapes 1x1,1x2,2x2 --repeat 3
    python benchmarks/overlap.py --shapes 1x1 --variants base,staged --in_process   # unshaped, CPU vs one process

For every shape (`PSxWORKERS`) and variant (base: float32, no staging; staged: `--staged_vars true`; bf16:
`--transfer_dtype bfloat16`; staged+bf16; sync: `--mode sync`, for "sync not slower") it runs `psworker local` on
the CIFAR-10 CNN (synthetic data unless --data_dir), async, batch 64 per worker, and measures after the warm-up
(the first 10% of the global steps):
  - examples/s: global steps/s from the workers' own summaries (global step and wall time), times the batch;
  - CPU-s per 1,000 examples: the CPU time of every process of the run (launcher, ps and workers, sampled every
    0.2 s), over the same window, per 1,000 examples trained in it.
With --in_process, the same graph in one process without servers gives the CPU baseline (`cpu/in-process`).
Each repeat runs every variant once (interleaved); medians are printed, then a JSON line with every sample.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import psutil

REPO = Path(__file__).resolve().parent.parent
VARIANTS = {"base": [], "staged": ["--staged_vars", "true"], "bf16": ["--transfer_dtype", "bfloat16"],
            "staged+bf16": ["--staged_vars", "true", "--transfer_dtype", "bfloat16"], "sync": ["--mode", "sync"]}


class CpuSampler:
    """CPU seconds (user + system) of a process and all its descendants, sampled in a thread: `at(t)` interpolates
    the running total at monotonic time `t`; processes that exit keep their last sample."""

    def __init__(self, pid: int, every: float = 0.2):
        self._root, self._every = pid, every
        self._last: dict[int, float] = {}
        self.samples: list[tuple[float, float]] = []   # (time.time(), total CPU-s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                root = psutil.Process(self._root)
                procs = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                procs = []
            for p in procs:
                try:
                    t = p.cpu_times()
                    self._last[p.pid] = t.user + t.system
                except psutil.NoSuchProcess:
                    pass
            self.samples.append((time.time(), sum(self._last.values())))
            self._stop.wait(self._every)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def at(self, t: float) -> float:
        prev = self.samples[0]
        for cur in self.samples:
            if cur[0] >= t:
                span = cur[0] - prev[0]
                return prev[1] + (cur[1] - prev[1]) * ((t - prev[0]) / span if span > 0 else 1.0)
            prev = cur
        return prev[1]


def summaries(train_dir: Path, workers: int) -> list[tuple[float, int]]:
    """(wall time, global step) of every worker's summaries, once every worker has written one."""
    import tensorflow as tf

    points, firsts = [], []
    for i in range(workers):
        mine = [(e.wall_time, e.step) for f in sorted((train_dir / f"worker_{i}").glob("events.out.tfevents*"))
                for e in tf.compat.v1.train.summary_iterator(str(f)) if e.summary.value]
        if not mine:
            raise RuntimeError(f"worker:{i} wrote no summaries under {train_dir}")
        firsts.append(min(mine)[0])
        points += mine
    return sorted(p for p in points if p[0] >= max(firsts))


def cluster_run(shape: str, variant: str, args, workdir: Path, tag: str) -> dict:
    """One `psworker local` run; examples/s and CPU-s per 1,000 examples after the warm-up."""
    import yaml

    num_ps, workers = (int(x) for x in shape.split("x"))
    log_every = max(1, args.steps // (args.intervals * workers))
    spec = workdir / f"{tag}.yaml"
    spec.write_text(yaml.safe_dump({
        "cluster": {"ps": ["localhost:auto"] * num_ps, "worker": ["localhost:auto"] * workers},
        "train": {"model": "cifar10", "mode": "async", "max_steps": args.steps, "batch_size": args.batch_size,
                  "learning_rate": args.learning_rate, "log_every_steps": log_every, "data_dir": args.data_dir,
                  "seed": 1}}, sort_keys=False))
    argv = [sys.executable, "-m", "psworker", "local", str(spec), "--train_dir", str(workdir / tag),
            *VARIANTS[variant], *(["--ps_link_rate", args.ps_link_rate] if args.ps_link_rate else [])]
    with open(workdir / f"{tag}.out", "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=workdir, start_new_session=True)
        sampler = CpuSampler(proc.pid)
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            rc = "timeout"
        finally:
            sampler.stop()
    if rc != 0:
        tail = (workdir / f"{tag}.out").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{tag}: psworker local exited {rc}:\n{tail}")
    window = [p for p in summaries(workdir / tag, workers) if p[1] >= max(5, args.steps // 10)]
    (t0, s0), (t1, s1) = window[0], window[-1]
    examples = (s1 - s0) * args.batch_size
    cpu = sampler.at(t1) - sampler.at(t0)
    return {"examples_per_sec": examples / (t1 - t0), "cpu_s_per_1k": 1000 * cpu / examples}


def in_process(args) -> dict:
    """The `_in_process` subcommand: the same graph in this process, no servers; CPU of this process."""
    import tensorflow as tf

    from psworker import models
    from psworker.spec import TrainConfig
    from psworker.train.graph import build_train_graph

    v1 = tf.compat.v1
    v1.disable_eager_execution()
    config = TrainConfig(model="cifar10", batch_size=args.batch_size, learning_rate=args.learning_rate,
                         data_dir=args.data_dir, seed=1)
    with tf.Graph().as_default():
        tg = build_train_graph(models.get("cifar10"), config, cluster=None, task_index=0)
        with v1.train.MonitoredSession(session_creator=v1.train.ChiefSessionCreator()) as sess:
            for _ in range(max(5, args.steps // 10)):
                sess.run(tg.train_op)
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                sess.run(tg.train_op)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    examples = args.steps * args.batch_size
    return {"examples_per_sec": examples / wall, "cpu_s_per_1k": 1000 * cpu / examples}


def in_process_run(args) -> dict:
    argv = [sys.executable, str(Path(__file__).resolve()), "_in_process", "--steps", str(args.steps),
            "--batch_size", str(args.batch_size), "--learning_rate", str(args.learning_rate),
            "--data_dir", args.data_dir]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"in-process run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def print_table(samples: dict, args) -> dict:
    medians = {k: {m: statistics.median(r[m] for r in runs) for m in ("examples_per_sec", "cpu_s_per_1k")}
               for k, runs in samples.items() if runs}
    base_cpu = medians.get("in-process", {}).get("cpu_s_per_1k")
    print(f"\nCIFAR-10 CNN, batch {args.batch_size}/worker, {args.steps} global steps, ps link "
          f"{args.ps_link_rate or 'unshaped'}; medians of {args.repeat} interleaved runs")
    print(f"{'shape':<8}{'variant':<14}{'examples/s':>12}{'x base':>8}{'CPU-s/1k ex':>13}"
          f"{'cpu/in-process':>16}{'runs':>6}")
    for key, m in medians.items():
        shape, _, variant = key.partition(" ")
        base = medians.get(f"{shape} base")
        ratio = f"{m['examples_per_sec'] / base['examples_per_sec']:.2f}" if base and variant else ""
        cpu_ratio = f"{m['cpu_s_per_1k'] / base_cpu:.2f}" if base_cpu else ""
        print(f"{shape:<8}{variant:<14}{m['examples_per_sec']:>12,.1f}{ratio:>8}{m['cpu_s_per_1k']:>13.2f}"
              f"{cpu_ratio:>16}{len(samples[key]):>6}")
    return medians


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="1x1,1x2,2x2", help="PSxWORKERS, comma-separated")
    p.add_argument("--variants", default="base,staged,bf16,staged+bf16", help=f"of {', '.join(VARIANTS)}")
    p.add_argument("--ps_link_rate", help="shape each ps port (psworker local --ps_link_rate), e.g. 100mbit")
    p.add_argument("--in_process", action="store_true", help="also the one-process CPU baseline")
    p.add_argument("--steps", type=int, default=200, help="global steps per run")
    p.add_argument("--intervals", type=int, default=10, help="summaries per worker per run")
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--learning_rate", type=float, default=0.1)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--data_dir", help="CIFAR-10 records (default: synthetic, in a temporary folder)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    if argv[:1] == ["_in_process"]:
        print(json.dumps(in_process(p.parse_args(argv[1:]))))
        return 0
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        p.error(f"--variants: unknown {', '.join(sorted(unknown))}")
    with tempfile.TemporaryDirectory(prefix="psworker-overlap-") as tmp:
        workdir = Path(tmp)
        if args.data_dir is None:
            args.data_dir = str(workdir / "data")
            subprocess.run([sys.executable, "-m", "psworker", "data", "cifar10-synthetic", "--data_dir",
                            args.data_dir], check=True, capture_output=True, cwd=REPO)
        args.data_dir = os.path.abspath(args.data_dir)
        samples: dict[str, list] = {}
        for r in range(args.repeat):
            if args.in_process:
                samples.setdefault("in-process", []).append(in_process_run(args))
            for shape in args.shapes.split(","):
                for variant in variants:
                    key = f"{shape} {variant}"
                    result = cluster_run(shape, variant, args, workdir, f"r{r}-{shape}-{variant}")
                    print(f"  {key}: {result['examples_per_sec']:,.1f} ex/s, {result['cpu_s_per_1k']:.2f} CPU-s/1k",
                          flush=True)
                    samples.setdefault(key, []).append(result)
        medians = print_table(samples, args)
    print(json.dumps({"args": vars(args), "medians": medians, "samples": samples}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
