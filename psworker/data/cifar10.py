"""CIFAR-10 in the official binary layout: file names and format, a numpy reader and writer, tf.data input pipelines.

Getting the files (download, or a synthetic stand-in) is `cifar10_files`.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import numpy as np

from psworker.errors import TrainingFailed

BATCHES_DIR = "cifar-10-batches-bin"
TRAIN_FILES = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
TEST_FILE = "test_batch.bin"

ORIGINAL_SIZE = 32
IMAGE_SIZE = 24  # the network's input: random (train) or central (eval) 24x24 crops
DEPTH = 3
NUM_CLASSES = 10
LABEL_BYTES = 1
IMAGE_BYTES = ORIGINAL_SIZE * ORIGINAL_SIZE * DEPTH
RECORD_BYTES = LABEL_BYTES + IMAGE_BYTES
NUM_TRAIN_EXAMPLES = 50000
OFFICIAL_FILE_BYTES = 10000 * RECORD_BYTES
SHUFFLE_BUFFER = 20000  # the tutorial's min_queue_examples: 40% of an epoch


# ---------------------------------------------------------------------------------------------- files


def batches_dir(data_dir: str) -> str:
    """Resolves `data_dir` (the parent of `cifar-10-batches-bin`, or that folder itself) to the batches folder.

    Args:
        data_dir: where the data was downloaded or written.

    Returns:
        The folder that holds (or should hold) `data_batch_*.bin` and `test_batch.bin`.
    """
    data_dir = os.path.expanduser(str(data_dir))
    nested = os.path.join(data_dir, BATCHES_DIR)
    if os.path.isdir(nested):
        return nested
    if any(os.path.exists(os.path.join(data_dir, f)) for f in TRAIN_FILES + (TEST_FILE,)):
        return data_dir
    return nested


def _how_to_get(data_dir: Optional[str]) -> str:
    where = data_dir if data_dir else "D"
    return (f"Download it with `psworker data cifar10 --data_dir {where}`, or write a small offline synthetic "
            f"set with `psworker data cifar10-synthetic --data_dir {where}`.")


def _missing_data_error(data_dir: Optional[str], missing: Sequence[str]) -> TrainingFailed:
    return TrainingFailed(f"CIFAR-10 data not found: missing {', '.join(missing)}. {_how_to_get(data_dir)}")


def _existing_files(data_dir: Optional[str], names: Sequence[str]) -> list[str]:
    if not data_dir:
        raise _missing_data_error(None, ["--data_dir (no data directory given)"])
    folder = batches_dir(data_dir)
    paths = [os.path.join(folder, n) for n in names]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise _missing_data_error(data_dir, missing)
    return paths


def train_files(data_dir: Optional[str]) -> list[str]:
    """Paths of the five training files.

    Raises:
        TrainingFailed: a file is missing; the message names it and how to get the data.
    """
    return _existing_files(data_dir, TRAIN_FILES)


def test_files(data_dir: Optional[str]) -> list[str]:
    """Path of the test file, as a one-element list.

    Raises:
        TrainingFailed: the file is missing; the message names it and how to get the data.
    """
    return _existing_files(data_dir, (TEST_FILE,))


test_files.__test__ = False  # not a pytest test, despite the name


def check_files(data_dir: Optional[str]) -> int:
    """What a launcher checks before any task starts: every file is there, holds whole records, and its first
    record's label is a class; returns the training records.

    Raises:
        TrainingFailed: a file missing or not CIFAR-10's binary format (names it and how to get the data).
    """
    train = train_files(data_dir)
    for path in train + test_files(data_dir):
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            label = f.read(LABEL_BYTES)
        if size == 0 or size % RECORD_BYTES or label[0] >= NUM_CLASSES:
            raise TrainingFailed(f"{path}: not CIFAR-10's binary format ({size} bytes, records of {RECORD_BYTES}, "
                                 f"the first label {label[0] if label else None}). {_how_to_get(data_dir)}")
    return num_records(train)


def num_records(paths: Sequence[str]) -> int:
    """Number of records in `paths` (from the file sizes)."""
    return sum(os.path.getsize(p) // RECORD_BYTES for p in paths)


# ---------------------------------------------------------------------------------------------- numpy


def read_records(path: str) -> tuple[np.ndarray, np.ndarray]:
    """Reads one binary file with numpy.

    Args:
        path: a `data_batch_*.bin` or `test_batch.bin` file.

    Returns:
        `(labels, images)`: int32 `[N]` and uint8 `[N, 32, 32, 3]` (height, width, RGB).

    Raises:
        TrainingFailed: the file size is not a whole number of records.
    """
    raw = np.fromfile(path, dtype=np.uint8)
    if raw.size % RECORD_BYTES:
        raise TrainingFailed(f"{path}: {raw.size} bytes is not a whole number of {RECORD_BYTES}-byte records")
    raw = raw.reshape(-1, RECORD_BYTES)
    labels = raw[:, 0].astype(np.int32)
    images = raw[:, LABEL_BYTES:].reshape(-1, DEPTH, ORIGINAL_SIZE, ORIGINAL_SIZE).transpose(0, 2, 3, 1)
    return labels, np.ascontiguousarray(images)


def write_records(path: str, labels: np.ndarray, images: np.ndarray) -> None:
    """Writes records in the official layout: 1 label byte, then 1024 R, 1024 G, 1024 B bytes (row-major).

    Args:
        path: the file to write.
        labels: `[N]` integers in 0..255.
        images: uint8 `[N, 32, 32, 3]`.
    """
    labels = np.asarray(labels)
    images = np.asarray(images, dtype=np.uint8)
    if images.shape[1:] != (ORIGINAL_SIZE, ORIGINAL_SIZE, DEPTH) or len(labels) != len(images):
        raise ValueError(f"expected labels [N] and images [N, 32, 32, 3], got {labels.shape} and {images.shape}")
    out = np.empty((len(labels), RECORD_BYTES), np.uint8)
    out[:, 0] = labels.astype(np.uint8)
    out[:, LABEL_BYTES:] = images.transpose(0, 3, 1, 2).reshape(len(labels), IMAGE_BYTES)
    with open(path, "wb") as f:
        f.write(out.tobytes())


# ---------------------------------------------------------------------------------------------- tf.data


def decode_record(record):
    """Decodes one raw record string tensor.

    Returns:
        `(label, image)`: int32 scalar and uint8 `[32, 32, 3]`.
    """
    import tensorflow as tf

    raw = tf.io.decode_raw(record, tf.uint8)
    label = tf.cast(raw[0], tf.int32)
    image = tf.reshape(raw[LABEL_BYTES:RECORD_BYTES], [DEPTH, ORIGINAL_SIZE, ORIGINAL_SIZE])
    return label, tf.transpose(image, [1, 2, 0])


def preprocess_train(image, seed: Optional[int] = None):
    """The tutorial's training distortions of one uint8 `[32, 32, 3]` image.

    Random 24x24 crop, random left-right flip, random brightness (max delta 63), random contrast (0.2-1.8),
    then per-image standardization.

    Returns:
        float32 `[24, 24, 3]`.
    """
    import tensorflow as tf

    def op_seed(k: int) -> Optional[int]:
        return None if seed is None else seed + k

    image = tf.cast(image, tf.float32)
    image = tf.image.random_crop(image, [IMAGE_SIZE, IMAGE_SIZE, DEPTH], seed=op_seed(1))
    image = tf.image.random_flip_left_right(image, seed=op_seed(2))
    image = tf.image.random_brightness(image, max_delta=63, seed=op_seed(3))
    image = tf.image.random_contrast(image, lower=0.2, upper=1.8, seed=op_seed(4))
    image = tf.image.per_image_standardization(image)
    image.set_shape([IMAGE_SIZE, IMAGE_SIZE, DEPTH])
    return image


def preprocess_eval(image):
    """Central 24x24 crop and per-image standardization (float32 out) of one uint8 `[32, 32, 3]` image, or of each
    image of a batch `[N, 32, 32, 3]` (the exported model's graph: the same ops, batched)."""
    import tensorflow as tf

    image = tf.image.resize_with_crop_or_pad(tf.cast(image, tf.float32), IMAGE_SIZE, IMAGE_SIZE)
    image = tf.image.per_image_standardization(image)
    image.set_shape([*image.shape[:-3], IMAGE_SIZE, IMAGE_SIZE, DEPTH])
    return image


def train_records(data_dir: Optional[str], shard_index: int = 0, num_shards: int = 1):
    """This shard's raw training records, decoded: a dataset of `(label int32, image uint8 [32, 32, 3])`.

    Records are dealt round-robin: shard `i` of `n` gets records `i, i + n, i + 2n, ...` of the five files.

    Raises:
        TrainingFailed: training files are missing.
        ValueError: `shard_index` is not in `0..num_shards-1`.
    """
    import tensorflow as tf

    return _train_raw(data_dir, shard_index, num_shards).map(tf.autograph.experimental.do_not_convert(decode_record))


def _train_raw(data_dir: Optional[str], shard_index: int, num_shards: int):
    import tensorflow as tf

    if num_shards < 1 or not 0 <= shard_index < num_shards:
        raise ValueError(f"shard_index {shard_index} is not in 0..{num_shards - 1}")
    files = train_files(data_dir)
    return tf.data.FixedLengthRecordDataset(files, RECORD_BYTES).shard(num_shards, shard_index)


def train_dataset(
    data_dir: Optional[str],
    batch_size: int,
    shard_index: int = 0,
    num_shards: int = 1,
    seed: Optional[int] = None,
    *,
    shuffle_buffer: int = SHUFFLE_BUFFER,
):
    """The training input of one worker: its shard, shuffled, repeated, distorted, batched.

    Args:
        data_dir: the data folder (parent of `cifar-10-batches-bin`, or that folder).
        batch_size: images per batch; the last partial batch of the (infinite) stream is dropped.
        shard_index: which shard this worker reads.
        num_shards: how many shards the records are dealt into (usually the number of workers).
        seed: shuffle and distortion seed; None for nondeterministic.
        shuffle_buffer: records held in the shuffle buffer.

    Returns:
        A `tf.data.Dataset` of `(images float32 [batch, 24, 24, 3], labels int32 [batch])`.

    Raises:
        TrainingFailed: training files are missing.
    """
    import tensorflow as tf

    ds = _train_raw(data_dir, shard_index, num_shards)
    ds = ds.shuffle(shuffle_buffer, seed=seed, reshuffle_each_iteration=True).repeat()

    # Straight-line ops: AutoGraph's transpiling of them was ~0.1 s of every worker's graph build (issue #9).
    @tf.autograph.experimental.do_not_convert
    def parse(record):
        label, image = decode_record(record)
        return preprocess_train(image, seed), label

    ds = ds.map(parse, num_parallel_calls=tf.data.AUTOTUNE)
    return ds.batch(batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)


class RecordReader:
    """Records of the training files by position (file order: position `p` is record `p - offset` of the file that
    holds it), read through memory maps: `read(positions)` -> uint8 `[n, RECORD_BYTES]`."""

    def __init__(self, paths: Sequence[str]):
        self._paths = list(paths)
        self._maps: Optional[list] = None
        self.offsets = np.cumsum([0] + [os.path.getsize(p) // RECORD_BYTES for p in self._paths])

    def read(self, positions: np.ndarray) -> np.ndarray:
        if self._maps is None:
            self._maps = [np.memmap(p, np.uint8, "r").reshape(-1, RECORD_BYTES) for p in self._paths]
        positions = np.asarray(positions, np.int64)
        files = np.searchsorted(self.offsets, positions, side="right") - 1
        out = np.empty((len(positions), RECORD_BYTES), np.uint8)
        for f in np.unique(files):
            at = files == f
            out[at] = self._maps[f][positions[at] - self.offsets[f]]
        return out


def dealt_dataset(data_dir: Optional[str], positions, batch_size: int, seed: Optional[int] = None):
    """The training examples at `positions` (a dataset of int64 positions over the five files in order), in that
    order, distorted as `train_dataset` does, in batches of `batch_size` (the last one may be smaller).

    Raises:
        TrainingFailed: training files are missing.
    """
    import tensorflow as tf

    reader = RecordReader(train_files(data_dir))

    def read(p):
        raw = tf.numpy_function(reader.read, [p], tf.uint8, stateful=False)
        return tf.reshape(raw, [-1, RECORD_BYTES])

    @tf.autograph.experimental.do_not_convert   # as in train_dataset
    def parse(raw):
        label = tf.cast(raw[0], tf.int32)
        image = tf.transpose(tf.reshape(raw[LABEL_BYTES:], [DEPTH, ORIGINAL_SIZE, ORIGINAL_SIZE]), [1, 2, 0])
        return preprocess_train(image, seed), label

    ds = positions.batch(batch_size).map(tf.autograph.experimental.do_not_convert(read)).unbatch()
    ds = ds.map(parse, num_parallel_calls=tf.data.AUTOTUNE)
    return ds.batch(batch_size).prefetch(2)


def eval_dataset(data_dir: Optional[str], batch_size: int):
    """The whole test split once, in file order, centrally cropped and standardized.

    Returns:
        A finite `tf.data.Dataset` of `(images float32 [<=batch, 24, 24, 3], labels int32)`; the last partial
        batch is kept.

    Raises:
        TrainingFailed: the test file is missing.
    """
    import tensorflow as tf

    ds = tf.data.FixedLengthRecordDataset(test_files(data_dir), RECORD_BYTES)

    @tf.autograph.experimental.do_not_convert   # as in train_dataset
    def parse(record):
        label, image = decode_record(record)
        return preprocess_eval(image), label

    ds = ds.map(parse, num_parallel_calls=tf.data.AUTOTUNE)
    return ds.batch(batch_size, drop_remainder=False).prefetch(tf.data.AUTOTUNE)


__all__ = [
    "BATCHES_DIR",
    "TRAIN_FILES",
    "TEST_FILE",
    "ORIGINAL_SIZE",
    "IMAGE_SIZE",
    "DEPTH",
    "NUM_CLASSES",
    "RECORD_BYTES",
    "NUM_TRAIN_EXAMPLES",
    "batches_dir",
    "train_files",
    "test_files",
    "num_records",
    "read_records",
    "write_records",
    "decode_record",
    "preprocess_train",
    "preprocess_eval",
    "train_records",
    "train_dataset",
    "dealt_dataset",
    "RecordReader",
    "eval_dataset",
]
