"""CIFAR-10 data: binary layout, tf.data pipelines, download/extract safety, synthetic data."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile

import numpy as np
import pytest

from psworker.data import cifar10 as data
from psworker.data import cifar10_files as files
from psworker.errors import PsworkerError


def _random_split(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 10, n).astype(np.int32), rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)


def _official_bytes(labels, images) -> bytes:
    """Encodes records independently of `write_records`: label byte, then the R, G and B planes."""
    out = bytearray()
    for label, image in zip(labels, images):
        out.append(int(label))
        for c in range(3):
            out += image[:, :, c].tobytes()  # row-major 32x32 plane
    return bytes(out)


@pytest.fixture
def dataset_dir(tmp_path):
    """Small files in the official layout; returns (data_dir, {file name: (labels, images)})."""
    folder = tmp_path / data.BATCHES_DIR
    folder.mkdir()
    contents = {}
    for i, name in enumerate(data.TRAIN_FILES + (data.TEST_FILE,)):
        labels, images = _random_split(7, seed=i)
        (folder / name).write_bytes(_official_bytes(labels, images))
        contents[name] = (labels, images)
    return str(tmp_path), contents


def _drain(ds):
    import tensorflow as tf

    out = []
    with tf.Graph().as_default():
        nxt = tf.compat.v1.data.make_one_shot_iterator(ds()).get_next()
        with tf.compat.v1.Session() as sess:
            while True:
                try:
                    out.append(sess.run(nxt))
                except tf.errors.OutOfRangeError:
                    return out


def test_write_records_matches_official_encoding(tmp_path):
    labels, images = _random_split(3, seed=9)
    data.write_records(str(tmp_path / "x.bin"), labels, images)
    assert (tmp_path / "x.bin").read_bytes() == _official_bytes(labels, images)


def test_numpy_reader_returns_what_was_written(dataset_dir):
    data_dir, contents = dataset_dir
    for name, (labels, images) in contents.items():
        got_labels, got_images = data.read_records(os.path.join(data_dir, data.BATCHES_DIR, name))
        assert got_labels.dtype == np.int32 and got_images.dtype == np.uint8
        np.testing.assert_array_equal(got_labels, labels)
        np.testing.assert_array_equal(got_images, images)


def test_reader_rejects_truncated_file(tmp_path):
    (tmp_path / "bad.bin").write_bytes(b"\0" * (data.RECORD_BYTES + 5))
    with pytest.raises(PsworkerError, match="whole number"):
        data.read_records(str(tmp_path / "bad.bin"))


def test_data_dir_may_be_the_batches_folder(dataset_dir):
    data_dir, _ = dataset_dir
    inner = os.path.join(data_dir, data.BATCHES_DIR)
    assert data.batches_dir(data_dir) == inner
    assert data.batches_dir(inner) == inner
    assert data.train_files(inner) == data.train_files(data_dir)


def test_decode_record_in_tf_data_matches_written(dataset_dir):
    import tensorflow as tf

    data_dir, contents = dataset_dir
    labels, images = contents[data.TEST_FILE]
    out = _drain(lambda: tf.data.FixedLengthRecordDataset(data.test_files(data_dir), data.RECORD_BYTES).map(
        data.decode_record))
    np.testing.assert_array_equal([lab for lab, _ in out], labels)
    np.testing.assert_array_equal(np.stack([img for _, img in out]), images)
    assert out[0][0].dtype == np.int32 and out[0][1].dtype == np.uint8


def test_eval_dataset_is_central_crop_standardized_and_keeps_last_batch(dataset_dir):
    data_dir, contents = dataset_dir
    labels, images = contents[data.TEST_FILE]
    batches = _drain(lambda: data.eval_dataset(data_dir, batch_size=3))
    assert [len(b[1]) for b in batches] == [3, 3, 1]  # 7 records, finite, last partial batch kept
    got_images = np.concatenate([b[0] for b in batches])
    got_labels = np.concatenate([b[1] for b in batches])
    assert got_labels.dtype == np.int32
    np.testing.assert_array_equal(got_labels, labels)
    crop = images[:, 4:28, 4:28, :].astype(np.float64)
    mean = crop.mean(axis=(1, 2, 3), keepdims=True)
    std = np.maximum(crop.std(axis=(1, 2, 3), keepdims=True), 1.0 / np.sqrt(24 * 24 * 3))
    np.testing.assert_allclose(got_images, (crop - mean) / std, atol=1e-4)


def test_shards_are_disjoint_and_cover_the_training_set(dataset_dir):
    data_dir, contents = dataset_dir
    everything = np.concatenate([contents[n][1] for n in data.TRAIN_FILES])
    shards = [
        np.stack([img for _, img in _drain(lambda i=i: data.train_records(data_dir, i, 3))]) for i in range(3)
    ]
    assert [len(s) for s in shards] == [12, 12, 11]  # 35 records dealt round-robin
    for i, shard in enumerate(shards):
        np.testing.assert_array_equal(shard, everything[i::3])
    assert not np.array_equal(shards[0][:11], shards[1][:11])
    with pytest.raises(ValueError, match="shard_index"):
        data.train_records(data_dir, 3, 3)


def test_train_dataset_shapes_ranges_and_distortions(dataset_dir):
    import tensorflow as tf

    data_dir, contents = dataset_dir
    with tf.Graph().as_default():
        ds = data.train_dataset(data_dir, batch_size=8, shard_index=1, num_shards=2, seed=3)
        assert ds.element_spec[0].shape.as_list() == [8, 24, 24, 3]  # drop_remainder: static batch
        images, labels = tf.compat.v1.data.make_one_shot_iterator(ds).get_next()
        with tf.compat.v1.Session() as sess:
            batches = [sess.run([images, labels]) for _ in range(6)]  # several passes over the 17-record shard
    shard_labels = set(np.concatenate([contents[n][0] for n in data.TRAIN_FILES])[1::2].tolist())
    for imgs, labs in batches:
        assert imgs.dtype == np.float32 and labs.dtype == np.int32
        assert np.isfinite(imgs).all()
        assert set(labs.tolist()) <= shard_labels
        np.testing.assert_allclose(imgs.mean(axis=(1, 2, 3)), 0.0, atol=1e-3)  # per-image standardization
        np.testing.assert_allclose(imgs.std(axis=(1, 2, 3)), 1.0, atol=1e-2)
    all_images = np.concatenate([b[0] for b in batches])
    assert len({img.tobytes() for img in all_images}) == len(all_images)  # crops/flips/colour vary per pass


def test_missing_data_error_names_file_and_commands(tmp_path):
    with pytest.raises(PsworkerError) as err:
        data.train_dataset(str(tmp_path), 4)
    msg = str(err.value)
    assert os.path.join(str(tmp_path), data.BATCHES_DIR, "data_batch_1.bin") in msg
    assert f"psworker data cifar10 --data_dir {tmp_path}" in msg
    assert f"psworker data cifar10-synthetic --data_dir {tmp_path}" in msg
    with pytest.raises(PsworkerError, match="test_batch.bin"):
        data.eval_dataset(str(tmp_path), 4)
    with pytest.raises(PsworkerError, match="--data_dir"):
        data.train_files(None)


# ------------------------------------------------------------------------------------------- download


def _archive(tmp_path, members: dict[str, bytes], name="cifar.tar.gz") -> tuple[str, str]:
    """Writes a tar.gz of `members`; returns (file:// url, sha256)."""
    path = tmp_path / name
    with tarfile.open(path, "w:gz") as tar:
        for member_name, payload in members.items():
            info = tarfile.TarInfo(member_name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    return path.as_uri(), hashlib.sha256(path.read_bytes()).hexdigest()


def _official_members(records_per_file=3) -> dict[str, bytes]:
    members = {f"{data.BATCHES_DIR}/batches.meta.txt": b"airplane\n"}
    for i, name in enumerate(data.TRAIN_FILES + (data.TEST_FILE,)):
        members[f"{data.BATCHES_DIR}/{name}"] = _official_bytes(*_random_split(records_per_file, seed=20 + i))
    return members


def _no_network(url, timeout=None):
    raise AssertionError(f"unexpected download of {url}")


def test_download_extracts_verifies_and_skips_when_present(tmp_path):
    members = _official_members()
    url, sha = _archive(tmp_path, members)
    dest = tmp_path / "data"
    folder = files.download_and_extract(str(dest), url, sha256=sha)
    assert folder == str(dest / data.BATCHES_DIR)
    for name, payload in members.items():
        assert (dest / name).read_bytes() == payload
    assert [p.name for p in dest.iterdir()] == [data.BATCHES_DIR]  # temp archive removed
    labels, _ = data.read_records(os.path.join(folder, data.TEST_FILE))
    assert len(labels) == 3
    # second call: files present with the recorded sizes, nothing fetched
    assert files.download_and_extract(str(dest), url, sha256=sha, opener=_no_network) == folder
    # a truncated file is noticed and the archive fetched again
    with open(os.path.join(folder, data.TRAIN_FILES[0]), "r+b") as f:
        f.truncate(10)
    files.download_and_extract(str(dest), url, sha256=sha)
    assert (dest / data.BATCHES_DIR / data.TRAIN_FILES[0]).read_bytes() == members[
        f"{data.BATCHES_DIR}/{data.TRAIN_FILES[0]}"]


def test_download_skipped_for_official_sizes(tmp_path):
    folder = tmp_path / data.BATCHES_DIR
    folder.mkdir()
    for name in data.TRAIN_FILES + (data.TEST_FILE,):
        with open(folder / name, "wb") as f:
            f.truncate(10000 * data.RECORD_BYTES)  # sparse: official size, no disk used
    assert files.download_and_extract(str(tmp_path), opener=_no_network) == str(folder)


def test_download_checksum_mismatch(tmp_path):
    url, sha = _archive(tmp_path, _official_members())
    dest = tmp_path / "data"
    with pytest.raises(PsworkerError, match="checksum mismatch") as err:
        files.download_and_extract(str(dest), url, sha256="0" * 64)
    assert sha in str(err.value)
    assert list(dest.iterdir()) == []  # nothing extracted, temp file removed


def test_download_corrupted_archive(tmp_path):
    path = tmp_path / "corrupt.tar.gz"
    good = tmp_path / "good.tar.gz"
    _archive(tmp_path, _official_members(), name="good.tar.gz")
    raw = bytearray(good.read_bytes())
    raw[len(raw) // 2:] = b"\xff" * (len(raw) - len(raw) // 2)
    path.write_bytes(bytes(raw))
    sha = hashlib.sha256(bytes(raw)).hexdigest()
    with pytest.raises(PsworkerError, match="cannot extract"):
        files.download_and_extract(str(tmp_path / "data"), path.as_uri(), sha256=sha)
    path.write_bytes(b"not an archive at all")
    with pytest.raises(PsworkerError, match="cannot extract"):
        files.download_and_extract(str(tmp_path / "data"), path.as_uri(), sha256=None)


@pytest.mark.parametrize("bad_name", ["../escaped.bin", "/tmp/psworker-absolute-escape.bin",
                                      f"{data.BATCHES_DIR}/../../escaped.bin"])
def test_download_rejects_unsafe_members(tmp_path, bad_name):
    members = _official_members()
    members[bad_name] = b"evil"
    url, sha = _archive(tmp_path, members)
    dest = tmp_path / "a" / "b"
    with pytest.raises(PsworkerError, match="unsafe path"):
        files.download_and_extract(str(dest), url, sha256=sha)
    assert not (tmp_path / "a" / "escaped.bin").exists() and not (tmp_path / "escaped.bin").exists()
    assert not os.path.exists("/tmp/psworker-absolute-escape.bin")
    assert not (dest / data.BATCHES_DIR).exists()  # checked before anything is extracted


def test_download_rejects_links(tmp_path):
    path = tmp_path / "link.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo(f"{data.BATCHES_DIR}/test_batch.bin")
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(info)
    with pytest.raises(PsworkerError, match="not a regular file"):
        files.download_and_extract(str(tmp_path / "d"), path.as_uri(), sha256=None)


def test_download_archive_without_the_files(tmp_path):
    url, sha = _archive(tmp_path, {"readme.txt": b"hi"})
    with pytest.raises(PsworkerError, match="lacks"):
        files.download_and_extract(str(tmp_path / "d"), url, sha256=sha)


def test_download_network_error_is_reported(tmp_path):
    with pytest.raises(PsworkerError, match="cannot download"):
        files.download_and_extract(str(tmp_path / "d"), (tmp_path / "nope.tar.gz").as_uri())


# ------------------------------------------------------------------------------------------- synthetic


def test_write_synthetic_layout_sizes_and_labels(tmp_path):
    folder = files.write_synthetic(str(tmp_path), train_per_class=20, test_per_class=5, seed=1)
    assert folder == str(tmp_path / data.BATCHES_DIR)
    sizes = [os.path.getsize(os.path.join(folder, n)) for n in data.TRAIN_FILES]
    assert sizes == [40 * data.RECORD_BYTES] * 5
    assert os.path.getsize(os.path.join(folder, data.TEST_FILE)) == 50 * data.RECORD_BYTES
    train_labels = np.concatenate([data.read_records(os.path.join(folder, n))[0] for n in data.TRAIN_FILES])
    assert np.bincount(train_labels).tolist() == [20] * 10
    test_labels, test_images = data.read_records(os.path.join(folder, data.TEST_FILE))
    assert np.bincount(test_labels).tolist() == [5] * 10
    assert test_images.std() > 10  # not blank
    again = files.write_synthetic(str(tmp_path / "again"), train_per_class=20, test_per_class=5, seed=1)
    assert open(os.path.join(again, data.TEST_FILE), "rb").read() == open(
        os.path.join(folder, data.TEST_FILE), "rb").read()


def test_write_synthetic_defaults_are_small():
    import inspect

    params = inspect.signature(files.write_synthetic).parameters
    total = 10 * (params["train_per_class"].default + params["test_per_class"].default)
    assert total * data.RECORD_BYTES < 30 * 2**20


def _features(images: np.ndarray) -> np.ndarray:
    """What survives the distortions: standardized per-channel means, and a 2-D spectrum of the luminance."""
    x = images.astype(np.float64)
    x = (x - x.mean(axis=(1, 2, 3), keepdims=True)) / x.std(axis=(1, 2, 3), keepdims=True)
    lum = x.mean(axis=3)
    spectrum = np.abs(np.fft.fft2(lum))[:, :8, :8].reshape(len(x), -1)  # shift- and flip-tolerant-ish
    return np.concatenate([x.mean(axis=(1, 2)) * 10, spectrum / 32], axis=1)


def test_synthetic_classes_are_learnable_after_distortions(tmp_path):
    """A nearest-centroid classifier on distorted training images separates the classes of distorted test ones."""
    import tensorflow as tf

    folder = files.write_synthetic(str(tmp_path), train_per_class=30, test_per_class=10, seed=2)

    def distorted(name, seed):
        labels, images = data.read_records(os.path.join(folder, name))
        with tf.Graph().as_default():
            ph = tf.compat.v1.placeholder(tf.uint8, [32, 32, 3])
            out = data.preprocess_train(ph, seed=seed)
            with tf.compat.v1.Session() as sess:
                return labels, np.stack([sess.run(out, {ph: img}) for img in images])

    train = [distorted(n, 5) for n in data.TRAIN_FILES]
    train_labels = np.concatenate([t[0] for t in train])
    train_feats = _features(np.concatenate([t[1] for t in train]))
    test_labels, test_images = distorted(data.TEST_FILE, 6)
    test_feats = _features(test_images)
    centroids = np.stack([train_feats[train_labels == k].mean(axis=0) for k in range(10)])
    predicted = np.argmin(((test_feats[:, None, :] - centroids[None]) ** 2).sum(axis=2), axis=1)
    accuracy = (predicted == test_labels).mean()
    assert accuracy > 0.6, accuracy
