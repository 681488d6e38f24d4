"""Input functions shared by the models that train on scikit-learn's handwritten digits (mlp, linear)."""

from __future__ import annotations

from typing import Optional

from psworker.data import digits
from psworker.models.base import InputSpec, Model

INPUT_DIM = 64


class DigitsModel(Model):
    """A `Model` whose data is the digits split: 64 standardised pixels per example, 10 classes."""

    num_classes = 10
    moving_average_decay = None
    image_shape = (INPUT_DIM,)
    raw_input_shape = (INPUT_DIM,)   # `load_digits().data`'s pixel values, 0..16, as float32

    def train_inputs(self, spec: InputSpec):
        import tensorflow as tf

        return tf.compat.v1.data.make_one_shot_iterator(self.train_dataset(spec)).get_next()

    def train_dataset(self, spec: InputSpec):
        if spec.positions is not None:
            return digits.dealt_dataset(spec.positions(), spec.batch_size)
        return digits.train_dataset(spec.batch_size, spec.shard_index, spec.num_shards, spec.seed)

    def eval_dataset(self, data_dir: Optional[str], batch_size: int):
        return digits.eval_dataset(batch_size)

    def serving_preprocess(self, raw):
        """Pixels / 16, standardised with the training split's per-pixel mean and spread (constants)."""
        return digits.preprocess_raw(raw)

    def num_train_examples(self, data_dir: Optional[str]) -> int:
        return len(digits.load_split()[1])
