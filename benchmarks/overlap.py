"""Staged variables and the transfer dtype (issue 19, item 3), side by side: `psworker local` variants, interleaved.

Not a test: run it by hand, e.g.

    python benchmarks/overlap.py --ps_link_rate 100mbit --shapes 1x1,1x2,2x2 --repeat 3
    python benchmarks/overlap.py --shapes 1x1 --variants base,staged --in_process   # unshaped, CPU vs one process

For every shape (`PSxWORKERS`) and variant (base: float32, no staging; staged: `--set staged_vars=true`; bf16:
`--set transfer_dtype=bfloat16`; staged+bf16; sync: `--mode sync`, for "sync not slower") it runs `psworker local` on
the CIFAR-10 CNN (synthetic data unless --data_dir), async, batch 64 per worker, and measures after the warm-up
(the first 10% of the global steps):
  - examples/s: global steps/s from the workers' own summaries (global step and wall time), times the batch;
  - CPU-s per 1,000 examples: the CPU time of every process of the run (launcher, ps and workers, sampled every
    0.2 s), over the same window, per 1,000 examples trained in it; then the same per process (`launcher`, `ps:N`,
    `worker:N`, `other` for anything else the launcher started).
With --in_process, the same graph in one process without servers gives the CPU baseline (`cpu/in-process`).
`--env_variant NAME:KEY=VALUE` adds a variant that is base with that environment (e.g.
`off:PSWORKER_TF_THREAD_SPINNING=off`); `--in_process_variants NAME` also runs the baseline with it (`in-process
NAME`, the `same env` column).
Each repeat runs every variant once (interleaved, the order rotated by one each repeat); medians are printed, then a
JSON line with every sample.

    python benchmarks/overlap.py --shapes 1x1 --variants on,base,off --in_process --steps 100 --repeat 4 \
        --env_variant on:PSWORKER_TF_THREAD_SPINNING=on --env_variant off:PSWORKER_TF_THREAD_SPINNING=off \
        --in_process_variants off      # issue 19's unshaped CPU ratio, per process, thread spinning side by side
"""

from __future__ import annotations

import argparse
import json
import os
import signal
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
VARIANTS = {"base": [], "staged": ["--set", "staged_vars=true"], "bf16": ["--set", "transfer_dtype=bfloat16"],
            "staged+bf16": ["--set", "staged_vars=true", "--set", "transfer_dtype=bfloat16"],
            "sync": ["--mode", "sync"]}

QUICK = {"shapes": "1x1", "variants": "staged", "in_process": True, "steps": 30, "intervals": 5,
         "batch_size": 16, "repeat": 1}


def role_of(proc: psutil.Process, root: int) -> str:
    """`launcher` (the `psworker local` process), `ps:N` / `worker:N` (a task, from its argv), else `other`."""
    if proc.pid == root:
        return "launcher"
    try:
        argv = proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "other"
    if "psworker" in argv and "--task_index" in argv:
        job = argv[argv.index("psworker") + 1]
        return f"{job}:{argv[argv.index('--task_index') + 1]}"
    return "other"


class CpuSampler:
    """CPU seconds (user + system) of a process and all its descendants, per role (see `role_of`), sampled in a
    thread: `at(t)` interpolates the running total at time `t` (`at(t, role)` one role's); processes that exit keep
    their last sample."""

    def __init__(self, pid: int, every: float = 0.2):
        self._root, self._every = pid, every
        self._last: dict[int, float] = {}
        self._roles: dict[int, str] = {}
        self.samples: list[tuple[float, dict[str, float]]] = []   # (time.time(), {role: CPU-s})
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
                    if self._roles.get(p.pid, "other") == "other":   # a task just forked still has our argv
                        self._roles[p.pid] = role_of(p, self._root)
                except psutil.NoSuchProcess:
                    pass
            totals: dict[str, float] = {}
            for pid, cpu in self._last.items():
                name = self._roles.get(pid, "other")
                totals[name] = totals.get(name, 0.0) + cpu
            self.samples.append((time.time(), totals))
            self._stop.wait(self._every)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def roles(self) -> list[str]:
        return sorted({r for _, totals in self.samples for r in totals})

    def at(self, t: float, role: Optional[str] = None) -> float:
        def value(sample):
            return sample[1].get(role, 0.0) if role else sum(sample[1].values())

        prev = self.samples[0]
        for cur in self.samples:
            if cur[0] >= t:
                span = cur[0] - prev[0]
                return value(prev) + (value(cur) - value(prev)) * ((t - prev[0]) / span if span > 0 else 1.0)
            prev = cur
        return value(prev)


def summaries(train_dir: Path, workers: int) -> list[tuple[float, int]]:
    """(wall time, global step) of every worker's summaries, once every worker has written one."""
    from peers import summary_points   # benchmarks/peers.py: read without TensorFlow

    points, firsts = [], []
    for i in range(workers):
        mine = summary_points(train_dir / f"worker_{i}")
        if not mine:
            raise RuntimeError(f"worker:{i} wrote no summaries under {train_dir}")
        firsts.append(min(mine)[0])
        points += mine
    return sorted(p for p in points if p[0] >= max(firsts))


def parse_env_variant(text: str) -> tuple[str, dict[str, str]]:
    """`NAME:KEY=VALUE;KEY=VALUE` (an `--env_variant`) -> `(NAME, {KEY: VALUE})`."""
    name, _, assignments = text.partition(":")
    env = dict(a.split("=", 1) for a in assignments.split(";") if a)
    if not name or not env:
        raise argparse.ArgumentTypeError(f"expected NAME:KEY=VALUE[;KEY=VALUE...], got {text!r}")
    return name, env


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
            *VARIANTS.get(variant, []), *(["--ps_link_rate", args.ps_link_rate] if args.ps_link_rate else [])]
    env = dict(os.environ, **args.env_variants.get(variant, {}))
    with open(workdir / f"{tag}.out", "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=workdir, start_new_session=True,
                                env=env)
        sampler = CpuSampler(proc.pid)
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            rc = "timeout"
        except BaseException:   # interrupted (Ctrl-C, SIGTERM): the launcher stops its tasks
            proc.terminate()
            proc.wait(timeout=60)
            raise
        finally:
            sampler.stop()
    if rc != 0:
        tail = (workdir / f"{tag}.out").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{tag}: psworker local exited {rc}:\n{tail}")
    window = [p for p in summaries(workdir / tag, workers) if p[1] >= max(5, args.steps // 10)]
    (t0, s0), (t1, s1) = window[0], window[-1]
    examples = (s1 - s0) * args.batch_size
    cpu = sampler.at(t1) - sampler.at(t0)
    per_role = {r: 1000 * (sampler.at(t1, r) - sampler.at(t0, r)) / examples for r in sampler.roles()}
    return {"examples_per_sec": examples / (t1 - t0), "cpu_s_per_1k": 1000 * cpu / examples, "per_process": per_role}


def in_process(args) -> dict:
    """The `_in_process` subcommand: the same graph in this process, no servers; CPU of this process."""
    from psworker.tf_import import import_tensorflow
    tf = import_tensorflow()   # without Keras and scikit-learn, as a task

    from psworker import models
    from psworker.spec import TrainConfig
    from psworker.train.graph import build_train_graph

    v1 = tf.compat.v1
    v1.disable_eager_execution()
    config = TrainConfig(model="cifar10", batch_size=args.batch_size, learning_rate=args.learning_rate,
                         data_dir=args.data_dir, seed=1)
    with tf.Graph().as_default():
        tg = build_train_graph(models.get("cifar10"), config, cluster=None, task_index=0)
        from psworker.train.devices import with_spinning
        session_config = with_spinning(v1.ConfigProto(), "worker")   # as a worker's server, PSWORKER_TF_THREAD_SPINNING
        with v1.train.MonitoredSession(session_creator=v1.train.ChiefSessionCreator(config=session_config)) as sess:
            for _ in range(max(5, args.steps // 10)):
                sess.run(tg.train_op)
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                sess.run(tg.train_op)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    examples = args.steps * args.batch_size
    return {"examples_per_sec": examples / wall, "cpu_s_per_1k": 1000 * cpu / examples}


def in_process_run(args, extra_env: Optional[dict] = None) -> dict:
    argv = [sys.executable, str(Path(__file__).resolve()), "_in_process", "--steps", str(args.steps),
            "--batch_size", str(args.batch_size), "--learning_rate", str(args.learning_rate),
            "--data_dir", args.data_dir]
    env = dict(os.environ, PYTHONPATH=str(REPO), **(extra_env or {}))
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
    print(f"{'shape':<11}{'variant':<14}{'examples/s':>12}{'x base':>8}{'CPU-s/1k ex':>13}"
          f"{'cpu/in-process':>16}{'same env':>10}{'runs':>6}")
    for key, m in medians.items():
        shape, _, variant = key.partition(" ")
        base = medians.get(f"{shape} base")
        ratio = f"{m['examples_per_sec'] / base['examples_per_sec']:.2f}" if base and variant else ""
        cpu_ratio = f"{m['cpu_s_per_1k'] / base_cpu:.2f}" if base_cpu else ""
        own = medians.get(f"in-process {variant}") if shape != "in-process" else None   # an --env_variant's
        own_ratio = f"{m['cpu_s_per_1k'] / own['cpu_s_per_1k']:.2f}" if own else ""
        print(f"{shape:<11}{variant:<14}{m['examples_per_sec']:>12,.1f}{ratio:>8}{m['cpu_s_per_1k']:>13.2f}"
              f"{cpu_ratio:>16}{own_ratio:>10}{len(samples[key]):>6}")
    print_breakdown(samples, medians)
    return medians


def print_breakdown(samples: dict, medians: dict) -> None:
    """CPU-s per 1,000 examples per process (medians), in the same window as the totals above."""
    roles = sorted({r for runs in samples.values() for run in runs for r in run.get("per_process", {})},
                   key=lambda r: (r != "launcher", r))
    if not roles:
        return
    print(f"\nCPU-s per 1,000 examples, per process (medians)\n{'shape':<11}{'variant':<14}"
          + "".join(f"{r:>11}" for r in roles))
    for key, runs in samples.items():
        if "per_process" not in runs[0]:
            continue
        shape, _, variant = key.partition(" ")
        per = {r: statistics.median(run["per_process"].get(r, 0.0) for run in runs) for r in roles}
        medians[key]["per_process"] = per
        print(f"{shape:<11}{variant:<14}" + "".join(f"{per[r]:>11.3f}" for r in roles))


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="1x1,1x2,2x2", help="PSxWORKERS, comma-separated")
    p.add_argument("--variants", default="base,staged,bf16,staged+bf16", help=f"of {', '.join(VARIANTS)}")
    p.add_argument("--ps_link_rate", help="shape each ps port (psworker local --ps_link_rate), e.g. 100mbit")
    p.add_argument("--in_process", action="store_true", help="also the one-process CPU baseline")
    p.add_argument("--env_variant", type=parse_env_variant, action="append", default=[],
                   help="NAME:KEY=VALUE[;KEY=VALUE]: a variant that is base with these environment variables in "
                        "every process of the run; repeatable")
    p.add_argument("--in_process_variants", default="",
                   help="env variants (comma-separated) that also get an `in-process NAME` row: the baseline with "
                        "the same environment")
    p.add_argument("--steps", type=int, default=200, help="global steps per run")
    p.add_argument("--intervals", type=int, default=10, help="summaries per worker per run")
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--learning_rate", type=float, default=0.1)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--data_dir", help="CIFAR-10 records (default: synthetic, in a temporary folder)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    p.add_argument("--quick", action="store_true", help=f"seconds, for tests/test_benchmarks.py: {QUICK}, a tiny "
                                                        "synthetic set")
    if argv[:1] == ["_in_process"]:
        print(json.dumps(in_process(p.parse_args(argv[1:]))))
        return 0
    args = p.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # so that a running cluster is stopped (see cluster_run)
    variants = [v for v in args.variants.split(",") if v]
    args.env_variants = dict(args.env_variant)
    unknown = set(variants) - set(VARIANTS) - set(args.env_variants)
    if unknown:
        p.error(f"--variants: unknown {', '.join(sorted(unknown))}")
    with tempfile.TemporaryDirectory(prefix="psworker-overlap-") as tmp:
        workdir = Path(tmp)
        if args.data_dir is None and args.quick:
            from psworker.data.cifar10_files import write_synthetic

            args.data_dir = str(workdir / "data")
            write_synthetic(args.data_dir, train_per_class=10, test_per_class=2)
        if args.data_dir is None:
            args.data_dir = str(workdir / "data")
            subprocess.run([sys.executable, "-m", "psworker", "data", "cifar10-synthetic", "--data_dir",
                            args.data_dir], check=True, capture_output=True, cwd=REPO)
        args.data_dir = os.path.abspath(args.data_dir)
        samples: dict[str, list] = {}
        for r in range(args.repeat):
            if args.in_process:
                samples.setdefault("in-process", []).append(in_process_run(args))
                for name, env in args.env_variants.items():
                    if name in variants and name in args.in_process_variants.split(","):
                        samples.setdefault(f"in-process {name}", []).append(in_process_run(args, env))
            for shape in args.shapes.split(","):
                for variant in variants[r % len(variants):] + variants[:r % len(variants)]:   # rotated: no order bias
                    key = f"{shape} {variant}"
                    result = cluster_run(shape, variant, args, workdir, f"r{r}-{shape}-{variant}")
                    per = ", ".join(f"{r} {v:.2f}" for r, v in sorted(result["per_process"].items()))
                    print(f"  {key}: {result['examples_per_sec']:,.1f} ex/s, {result['cpu_s_per_1k']:.2f} CPU-s/1k "
                          f"({per})", flush=True)
                    samples.setdefault(key, []).append(result)
        medians = print_table(samples, args)
    print(json.dumps({"args": vars(args), "medians": medians, "samples": samples}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
