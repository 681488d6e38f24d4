"""What checking a checkpoint before a restore costs (`psworker.train.checkpoints.problem`), against the restore.

Not a test: run it by hand, e.g. `python benchmarks/checkpoint_check.py --repeat 5`. Writes one checkpoint of the
CIFAR-10 CNN's variables with their moving averages (what `--model cifar10` saves, optimizer slots aside:
about 8.5 MB), then times, in this process: the cheap checks (files, sizes, variables against the graph), the full
check (also every tensor read back, checksums verified), and `Saver.restore` into a fresh session. Medians in ms,
then a JSON line.
"""

from __future__ import annotations

import argparse
import sys
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # this checkout


def _timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        fn()
        times.append((time.perf_counter() - began) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="one repeat (seconds, for tests/test_benchmarks.py)")
    args = parser.parse_args()
    if args.quick:
        args.repeat = 1
    from psworker.tf_import import import_tensorflow
    tf = import_tensorflow()   # without Keras and scikit-learn, as a task

    from psworker import models
    from psworker.train import checkpoints

    v1 = tf.compat.v1
    v1.disable_eager_execution()
    model = models.get("cifar10")
    with tempfile.TemporaryDirectory() as train_dir, tf.Graph().as_default():
        v1.train.get_or_create_global_step()
        model.inference(v1.placeholder(tf.float32, [None, 24, 24, 3]), training=True)
        v1.train.ExponentialMovingAverage(model.moving_average_decay).apply(v1.trainable_variables())
        saver = v1.train.Saver(sharded=True)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            path = saver.save(sess, os.path.join(train_dir, "model.ckpt"), global_step=0, write_meta_graph=False)
            expected = checkpoints.expected_variables()
            (found,) = checkpoints.find(train_dir)
            size = sum(os.path.getsize(os.path.join(train_dir, f)) for f in found.files)
            cheap = _timed(lambda: checkpoints.problem(found, expected, read_tensors=False), args.repeat)
            full = _timed(lambda: checkpoints.problem(found, expected), args.repeat)
            restore = _timed(lambda: saver.restore(sess, path), args.repeat)
    print(f"checkpoint {size / 1e6:.2f} MB: cheap check {cheap:.1f} ms, full check {full:.1f} ms, "
          f"restore {restore:.1f} ms (medians of {args.repeat})")
    print(json.dumps({"bytes": size, "cheap_ms": round(cheap, 2), "full_ms": round(full, 2),
                      "restore_ms": round(restore, 2)}))


if __name__ == "__main__":
    main()
