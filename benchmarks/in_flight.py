"""Steps in flight on one worker (`--concurrent_steps`) and packed transfers (`--pack_transfers`), measured bare: a
1 ps + 1 worker criteo cluster on this machine, psworker's training graph (packed and not, one model) and session
config, and 1, 2 or 3 threads running `train_op` on one session.

The ps is a `tf.distribute.Server` subprocess (benchmarks/pss_peer.py's `serve`); this process is worker 0. Each
round runs both graphs with every thread count in turn (interleaved), `--steps` global steps each; it prints, per
graph and thread count, the medians over the rounds of wall ms per global step, CPU ms per global step (worker + ps)
and examples/s, and the ratios to one unpacked thread. Without hooks, savers or the dealer: what more steps in flight
can win at most, and where the CPU then binds.

    python benchmarks/in_flight.py [--criteo_dir D] [--batch_size 256] [--steps 600] [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import pss_peer  # noqa: E402  (free ports, server subprocesses)

THREADS = (1, 2, 3)


def measure(sess, train_op, global_step, procs, threads: int, steps: int) -> tuple[float, float]:
    """(wall ms, CPU ms of `procs`) per global step, with `threads` threads sharing `steps` steps."""
    def loop(n: int) -> None:
        for _ in range(n):
            sess.run(train_op)

    cpu = lambda: sum(sum(p.cpu_times()[:2]) for p in procs)   # noqa: E731
    g0, c0, t0 = sess.run(global_step), cpu(), time.perf_counter()
    workers = [threading.Thread(target=loop, args=(steps // threads,)) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    t1, c1, g1 = time.perf_counter(), cpu(), sess.run(global_step)
    return (t1 - t0) / (g1 - g0) * 1000, (c1 - c0) / (g1 - g0) * 1000


def _build(args, cluster: dict, server, packed: bool):
    """(session, train op, global step) of worker 0's criteo graph, packed or not. Both graphs name the same
    variables on the same ps, as two workers' graphs do: they train one model."""
    from psworker.tf_import import import_tensorflow
    tf = import_tensorflow()   # without Keras and scikit-learn, as a task

    from psworker import models
    from psworker.spec import TrainConfig
    from psworker.task.server import session_config
    from psworker.train.graph import build_train_graph

    graph = tf.Graph()
    with graph.as_default():
        config = TrainConfig(model="criteo", batch_size=args.batch_size, learning_rate=0.1, max_steps=10 ** 9,
                             data_dir=args.criteo_dir, train_dir=tempfile.mkdtemp(prefix="in-flight-"),
                             pack_transfers=packed)
        tg = build_train_graph(models.get("criteo"), config, cluster=cluster, task_index=0)
        sess = tf.compat.v1.Session(server.target, graph=graph, config=session_config("worker", 0))
        init = [tf.compat.v1.local_variables_initializer()]
        if not packed:
            init.append(tf.compat.v1.global_variables_initializer())
        sess.run(init)
    return sess, tg.train_op, tg.global_step


def run(args, cluster: dict, ps_pid: int) -> dict:
    """Both graphs, then the interleaved rounds; returns {(packed, threads): (wall, cpu) medians}."""
    import psutil
    from psworker.tf_import import import_tensorflow
    tf = import_tensorflow()   # without Keras and scikit-learn, as a task

    from psworker.task.server import session_config

    server = tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name="worker", task_index=0,
                                  config=session_config("worker", 0))
    built = {packed: _build(args, cluster, server, packed) for packed in (False, True)}
    procs = [psutil.Process(), psutil.Process(ps_pid)]
    for sess, train_op, step in built.values():
        measure(sess, train_op, step, procs, 1, min(30, args.steps))   # warm-up
    got: dict[tuple[bool, int], list[tuple[float, float]]] = {(p, k): [] for p in built for k in THREADS}
    for _ in range(args.rounds):
        for packed, (sess, train_op, step) in built.items():
            for k in THREADS:
                got[packed, k].append(measure(sess, train_op, step, procs, k, args.steps))
    return {key: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for key, v in got.items()}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--criteo_dir", help="Criteo day files (default: `criteo-synthetic --rows_per_day 50000`, in a "
                                        "temporary folder)")
    p.add_argument("--batch_size", type=int, default=256)
    p.add_argument("--steps", type=int, default=600, help="global steps per thread count and round")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--rows_per_day", type=int, default=50_000, help="of the synthetic Criteo days")
    p.add_argument("--quick", action="store_true", help="one round of 12 steps of batch 32 on 2,000 rows a day (for "
                                                        "tests/test_benchmarks.py)")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.rounds, args.batch_size, args.rows_per_day = 12, 1, 32, 2000
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.criteo_dir is None:
        from psworker.data.criteo_synthetic import write_synthetic

        args.criteo_dir = tempfile.mkdtemp(prefix="in-flight-criteo-")
        write_synthetic(args.criteo_dir, days=3, rows_per_day=args.rows_per_day)
    from psworker.tf_import import import_tensorflow
    tf = import_tensorflow()   # without Keras and scikit-learn, as a task

    tf.compat.v1.disable_eager_execution()
    ports = pss_peer.free_ports(2)
    cluster = {"ps": [f"localhost:{ports[0]}"], "worker": [f"localhost:{ports[1]}"]}
    ps_proc = pss_peer.subprocess.Popen(
        [sys.executable, str(HERE / "pss_peer.py"), "serve", "--cluster", json.dumps(cluster), "--job", "ps",
         "--index", "0"], stdout=pss_peer.subprocess.DEVNULL)
    try:
        pss_peer.wait_listening(ports[0], pss_peer.SERVER_START_TIMEOUT_S)
        result = run(args, cluster, ps_proc.pid)
    finally:
        ps_proc.kill()
        ps_proc.wait()
    one = result[False, 1][0]
    print(f"criteo, 1 ps + 1 worker, batch {args.batch_size}, {os.cpu_count()} CPUs, medians of {args.rounds} "
          "interleaved rounds")
    print(f"{'transfers':>10}{'threads':>8}{'wall ms/step':>14}{'CPU ms/step':>13}{'examples/s':>12}{'x one unpacked':>16}")
    for (packed, k), (wall, cpu) in result.items():
        print(f"{'packed' if packed else 'unpacked':>10}{k:>8}{wall:>14.2f}{cpu:>13.2f}"
              f"{args.batch_size * 1000 / wall:>12.0f}{one / wall:>16.2f}")
    print(json.dumps({"batch_size": args.batch_size, "results": {f"{'packed' if p else 'unpacked'} x{k}":
                                                                {"wall_ms": w, "cpu_ms": c}
                                                                for (p, k), (w, c) in result.items()}}))
    sys.stdout.flush()
    os._exit(0)   # the in-process server has no clean shutdown


if __name__ == "__main__":
    sys.exit(main())
