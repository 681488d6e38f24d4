"""What a batch of criteo input costs: psworker's pipeline against the ParameterServerStrategy peer's, side by side.

    python benchmarks/criteo_input.py --criteo_dir /tmp/criteo          # batches of 256, 5 interleaved rounds
    python benchmarks/criteo_input.py --quick                            # a small synthetic set of its own

In this process, on the same training days, each round draws `--batches` batches of `--batch_size` from each
pipeline in turn and times the process's CPU (every thread: tf.data's too) and the wall clock per batch:
  - psworker: `data.criteo.dealt_dataset` (the split read once into int64 integers and 64-bit category keys; a
    batch gathered by line number and hashed to table rows in numpy), fed a shuffled range of line numbers one by
    one, as a worker's dealt positions reach it (there from its dealer's shards, `train.dealer.positions_dataset`);
  - pss: `benchmarks/pss_peer.py`'s `criteo_dataset` (the lines' fields kept as strings; a batch parsed with
    `tf.strings.to_number` and hashed with `tf.strings.to_hash_bucket_fast` in a `map`, prefetched), as that peer's
    workers read it.
Both give `(int64 [B, 39], int32 [B])`: the 13 integers, then each categorical's row in the fused table. Prints
medians over --repeat rounds and the ratio, then a JSON line. The peer's pipeline runs beside its step (tf.data's
threads); a psworker worker's too (`prefetch(2)`): on a CPU-bound host both cost CPU that a step could have used.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # this checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))          # pss_peer

QUICK = {"batches": 20, "repeat": 1, "rows_per_day": 3000}


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--criteo_dir", help="Criteo day files (default: a synthetic set written in a temp dir)")
    p.add_argument("--batch_size", type=int, default=256)
    p.add_argument("--batches", type=int, default=300, help="batches per pipeline and round")
    p.add_argument("--repeat", type=int, default=5, help="rounds (interleaved)")
    p.add_argument("--rows_per_day", type=int, default=50_000, help="of the synthetic set, when no --criteo_dir")
    p.add_argument("--quick", action="store_true", help=f"seconds, for tests/test_benchmarks.py: {QUICK}")
    args = p.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    return args


def _pipelines(data_dir: str, batch_size: int) -> dict:
    """{name: an endless iterator of (features, labels) batches}."""
    import tensorflow as tf

    import pss_peer
    from psworker.data import criteo
    from psworker.models.criteo import buckets

    n = criteo.num_examples(data_dir)
    positions = tf.data.Dataset.range(n).shuffle(n, seed=0).repeat()
    return {"psworker": iter(criteo.dealt_dataset(data_dir, positions, batch_size, buckets())),
            "pss": iter(pss_peer.criteo_dataset(data_dir, batch_size, seed=0))}


def _round(batches, count: int) -> tuple[float, float]:
    """(CPU-us, wall-us) per batch drawn from `batches`."""
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(count):
        features, _labels = next(batches)
    assert features.shape[1] == 39, features.shape
    return (time.process_time() - cpu) / count * 1e6, (time.perf_counter() - wall) / count * 1e6


def measure(args, data_dir: str) -> dict:
    """{name: {"cpu_us": [per round], "wall_us": [per round]}}, interleaved rounds after a warm-up."""
    pipelines = _pipelines(data_dir, args.batch_size)
    out = {name: {"cpu_us": [], "wall_us": []} for name in pipelines}
    for batches in pipelines.values():
        _round(batches, 5)                                  # warm-up: the split's read, tf.data's threads
    for _ in range(args.repeat):
        for name, batches in pipelines.items():
            cpu, wall = _round(batches, args.batches)
            out[name]["cpu_us"].append(cpu)
            out[name]["wall_us"].append(wall)
    return out


def main(argv=None) -> dict:
    args = _parse(argv)
    from psworker.tf_import import import_tensorflow

    import_tensorflow()
    with tempfile.TemporaryDirectory(prefix="criteo_input_") as tmp:
        data_dir = args.criteo_dir
        if data_dir is None:
            from psworker.data.criteo_synthetic import write_synthetic

            data_dir = str(Path(tmp) / "criteo")
            write_synthetic(data_dir, rows_per_day=args.rows_per_day)
        samples = measure(args, data_dir)
    cpu = {name: statistics.median(s["cpu_us"]) for name, s in samples.items()}
    wall = {name: statistics.median(s["wall_us"]) for name, s in samples.items()}
    print(f"criteo input, batches of {args.batch_size}, {args.batches} per pipeline and round, medians of "
          f"{args.repeat}")
    for name, label in (("psworker", "psworker (numpy, hashed once)"), ("pss", "pss_peer (strings, tf.data)")):
        print(f"  {label:30s} {cpu[name]:9.1f} CPU-us per batch, {wall[name]:9.1f} wall-us")
    print(f"psworker / pss: {cpu['psworker'] / cpu['pss']:.2f}x the CPU per batch")
    result = {"args": vars(args), "cpu_us": cpu, "wall_us": wall, "samples": samples}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    main()
