"""Getting CIFAR-10's files: download and verify the official archive, or write a small synthetic stand-in."""

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
from typing import Callable, Optional

import numpy as np

from psworker.data.cifar10 import (BATCHES_DIR, DEPTH, NUM_CLASSES, OFFICIAL_FILE_BYTES, ORIGINAL_SIZE, TEST_FILE,
                                   TRAIN_FILES, write_records)
from psworker.errors import TrainingFailed

log = logging.getLogger(__name__)

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz"
CIFAR10_SHA256 = "c4a38c50a1bc5f3a1c5537f2155ab9d68f9f25eb1ed8d9ddda3db29a59bca1dd"
DOWNLOAD_TIMEOUT_SECS = 60.0
_MARKER = ".psworker-download.json"


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
            raise TrainingFailed(f"{source}: unsafe path in archive: {name!r}")
        if not (member.isfile() or member.isdir()):
            raise TrainingFailed(f"{source}: archive member {name!r} is not a regular file or folder")


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
    except TrainingFailed:
        raise
    except (tarfile.TarError, EOFError, OSError, ValueError, zlib.error) as e:
        raise TrainingFailed(f"{source}: cannot extract archive (corrupted or not a tar.gz?): {e}") from e


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
        TrainingFailed: the download fails, the checksum differs, the archive is corrupted or holds an unsafe
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
                raise TrainingFailed(f"cannot download {url}: {e}") from e
        if sha256 is not None and actual.lower() != sha256.lower():
            raise TrainingFailed(f"checksum mismatch for {url}: expected sha256 {sha256}, got {actual}")
        _extract(tmp_path, data_dir, url)
    finally:
        os.unlink(tmp_path)
    sizes = _sizes(folder)
    if sizes is None:
        missing = [n for n in TRAIN_FILES + (TEST_FILE,) if not os.path.isfile(os.path.join(folder, n))]
        raise TrainingFailed(f"{url}: archive lacks {BATCHES_DIR}/{', '.join(missing)}")
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


__all__ = ["CIFAR10_URL", "CIFAR10_SHA256", "download_and_extract", "synthetic_images", "write_synthetic"]
