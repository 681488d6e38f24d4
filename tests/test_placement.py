"""Pure tests of where a training graph puts its work: the moving averages on the ps (no servers, no data)."""

from __future__ import annotations

import pytest

CLUSTER = {"ps": ["p0:1", "p1:1"], "worker": ["w0:1", "w1:1"]}


def _cifar_graph(mode: str, task_index: int = 0):
    import tensorflow as tf

    from psworker import models
    from psworker.spec import TrainConfig
    from psworker.train.graph import build_train_graph
    from psworker.train.report import _NoDataModel

    graph = tf.Graph()
    config = TrainConfig(model="cifar10", batch_size=2, mode=mode, max_steps=10)
    with graph.as_default():
        tg = build_train_graph(_NoDataModel(models.get("cifar10")), config, cluster=CLUSTER, task_index=task_index)
    return graph, tg


def _job(op) -> str:
    import tensorflow as tf

    return tf.DeviceSpec.from_string(op.device or "").job or ""


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_moving_average_updates_run_on_the_ps_of_their_variable(mode):
    """No moving-average op runs on the worker; each shadow's update runs on that shadow's (= its variable's) ps."""
    graph, _ = _cifar_graph(mode)
    ops = [op for op in graph.get_operations() if "MovingAv" in op.name and op.type != "ReadVariableOp"]
    assert ops and {_job(op) for op in ops} == {"ps"}
    updates = [op for op in ops if op.type == "AssignSubVariableOp"]
    assert len(updates) == 10   # one per trainable variable
    for op in updates:
        scope = op.name.split("/")[0]   # ExponentialMovingAverage_N: this variable's decay and update
        shadow = op.inputs[0].op
        assert shadow.name.endswith("/ExponentialMovingAverage")
        assert {o.device for o in ops if o.name.startswith(scope + "/")} == {shadow.device}, scope


def _checkpoint_names(graph) -> set[str]:
    """The names the trainer's Saver writes: a partitioned variable's shards under its full name."""
    import tensorflow as tf

    with graph.as_default():
        variables = tf.compat.v1.global_variables()
    return {v._save_slice_info.full_name if getattr(v, "_save_slice_info", None) else v.op.name for v in variables}


def test_checkpoint_names_are_those_the_evaluator_restores():
    """The evaluator restores the shadows (`<variable>/ExponentialMovingAverage`) of an unplaced inference graph."""
    import tensorflow as tf

    from psworker import models

    model = models.get("cifar10")
    with tf.Graph().as_default():
        model.inference(tf.zeros([1, *model.image_shape]), training=False)
        wanted = set(tf.compat.v1.train.ExponentialMovingAverage(model.moving_average_decay).variables_to_restore())
    assert len(wanted) == 10
    graph, _ = _cifar_graph("async")
    assert wanted <= _checkpoint_names(graph)
