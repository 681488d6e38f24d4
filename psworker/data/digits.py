"""The handwritten-digits data set that scikit-learn ships (1,797 8x8 images): real data, no network."""

from __future__ import annotations

import functools

import numpy as np

TEST_FRACTION = 0.2
SPLIT_SEED = 0
RAW_MAX = 16.0   # `load_digits().data` holds pixel values 0..16


@functools.lru_cache(maxsize=1)
def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's `load_digits()` as `(data float64 [1797, 64], target int [1797])`, read from the file that
    scikit-learn ships (`sklearn/datasets/data/digits.csv.gz`) without importing scikit-learn (0.8 s of every task's
    start-up here); through scikit-learn itself where that file is not found."""
    import gzip
    import importlib.util
    import os

    spec = importlib.util.find_spec("sklearn")
    path = os.path.join(list(spec.submodule_search_locations)[0], "datasets", "data", "digits.csv.gz") if spec else ""
    if not os.path.isfile(path):
        from sklearn.datasets import load_digits as from_sklearn

        digits = from_sklearn()
        return digits.data, digits.target
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",")
    return table[:, :-1], table[:, -1].astype(int)


@functools.lru_cache(maxsize=1)
def held_out_mask() -> np.ndarray:
    """Which of `load_digits()`'s 1,797 examples are the held-out split: bool `[1797]`, stratified, fixed (seed 0)."""
    y = load_digits()[1]
    rng = np.random.default_rng(SPLIT_SEED)
    test_idx = []
    for label in np.unique(y):
        idx = np.flatnonzero(y == label)
        rng.shuffle(idx)
        test_idx.extend(idx[: int(round(len(idx) * TEST_FRACTION))])
    mask = np.zeros(len(y), dtype=bool)
    mask[test_idx] = True
    mask.flags.writeable = False
    return mask


@functools.lru_cache(maxsize=1)
def load_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Returns `(train_x, train_y, test_x, test_y)`: float32 pixels scaled to [0, 1], int32 labels.

    The split is stratified and fixed (`held_out_mask`), so every worker and the evaluator see the same one.
    """
    data, target = load_digits()
    x = (data / RAW_MAX).astype(np.float32)
    y = target.astype(np.int32)
    test_mask = held_out_mask()
    return x[~test_mask], y[~test_mask], x[test_mask], y[test_mask]


@functools.lru_cache(maxsize=1)
def feature_stats() -> tuple[np.ndarray, np.ndarray]:
    """Per-pixel mean and spread of the training split, for standardising inputs (test statistics unused)."""
    train_x = load_split()[0]
    return train_x.mean(axis=0), train_x.std(axis=0) + 0.1


def standardize(x: np.ndarray) -> np.ndarray:
    """Pixels scaled to [0, 1] (as `load_split` gives them), standardised with `feature_stats`."""
    mean, spread = feature_stats()
    return ((x - mean) / spread).astype(np.float32)


def preprocess_raw(raw):
    """The graph form of what `eval_dataset` does to raw pixels: float32 `[batch, 64]` (0..16) -> scaled by 1/16 and
    standardised, the training split's per-pixel mean and spread held as constants (`train_mean`, `train_spread`)."""
    import tensorflow as tf

    mean, spread = feature_stats()
    x = tf.cast(raw, tf.float32) / RAW_MAX
    return tf.math.divide(x - tf.constant(mean, name="train_mean"), tf.constant(spread, name="train_spread"),
                          name="standardized")


def shard(x: np.ndarray, y: np.ndarray, shard_index: int, num_shards: int) -> tuple[np.ndarray, np.ndarray]:
    """Every `num_shards`-th example starting at `shard_index`: disjoint shards that cover the data."""
    if not 0 <= shard_index < num_shards:
        raise ValueError(f"shard_index {shard_index} is out of range for {num_shards} shards")
    return x[shard_index::num_shards], y[shard_index::num_shards]


def train_dataset(batch_size: int, shard_index: int = 0, num_shards: int = 1, seed: int | None = None):
    """An endless, shuffled `tf.data.Dataset` of `(images [B, 64], labels [B])` from one shard."""
    import tensorflow as tf

    x, y, _, _ = load_split()
    x, y = shard(standardize(x), y, shard_index, num_shards)
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    ds = ds.shuffle(len(x), seed=seed, reshuffle_each_iteration=True).repeat()
    return ds.batch(batch_size, drop_remainder=True).prefetch(2)


def dealt_dataset(positions, batch_size: int):
    """The examples at `positions` (a dataset of int64 positions in the training split), in order, in batches of
    `batch_size` (the last one may be smaller)."""
    import tensorflow as tf

    x, y, _, _ = load_split()
    x, y = tf.constant(standardize(x)), tf.constant(y)
    ds = positions.batch(batch_size).map(tf.autograph.experimental.do_not_convert(
        lambda p: (tf.gather(x, p), tf.gather(y, p))))   # straight ops: no AutoGraph file left in /tmp
    return ds.prefetch(2)


def eval_dataset(batch_size: int):
    """The whole test split once, in batches (the last one may be smaller)."""
    import tensorflow as tf

    _, _, x, y = load_split()
    return tf.data.Dataset.from_tensor_slices((standardize(x), y)).batch(batch_size)
