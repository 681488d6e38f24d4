"""An MNIST-style multi-layer perceptron on scikit-learn's 8x8 handwritten digits (the default job)."""

from __future__ import annotations

from psworker.models.digits_inputs import INPUT_DIM, DigitsModel

HIDDEN = (256,)


class MlpModel(DigitsModel):
    """Standardised 64 pixels -> 256 ReLU -> 10; plain cross-entropy; constant learning rate 0.1."""

    name = "mlp"
    default_learning_rate = 0.1

    def inference(self, images, *, training: bool):
        import tensorflow as tf

        v1 = tf.compat.v1
        x = tf.reshape(images, [-1, INPUT_DIM])
        fan_in = INPUT_DIM
        for i, width in enumerate(HIDDEN, start=1):
            with v1.variable_scope(f"hidden{i}"):
                w = v1.get_variable(
                    "weights", [fan_in, width], tf.float32,
                    v1.truncated_normal_initializer(stddev=(2.0 / fan_in) ** 0.5),
                )
                b = v1.get_variable("biases", [width], tf.float32, v1.zeros_initializer())
                x = tf.nn.relu(tf.matmul(x, w) + b)
            fan_in = width
        with v1.variable_scope("softmax_linear"):
            w = v1.get_variable(
                "weights", [fan_in, self.num_classes], tf.float32,
                v1.truncated_normal_initializer(stddev=1.0 / fan_in),
            )
            b = v1.get_variable("biases", [self.num_classes], tf.float32, v1.zeros_initializer())
            return tf.add(tf.matmul(x, w), b, name="logits")
