"""The CIFAR-10 tutorial's CNN (two conv+LRN+pool blocks, two fully connected layers) as a registered Model."""

from __future__ import annotations

import logging
import weakref
from typing import Optional

from psworker.models.base import InputSpec, Model

log = logging.getLogger(__name__)

WEIGHT_DECAY = 0.004  # on local3 and local4 weights
NUM_EPOCHS_PER_DECAY = 350.0
LEARNING_RATE_DECAY_FACTOR = 0.1


def _variable(name: str, shape, initializer):
    import tensorflow as tf

    return tf.compat.v1.get_variable(name, shape, initializer=initializer, dtype=tf.float32)


def _layer_variables(shape, stddev: float, bias: float):
    import tensorflow as tf

    weights = _variable("weights", shape, tf.compat.v1.truncated_normal_initializer(stddev=stddev))
    biases = _variable("biases", shape[-1:], tf.compat.v1.constant_initializer(bias))
    return weights, biases


def _read_once(weights):
    """One read of `weights` (a variable, or the shards of a partitioned one) for every use in a tower.

    The matmul and the weight decay then share it: each use of the variable itself would be its own read, i.e. a
    second pull of local3's 3.5 MB from the ps every step (issue #9; `psworker plan --model cifar10` counts it).
    """
    import tensorflow as tf

    return tf.identity(tf.convert_to_tensor(weights), name="read_once")


class Cifar10Model(Model):
    """The tutorial's CNN: 1,068,298 parameters for 24x24x3 input; SGD, lr 0.1 decayed 10x every 350 epochs."""

    name = "cifar10"
    num_classes = 10
    default_learning_rate = 0.1
    reference_batch_size = 128   # the tutorial's batch; other global batches scale the rate linearly
    moving_average_decay = 0.9999
    image_shape = (24, 24, 3)
    raw_input_dtype = "uint8"
    raw_input_shape = (32, 32, 3)   # the data set's images: height, width, RGB
    needs_data_dir = True

    def __init__(self) -> None:
        # graph -> {logits tensor name: [weights to decay]}: `loss` finds the (shared) variables of the
        # network that produced its logits, without global collections or name-scope lookups.
        self._decay_vars: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    # ------------------------------------------------------------------------------------------ inputs

    def train_inputs(self, spec: InputSpec):
        """Returns `(images [batch, 24, 24, 3] float32, labels [batch] int32)` of what `spec` deals."""
        import tensorflow as tf

        images, labels = tf.compat.v1.data.make_one_shot_iterator(self.train_dataset(spec)).get_next()
        return images, labels

    def train_dataset(self, spec: InputSpec):
        """The batches of `train_inputs`: dealt positions (records by position), or a static slice."""
        from psworker.data import cifar10 as data

        if spec.positions is not None:
            return data.dealt_dataset(spec.data_dir, spec.positions(), spec.batch_size, spec.seed)
        return data.train_dataset(spec.data_dir, spec.batch_size, spec.shard_index, spec.num_shards, spec.seed)

    def eval_dataset(self, data_dir: Optional[str], batch_size: int):
        """The whole test split once (central crops), last partial batch kept."""
        from psworker.data import cifar10 as data

        return data.eval_dataset(data_dir, batch_size)

    def serving_preprocess(self, raw):
        """Central 24x24 crop and per-image standardisation of each uint8 `[32, 32, 3]` image, as eval does."""
        from psworker.data import cifar10 as data

        return data.preprocess_eval(raw)

    def check_data(self, data_dir: Optional[str], need: int) -> int:
        from psworker.data import cifar10 as data

        return data.check_files(data_dir)

    def num_train_examples(self, data_dir: Optional[str]) -> int:
        """Records in the training files (50,000 for the real data; 50,000 when the files are not there)."""
        from psworker.data import cifar10 as data
        from psworker.errors import PsworkerError

        try:
            return data.num_records(data.train_files(data_dir))
        except PsworkerError:
            return data.NUM_TRAIN_EXAMPLES

    # ------------------------------------------------------------------------------------------ network

    def inference(self, images, *, training: bool):
        """Builds the network on `images [batch, 24, 24, 3]`; returns logits `[batch, 10]` (no softmax).

        Args:
            images: float32 images.
            training: unused (the network has no dropout or batch norm); kept for the Model interface.
        """
        import tensorflow as tf

        v1 = tf.compat.v1
        with v1.variable_scope("conv1"):
            w, b = _layer_variables([5, 5, 3, 64], stddev=5e-2, bias=0.0)
            conv1 = tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(images, w, [1, 1, 1, 1], "SAME"), b), name="conv1")
        pool1 = tf.nn.max_pool2d(conv1, ksize=3, strides=2, padding="SAME", name="pool1")
        norm1 = tf.nn.lrn(pool1, depth_radius=4, bias=1.0, alpha=0.001 / 9.0, beta=0.75, name="norm1")

        with v1.variable_scope("conv2"):
            w, b = _layer_variables([5, 5, 64, 64], stddev=5e-2, bias=0.1)
            conv2 = tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(norm1, w, [1, 1, 1, 1], "SAME"), b), name="conv2")
        norm2 = tf.nn.lrn(conv2, depth_radius=4, bias=1.0, alpha=0.001 / 9.0, beta=0.75, name="norm2")
        pool2 = tf.nn.max_pool2d(norm2, ksize=3, strides=2, padding="SAME", name="pool2")

        dim = 1
        for d in pool2.shape[1:]:
            if d is None:
                raise ValueError(f"inference needs static image height/width/depth, got {images.shape}")
            dim *= int(d)
        flat = tf.reshape(pool2, [-1, dim])
        decayed = []
        with v1.variable_scope("local3"):
            w, b = _layer_variables([dim, 384], stddev=0.04, bias=0.1)
            w = _read_once(w)
            local3 = tf.nn.relu(tf.matmul(flat, w) + b, name="local3")
            decayed.append(w)
        with v1.variable_scope("local4"):
            w, b = _layer_variables([384, 192], stddev=0.04, bias=0.1)
            w = _read_once(w)
            local4 = tf.nn.relu(tf.matmul(local3, w) + b, name="local4")
            decayed.append(w)
        with v1.variable_scope("softmax_linear"):
            w, b = _layer_variables([192, self.num_classes], stddev=1 / 192.0, bias=0.0)
            logits = tf.add(tf.matmul(local4, w), b, name="logits")

        self._decay_vars.setdefault(logits.graph, {})[logits.name] = decayed
        return logits

    def weight_decay_variables(self, logits) -> list:
        """The weights under L2 decay (local3, local4) of the network that produced `logits`: the tensors its
        matmuls read (one read of each variable per tower).

        Raises:
            ValueError: `logits` did not come from this model's `inference` in this graph.
        """
        try:
            return list(self._decay_vars[logits.graph][logits.name])
        except KeyError:
            raise ValueError(
                f"{logits.name} was not returned by this model's inference(); pass its logits to loss()"
            ) from None

    def loss(self, logits, labels):
        """Mean sparse cross-entropy plus 0.004 * l2_loss of the local3 and local4 weights.

        Computed from the weights `inference` read for `logits` (variables shared across towers, one read per
        tower), so each tower's loss carries the decay once.
        """
        import tensorflow as tf

        cross_entropy = tf.reduce_mean(
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels=tf.cast(labels, tf.int64), logits=logits),
            name="cross_entropy",
        )
        decay = tf.add_n(
            [tf.multiply(tf.nn.l2_loss(w), WEIGHT_DECAY) for w in self.weight_decay_variables(logits)],
            name="weight_decay",
        )
        return tf.add(cross_entropy, decay, name="total_loss")

    # ------------------------------------------------------------------------------------------ training

    def learning_rate(self, global_step, base_learning_rate: float, batch_size: int, data_dir: Optional[str]):
        """`base_learning_rate` decayed by 0.1 every 350 epochs (staircase)."""
        import tensorflow as tf

        steps_per_epoch = self.num_train_examples(data_dir) / batch_size
        decay_steps = max(1, int(steps_per_epoch * NUM_EPOCHS_PER_DECAY))
        return tf.compat.v1.train.exponential_decay(
            base_learning_rate,
            global_step,
            decay_steps,
            LEARNING_RATE_DECAY_FACTOR,
            staircase=True,
            name="learning_rate",
        )

    def optimizer(self, learning_rate):
        """Plain gradient descent, as the tutorial."""
        import tensorflow as tf

        return tf.compat.v1.train.GradientDescentOptimizer(learning_rate)


__all__ = ["Cifar10Model", "WEIGHT_DECAY"]
