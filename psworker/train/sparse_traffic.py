"""The sparse tables' share of a worker step's traffic (`psworker plan`): distinct rows touched x bytes per row.

A step gathers each distinct row its batch looks up once (`models.criteo.sparse_lookup`) and pushes one gradient
row per distinct row, each with its int64 id. How many rows are distinct depends on the data, so the count is
measured on the training files (`measure`: the model's own input pipeline, shuffled batches of the run's size),
given (`--rows_per_step`), or bounded (`upper_bound`: every id of every example distinct).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Optional

ID_BYTES = 8            # an int64 row id, sent with each row both ways
MEASURED_BATCHES = 20   # batches `measure` counts (their median is the estimate)


@dataclass(frozen=True)
class RowsTouched:
    """Distinct table rows one worker step touches, and where the figure comes from."""

    rows: int
    source: str


@dataclass(frozen=True)
class SparseTraffic:
    """Bytes one worker step moves for its sparse tables: `pull` (ids, row values), `push` (ids, row gradients)."""

    rows: RowsTouched
    pull: int
    push: int


def upper_bound(model, batch_size: int) -> RowsTouched:
    """Every id of every example distinct: the most a step can touch."""
    return RowsTouched(batch_size * model.ids_per_example,
                       f"at most: {batch_size} examples x {model.ids_per_example} ids, all distinct; "
                       "--data_dir measures it")


def measure(model, data_dir: str, batch_size: int, batches: int = MEASURED_BATCHES, seed: int = 0) -> RowsTouched:
    """The median distinct rows of `batches` shuffled training batches of `data_dir`, read by `model`'s input."""
    from psworker.tf_import import import_tensorflow

    tf = import_tensorflow()   # without Keras and scikit-learn (1.5 s of CPU)

    from psworker.models.base import InputSpec

    with tf.Graph().as_default():
        dataset = model.train_dataset(InputSpec(data_dir=data_dir, batch_size=batch_size, seed=seed))
        features, _ = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()
        distinct = tf.size(tf.unique(tf.reshape(model.table_ids(features), [-1]))[0])
        with tf.compat.v1.Session() as sess:
            counts = [int(sess.run(distinct)) for _ in range(batches)]
    return RowsTouched(int(statistics.median(counts)),
                       f"measured: median of {batches} batches of {data_dir}, {min(counts):,}-{max(counts):,}")


def per_step(rows: RowsTouched, dims: list[int]) -> SparseTraffic:
    """The bytes `rows` distinct rows move, per table of `dims` columns (float32), both ways."""
    per_row = sum(ID_BYTES + 4 * dim for dim in dims)
    return SparseTraffic(rows, rows.rows * per_row, rows.rows * per_row)


def describe(traffic: SparseTraffic, batch_size: int, dense_pull: int, dense_push: int, table_bytes: int) -> str:
    """The plan's line: the sparse bytes per step, with the dense weights, against pulling the tables whole."""
    return (f"sparse traffic per worker step, batch {batch_size}: {traffic.rows.rows:,} distinct rows "
            f"({traffic.rows.source}): {traffic.pull:,} bytes pulled, {traffic.push:,} pushed; with the dense "
            f"weights {dense_pull + traffic.pull:,} pulled, {dense_push + traffic.push:,} pushed (the tables whole: "
            f"{table_bytes:,} bytes)")


def rows_touched(model, batch_size: int, data_dir: Optional[str], rows_per_step: Optional[int]) -> RowsTouched:
    """`--rows_per_step` if given, else measured on `data_dir` if given, else the upper bound."""
    if rows_per_step is not None:
        return RowsTouched(rows_per_step, "given: --rows_per_step")
    return measure(model, data_dir, batch_size) if data_dir else upper_bound(model, batch_size)


__all__ = ["RowsTouched", "SparseTraffic", "upper_bound", "measure", "per_step", "describe", "rows_touched"]
