"""The criteo tables' Adagrad (`psworker.train.slots.adagrad`): its sparse update is TF's arithmetic in whole-block
ops (`gathered_adagrad`), so it must leave a table, its partitions and its accumulator exactly as TF's
`AdagradOptimizer` does, repeated rows in a gradient included; with `use_locking` it is TF's kernel."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from psworker.tf_import import import_tensorflow

ROWS, DIM = 40, 4


def _updated(make_optimizer, partitions: int, steps: list[tuple[np.ndarray, np.ndarray]], distinct: bool = False):
    """(table, accumulator) as numpy after `steps` of (ids, gradient rows) applied by `make_optimizer()`, and the
    graph's op types. `distinct`: looked up by `criteo.sparse_lookup` (distinct rows, marked), else by TF's
    `embedding_lookup` (every id, repeats included)."""
    from psworker.models import criteo

    tf = import_tensorflow()
    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        partitioner = v1.fixed_size_partitioner(partitions) if partitions > 1 else None
        table = v1.get_variable("table", [ROWS, DIM], tf.float32, v1.random_normal_initializer(seed=3),
                                partitioner=partitioner, use_resource=True)
        ids = v1.placeholder(tf.int64, [None])
        rows = v1.placeholder(tf.float32, [None, DIM])
        if distinct:
            lookup = tf.reshape(criteo.sparse_lookup(table, ids[:, tf.newaxis]), [-1, DIM])
        else:
            lookup = v1.nn.embedding_lookup(table, ids, partition_strategy="div")
        loss = tf.reduce_sum(lookup * rows)         # d loss / d row[i] = rows[i]: the gradient fed
        optimizer = make_optimizer()
        train = optimizer.minimize(loss)
        parts = list(table) if partitions > 1 else [table]
        with v1.Session(graph=graph) as sess:
            sess.run(v1.global_variables_initializer())
            for step_ids, step_rows in steps:
                sess.run(train, {ids: step_ids, rows: step_rows})
            value = np.concatenate(sess.run(parts))
            accumulator = np.concatenate(sess.run([optimizer.get_slot(p, "accumulator") for p in parts]))
        return value, accumulator, collections.Counter(op.type for op in graph.get_operations())


def _steps(seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    steps = []
    for _ in range(6):
        ids = rng.integers(0, ROWS, 30)             # repeats within a step: 30 draws of 40 rows
        steps.append((ids, rng.normal(size=(30, DIM)).astype(np.float32)))
    return steps


@pytest.mark.parametrize("partitions", [1, 3])
def test_gathered_updates_leave_the_table_and_accumulator_as_tf_adagrad_does(partitions):
    from psworker.train import slots

    tf = import_tensorflow()
    steps = _steps()
    ours, our_acc, our_ops = _updated(lambda: slots.adagrad(0.3, initial_accumulator_value=0.1), partitions, steps)
    assert "Unique" in our_ops                      # TF's lookup of every id: summed by row before the update
    theirs, their_acc, their_ops = _updated(
        lambda: tf.compat.v1.train.AdagradOptimizer(0.3, initial_accumulator_value=0.1), partitions, steps)
    assert "ResourceSparseApplyAdagrad" in their_ops and "ResourceSparseApplyAdagrad" not in our_ops
    assert our_ops["ResourceGather"] and our_ops["ResourceScatterUpdate"]
    np.testing.assert_allclose(our_acc, their_acc, rtol=1e-6)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    assert not np.allclose(ours, _updated(lambda: slots.adagrad(0.3), partitions, steps[:1])[0])   # it moved


@pytest.mark.parametrize("partitions", [1, 3])
def test_distinct_rows_skip_the_sum_by_row_and_train_the_same(partitions):
    """`criteo.sparse_lookup` sums repeated ids' gradients into distinct rows on the worker and marks its gathers:
    the update then has no `Unique` of its own (the lookup's is the graph's only one), and the table ends as TF's
    Adagrad leaves it after the plain lookup."""
    from psworker.train import slots

    tf = import_tensorflow()
    steps = _steps(1)
    ours, our_acc, our_ops = _updated(lambda: slots.adagrad(0.3), partitions, steps, distinct=True)
    theirs, their_acc, _ = _updated(lambda: tf.compat.v1.train.AdagradOptimizer(0.3), partitions, steps)
    assert our_ops["Unique"] == 1 and our_ops["ResourceSparseApplyAdagrad"] == 0, our_ops
    np.testing.assert_allclose(our_acc, their_acc, rtol=1e-5)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    tf_graph = tf.Graph()
    with tf_graph.as_default():
        assert not slots.is_distinct(tf.reshape(tf.constant([1, 2]), [-1]))


def test_with_use_locking_the_update_is_tfs_kernel():
    from psworker.train import slots

    optimizer = slots.adagrad(0.3)
    optimizer._use_locking = True          # AdagradOptimizer(use_locking=True)'s field
    _, _, ops = _updated(lambda: optimizer, 1, _steps()[:1])
    assert "ResourceSparseApplyAdagrad" in ops and "ResourceScatterUpdate" not in ops
