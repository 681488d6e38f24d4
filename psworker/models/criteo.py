"""A click-through model on Criteo's format: hashed categoricals in one fused, row-sharded embedding table, the
log of the integers, an MLP on top (the deep half of wide & deep), logloss, Adagrad with sparse updates.

The 26 categorical columns share one table (`embeddings`, `[sum of buckets, EMBEDDING_DIM]`): column `c`'s value
lands in row `offset[c] + hash(value) % buckets[c]` (`data.criteo.table_rows`; in the graph, `preprocess_fields`).
One fused variable rather than 26: one gather per ps per step instead of 26 (the issue measured 26 tables 1.5x
slower in TF2's PSS). On a cluster the table is split by rows into one shard per ps (`train.placement`), each
shard's Adagrad accumulator beside it. A step takes the batch's distinct rows (`tf.unique`), gathers only those
on the ps tasks (`embedding_lookup`, contiguous row ranges: `div`), and pushes their gradients as `IndexedSlices`,
applied on the ps by `train.slots.adagrad` (marked distinct, so not summed by row again there).

The logits are `[0, z]` for a click score `z`, so softmax gives `sigmoid(z)` as the click probability and the
trainer's two-class machinery (export's `classes`, the sync and tower code) works unchanged.
"""

from __future__ import annotations

from typing import Optional

from psworker.data import criteo
from psworker.models.base import SPARSE_TABLES, InputSpec, Model

EMBEDDING_DIM = 8
HIDDEN = (64, 32)
BUCKETS_PER_VALUE = 4          # buckets per distinct value a column has in Criteo (fewer collisions)...
MAX_BUCKETS = 20_000           # ...up to this many per column (`buckets`)
TABLE_NAME = "embeddings"


def buckets(max_buckets: int = MAX_BUCKETS) -> tuple[int, ...]:
    """Each categorical column's hash buckets: `BUCKETS_PER_VALUE` times Criteo's cardinality, capped."""
    return tuple(min(BUCKETS_PER_VALUE * c, max_buckets) for c in criteo.CARDINALITIES)


def sparse_lookup(table, ids):
    """Rows `ids` (int64 `[batch, k]`) of `table` (a variable or a row-partitioned one): `[batch, k, dim]`.

    Each distinct id is gathered once, on the ps that holds its row; the gradient reaches the table as
    `IndexedSlices` of those distinct rows only (`slots.mark_distinct`: each shard's gather takes distinct rows)."""
    import tensorflow as tf

    from psworker.train import slots

    flat = tf.reshape(ids, [-1])
    distinct, where = tf.unique(flat, out_idx=tf.int32)
    graph = tf.compat.v1.get_default_graph()
    before = len(graph.get_operations())
    rows = tf.compat.v1.nn.embedding_lookup(table, distinct, partition_strategy="div", name="distinct_rows")
    slots.mark_distinct(op for op in graph.get_operations()[before:] if op.type == "ResourceGather")
    dim = rows.shape[-1]
    return tf.reshape(tf.gather(rows, where), [-1, ids.shape[1], dim])


class CriteoModel(Model):
    """Criteo click-through: 39 raw fields -> fused embeddings (26 x 8) + log(1 + integers) (13) -> 64 -> 32 -> 1."""

    name = "criteo"
    num_classes = 2
    default_learning_rate = 0.1
    moving_average_decay = None
    image_shape = (criteo.NUM_FEATURES,)
    raw_input_dtype = "string"              # the raw fields as the files hold them: integers and hex strings
    raw_input_shape = (criteo.NUM_FEATURES,)
    preprocessed_dtype = "int64"            # `preprocess_fields`: integers, then table rows
    eval_metric = "auc"
    python_input = True                     # lines gathered by position from memory (`tf.numpy_function`)
    ids_per_example = criteo.NUM_CAT
    needs_data_dir = True

    def __init__(self, max_buckets: int = MAX_BUCKETS, embedding_dim: int = EMBEDDING_DIM, name: Optional[str] = None):
        """Args:
            max_buckets: each column's buckets at most (the table's rows: `buckets`).
            embedding_dim: the table's columns.
            name: the name a variant is registered under (docs/criteo.md, "Tables larger than one ps"); default
                `criteo`.
        """
        self.buckets = buckets(max_buckets)
        self.embedding_dim = embedding_dim
        if name is not None:
            self.name = name

    @property
    def table_rows(self) -> int:
        return sum(self.buckets)

    def train_inputs(self, spec: InputSpec):
        import tensorflow as tf

        return tf.compat.v1.data.make_one_shot_iterator(self.train_dataset(spec)).get_next()

    def train_dataset(self, spec: InputSpec):
        if spec.positions is not None:
            return criteo.dealt_dataset(spec.data_dir, spec.positions(), spec.batch_size, self.buckets)
        return criteo.train_dataset(spec.data_dir, spec.batch_size, self.buckets, spec.shard_index, spec.num_shards,
                                    spec.seed)

    def eval_dataset(self, data_dir: Optional[str], batch_size: int):
        return criteo.eval_dataset(data_dir, batch_size, self.buckets)

    def num_train_examples(self, data_dir: Optional[str]) -> int:
        return criteo.num_examples(data_dir)

    def check_data(self, data_dir: Optional[str], need: int) -> int:
        return criteo.check_files(data_dir, need)

    def table_ids(self, features):
        return features[:, criteo.NUM_INT:]

    def serving_preprocess(self, raw):
        """Raw fields (string `[batch, 39]`: integers as text, hex strings, '' where empty) -> table rows."""
        return criteo.preprocess_fields(raw, self.buckets)

    def inference(self, images, *, training: bool):
        import tensorflow as tf

        v1 = tf.compat.v1
        features = tf.convert_to_tensor(images, tf.int64)
        dense = tf.math.log1p(tf.cast(tf.maximum(features[:, :criteo.NUM_INT], 0), tf.float32))
        table = v1.get_variable(
            TABLE_NAME, [self.table_rows, self.embedding_dim], tf.float32,
            v1.truncated_normal_initializer(stddev=0.05),
            collections=[v1.GraphKeys.GLOBAL_VARIABLES, v1.GraphKeys.TRAINABLE_VARIABLES, SPARSE_TABLES])
        embedded = sparse_lookup(table, self.table_ids(features))
        x = tf.concat([tf.reshape(embedded, [-1, criteo.NUM_CAT * self.embedding_dim]), dense], axis=1)
        fan_in = criteo.NUM_CAT * self.embedding_dim + criteo.NUM_INT
        for i, width in enumerate((*HIDDEN, 1), start=1):
            with v1.variable_scope(f"dense{i}"):
                w = v1.get_variable("weights", [fan_in, width], tf.float32,
                                    v1.truncated_normal_initializer(stddev=(2.0 / fan_in) ** 0.5))
                b = v1.get_variable("biases", [width], tf.float32, v1.zeros_initializer())
                x = tf.matmul(x, w) + b
                x = tf.nn.relu(x) if i <= len(HIDDEN) else x
            fan_in = width
        return tf.concat([tf.zeros_like(x), x], axis=1, name="logits")

    def loss(self, logits, labels):
        """Logloss of the click score `logits[:, 1]`."""
        import tensorflow as tf

        return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
            labels=tf.cast(labels, tf.float32), logits=logits[:, 1]), name="logloss")

    def optimizer(self, learning_rate):
        from psworker.train import slots

        return slots.adagrad(learning_rate, initial_accumulator_value=0.1)   # no constant of the slot's size kept
