"""What staged variables cost the CIFAR-10 CNN's convergence (issue 19, item 3), in one process: loss curves.

Not a test: run it by hand, e.g.

    python benchmarks/staged_loss.py --rates 0.1,0.05 --variants plain,staged,delayed --steps 240

Each variant trains the CNN in one process without servers (`build_train_graph(..., cluster=None)`), synthetic
CIFAR-10 (written to --data_dir when missing), batch 128, seed 1, at each rate (`--learning_rate`, the tutorial's
0.1 by default):
  - plain: no staging;
  - staged: `--staged_vars true` under the CNN's plain gradient descent (the staged copy carries the worker's own
    update: in one process the same update rule as plain);
  - delayed: `--staged_vars true` under `MomentumOptimizer(momentum=0)`, the same updates as gradient descent but
    an optimizer whose own update the staged copy does not add: one-step-delayed SGD, what every optimizer other
    than plain gradient descent gets (and what every staged run got before).
Prints the mean loss over each window of `--window` steps and over steps 200-240 (or the last window), then a JSON
line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _model(variant: str):
    from psworker.tf_import import import_tensorflow
    tf = import_tensorflow()   # without Keras and scikit-learn, as a task

    from psworker import models

    model = models.get("cifar10")
    if variant != "delayed":
        return model

    class MomentumZero(type(model)):
        def optimizer(self, learning_rate):
            return tf.compat.v1.train.MomentumOptimizer(learning_rate, momentum=0.0)

    return MomentumZero()


def losses(variant: str, rate: float, steps: int, data_dir: str, batch_size: int = 128) -> list[float]:
    """The loss of every step of one in-process run."""
    from psworker.tf_import import import_tensorflow
    tf = import_tensorflow()   # without Keras and scikit-learn, as a task

    from psworker.spec import TrainConfig
    from psworker.train.graph import build_train_graph

    v1 = tf.compat.v1
    with tf.Graph().as_default():
        v1.set_random_seed(1)
        config = TrainConfig(model="cifar10", batch_size=batch_size, seed=1, data_dir=data_dir, learning_rate=rate,
                             staged_vars=variant != "plain")
        tg = build_train_graph(_model(variant), config, cluster=None, task_index=0)
        with v1.train.MonitoredSession(session_creator=v1.train.ChiefSessionCreator()) as sess:
            return [float(sess.run([tg.train_op, tg.loss])[1]) for _ in range(steps)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", default="0.1", help="comma-separated learning rates")
    p.add_argument("--variants", default="plain,staged,delayed", help="of plain, staged, delayed")
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--window", type=int, default=40)
    p.add_argument("--data_dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "psworker-cifar10-synth"))
    p.add_argument("--batch_size", type=int, default=128)
    p.add_argument("--quick", action="store_true", help="6 steps of batch 16 on a tiny synthetic set, per variant "
                                                        "(for tests/test_benchmarks.py)")
    args = p.parse_args()
    synthetic = {}
    if args.quick:
        args.steps, args.window, args.batch_size = 6, 3, 16
        args.data_dir, synthetic = args.data_dir + "-quick", {"train_per_class": 10, "test_per_class": 2}
    from psworker.tf_import import import_tensorflow
    tf = import_tensorflow()   # without Keras and scikit-learn, as a task

    from psworker.data import cifar10, cifar10_files

    tf.compat.v1.disable_eager_execution()
    if not os.path.isdir(os.path.join(args.data_dir, cifar10.BATCHES_DIR)):
        cifar10_files.write_synthetic(args.data_dir, **synthetic)
    rows = []
    for rate in (float(r) for r in args.rates.split(",")):
        for variant in args.variants.split(","):
            start = time.perf_counter()
            got = losses(variant, rate, args.steps, args.data_dir, args.batch_size)
            windows = [round(sum(got[i:i + args.window]) / len(got[i:i + args.window]), 3)
                       for i in range(0, len(got), args.window)]
            tail = got[200:240] or got[-args.window:]
            rows.append({"variant": variant, "rate": rate, "windows": windows,
                         "mean_200_240": round(sum(tail) / len(tail), 3),
                         "secs": round(time.perf_counter() - start, 1)})
            label = "steps 200-240" if len(got) >= 240 else f"last {len(tail)} steps"
            print(f"rate {rate:g} {variant:8s} mean loss {label} {rows[-1]['mean_200_240']:.3f}  "
                  f"per {args.window} steps {windows}", flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
