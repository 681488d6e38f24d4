"""The CPU that TensorFlow's gRPC transfer alone costs per CIFAR-10 CNN step: the floor under issue 19's unshaped goal.

Not a test: run it by hand on a quiet machine, e.g.

    python benchmarks/transfer_floor.py --steps 300 --repeat 3

A ps server (its own process) holds variables of the CNN's shapes (4.27 MB of float32); a worker server in this
process runs steps that push one "gradient" per variable to the ps (`assign_sub` placed on the ps, its input a
worker-side tensor) and pull every variable back (an `identity` placed on the worker): the bytes a 1 ps + 1 worker
step moves, with no model compute. The same step in one process without servers gives the apply's own CPU. The
difference, summed over both processes, is what the transfer costs per step; it is compared with the CPU budget
the unshaped goal leaves (10% of a one-process CNN step, `--in_process_ms`, measured by benchmarks/overlap.py).
Repeats are interleaved (cluster, one process, cluster, ...); medians are printed, then a JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # this checkout

# The CIFAR-10 tutorial CNN's trainable variables (psworker/models/cifar10.py): 1,068,298 floats, 4.27 MB.
SHAPES = [(5, 5, 3, 64), (64,), (5, 5, 64, 64), (64,), (2304, 384), (384,), (384, 192), (192,), (192, 10), (10,)]

PS_MAIN = """
import sys
import tensorflow as tf
cluster = tf.train.ClusterSpec({"ps": [sys.argv[1]], "worker": [sys.argv[2]]})
server = tf.compat.v1.train.Server(cluster, job_name="ps", task_index=0)
print("ready", flush=True)
server.join()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build(tf, ps: str, worker: str):
    """Variables on `ps` (empty string: this process), gradients on `worker`; returns (init, step)."""
    v1 = tf.compat.v1
    applies, pulls, grads = [], [], []
    for i, shape in enumerate(SHAPES):
        with tf.device(ps):
            var = v1.get_variable(f"v{i}", shape, initializer=v1.zeros_initializer(), use_resource=True)
        with tf.device(worker):
            grads.append(v1.get_variable(f"g{i}", shape, initializer=v1.ones_initializer(), use_resource=True,
                                         collections=[v1.GraphKeys.LOCAL_VARIABLES]))
        with tf.device(ps):
            applies.append(var.assign_sub(grads[-1].read_value() * 1e-6, read_value=False))
        with tf.device(worker):
            with tf.control_dependencies(applies[-1:]):
                pulls.append(tf.identity(var.read_value()))
    init = tf.group(v1.global_variables_initializer(), v1.local_variables_initializer())
    return init, tf.group(*pulls)


def cpu_of(procs) -> float:
    return sum(p.cpu_times().user + p.cpu_times().system for p in procs)


def run_steps(sess, step, steps: int, procs) -> float:
    """CPU seconds (summed over `procs`) per step over `steps` steps, after 20 warm-up steps."""
    for _ in range(20):
        sess.run(step)
    before = cpu_of(procs)
    for _ in range(steps):
        sess.run(step)
    return (cpu_of(procs) - before) / steps


def cluster_round(tf, steps: int) -> float:
    ps_addr, worker_addr = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    ps = subprocess.Popen([sys.executable, "-c", PS_MAIN, ps_addr, worker_addr], stdout=subprocess.PIPE, text=True,
                          stderr=subprocess.DEVNULL)
    try:
        if ps.stdout.readline().strip() != "ready":
            raise RuntimeError("the ps server did not start")
        cluster = tf.train.ClusterSpec({"ps": [ps_addr], "worker": [worker_addr]})
        server = tf.compat.v1.train.Server(cluster, job_name="worker", task_index=0)
        with tf.Graph().as_default():
            init, step = build(tf, "/job:ps/task:0", "/job:worker/task:0")
            with tf.compat.v1.Session(server.target) as sess:
                sess.run(init)
                return run_steps(sess, step, steps, [psutil.Process(), psutil.Process(ps.pid)])
    finally:
        ps.kill()
        ps.wait()


def local_round(tf, steps: int) -> float:
    with tf.Graph().as_default():
        init, step = build(tf, "/cpu:0", "/cpu:0")
        with tf.compat.v1.Session() as sess:
            sess.run(init)
            return run_steps(sess, step, steps, [psutil.Process()])


def one_round(kind: str, steps: int) -> float:
    """CPU ms per step of one round, in a fresh process (a TensorFlow server cannot be stopped in-process)."""
    done = subprocess.run([sys.executable, __file__, "_round", kind, "--steps", str(steps)], capture_output=True,
                          text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{kind} round failed:\n{done.stderr[-3000:]}")
    return 1000 * float(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_round"]:
        from psworker.tf_import import import_tensorflow
        tf = import_tensorflow()   # without Keras and scikit-learn, as a task

        tf.compat.v1.disable_eager_execution()
        steps = int(argv[argv.index("--steps") + 1])
        print((cluster_round if argv[1] == "cluster" else local_round)(tf, steps))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--in_process_ms", type=float, default=89.6,
                   help="CPU ms of one CNN step in one process (overlap.py's in-process CPU-s per 1,000 examples x "
                        "64 examples; default: 1.40 CPU-s/1k, measured quietly)")
    p.add_argument("--quick", action="store_true", help="one repeat of 20 steps (for tests/test_benchmarks.py)")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.repeat = 20, 1
    cluster, local = [], []
    for r in range(args.repeat):
        cluster.append(one_round("cluster", args.steps))
        local.append(one_round("local", args.steps))
        print(f"[{time.strftime('%H:%M:%S')}] repeat {r + 1}: cluster {cluster[-1]:.2f} CPU-ms/step (ps + worker), "
              f"one process {local[-1]:.2f}", flush=True)
    c, l = statistics.median(cluster), statistics.median(local)
    budget = 0.10 * args.in_process_ms
    mb = 4 * sum(math.prod(s) for s in SHAPES) / 1e6
    print(f"{mb:.2f} MB each way per step: cluster {c:.2f} CPU-ms per step, one process {l:.2f}; the "
          f"transfer costs {c - l:.2f} CPU-ms per step, against a budget of {budget:.2f} (10% of a "
          f"{args.in_process_ms:g} ms one-process CNN step): {(c - l) / budget:.2f}x the budget")
    print(json.dumps({"cluster_ms": cluster, "local_ms": local, "transfer_ms": c - l, "budget_ms": budget,
                      "steps": args.steps}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
