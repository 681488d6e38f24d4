"""The CIFAR-10 tutorial CNN: architecture, parameter count, loss with weight decay, learning-rate schedule."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from psworker.data import cifar10_files as files  # noqa: E402
from psworker.models.base import InputSpec  # noqa: E402
from psworker.models.cifar10 import WEIGHT_DECAY, Cifar10Model  # noqa: E402

v1 = tf.compat.v1


def _build(batch=None):
    model = Cifar10Model()
    images = v1.placeholder(tf.float32, [batch, 24, 24, 3])
    labels = v1.placeholder(tf.int32, [batch])
    logits = model.inference(images, training=True)
    return model, images, labels, logits


def test_parameter_count_and_variable_names():
    with tf.Graph().as_default():
        _build()
        variables = v1.trainable_variables()
        assert sum(int(np.prod(v.shape)) for v in variables) == 1_068_298
        shapes = {v.op.name: v.shape.as_list() for v in variables}
    assert shapes == {
        "conv1/weights": [5, 5, 3, 64], "conv1/biases": [64],
        "conv2/weights": [5, 5, 64, 64], "conv2/biases": [64],
        "local3/weights": [2304, 384], "local3/biases": [384],
        "local4/weights": [384, 192], "local4/biases": [192],
        "softmax_linear/weights": [192, 10], "softmax_linear/biases": [10],
    }


def test_inference_shape_and_initialisers():
    with tf.Graph().as_default():
        v1.set_random_seed(0)
        _, images, _, logits = _build()
        assert logits.shape.as_list() == [None, 10]
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            out = sess.run(logits, {images: np.random.default_rng(0).normal(size=(5, 24, 24, 3))})
            values = {v.op.name: sess.run(v) for v in v1.trainable_variables()}
    assert out.shape == (5, 10) and np.isfinite(out).all()
    for name, bias in [("conv1", 0.0), ("conv2", 0.1), ("local3", 0.1), ("local4", 0.1), ("softmax_linear", 0.0)]:
        np.testing.assert_array_equal(values[f"{name}/biases"], np.float32(bias))
    for name, stddev in [("conv2", 5e-2), ("local3", 0.04), ("softmax_linear", 1 / 192.0)]:
        w = values[f"{name}/weights"]
        assert np.abs(w).max() <= 2 * stddev + 1e-6  # truncated at two standard deviations
        assert 0.7 * stddev < w.std() < 1.0 * stddev  # a truncated normal's std is ~0.88 of stddev


def test_loss_is_cross_entropy_plus_weight_decay():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(4, 24, 24, 3)).astype(np.float32)
    y = np.array([0, 3, 9, 3], np.int32)
    with tf.Graph().as_default():
        model, images, labels, logits = _build()
        loss = model.loss(logits, labels)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            got, logit_values = sess.run([loss, logits], {images: x, labels: y})
            by_name = {v.op.name: v for v in v1.trainable_variables()}
            w3, w4 = sess.run([by_name["local3/weights"], by_name["local4/weights"]])
            # The decay's gradient reaches the variables through the read the matmuls share.
            decay_op = v1.get_default_graph().get_tensor_by_name("weight_decay:0")
            g3, g4 = sess.run(tf.gradients(decay_op, [by_name["local3/weights"], by_name["local4/weights"]]))
    np.testing.assert_allclose(g3, WEIGHT_DECAY * w3, rtol=1e-6)
    np.testing.assert_allclose(g4, WEIGHT_DECAY * w4, rtol=1e-6)
    z = logit_values.astype(np.float64)
    log_softmax = z - z.max(axis=1, keepdims=True)
    log_softmax -= np.log(np.exp(log_softmax).sum(axis=1, keepdims=True))
    cross_entropy = -log_softmax[np.arange(4), y].mean()
    decay = WEIGHT_DECAY * ((w3.astype(np.float64) ** 2).sum() / 2 + (w4.astype(np.float64) ** 2).sum() / 2)
    assert decay > 0.01  # big enough that leaving it out would fail the comparison
    np.testing.assert_allclose(got, cross_entropy + decay, rtol=1e-5)


def test_loss_counts_shared_weights_once_per_tower():
    with tf.Graph().as_default():
        model = Cifar10Model()
        images = v1.placeholder(tf.float32, [None, 24, 24, 3])
        with v1.variable_scope("", reuse=v1.AUTO_REUSE):
            logits_a = model.inference(images, training=True)
            logits_b = model.inference(images, training=True)
        assert len(v1.trainable_variables()) == 10
        decayed_a = model.weight_decay_variables(logits_a)
        decayed_b = model.weight_decay_variables(logits_b)
        assert decayed_a != decayed_b   # each tower decays what it read itself
        for decayed in (decayed_a, decayed_b):
            reads = [t.op.inputs[0].op for t in decayed]
            assert [r.inputs[0].op.name for r in reads] == ["local3/weights", "local4/weights"]
        # One read of each decayed weight per tower, shared by its matmul and the decay (issue #9: a second read
        # was a second pull of local3's 3.5 MB from the ps every step).
        for name in ("local3/weights", "local4/weights"):
            handle = v1.get_default_graph().get_operation_by_name(name)
            assert len(_reads(handle)) == 2, (name, _reads(handle))
        model.loss(logits_a, tf.zeros([1], tf.int32))
        assert len(_reads(handle)) == 2, _reads(handle)
        with pytest.raises(ValueError, match="inference"):
            model.loss(tf.identity(logits_a), tf.zeros([1], tf.int32))


def _reads(handle) -> list:
    """The reads of a variable by the model (the variable's own `<name>/Read` is made with it and never runs)."""
    return [op.name for op in handle.outputs[0].consumers()
            if op.type == "ReadVariableOp" and not op.name.startswith(handle.name + "/Read/")]


def test_learning_rate_schedule(tmp_path):
    model = Cifar10Model()
    assert model.default_learning_rate == 0.1 and model.moving_average_decay == 0.9999
    assert model.image_shape == (24, 24, 3)
    assert model.num_train_examples(None) == 50000
    files.write_synthetic(str(tmp_path), train_per_class=10, test_per_class=1)
    assert model.num_train_examples(str(tmp_path)) == 100
    with tf.Graph().as_default():
        step = v1.placeholder(tf.int64, [])
        lr = model.learning_rate(step, 0.1, 128, None)  # decay_steps = int(50000 / 128 * 350) = 136718
        small = model.learning_rate(step, 0.1, 10, str(tmp_path))  # int(100 / 10 * 350) = 3500
        with v1.Session() as sess:
            assert sess.run(lr, {step: 0}) == pytest.approx(0.1)
            assert sess.run(lr, {step: 136717}) == pytest.approx(0.1)
            assert sess.run(lr, {step: 136718}) == pytest.approx(0.01)
            assert sess.run(lr, {step: 2 * 136718}) == pytest.approx(0.001)
            assert sess.run(small, {step: 3499}) == pytest.approx(0.1)
            assert sess.run(small, {step: 3500}) == pytest.approx(0.01)
        assert isinstance(model.optimizer(0.1), v1.train.GradientDescentOptimizer)


def test_train_inputs_and_a_training_step_lowers_the_loss(tmp_path):
    files.write_synthetic(str(tmp_path), train_per_class=4, test_per_class=1)
    model = Cifar10Model()
    with tf.Graph().as_default():
        v1.set_random_seed(0)
        images, labels = model.train_inputs(InputSpec(str(tmp_path), batch_size=8, seed=0))
        assert images.shape.as_list() == [8, 24, 24, 3] and labels.dtype == tf.int32
        x, y = v1.placeholder(tf.float32, [8, 24, 24, 3]), v1.placeholder(tf.int32, [8])
        loss = model.loss(model.inference(x, training=True), y)
        train = model.optimizer(0.05).minimize(loss)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            feed = dict(zip((x, y), sess.run([images, labels])))  # one batch, trained on repeatedly
            before = sess.run(loss, feed)
            for _ in range(5):
                sess.run(train, feed)
            after = sess.run(loss, feed)
    assert np.isfinite(before) and after < before - 0.05


def test_moving_averages_start_at_their_variables_and_live_on_their_ps(tmp_path):
    """The shadows the trainer creates (`ColocatedAverages`) start equal to their variables in one init run, sit on
    their variable's ps, and keep TF's names and collection."""
    from psworker.spec import TrainConfig
    from psworker.train import graph

    files.write_synthetic(str(tmp_path), train_per_class=2, test_per_class=1)
    config = TrainConfig(model="cifar10", batch_size=4, data_dir=str(tmp_path))
    cluster = {"ps": ["127.0.0.1:1", "127.0.0.1:2"], "worker": ["127.0.0.1:3"]}
    with tf.Graph().as_default():
        graph.build_train_graph(Cifar10Model(), config, cluster=cluster, task_index=0)
        variables = {v.op.name: v for v in v1.global_variables()}
        averaged = v1.moving_average_variables()
        assert averaged and {v.op.name for v in averaged} == {v.op.name for v in v1.trainable_variables()}
        for var in averaged:
            assert variables[f"{var.op.name}/ExponentialMovingAverage"].device == var.device
    with tf.Graph().as_default():
        tg = graph.build_train_graph(Cifar10Model(), config, cluster=None, task_index=0)
        variables = {v.op.name: v for v in v1.global_variables()}
        pairs = [(var, variables[f"{var.op.name}/ExponentialMovingAverage"]) for var in v1.moving_average_variables()]
        assert len(pairs) == 10
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for var, shadow in pairs:
                np.testing.assert_array_equal(*sess.run([var, shadow]), err_msg=var.op.name)
            start = sess.run(pairs[0][0])
            sess.run(tg.train_op)
            moved, shadow = sess.run(pairs[0])
    assert np.abs(moved - start).max() > 0
    assert np.abs(shadow - start).max() < np.abs(moved - start).max()   # the average trails the variable


def test_eval_dataset_from_model(tmp_path):
    files.write_synthetic(str(tmp_path), train_per_class=1, test_per_class=3)
    ds = Cifar10Model().eval_dataset(str(tmp_path), 16)
    assert ds.element_spec[0].shape.as_list() == [None, 24, 24, 3]


def test_registered_as_cifar10():
    from psworker import models

    pytest.importorskip("psworker.models.mlp")
    assert isinstance(models.get("cifar10"), Cifar10Model)
    assert "cifar10" in models.names()
