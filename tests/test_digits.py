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


def test_the_digits_read_from_scikit_learns_file_are_load_digits():
    from sklearn.datasets import load_digits

    data, target = digits.load_digits()
    np.testing.assert_array_equal(data, load_digits().data)
    np.testing.assert_array_equal(target, load_digits().target)


def test_a_task_imports_tensorflow_and_the_digits_without_keras_or_scikit_learn_which_stay_importable():
    """A task's TensorFlow import (`tf_import`) goes on without Keras and scikit-learn (1.5 s of every start), and
    the digits come from its file; later, `tf.keras` and `import sklearn` (a user's model) work. In a fresh
    process."""
    import subprocess
    import sys

    from tests.cluster_utils import task_env

    code = ("import sys\n"
            "from psworker.tf_import import import_tensorflow\n"
            "tf = import_tensorflow()\n"
            "from psworker.data import digits\n"
            "digits.load_split()\n"
            "print('imported', 'keras' in sys.modules, 'sklearn' in sys.modules)\n"
            "print('keras', tf.keras.layers.Dense.__module__.split('.')[0])\n"
            "import sklearn.datasets\n"
            "print('after', 'keras' in sys.modules, 'sklearn' in sys.modules)\n")
    run = subprocess.run([sys.executable, "-c", code], env=task_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split("\n")[:3] == ["imported False False", "keras keras", "after True True"], \
        run.stdout + run.stderr[-3000:]
