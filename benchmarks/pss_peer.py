"""The peer to compare psworker with: TF2 `ParameterServerStrategy` + `ClusterCoordinator`, the same models.

Standalone (imports nothing from psworker), written from TensorFlow's parameter-server training guide:
ps and worker `tf.distribute.Server`s run as subprocesses on free loopback ports, the coordinator runs in this
process (`SimpleClusterResolver(..., rpc_layer="grpc")`), each worker reads its own `tf.data` pipeline
(`create_per_worker_dataset`) and the coordinator schedules one training step per closure.

The models are psworker's, rebuilt with `tf.Variable` + `tf.nn` (no Keras):
  - cnn: the CIFAR-10 tutorial CNN of psworker/models/cifar10.py (same layers, initialisers, 0.004 weight decay on
    local3/local4, plain SGD at the same constant learning rate, a global step on the ps). Moving averages only
    with --ema (decay 0.9999 with num_updates = global step, updated on the ps after the apply, as
    `ExponentialMovingAverage` does in psworker). Data: synthetic/real CIFAR-10 binary records
    (`python -m psworker data cifar10-synthetic --data_dir D`), read, cropped, flipped, brightness/contrast,
    standardised, batched: the same pipeline as psworker/data/cifar10.py.
  - mlp: 64-256-10 ReLU MLP of psworker/models/mlp.py on scikit-learn's digits (same split, same standardisation).
  - criteo: psworker/models/criteo.py's click-through model (one fused table of the 26 hashed columns, dim 8, the
    log of the 13 integers, a 64-32-1 MLP, logloss, Adagrad at 0.1) on Criteo day files
    (`python -m psworker data criteo-synthetic --data_dir D`; every day but the last). As a fair peer must: the
    table is a `ShardedVariable` (`MinSizePartitioner`, --ps > 1) built from a callable initializer that takes each
    partition's shape and offset; each batch's ids are deduplicated before `tf.nn.embedding_lookup`; each
    Adagrad accumulator is colocated with its shard and updated there by `ResourceSparseApplyAdagrad`.

    python benchmarks/pss_peer.py --model cnn --workers 1 --steps 200 --data_dir D   # 1 ps + 1 worker
    python benchmarks/pss_peer.py --model mlp --workers 0 --steps 2000                 # in-process baseline

    python benchmarks/pss_peer.py --model cnn --ps 2 --workers 2 --ps_link_rate 100mbit --data_dir D
    python benchmarks/pss_peer.py --model criteo --ps 2 --workers 1 --batch_size 256 --data_dir CRITEO_DIR

--ps N > 1 gives the strategy a `MinSizePartitioner` (256 KiB shards, at most N), its best. --ps_link_rate RATE
runs the whole peer in a private network namespace (`unshare --net --map-root-user`) with each ps port shaped as
`psworker local --ps_link_rate` shapes it (psworker/launcher/shaping.py: the one import from psworker); the JSON
then has the bytes each ps link carried.

Prints one line, and last a JSON line: {"examples_per_sec": ..., "steps_per_sec": ..., ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Optional

WEIGHT_DECAY = 0.004
EMA_DECAY = 0.9999
DIGITS_TEST_FRACTION = 0.2
SERVER_START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 5.0


# ------------------------------------------------------------------------------------------------ servers

def free_ports(n: int) -> list[int]:
    """`n` distinct free loopback ports (all held open until every one is chosen)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def serve(cluster: dict, job: str, index: int) -> None:
    """Runs one `tf.distribute.Server` until killed (the `serve` subcommand)."""
    import tensorflow as tf

    server = tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=job, task_index=index,
                                  protocol="grpc", start=True)
    print(f"{job}:{index} serving at {server.target}", flush=True)
    server.join()


def wait_listening(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"no server listening on 127.0.0.1:{port} after {timeout_s:.0f} s")


def start_servers(num_ps: int, num_workers: int, link_rate_bps: Optional[int] = None
                  ) -> tuple[dict, list[subprocess.Popen], object]:
    """Starts the ps and worker servers as subprocesses; returns the cluster dict, the processes and the link
    shaping installed on their ports (None: unshaped)."""
    ports = free_ports(num_ps + num_workers)
    link = None
    if link_rate_bps is not None:
        from psworker.launcher import shaping

        link = shaping.LinkShaping(link_rate_bps, tuple(ports[:num_ps]), tuple(ports[num_ps:]))
        shaping.install(link)
    cluster = {"ps": [f"localhost:{p}" for p in ports[:num_ps]],
               "worker": [f"localhost:{p}" for p in ports[num_ps:]]}
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
    procs = []
    try:
        for job, addresses in cluster.items():
            for i in range(len(addresses)):
                procs.append(subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), "serve", "--cluster", json.dumps(cluster),
                     "--job", job, "--index", str(i)], env=env, stdout=subprocess.DEVNULL))
        for port in ports:
            wait_listening(port, SERVER_START_TIMEOUT_S)
    except BaseException:
        stop_servers(procs)
        raise
    return cluster, procs, link


def stop_servers(procs: list[subprocess.Popen]) -> None:
    """Terminates each server process, then kills what is left after STOP_TIMEOUT_S."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=STOP_TIMEOUT_S)


# ------------------------------------------------------------------------------------------------ data

def cifar_dataset(data_dir: str, batch_size: int, seed: Optional[int] = None):
    """psworker/data/cifar10.py's training pipeline: records -> shuffle -> distort -> batch."""
    import tensorflow as tf

    folder = os.path.join(data_dir, "cifar-10-batches-bin")
    folder = folder if os.path.isdir(folder) else data_dir
    files = [os.path.join(folder, f"data_batch_{i}.bin") for i in range(1, 6)]
    missing = [f for f in files if not os.path.exists(f)]
    if missing:
        raise SystemExit(f"missing CIFAR-10 files {missing}: run `python -m psworker data cifar10-synthetic "
                         f"--data_dir {data_dir}` first")
    ds = tf.data.FixedLengthRecordDataset(files, 1 + 32 * 32 * 3)
    ds = ds.shuffle(20000, seed=seed, reshuffle_each_iteration=True).repeat()

    def parse(record):
        raw = tf.io.decode_raw(record, tf.uint8)
        label = tf.cast(raw[0], tf.int32)
        image = tf.transpose(tf.reshape(raw[1:], [3, 32, 32]), [1, 2, 0])
        image = tf.cast(image, tf.float32)
        image = tf.image.random_crop(image, [24, 24, 3])
        image = tf.image.random_flip_left_right(image)
        image = tf.image.random_brightness(image, max_delta=63)
        image = tf.image.random_contrast(image, lower=0.2, upper=1.8)
        image = tf.image.per_image_standardization(image)
        image.set_shape([24, 24, 3])
        return image, label

    ds = ds.map(parse, num_parallel_calls=tf.data.AUTOTUNE)
    return ds.batch(batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)


def digits_dataset(batch_size: int, seed: Optional[int] = None):
    """psworker/data/digits.py's training split: [0,1] pixels standardised by train mean and std + 0.1."""
    import numpy as np
    import tensorflow as tf
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    rng = np.random.default_rng(0)
    test = np.zeros(len(y), dtype=bool)
    for label in np.unique(y):
        idx = np.flatnonzero(y == label)
        rng.shuffle(idx)
        test[idx[: int(round(len(idx) * DIGITS_TEST_FRACTION))]] = True
    x, y = x[~test], y[~test]
    x = ((x - x.mean(axis=0)) / (x.std(axis=0) + 0.1)).astype(np.float32)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=seed, reshuffle_each_iteration=True)
    return ds.repeat().batch(batch_size, drop_remainder=True).prefetch(2)


CRITEO_CARDINALITIES = (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27,
                        14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572)
CRITEO_BUCKETS = tuple(min(4 * c, 20_000) for c in CRITEO_CARDINALITIES)   # psworker/models/criteo.py's
CRITEO_DIM = 8


def criteo_dataset(data_dir: str, batch_size: int, seed: Optional[int] = None):
    """Criteo day files (every day but the last; .gz too) -> shuffled batches of (int64 [B, 39], int32 [B]): the 13
    integers (empty: 0), then each categorical's row in the fused table (its column's offset + hash bucket)."""
    import gzip
    import re

    import numpy as np
    import tensorflow as tf

    days = sorted((int(m[1]), n) for n in os.listdir(data_dir) if (m := re.match(r"^day_(\d+)(\.gz)?$", n)))
    if len(days) < 2:
        raise SystemExit(f"no Criteo day files in {data_dir}: run `python -m psworker data criteo-synthetic "
                         f"--data_dir {data_dir}` first")
    rows = []
    for _, name in days[:-1]:
        path = os.path.join(data_dir, name)
        with (gzip.open(path, "rb") if name.endswith(".gz") else open(path, "rb")) as f:
            rows += [line.rstrip(b"\r\n").split(b"\t") for line in f]
    table = np.array(rows, dtype=bytes)
    labels, fields = (table[:, 0] == b"1").astype(np.int32), table[:, 1:]
    offsets = tf.constant(np.concatenate([[0], np.cumsum(CRITEO_BUCKETS)[:-1]]), tf.int64)

    def parse(f, y):
        ints = tf.strings.to_number(tf.where(tf.equal(f[:, :13], b""), b"0", f[:, :13]), tf.int64)
        cats = tf.stack([tf.strings.to_hash_bucket_fast(f[:, 13 + c], CRITEO_BUCKETS[c]) for c in range(26)], 1)
        return tf.concat([ints, cats + offsets[tf.newaxis, :]], axis=1), y

    ds = tf.data.Dataset.from_tensor_slices((fields, labels)).shuffle(len(labels), seed=seed).repeat()
    return ds.batch(batch_size, drop_remainder=True).map(parse).prefetch(2)


# ------------------------------------------------------------------------------------------------ models


class CtrNet:
    """psworker's criteo model (see the module docstring): its variables, loss and sparse Adagrad step."""

    def __init__(self, strategy=None):
        import tensorflow as tf

        rows = sum(CRITEO_BUCKETS)

        def table_init(shape=(rows, CRITEO_DIM), dtype=tf.float32, partition_shape=None, partition_offset=None):
            return tf.random.truncated_normal(partition_shape or shape, stddev=0.05, dtype=dtype)

        self.table = tf.Variable(table_init, shape=(rows, CRITEO_DIM), dtype=tf.float32, name="embeddings")
        widths = (26 * CRITEO_DIM + 13, 64, 32, 1)
        self.dense = []
        for i, (a, b) in enumerate(zip(widths, widths[1:]), start=1):
            self.dense.append(tf.Variable(tf.random.truncated_normal([a, b], stddev=(2.0 / a) ** 0.5), name=f"w{i}"))
            self.dense.append(tf.Variable(tf.zeros([b]), name=f"b{i}"))
        self.global_step = tf.Variable(0, dtype=tf.int64, name="global_step", trainable=False)
        shards = getattr(self.table, "variables", [self.table])
        self.accumulators = []
        for v in [*shards, *self.dense]:   # each accumulator on its variable's ps
            colocate = strategy.extended.colocate_vars_with(v) if strategy else _null()
            with colocate:
                self.accumulators.append(tf.Variable(tf.fill(v.shape, 0.1), trainable=False))
        self.shards = shards

    def loss(self, features, labels):
        import tensorflow as tf

        ids = features[:, 13:]
        distinct, where = tf.unique(tf.reshape(ids, [-1]))
        rows = tf.nn.embedding_lookup(self.table, distinct)
        x = tf.reshape(tf.gather(rows, where), [-1, 26 * CRITEO_DIM])
        x = tf.concat([x, tf.math.log1p(tf.cast(tf.maximum(features[:, :13], 0), tf.float32))], axis=1)
        p = [tf.identity(v) for v in self.dense]
        for i in range(0, len(p), 2):
            x = tf.matmul(x, p[i]) + p[i + 1]
            x = tf.nn.relu(x) if i + 2 < len(p) else x
        return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(tf.cast(labels, tf.float32), x[:, 0]))

    def train_step(self, features, labels, learning_rate: float):
        import tensorflow as tf

        variables = [*self.shards, *self.dense]
        with tf.GradientTape() as tape:
            loss = self.loss(features, labels)
        grads = tape.gradient(loss, variables)
        for v, acc, g in zip(variables, self.accumulators, grads):
            with tf.device(v.device):
                if isinstance(g, tf.IndexedSlices):
                    tf.raw_ops.ResourceSparseApplyAdagrad(var=v.handle, accum=acc.handle, lr=learning_rate,
                                                          grad=g.values, indices=g.indices)
                else:
                    tf.raw_ops.ResourceApplyAdagrad(var=v.handle, accum=acc.handle, lr=learning_rate, grad=g)
        self.global_step.assign_add(1)
        return loss


def _null():
    import contextlib

    return contextlib.nullcontext()



class Net:
    """The model's variables (created in the caller's strategy scope) and its loss."""

    def __init__(self, kind: str, ema: bool):
        import tensorflow as tf

        self.kind = kind
        tn = tf.random.truncated_normal

        def var(name, value):
            return tf.Variable(value, name=name, dtype=tf.float32)

        if kind == "cnn":
            self.params = {
                "conv1/weights": var("conv1_w", tn([5, 5, 3, 64], stddev=5e-2)),
                "conv1/biases": var("conv1_b", tf.zeros([64])),
                "conv2/weights": var("conv2_w", tn([5, 5, 64, 64], stddev=5e-2)),
                "conv2/biases": var("conv2_b", tf.fill([64], 0.1)),
                "local3/weights": var("local3_w", tn([6 * 6 * 64, 384], stddev=0.04)),
                "local3/biases": var("local3_b", tf.fill([384], 0.1)),
                "local4/weights": var("local4_w", tn([384, 192], stddev=0.04)),
                "local4/biases": var("local4_b", tf.fill([192], 0.1)),
                "softmax/weights": var("softmax_w", tn([192, 10], stddev=1 / 192.0)),
                "softmax/biases": var("softmax_b", tf.zeros([10])),
            }
        elif kind == "mlp":
            self.params = {
                "hidden1/weights": var("hidden1_w", tn([64, 256], stddev=(2.0 / 64) ** 0.5)),
                "hidden1/biases": var("hidden1_b", tf.zeros([256])),
                "softmax/weights": var("softmax_w", tn([256, 10], stddev=1.0 / 256)),
                "softmax/biases": var("softmax_b", tf.zeros([10])),
            }
        else:
            raise ValueError(f"unknown model {kind!r}")
        self.global_step = tf.Variable(0, dtype=tf.int64, name="global_step", trainable=False)
        self.shadows = {k: tf.Variable(v.read_value(), name=k.replace("/", "_") + "_ema", trainable=False)
                        for k, v in self.params.items()} if ema else {}

    def loss(self, images, labels):
        import tensorflow as tf

        # One read per variable and step: each read of a remote variable crosses the network again (the weight
        # decay and the layer would read local3/local4 twice).
        p = {k: tf.concat([tf.identity(s) for s in v.variables], axis=0) if hasattr(v, "variables")
             else tf.identity(v) for k, v in self.params.items()}
        if self.kind == "mlp":
            x = tf.nn.relu(tf.matmul(images, p["hidden1/weights"]) + p["hidden1/biases"])
            logits = tf.matmul(x, p["softmax/weights"]) + p["softmax/biases"]
            decay = 0.0
        else:
            x = tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(images, p["conv1/weights"], 1, "SAME"), p["conv1/biases"]))
            x = tf.nn.max_pool2d(x, ksize=3, strides=2, padding="SAME")
            x = tf.nn.lrn(x, depth_radius=4, bias=1.0, alpha=0.001 / 9.0, beta=0.75)
            x = tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(x, p["conv2/weights"], 1, "SAME"), p["conv2/biases"]))
            x = tf.nn.lrn(x, depth_radius=4, bias=1.0, alpha=0.001 / 9.0, beta=0.75)
            x = tf.nn.max_pool2d(x, ksize=3, strides=2, padding="SAME")
            x = tf.reshape(x, [-1, 6 * 6 * 64])
            x = tf.nn.relu(tf.matmul(x, p["local3/weights"]) + p["local3/biases"])
            x = tf.nn.relu(tf.matmul(x, p["local4/weights"]) + p["local4/biases"])
            logits = tf.matmul(x, p["softmax/weights"]) + p["softmax/biases"]
            decay = WEIGHT_DECAY * (tf.nn.l2_loss(p["local3/weights"]) + tf.nn.l2_loss(p["local4/weights"]))
        xent = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=tf.cast(labels, tf.int64), logits=logits))
        return xent + decay

    def train_step(self, images, labels, learning_rate: float):
        """One SGD step: gradients on the worker, `v -= lr * g` on the variable's ps, step += 1, then the EMAs."""
        import tensorflow as tf

        shards = [s for v in self.params.values() for s in getattr(v, "variables", [v])]   # ShardedVariable
        with tf.GradientTape() as tape:
            loss = self.loss(images, labels)
        grads = tape.gradient(loss, shards)
        for v, g in zip(shards, grads):
            with tf.device(v.device):
                v.assign_sub(learning_rate * g)
        step = self.global_step.assign_add(1)
        if self.shadows:
            with tf.device(self.global_step.device):
                n_upd = tf.cast(step, tf.float32)
                decay = tf.minimum(EMA_DECAY, (1.0 + n_upd) / (10.0 + n_upd))
            for n, shadow in self.shadows.items():
                with tf.device(shadow.device):
                    shadow.assign_sub((1.0 - decay) * (shadow - self.params[n]))
        return loss


# ------------------------------------------------------------------------------------------------ runs

def make_dataset(model: str, batch_size: int, data_dir: Optional[str]):
    if model == "criteo":
        if not data_dir:
            raise SystemExit("--data_dir is required for criteo")
        return criteo_dataset(data_dir, batch_size)
    if model == "cnn":
        if not data_dir:
            raise SystemExit("--data_dir is required for the cnn")
        return cifar_dataset(data_dir, batch_size)
    return digits_dataset(batch_size)


def run_in_process(args) -> float:
    """Seconds for `args.steps` steps of the same tf.function step in this process, no servers."""
    import tensorflow as tf

    net = CtrNet() if args.model == "criteo" else Net(args.model, args.ema)
    it = iter(make_dataset(args.model, args.batch_size, args.data_dir))

    @tf.function
    def step(iterator):
        images, labels = next(iterator)
        return net.train_step(images, labels, args.learning_rate)

    for _ in range(args.warmup):
        step(it)
    step(it).numpy()
    started = time.perf_counter()
    for _ in range(args.steps):
        loss = step(it)
    loss.numpy()
    return time.perf_counter() - started


def run_cluster(args) -> tuple[float, dict]:
    """Seconds for `args.steps` steps scheduled by a ClusterCoordinator on `args.ps` ps + `args.workers` workers,
    and what else the JSON line reports (the bytes each shaped ps link carried)."""
    import tensorflow as tf

    cluster, procs, link = start_servers(args.ps, args.workers, args.ps_link_rate)
    try:
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(cluster), rpc_layer="grpc")
        partitioner = (tf.distribute.experimental.partitioners.MinSizePartitioner(
            min_shard_bytes=256 << 10, max_shards=args.ps) if args.ps > 1 else None)
        strategy = tf.distribute.experimental.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
        coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            net = CtrNet(strategy) if args.model == "criteo" else Net(args.model, args.ema)

        def dataset_fn():
            return make_dataset(args.model, args.batch_size, args.data_dir)

        per_worker = coordinator.create_per_worker_dataset(dataset_fn)
        it = iter(per_worker)

        @tf.function
        def step(iterator):
            images, labels = next(iterator)
            return strategy.run(net.train_step, args=(images, labels, args.learning_rate))

        for _ in range(args.warmup):
            coordinator.schedule(step, args=(it,))
        coordinator.join()
        started = time.perf_counter()
        for _ in range(args.steps):
            coordinator.schedule(step, args=(it,))
        coordinator.join()
        seconds = time.perf_counter() - started
        return seconds, _link_bytes(link)
    finally:
        stop_servers(procs)


def _link_bytes(link) -> dict:
    """{"link_bytes": [[to ps i, from ps i], ...], "pulled_bytes": gradients pulled from the workers} or {}."""
    if link is None:
        return {}
    from psworker.launcher import shaping

    counters = shaping.read_counters(link.dev)
    return {"link_bytes": [[b.to_ps, b.from_ps] for b in shaping.port_bytes(link, counters)],
            "pulled_bytes": counters.get(shaping.PULLED_CLASS, 0)}


def isolate(argv: list[str]) -> None:
    """--ps_link_rate: re-executes this script in a private network namespace (once), and sets `lo` up there."""
    from psworker.launcher import netns, shaping

    if not netns.inside():
        missing = shaping.missing_tool() or (None if netns.available() else "a private network namespace")
        if missing:
            raise SystemExit(f"pss_peer.py --ps_link_rate: missing {missing}")
        env = dict(os.environ, **{netns.ENV_MARK: "1"})
        sys.stdout.flush()
        os.execvpe(netns.UNSHARE[0], [*netns.UNSHARE, "--", sys.executable, os.path.abspath(__file__), *argv], env)
    netns.bring_up_loopback()


def main(argv: Optional[list[str]] = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["serve"]:
        p = argparse.ArgumentParser(prog="pss_peer.py serve")
        p.add_argument("--cluster", required=True)
        p.add_argument("--job", required=True)
        p.add_argument("--index", type=int, required=True)
        a = p.parse_args(argv[1:])
        serve(json.loads(a.cluster), a.job, a.index)
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("cnn", "mlp", "criteo"), default="mlp")
    p.add_argument("--workers", type=int, default=1, help="0: in-process baseline, no servers")
    p.add_argument("--ps", type=int, default=1, help="ps tasks (> 1: a MinSizePartitioner shards the variables)")
    p.add_argument("--ps_link_rate", default=None, metavar="RATE",
                   help="shape each ps port to RATE per direction (tc units: 100mbit, 1gbit) in a private namespace")
    p.add_argument("--steps", type=int, default=200, help="timed steps (global steps in a cluster)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--batch_size", type=int, default=64, help="per step (per worker)")
    p.add_argument("--learning_rate", type=float, default=0.1)
    p.add_argument("--ema", action="store_true", help="also update moving averages of the weights on the ps")
    p.add_argument("--data_dir", help="CIFAR-10 records (cnn), Criteo day files (criteo)")
    p.add_argument("--quick", action="store_true", help="seconds, for tests/test_benchmarks.py: the MLP, 1 ps + 1 "
                                                        "worker, 20 steps, each ps link shaped to 1gbit")
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.ps, args.workers, args.steps, args.warmup, args.ps_link_rate = "mlp", 1, 1, 20, 3, "1gbit"
    if args.ps_link_rate is not None:
        from psworker.launcher.shaping import parse_rate

        try:
            args.ps_link_rate = parse_rate(args.ps_link_rate)
        except ValueError as e:
            p.error(f"argument --ps_link_rate: {e}")
        isolate(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # SIGTERM (a caller's timeout) unwinds through run_cluster's `finally`, which stops the server processes.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    seconds, extra = run_cluster(args) if args.workers else (run_in_process(args), {})
    result = {"side": "pss", "model": args.model, "ps": args.ps, "workers": args.workers, "ema": args.ema,
              "steps": args.steps, "warmup": args.warmup, "batch_size": args.batch_size, "seconds": seconds,
              "steps_per_sec": args.steps / seconds, "examples_per_sec": args.steps * args.batch_size / seconds,
              **extra}
    shape = f"{args.ps} ps + {args.workers} worker(s)" if args.workers else "in-process"
    print(f"pss {args.model} {shape}: {result['examples_per_sec']:.1f} examples/s "
          f"({result['steps_per_sec']:.1f} steps/s)")
    print(json.dumps(result, sort_keys=True), flush=True)
    # The coordinator's threads can outlive the servers; leave without waiting for them.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
