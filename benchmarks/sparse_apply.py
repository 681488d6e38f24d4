"""What one sparse Adagrad update of a table's rows costs on a ps: TF's kernel against `slots.gathered_adagrad`.

    python benchmarks/sparse_apply.py                        # criteo's shard at 2 ps: 1,175 rows of 8 in 260k
    python benchmarks/sparse_apply.py --rows 520000 --touched 2350 --repeat 7

In this process, on one table (`--rows` x `--dim` float32, and its accumulator), each round times `--steps` updates
of `--touched` distinct random rows by each variant, interleaved: TF's `ResourceSparseApplyAdagrad` (what
`AdagradOptimizer` runs), psworker's `gathered_adagrad`, and the same in its `row_lock` (as the ps runs it); also the feed alone (the indices and gradient rows fed in,
summed), to subtract. Prints CPU microseconds per update (process time, feed subtracted), medians of --repeat
rounds, the ratio, and that both give the same table (max abs difference after the same updates); then a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # this checkout

QUICK = {"rows": 50_000, "touched": 1_000, "steps": 30, "repeat": 1}


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=260_000)
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--touched", type=int, default=1_175, help="distinct rows per update")
    p.add_argument("--steps", type=int, default=300, help="updates per variant and round")
    p.add_argument("--repeat", type=int, default=5, help="rounds (interleaved)")
    p.add_argument("--quick", action="store_true", help=f"seconds, for tests/test_benchmarks.py: {QUICK}")
    args = p.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    return args


def _graph(args):
    """`(placeholders, {variant: op}, variables)` on one table and accumulator per update variant."""
    import tensorflow as tf

    from psworker.train import slots

    v1 = tf.compat.v1
    ids = v1.placeholder(tf.int64, [None])
    grad = v1.placeholder(tf.float32, [None, args.dim])
    tables = {}
    for name in ("tf", "gathered", "locked"):
        tables[name] = (tf.Variable(v1.random_normal([args.rows, args.dim], seed=1), name=f"{name}_table"),
                        tf.Variable(tf.fill([args.rows, args.dim], 0.1), name=f"{name}_accumulator"))
    lr = tf.constant(0.05)
    (var, acc), (gvar, gacc), (lvar, lacc) = tables["tf"], tables["gathered"], tables["locked"]
    ops = {"feed": tf.group(tf.reduce_sum(grad), tf.reduce_sum(ids)),
           "tf": tf.raw_ops.ResourceSparseApplyAdagrad(var=var.handle, accum=acc.handle, lr=lr, grad=grad,
                                                       indices=ids),
           "gathered": slots.gathered_adagrad(gvar, gacc, lr, grad, ids),
           "locked": slots.gathered_adagrad(lvar, lacc, lr, grad, ids, slots.row_lock(lvar))}
    return (ids, grad), ops, tables


def _round(sess, op, feeds) -> float:
    """CPU microseconds per run of `op` over `feeds`."""
    began = time.process_time()
    for feed in feeds:
        sess.run(op, feed)
    return (time.process_time() - began) / len(feeds) * 1e6


def main(argv=None) -> dict:
    args = _parse(argv)
    from psworker.tf_import import import_tensorflow

    tf = import_tensorflow()
    import numpy as np

    tf.compat.v1.disable_eager_execution()
    (ids, grad), ops, tables = _graph(args)
    rng = np.random.default_rng(0)
    feeds = [{ids: rng.choice(args.rows, args.touched, replace=False),
              grad: rng.normal(size=(args.touched, args.dim)).astype(np.float32)} for _ in range(args.steps)]
    times = {name: [] for name in ops}
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for name, op in ops.items():
            _round(sess, op, feeds[:3])                     # warm-up
        for _ in range(args.repeat):
            for name, op in ops.items():
                times[name].append(_round(sess, op, feeds))
        diff = max(float(np.max(np.abs(sess.run(tables["tf"][0]) - sess.run(tables[name][0]))))
                   for name in ("gathered", "locked"))
    feed = statistics.median(times["feed"])
    net = {name: statistics.median(times[name]) - feed for name in ("tf", "gathered", "locked")}
    print(f"table {args.rows:,} x {args.dim}, {args.touched:,} distinct rows per update, medians of {args.repeat}")
    print(f"  feed alone                      {feed:9.1f} CPU-us")
    for name, label in (("tf", "TF ResourceSparseApplyAdagrad"), ("gathered", "psworker gathered_adagrad"),
                        ("locked", "the same in its row_lock")):
        print(f"  {label:31s} {net[name]:9.1f} CPU-us per update, feed subtracted "
              f"({statistics.median(times[name]):.1f} with it)")
    print(f"gathered / TF: {net['gathered'] / net['tf']:.2f}x the CPU, in its lock {net['locked'] / net['tf']:.2f}x; "
          f"tables after the same updates differ by at most {diff:.2e}")
    result = {"args": vars(args), "feed_us": feed, "net_us": net, "samples_us": times, "max_abs_diff": diff}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    main()
