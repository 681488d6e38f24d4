"""A linear softmax classifier (multinomial logistic regression) on the handwritten digits: 64 -> 10.

Zero-initialised and without hidden layers, so one update can be checked by hand (the sync-update test does), and
it trains in seconds (a quick demo: `--model linear`).
"""

from __future__ import annotations

from psworker.models.digits_inputs import INPUT_DIM, DigitsModel


class LinearModel(DigitsModel):
    """`logits = images @ weights + biases`; plain cross-entropy; constant learning rate."""

    name = "linear"
    default_learning_rate = 0.5

    def inference(self, images, *, training: bool):
        import tensorflow as tf

        v1 = tf.compat.v1
        x = tf.reshape(images, [-1, INPUT_DIM])
        with v1.variable_scope("linear"):
            w = v1.get_variable("weights", [INPUT_DIM, self.num_classes], tf.float32, v1.zeros_initializer())
            b = v1.get_variable("biases", [self.num_classes], tf.float32, v1.zeros_initializer())
        return tf.add(tf.matmul(x, w), b, name="logits")
