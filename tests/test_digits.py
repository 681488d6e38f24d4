"""The default job's data: scikit-learn's real digits, a fixed stratified split, disjoint worker shards."""

from __future__ import annotations

import numpy as np
import pytest

from psworker.data import digits


def test_split_is_fixed_stratified_and_disjoint():
    train_x, train_y, test_x, test_y = digits.load_split()
    assert len(train_x) + len(test_x) == 1797 and train_x.shape[1] == 64
    assert 0.0 <= train_x.min() and train_x.max() <= 1.0
    # every class is in both parts in about the same proportion
    for label in range(10):
        share = np.mean(test_y == label) / np.mean(train_y == label)
        assert 0.8 < share < 1.25
    train_rows = {row.tobytes() for row in train_x}
    assert sum(row.tobytes() in train_rows for row in test_x) < 5   # the data set has a few duplicate images


def test_shards_are_disjoint_and_cover_the_training_split():
    x, y, _, _ = digits.load_split()
    parts = [digits.shard(x, y, i, 3) for i in range(3)]
    assert sum(len(px) for px, _ in parts) == len(x)
    ids = [set(map(bytes, (px * 16).astype(np.uint8))) for px, _ in parts]
    assert len(ids[0] & ids[1]) < 5 and len(ids[1] & ids[2]) < 5
    with pytest.raises(ValueError, match="out of range"):
        digits.shard(x, y, 3, 3)


def test_standardize_uses_training_statistics_only():
    train_x = digits.load_split()[0]
    z = digits.standardize(train_x)
    assert np.allclose(z.mean(axis=0), 0.0, atol=1e-4)
    assert z.dtype == np.float32
