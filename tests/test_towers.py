"""In-process towers: device list, gradient averaging, and tower gradients equal to the whole-batch gradient."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from psworker.train import towers  # noqa: E402
from psworker.models.cifar10 import Cifar10Model  # noqa: E402

v1 = tf.compat.v1
CPU_TOWERS = ["/device:CPU:0", "/device:CPU:1"]


def test_tower_devices_and_session_config():
    if tf.config.list_physical_devices("GPU"):
        assert towers.tower_devices(1) == ["/device:GPU:0"]
    else:
        assert towers.tower_devices(3) == ["/device:CPU:0", "/device:CPU:1", "/device:CPU:2"]
    with pytest.raises(ValueError):
        towers.tower_devices(0)
    config = towers.session_config_for_towers(4)
    assert config.device_count["CPU"] == 4 and config.allow_soft_placement
    base = v1.ConfigProto(device_count={"CPU": 8}, log_device_placement=True)
    merged = towers.session_config_for_towers(2, base=base)
    assert merged.device_count["CPU"] == 8 and merged.log_device_placement


def test_average_gradients_values_and_checks():
    with tf.Graph().as_default():
        a = v1.get_variable("a", [2], initializer=v1.zeros_initializer())
        b = v1.get_variable("b", [], initializer=v1.zeros_initializer())
        sparse = tf.IndexedSlices(tf.constant([[1.0, 1.0]]), tf.constant([0]), tf.constant([3, 2]))
        sparse2 = tf.IndexedSlices(tf.constant([[3.0, 5.0]]), tf.constant([2]), tf.constant([3, 2]))
        c = v1.get_variable("c", [3, 2], initializer=v1.zeros_initializer())
        averaged = towers.average_gradients([
            [(tf.constant([1.0, 2.0]), a), (None, b), (sparse, c)],
            [(tf.constant([3.0, 6.0]), a), (None, b), (sparse2, c)],
        ])
        assert [v for _, v in averaged] == [a, b, c] and averaged[1][0] is None
        with v1.Session() as sess:
            np.testing.assert_allclose(sess.run(averaged[0][0]), [2.0, 4.0])
            np.testing.assert_allclose(sess.run(tf.convert_to_tensor(averaged[2][0])), [[0.5, 0.5], [0, 0], [1.5, 2.5]])
        with pytest.raises(ValueError, match="some towers only"):
            towers.average_gradients([[(tf.constant(1.0), b)], [(None, b)]])
        with pytest.raises(ValueError, match="different variables"):
            towers.average_gradients([[(tf.constant(1.0), b)], [(tf.constant([1.0, 1.0]), a)]])
        with pytest.raises(ValueError):
            towers.average_gradients([])


def _tower_vs_whole_batch(num_devices: int, batch: int):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, 24, 24, 3)).astype(np.float32)
    y = rng.integers(0, 10, batch).astype(np.int32)
    model = Cifar10Model()
    with tf.Graph().as_default():
        v1.set_random_seed(1)
        images, labels = tf.constant(x), tf.constant(y)
        optimizer = model.optimizer(0.1)
        grads_and_vars, mean_loss = towers.build_tower_gradients(
            model, optimizer, images, labels, num_devices, devices=CPU_TOWERS[:num_devices]
        )
        variables = v1.trainable_variables()
        assert len(variables) == 10  # shared, not one set per tower
        with v1.variable_scope("", reuse=True):
            whole_loss = model.loss(model.inference(images, training=True), labels)
        whole_grads = tf.gradients(whole_loss, [v for _, v in grads_and_vars])
        train = optimizer.apply_gradients(grads_and_vars)
        with v1.Session(config=towers.session_config_for_towers(num_devices)) as sess:
            assert any(d.name.endswith("CPU:1") for d in sess.list_devices())
            sess.run(v1.global_variables_initializer())
            got = sess.run([g for g, _ in grads_and_vars] + [mean_loss])
            want = sess.run(whole_grads + [whole_loss])
            sess.run(train)
            assert sess.run(mean_loss) < got[-1]  # the averaged step descends
    return got, want, grads_and_vars


def test_two_towers_equal_the_whole_batch_gradient():
    got, want, grads_and_vars = _tower_vs_whole_batch(2, batch=6)
    for (_, var), g, w in zip(grads_and_vars, got[:-1], want[:-1]):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6, err_msg=var.name)
    np.testing.assert_allclose(got[-1], want[-1], rtol=1e-5)
    assert all(np.abs(g).max() > 0 for g in got[:-1])


def test_ops_go_to_towers_and_variables_to_the_ps():
    """Under `replica_device_setter`, variables land on the ps and tower ops on the worker's CPU:i."""
    model = Cifar10Model()
    cluster = tf.train.ClusterSpec({"ps": ["localhost:2222"], "worker": ["localhost:2223"]})
    with tf.Graph().as_default():
        setter = v1.train.replica_device_setter(cluster=cluster, worker_device="/job:worker/task:0")
        with v1.device(setter):
            images, labels = tf.zeros([4, 24, 24, 3]), tf.zeros([4], tf.int32)
            towers.build_tower_gradients(model, model.optimizer(0.1), images, labels, 2,
                                         device_prefix="/job:worker/task:0", devices=CPU_TOWERS)
        for var in v1.trainable_variables():
            assert var.device == "/job:ps/task:0", (var.name, var.device)
        ops = {op.name: op.device for op in v1.get_default_graph().get_operations()}
    assert ops["tower_0/conv1/Conv2D"] == "/job:worker/task:0/device:CPU:0"
    assert ops["tower_1/conv1/Conv2D"] == "/job:worker/task:0/device:CPU:1"
    assert ops["tower_1/local3/MatMul"] == "/job:worker/task:0/device:CPU:1"


def test_batch_must_divide_into_towers():
    model = Cifar10Model()
    with tf.Graph().as_default():
        with pytest.raises(ValueError, match="divide"):
            towers.build_tower_gradients(model, model.optimizer(0.1), tf.zeros([5, 24, 24, 3]),
                                         tf.zeros([5], tf.int32), 2, devices=CPU_TOWERS)


def _gpus_or_skip(needed: int) -> int:
    gpus = len(tf.config.list_physical_devices("GPU"))
    if not gpus:
        pytest.skip("no GPU visible")
    if gpus < needed:
        pytest.skip(f"needs {needed} GPUs, {gpus} visible")
    return gpus


def test_towers_run_on_two_gpus():
    """A tiny tower graph on /gpu:0 and /gpu:1 (no soft placement): each tower's matmul runs on its GPU."""
    from psworker.train import devices

    gpus = _gpus_or_skip(2)
    names = devices.device_names(devices.resolve_num_devices("auto", gpus), gpus)[:2]
    assert names == ["/gpu:0", "/gpu:1"]

    class Tiny:
        def inference(self, images, *, training):
            w = v1.get_variable("w", [4, 3], initializer=v1.ones_initializer())
            return tf.matmul(images, w)

        def loss(self, logits, labels):
            return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))

    with tf.Graph().as_default():
        with v1.device("/cpu:0"):
            images, labels = tf.ones([8, 4]), tf.zeros([8], tf.int64)
        optimizer = v1.train.GradientDescentOptimizer(0.1)
        with v1.device("/cpu:0"):   # variables outside the towers, as on the ps
            grads, loss = towers.build_tower_gradients(Tiny(), optimizer, images, labels, 2, devices=names)
        matmuls = {op.name: op.device for op in v1.get_default_graph().get_operations()
                   if op.name in ("tower_0/MatMul", "tower_1/MatMul")}
        assert matmuls == {"tower_0/MatMul": "/device:GPU:0", "tower_1/MatMul": "/device:GPU:1"}
        config = devices.server_config(2, gpus)
        config.allow_soft_placement = False
        with v1.Session(config=config) as sess:
            sess.run(v1.global_variables_initializer())
            before = sess.run(loss)
            sess.run(optimizer.apply_gradients(grads))
            assert sess.run(loss) < before
