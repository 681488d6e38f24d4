"""What a model is to the trainer: input functions, inference, loss, learning rate, all with explicit args.

Everything here builds graph-mode (`tf.compat.v1`) tensors; nothing reads flags or module globals.
Variables are made with `tf.compat.v1.get_variable` so that towers can share them through variable scopes.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, Optional


# The graph collection of a model's sparse tables (embedding tables): pass it in `get_variable(collections=...)`
# beside the global and trainable ones. The trainer reads such a table only by rows (gathers on its ps) and updates
# it only by rows; its machinery that would move a table whole (staged variables, the transfer dtype, moving
# averages) leaves it out, and says so.
SPARSE_TABLES = "psworker_sparse_tables"


@dataclass(frozen=True)
class InputSpec:
    """What training data one worker (or tower) reads.

    `positions` set (dealt shards, the default): a function that returns a finite `tf.data.Dataset` of int64
    positions in `0..num_train_examples-1`, dealt to this worker on demand. The input must then read exactly the
    examples at those positions, in that order, one per position (no shuffle, no repeat: the order is already a
    per-epoch permutation), in batches of `batch_size` with the last partial batch kept, and end when it ends.
    `positions` None (static slices): read slice `shard_index` of `num_shards`, shuffled, forever.
    """

    data_dir: Optional[str]
    batch_size: int
    shard_index: int = 0
    num_shards: int = 1
    seed: Optional[int] = None
    positions: Optional[Callable[[], Any]] = None


class Model(abc.ABC):
    """A registered workload. Subclasses set the class attributes and implement the methods."""

    name: str = ""
    num_classes: int = 10
    default_learning_rate: float = 0.1
    # The global batch (examples per update) that `default_learning_rate` is tuned for. Set: the trainer scales the
    # rate linearly with the actual global batch (`--scale_learning_rate`); None: the rate is used as given.
    reference_batch_size: Optional[int] = None
    moving_average_decay: Optional[float] = None   # set: the trainer keeps EMAs, eval restores them
    image_shape: tuple[int, ...] = ()              # one example as `inference` takes it, e.g. (24, 24, 3)
    # One example as the data set gives it, which the exported model's default signature takes: its dtype name and
    # shape (None: `image_shape`), turned into `image_shape` in the graph by `serving_preprocess`.
    raw_input_dtype: str = "float32"
    raw_input_shape: Optional[tuple[int, ...]] = None
    preprocessed_dtype: str = "float32"           # `inference`'s input dtype (the export's `preprocessed` signature)
    # What evaluation reports: "precision@1" (top-1 hits), or "auc" (a binary click model: AUC and logloss of
    # softmax(logits)[:, 1], `events.AucResult`).
    eval_metric: str = "precision@1"
    # The input runs Python (`tf.numpy_function`), which only the process that built the graph can run: in-graph
    # replication then reads every worker's batches on its client (worker 0) and sends them on.
    python_input: bool = False
    ids_per_example: int = 0   # a sparse-table model's: the table ids one example looks up (`table_ids`)
    needs_data_dir: bool = False   # its data is read from `data_dir` (no data_dir: refused by every launcher)

    @abc.abstractmethod
    def train_inputs(self, spec: InputSpec):
        """Returns `(images, labels)` batch tensors of what `spec` deals (see `InputSpec`)."""

    def train_dataset(self, spec: InputSpec):
        """The batches of `(images, labels)` as a `tf.data.Dataset`, or None (the default): then the trainer calls
        `train_inputs`. With a dataset the trainer makes the iterator and starts it again with each new session, so
        that after a ps restart the input resumes exactly from the restored data position."""
        return None

    @abc.abstractmethod
    def eval_dataset(self, data_dir: Optional[str], batch_size: int):
        """Returns a finite `tf.data.Dataset` of `(images, labels)` over the whole held-out split."""

    @abc.abstractmethod
    def num_train_examples(self, data_dir: Optional[str]) -> int:
        """Size of the training split (for epoch-based learning-rate decay)."""

    def check_data(self, data_dir: Optional[str], need: int) -> int:
        """What a launcher checks of the data before any task starts (where `data_dir` is visible to it): that the
        files are there and their format's first line parses. Returns the training examples, or `need` once it has
        counted that many (a model may stop there: a big split is not read through).

        Raises:
            PsworkerError: the data cannot be read, with what to do (the launcher turns it into a usage error).
        """
        return self.num_train_examples(data_dir)

    @abc.abstractmethod
    def inference(self, images, *, training: bool):
        """Builds the network; returns logits `[batch, num_classes]`.

        Safe to call several times inside `tf.compat.v1.variable_scope(..., reuse=tf.compat.v1.AUTO_REUSE)`
        (towers): variables come from `get_variable` and are shared.
        """

    def table_ids(self, features):
        """A sparse-table model's: the rows `inference` looks up for a batch (int64 `[batch, ids_per_example]`), which
        `psworker plan --data_dir` counts. Only models with `ids_per_example` implement it."""
        raise NotImplementedError(f"model {self.name!r} has no sparse table")

    def serving_preprocess(self, raw):
        """Graph ops that turn a raw batch `[batch, *raw_input_shape]` into `inference`'s input exactly as
        `eval_dataset` does, any statistics held as constants (the SavedModel's default signature). Default: none."""
        return raw

    def loss(self, logits, labels):
        """Total loss: mean cross-entropy plus any weight decay. Must not depend on global collections."""
        import tensorflow as tf

        labels = tf.cast(labels, tf.int64)
        return tf.reduce_mean(
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits), name="cross_entropy"
        )

    def learning_rate(self, global_step, base_learning_rate: float, batch_size: int, data_dir: Optional[str]):
        """The learning-rate tensor for `global_step` (constant unless a model decays it)."""
        import tensorflow as tf

        return tf.constant(base_learning_rate, tf.float32, name="learning_rate")

    def optimizer(self, learning_rate):
        import tensorflow as tf

        return tf.compat.v1.train.GradientDescentOptimizer(learning_rate)
