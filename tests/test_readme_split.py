"""docs/models.md's recipe for the digits' held-out split, run as printed, gives exactly what `psworker eval` reads."""

from __future__ import annotations

import numpy as np

from psworker.data import digits
from tests import docs_pages

FIRST_LINE = "# the held-out split of the digits"


def readme_recipe() -> str:
    blocks = [b for b in docs_pages.fenced(docs_pages.page("models.md"), "python") if b.startswith(FIRST_LINE)]
    assert len(blocks) == 1, f"expected one python block starting {FIRST_LINE!r}, found {len(blocks)}"
    return blocks[0]


def test_the_readme_recipe_is_the_split_eval_reads():
    import tensorflow as tf

    from psworker.models.mlp import MlpModel

    recipe: dict = {}
    exec(compile(readme_recipe(), "docs/models.md", "exec"), recipe)    # numpy and scikit-learn only
    assert len(recipe["held_out"]) == 359
    np.testing.assert_array_equal(recipe["held_out"], np.flatnonzero(digits.held_out_mask()))
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:   # as eval runs it (graph mode either way)
        batch = tf.compat.v1.data.make_one_shot_iterator(MlpModel().eval_dataset(None, 100)).get_next()
        served = digits.preprocess_raw(tf.constant(recipe["x_test"]))   # serving_default's input, preprocessed
        images, labels = _read_all(sess, batch)
        np.testing.assert_array_equal(labels, recipe["y_test"])
        np.testing.assert_allclose(sess.run(served), images, rtol=1e-6, atol=1e-6)


def _read_all(sess, batch) -> tuple[np.ndarray, np.ndarray]:
    import tensorflow as tf

    parts = []
    while True:
        try:
            parts.append(sess.run(batch))
        except tf.errors.OutOfRangeError:
            return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
