"""A linear softmax classifier (multinomial logistic regression) on the handwritten digits: 64 -> 10.

Zero-initialised and without hidden layers, so one update can be checked by hand (the sync-update test does), and
it trains in seconds (a quick demo: `--model linear`).
"""

from __future__ import annotations

from typing import Optional

from psworker.data import digits
from psworker.models import register
from psworker.models.base import InputSpec, Model

INPUT_DIM = 64


class LinearModel(Model):
    """`logits = images @ weights + biases`; plain cross-entropy; constant learning rate."""

    name = "linear"
    num_classes = 10
    default_learning_rate = 0.5
    moving_average_decay = None
    image_shape = (INPUT_DIM,)

    def train_inputs(self, spec: InputSpec):
        import tensorflow as tf

        ds = digits.train_dataset(spec.batch_size, spec.shard_index, spec.num_shards, spec.seed)
        return tf.compat.v1.data.make_one_shot_iterator(ds).get_next()

    def eval_dataset(self, data_dir: Optional[str], batch_size: int):
        return digits.eval_dataset(batch_size)

    def num_train_examples(self, data_dir: Optional[str]) -> int:
        return len(digits.load_split()[1])

    def inference(self, images, *, training: bool):
        import tensorflow as tf

        v1 = tf.compat.v1
        x = tf.reshape(images, [-1, INPUT_DIM])
        with v1.variable_scope("linear"):
            w = v1.get_variable("weights", [INPUT_DIM, self.num_classes], tf.float32, v1.zeros_initializer())
            b = v1.get_variable("biases", [self.num_classes], tf.float32, v1.zeros_initializer())
        return tf.add(tf.matmul(x, w), b, name="logits")


register("linear", LinearModel)
