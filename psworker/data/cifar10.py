"""CIFAR-10 in the official binary layout: tf.data input pipelines, a numpy reader, download and synthetic data."""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import tarfile
import tempfile
import urllib.request
import zlib
from typing import Callable, Optional, Sequence

import numpy as np

from psworker.errors import PsworkerError

log = logging.getLogger(__name__)

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz"
DOWNLOAD_TIMEOUT_SECS = 60.0
CIFAR10_SHA256 = "c4a38c50a1bc5f3a1c5537f2155ab9d68f9f25eb1ed8d9ddda3db29a59bca1dd"
CIFAR10_MD5 = "c32a1d4ab5d03f1284b67883e8d87530"
CIFAR10_ARCHIVE_BYTES = 170052171

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
NUM_EVAL_EXAMPLES = 10000
OFFICIAL_FILE_BYTES = 10000 * RECORD_BYTES
SHUFFLE_BUFFER = 20000  # the tutorial's min_queue_examples: 40% of an epoch

_MARKER = ".psworker-download.json"


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


def _missing_data_error(data_dir: Optional[str], missing: Sequence[str]) -> PsworkerError:
    where = data_dir if data_dir else "D"
    return PsworkerError(
        f"CIFAR-10 data not found: missing {', '.join(missing)}. "
        f"Download it with `psworker data cifar10 --data_dir {where}`, or write a small offline synthetic "
        f"set with `psworker data cifar10-synthetic --data_dir {where}`."
    )


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
        PsworkerError: a file is missing; the message names it and how to get the data.
    """
    return _existing_files(data_dir, TRAIN_FILES)


def test_files(data_dir: Optional[str]) -> list[str]:
    """Path of the test file, as a one-element list.

    Raises:
        PsworkerError: the file is missing; the message names it and how to get the data.
    """
    return _existing_files(data_dir, (TEST_FILE,))


test_files.__test__ = False  # not a pytest test, despite the name


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
        PsworkerError: the file size is not a whole number of records.
    """
    raw = np.fromfile(path, dtype=np.uint8)
    if raw.size % RECORD_BYTES:
        raise PsworkerError(f"{path}: {raw.size} bytes is not a whole number of {RECORD_BYTES}-byte records")
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
    """Central 24x24 crop and per-image standardization of one uint8 `[32, 32, 3]` image (float32 out)."""
    import tensorflow as tf

    image = tf.image.resize_with_crop_or_pad(tf.cast(image, tf.float32), IMAGE_SIZE, IMAGE_SIZE)
    image = tf.image.per_image_standardization(image)
    image.set_shape([IMAGE_SIZE, IMAGE_SIZE, DEPTH])
    return image


def train_records(data_dir: Optional[str], shard_index: int = 0, num_shards: int = 1):
    """This shard's raw training records, decoded: a dataset of `(label int32, image uint8 [32, 32, 3])`.

    Records are dealt round-robin: shard `i` of `n` gets records `i, i + n, i + 2n, ...` of the five files.

    Raises:
        PsworkerError: training files are missing.
        ValueError: `shard_index` is not in `0..num_shards-1`.
    """
    return _train_raw(data_dir, shard_index, num_shards).map(decode_record)


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
        PsworkerError: training files are missing.
    """
    import tensorflow as tf

    ds = _train_raw(data_dir, shard_index, num_shards)
    ds = ds.shuffle(shuffle_buffer, seed=seed, reshuffle_each_iteration=True).repeat()

    def parse(record):
        label, image = decode_record(record)
        return preprocess_train(image, seed), label

    ds = ds.map(parse, num_parallel_calls=tf.data.AUTOTUNE)
    return ds.batch(batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)


def eval_dataset(data_dir: Optional[str], batch_size: int):
    """The whole test split once, in file order, centrally cropped and standardized.

    Returns:
        A finite `tf.data.Dataset` of `(images float32 [<=batch, 24, 24, 3], labels int32)`; the last partial
        batch is kept.

    Raises:
        PsworkerError: the test file is missing.
    """
    import tensorflow as tf

    ds = tf.data.FixedLengthRecordDataset(test_files(data_dir), RECORD_BYTES)

    def parse(record):
        label, image = decode_record(record)
        return preprocess_eval(image), label

    ds = ds.map(parse, num_parallel_calls=tf.data.AUTOTUNE)
    return ds.batch(batch_size, drop_remainder=False).prefetch(tf.data.AUTOTUNE)


# ---------------------------------------------------------------------------------------------- download


def _sizes(folder: str) -> Optional[dict[str, int]]:
    sizes = {}
    for name in TRAIN_FILES + (TEST_FILE,):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            return None
        sizes[name] = os.path.getsize(path)
    return sizes


def _already_present(folder: str, sha256: Optional[str]) -> bool:
    sizes = _sizes(folder)
    if sizes is None:
        return False
    if all(s == OFFICIAL_FILE_BYTES for s in sizes.values()):
        return True
    try:  # an earlier download of another archive (tests, mirrors) left a marker with its sizes
        with open(os.path.join(folder, _MARKER)) as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return False
    return marker.get("sha256") == sha256 and marker.get("sizes") == sizes


def _fetch(url: str, dest, opener: Callable) -> str:
    """Copies `url` into the open file `dest`; returns the sha256 hex digest of what was written."""
    digest = hashlib.sha256()
    response = opener(url, timeout=DOWNLOAD_TIMEOUT_SECS)   # per blocking read, so a stalled server cannot hang us
    try:
        total = int(getattr(response, "headers", {}).get("Content-Length") or 0)
        done, next_report = 0, 0.0
        while True:
            chunk = response.read(1 << 20)
            if not chunk:
                break
            dest.write(chunk)
            digest.update(chunk)
            done += len(chunk)
            if total and done / total >= next_report:
                log.info("downloading %s: %.0f%% (%d of %d bytes)", url, 100.0 * done / total, done, total)
                next_report = done / total + 0.1
    finally:
        if hasattr(response, "close"):
            response.close()
    log.info("downloaded %s: %d bytes", url, done)
    return digest.hexdigest()


def _check_members(archive: tarfile.TarFile, source: str) -> None:
    for member in archive.getmembers():
        name = member.name
        parts = name.replace("\\", "/").split("/")
        if name.startswith(("/", "\\")) or os.path.isabs(name) or ".." in parts:
            raise PsworkerError(f"{source}: unsafe path in archive: {name!r}")
        if not (member.isfile() or member.isdir()):
            raise PsworkerError(f"{source}: archive member {name!r} is not a regular file or folder")


def _read_through_gzip(path: str) -> None:
    """Decompresses a gzip file to its end, so that a corrupted stream fails its CRC check before extraction."""
    with open(path, "rb") as f:
        if f.read(2) != b"\x1f\x8b":
            return
    with gzip.open(path, "rb") as f:
        while f.read(1 << 22):
            pass


def _extract(archive_path: str, data_dir: str, source: str) -> None:
    try:
        _read_through_gzip(archive_path)
        with tarfile.open(archive_path, "r:*") as archive:
            _check_members(archive, source)
            if hasattr(tarfile, "data_filter"):
                archive.extractall(data_dir, filter="data")
            else:  # pragma: no cover - Pythons without extraction filters; members were checked above
                archive.extractall(data_dir)
    except PsworkerError:
        raise
    except (tarfile.TarError, EOFError, OSError, ValueError, zlib.error) as e:
        raise PsworkerError(f"{source}: cannot extract archive (corrupted or not a tar.gz?): {e}") from e


def download_and_extract(
    data_dir: str,
    url: str = CIFAR10_URL,
    *,
    sha256: Optional[str] = CIFAR10_SHA256,
    opener: Callable = urllib.request.urlopen,
) -> str:
    """Downloads the CIFAR-10 binary archive, verifies it and extracts it into `data_dir`.

    Skips the download when the six files are already there with the official sizes (or with the sizes this
    function recorded when it last extracted an archive with the same checksum).

    Args:
        data_dir: the folder to extract into (`cifar-10-batches-bin` is created inside it).
        url: the archive's address (`file://` works too).
        sha256: the archive's expected sha256 hex digest; None skips the check.
        opener: `urllib.request.urlopen` or a stand-in: called with `url`, returns a readable response.

    Returns:
        The batches folder.

    Raises:
        PsworkerError: the download fails, the checksum differs, the archive is corrupted or holds an unsafe
            member (absolute path, `..`, link or device), or the expected files are missing from it.
    """
    data_dir = os.path.expanduser(str(data_dir))
    folder = os.path.join(data_dir, BATCHES_DIR)
    if _already_present(folder, sha256):
        log.info("CIFAR-10 already present in %s; not downloading", folder)
        return folder
    os.makedirs(data_dir, exist_ok=True)
    fd, tmp_path = tempfile.mkstemp(prefix=".cifar-10-", suffix=".tar.gz.part", dir=data_dir)
    try:
        with os.fdopen(fd, "wb") as tmp:
            try:
                actual = _fetch(url, tmp, opener)
            except (OSError, ValueError) as e:  # URLError is an OSError
                raise PsworkerError(f"cannot download {url}: {e}") from e
        if sha256 is not None and actual.lower() != sha256.lower():
            raise PsworkerError(f"checksum mismatch for {url}: expected sha256 {sha256}, got {actual}")
        _extract(tmp_path, data_dir, url)
    finally:
        os.unlink(tmp_path)
    sizes = _sizes(folder)
    if sizes is None:
        missing = [n for n in TRAIN_FILES + (TEST_FILE,) if not os.path.isfile(os.path.join(folder, n))]
        raise PsworkerError(f"{url}: archive lacks {BATCHES_DIR}/{', '.join(missing)}")
    with open(os.path.join(folder, _MARKER), "w") as f:
        json.dump({"url": url, "sha256": sha256, "sizes": sizes}, f)
    log.info("CIFAR-10 extracted to %s", folder)
    return folder


# ---------------------------------------------------------------------------------------------- synthetic


def synthetic_images(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Images whose class survives the training distortions.

    Class `k` has its own hue (a zero-sum colour offset, which brightness, contrast and standardization keep:
    they act alike on the three channels or per channel around its mean) and its own stripe orientation,
    plus noise and a random brightness offset per image.

    Returns:
        uint8 `[N, 32, 32, 3]`.
    """
    n = len(labels)
    hue = 2 * np.pi * labels[:, None] / NUM_CLASSES + np.array([0.0, 2 * np.pi / 3, 4 * np.pi / 3])
    colour = 50.0 * np.cos(hue)  # [N, 3], sums to 0 across channels
    yy, xx = np.mgrid[0:ORIGINAL_SIZE, 0:ORIGINAL_SIZE].astype(np.float32)
    angle = np.pi * labels / NUM_CLASSES
    phase = rng.uniform(0, 2 * np.pi, n)
    proj = np.cos(angle)[:, None, None] * xx + np.sin(angle)[:, None, None] * yy
    stripes = 35.0 * np.sin(2 * np.pi * proj / 8.0 + phase[:, None, None])  # [N, 32, 32]
    brightness = rng.uniform(-30, 30, n)
    images = (
        128.0
        + brightness[:, None, None, None]
        + colour[:, None, None, :]
        + stripes[..., None]
        + rng.normal(0.0, 20.0, (n, ORIGINAL_SIZE, ORIGINAL_SIZE, DEPTH))
    )
    return np.clip(np.rint(images), 0, 255).astype(np.uint8)


def write_synthetic(data_dir: str, *, train_per_class: int = 500, test_per_class: int = 100, seed: int = 0) -> str:
    """Writes a small learnable stand-in for CIFAR-10 in the official layout (no network needed).

    Args:
        data_dir: the folder; `cifar-10-batches-bin` is created inside it.
        train_per_class: training images per class, spread over the five training files (shuffled).
        test_per_class: test images per class.
        seed: makes the files reproducible.

    Returns:
        The batches folder.
    """
    rng = np.random.default_rng(seed)
    folder = os.path.join(os.path.expanduser(str(data_dir)), BATCHES_DIR)
    os.makedirs(folder, exist_ok=True)
    train_labels = rng.permutation(np.repeat(np.arange(NUM_CLASSES), train_per_class))
    train_images = synthetic_images(train_labels, rng)
    for i, (labels, images) in enumerate(
        zip(np.array_split(train_labels, len(TRAIN_FILES)), np.array_split(train_images, len(TRAIN_FILES)))
    ):
        write_records(os.path.join(folder, TRAIN_FILES[i]), labels, images)
    test_labels = rng.permutation(np.repeat(np.arange(NUM_CLASSES), test_per_class))
    write_records(os.path.join(folder, TEST_FILE), test_labels, synthetic_images(test_labels, rng))
    with open(os.path.join(folder, "batches.meta.txt"), "w") as f:
        f.write("\n".join(["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]))
        f.write("\n")
    log.info("wrote synthetic CIFAR-10 (%d train, %d test) to %s", len(train_labels), len(test_labels), folder)
    return folder


__all__ = [
    "CIFAR10_URL",
    "CIFAR10_SHA256",
    "BATCHES_DIR",
    "TRAIN_FILES",
    "TEST_FILE",
    "IMAGE_SIZE",
    "NUM_CLASSES",
    "RECORD_BYTES",
    "NUM_TRAIN_EXAMPLES",
    "NUM_EVAL_EXAMPLES",
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
    "eval_dataset",
    "download_and_extract",
    "write_synthetic",
]
