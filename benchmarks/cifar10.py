"""Throughput of the CIFAR-10 model: one process without servers vs local ps clusters, and input vs training.

Not a test: run it by hand, e.g.

    python benchmarks/cifar10.py                      # synthetic data in a temporary folder
    python benchmarks/cifar10.py --steps 100 --batch_size 32 --data_dir data/cifar10 --in_graph
    python benchmarks/cifar10.py --quick              # seconds: tiny data, steps and batch (tests/test_benchmarks.py)

Measures, side by side in one run (examples/s; every setup uses the same per-worker batch):
  - the input pipeline alone (read, decode, distort, batch) in this process;
  - training in this process without servers, fed by that pipeline ("what training consumes"), and on one fixed
    in-memory batch (compute only);
  - `psworker local` clusters on this machine: 1 ps + 1 worker and 1 ps + 2 workers (async between-graph), and
    with --in_graph also 1 ps + 2 workers in-graph. Cluster rates are the sum over workers of each worker's own
    progress-line rates, leaving out each worker's first interval (session start, warm-up). Each cluster runs
    --steps global steps: `steps * batch` examples between-graph, `steps * batch * workers` in-graph (one step
    feeds every worker), so wall times differ for that reason too.
Prints a table and ratios, and last a JSON line with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from psworker import events  # noqa: E402

QUICK = {"batch_size": 8, "steps": 12, "local_steps": 4, "warmup": 1, "log_every_steps": 3}


def _timed_runs(sess, fetch, *, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        sess.run(fetch)
    started = time.perf_counter()
    for _ in range(steps):
        sess.run(fetch)
    return time.perf_counter() - started


def input_pipeline_rate(data_dir: str, batch_size: int, steps: int, warmup: int) -> float:
    """Examples/s of the training input pipeline alone (one shard of one, as a lone worker reads)."""
    from psworker.tf_import import import_tensorflow
    tf = import_tensorflow()   # without Keras and scikit-learn, as a task

    from psworker.data import cifar10 as data

    with tf.Graph().as_default():
        images, labels = tf.compat.v1.data.make_one_shot_iterator(
            data.train_dataset(data_dir, batch_size)).get_next()
        fetch = tf.group(images, labels)
        with tf.compat.v1.Session() as sess:
            seconds = _timed_runs(sess, fetch, warmup=warmup, steps=steps)
    return steps * batch_size / seconds


class _FixedBatchModel:
    """The model, but its training input is one batch of the real pipeline kept in local variables."""

    def __init__(self, model) -> None:
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)

    def train_inputs(self, spec):
        from psworker.tf_import import import_tensorflow
        tf = import_tensorflow()   # without Keras and scikit-learn, as a task

        images, labels = self._model.train_inputs(spec)
        return (tf.compat.v1.get_local_variable("fixed_images", initializer=images),
                tf.compat.v1.get_local_variable("fixed_labels", initializer=labels))


def single_process_rates(data_dir: str, batch_size: int, steps: int, warmup: int,
                         learning_rate: float) -> tuple[float, float]:
    """Examples/s of one training process without servers: (fed by the input pipeline, on one fixed batch).

    The graph is the trainer's own (`trainer.build_train_graph` with no cluster: loss, learning rate, gradient
    descent, moving averages) on a plain session.
    """
    from psworker.tf_import import import_tensorflow
    tf = import_tensorflow()   # without Keras and scikit-learn, as a task

    from psworker.models.cifar10 import Cifar10Model
    from psworker.spec import TrainConfig
    from psworker.train.graph import build_train_graph

    v1 = tf.compat.v1
    config = TrainConfig(model="cifar10", batch_size=batch_size, learning_rate=learning_rate, data_dir=data_dir)
    rates = []
    for model in (Cifar10Model(), _FixedBatchModel(Cifar10Model())):
        with tf.Graph().as_default():
            tg = build_train_graph(model, config, cluster=None, task_index=0)
            with v1.Session() as sess:
                sess.run([v1.global_variables_initializer(), v1.local_variables_initializer()])
                seconds = _timed_runs(sess, tg.train_op, warmup=warmup, steps=steps)
        rates.append(steps * batch_size / seconds)
    return rates[0], rates[1]


def cluster_rate(workdir: Path, data_dir: str, *, num_workers: int, replication: str, batch_size: int,
                 steps: int, log_every: int, learning_rate: float, timeout: float) -> dict:
    """Runs `psworker local` on a fresh spec; returns examples/s (summed over workers) and the wall time."""
    import yaml

    name = f"{num_workers}w-{replication}"
    spec = workdir / f"{name}.yaml"
    spec.write_text(yaml.safe_dump({
        "cluster": {"ps": ["localhost:auto"], "worker": ["localhost:auto"] * num_workers},
        "train": {"model": "cifar10", "mode": "async", "replication": replication, "max_steps": steps,
                  "batch_size": batch_size, "learning_rate": learning_rate, "log_every_steps": log_every,
                  "data_dir": data_dir},
    }, sort_keys=False))
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "psworker", "local", str(spec), "--train_dir",
                           str(workdir / name)], cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=timeout)
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise RuntimeError(f"psworker local ({name}) failed with {done.returncode}:\n{done.stdout[-3000:]}")
    steady = {w: r for w, r in events.steady_rates(events.step_records(done.stdout)).items() if w is not None}
    if not steady:
        raise RuntimeError(f"{name}: too few progress lines; raise --steps or lower --log_every_steps")
    return {"examples_per_sec": sum(steady.values()), "per_worker": steady, "wall_secs": wall}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_dir", help="CIFAR-10 data (default: synthetic data in a temporary folder)")
    parser.add_argument("--batch_size", type=int, default=64, help="per worker (and per step in one process)")
    parser.add_argument("--steps", type=int, default=300, help="global steps of each cluster run")
    parser.add_argument("--local_steps", type=int, default=100, help="timed steps of each in-process measurement")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--log_every_steps", type=int, default=25)
    parser.add_argument("--learning_rate", type=float, default=0.05)
    parser.add_argument("--in_graph", action="store_true", help="also time 1 ps + 2 workers in-graph")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per cluster run")
    parser.add_argument("--quick", action="store_true",
                        help=f"seconds, for tests/test_benchmarks.py: {QUICK}, tiny synthetic data, 1 ps + 1 worker")
    args = parser.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    with tempfile.TemporaryDirectory(prefix="psworker-bench-") as tmp:
        workdir = Path(tmp)
        data_dir = args.data_dir
        if data_dir is None:
            from psworker.data.cifar10_files import write_synthetic

            data_dir = str(workdir / "data")
            write_synthetic(data_dir, **({"train_per_class": 10, "test_per_class": 2} if args.quick else {}))
        data_dir = os.path.abspath(data_dir)

        results: dict = {"batch_size": args.batch_size, "cpus": os.cpu_count(), "steps": args.steps,
                         "local_steps": args.local_steps}
        # 5x the batches: the pipeline is fast, and its prefetch buffer must not dominate a short measurement
        results["input_pipeline"] = input_pipeline_rate(data_dir, args.batch_size, 5 * args.local_steps,
                                                        args.warmup)
        fed, fixed = single_process_rates(data_dir, args.batch_size, args.local_steps, args.warmup,
                                          args.learning_rate)
        results["one_process"], results["one_process_fixed_batch"] = fed, fixed
        setups = [("1ps_1worker", 1, "between-graph"), ("1ps_2workers", 2, "between-graph")][:1 if args.quick else 2]
        if args.in_graph:
            setups.append(("1ps_2workers_in_graph", 2, "in-graph"))
        clusters = {}
        for key, workers, replication in setups:
            clusters[key] = cluster_rate(workdir, data_dir, num_workers=workers, replication=replication,
                                         batch_size=args.batch_size, steps=args.steps,
                                         log_every=args.log_every_steps, learning_rate=args.learning_rate,
                                         timeout=args.timeout)
        results["clusters"] = clusters

    rows = [("input pipeline alone (1 process)", results["input_pipeline"], ""),
            ("one process, no servers (fed by the pipeline)", fed, ""),
            ("one process, one fixed batch (compute only)", fixed, "")]
    labels = {"1ps_1worker": "1 ps + 1 worker (async)", "1ps_2workers": "1 ps + 2 workers (async)",
              "1ps_2workers_in_graph": "1 ps + 2 workers (in-graph)"}
    for key, c in clusters.items():
        workers = ", ".join(f"{w} {r:.0f}" for w, r in sorted(c["per_worker"].items()))
        rows.append((labels[key], c["examples_per_sec"], f"{workers}; wall {c['wall_secs']:.0f} s incl. start"))
    print(f"CIFAR-10 model, batch {args.batch_size} per worker, {os.cpu_count()} CPUs, data {data_dir}")
    print(f"{'setup':<48} {'examples/s':>10} {'vs 1 proc':>9}  notes")
    for label, rate, note in rows:
        print(f"{label:<48} {rate:>10.1f} {rate / fed:>9.2f}  {note}")
    ratios = {
        "input_over_training": results["input_pipeline"] / fed,
        "input_over_compute_only": results["input_pipeline"] / fixed,
        "training_over_compute_only": fed / fixed,
        **{f"{key}_over_one_process": c["examples_per_sec"] / fed for key, c in clusters.items()},
    }
    if "1ps_1worker" in clusters and "1ps_2workers" in clusters:
        ratios["two_workers_over_one"] = (clusters["1ps_2workers"]["examples_per_sec"]
                                          / clusters["1ps_1worker"]["examples_per_sec"])
    results["ratios"] = ratios
    print(f"input pipeline / what training consumes: {ratios['input_over_training']:.2f}x "
          f"(>1: input does not starve training); training / compute only: {ratios['training_over_compute_only']:.2f}")
    if "two_workers_over_one" in ratios:
        print(f"2 workers / 1 worker: {ratios['two_workers_over_one']:.2f}x")
    print(json.dumps(results, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
