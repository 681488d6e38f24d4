"""Pure tests of where a training graph puts its work (no servers, no data): the moving averages on the ps, large
variables split over the ps tasks, bytes per ps balanced."""

from __future__ import annotations

import pytest

CLUSTER = {"ps": ["p0:1", "p1:1"], "worker": ["w0:1", "w1:1"]}


def _cifar_graph(mode: str, task_index: int = 0):
    import tensorflow as tf

    from psworker import models
    from psworker.spec import TrainConfig
    from psworker.train.graph import build_train_graph
    from psworker.train.plan_report import _NoDataModel

    graph = tf.Graph()
    # unpacked: variables split from 256 KiB (packed, the default, splits from 16 KiB: one more here)
    config = TrainConfig(model="cifar10", batch_size=2, mode=mode, max_steps=10, pack_transfers=False)
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
    assert len(updates) == 13   # one per trainable variable or shard (2 ps: 3 variables in 2 shards)
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


@pytest.mark.parametrize("num_ps", [2, 3, 4])
def test_cifar10_bytes_per_ps_are_balanced(num_ps):
    """Goal: max/mean <= 1.05; shards and moving averages sit with (and are counted on) their variable's ps."""
    from psworker.train.plan_report import placement_report

    report = placement_report("cifar10", num_ps)
    assert report.max_over_mean <= 1.05, report.bytes_per_ps
    assert report.trainable_parameters == 1_068_298
    by_name = {v.name: v for v in report.variables}
    shards = [v for v in report.variables if v.is_shard and v.trainable]
    assert {v.checkpoint_name for v in shards} == {"conv2/weights", "local3/weights", "local4/weights"}
    for name in ("conv2/weights", "local3/weights", "local4/weights"):
        assert sorted(v.ps for v in shards if v.checkpoint_name == name) == list(range(num_ps))
    for v in report.variables:
        if v.name.endswith("/ExponentialMovingAverage"):
            assert v.ps == by_name[v.name.rsplit("/", 1)[0]].ps
            assert v.checkpoint_name == v.checkpoint_name.rsplit("/", 1)[0] + "/ExponentialMovingAverage"


def test_one_ps_splits_nothing():
    from psworker.train.plan_report import placement_report

    report = placement_report("cifar10", 1)
    assert not any(v.is_shard for v in report.variables) and report.max_over_mean == 1.0


def test_partitions_split_the_longest_axis_of_large_variables_only():
    from psworker.train.placement import MIN_PARTITION_BYTES, partitions

    assert partitions([5, 5, 64, 64], 4, 3) == [1, 1, 3, 1]
    assert partitions([2304, 384], 4, 4) == [4, 1]
    assert partitions([2304, 384], 4, 1) == [1, 1]
    assert partitions([10], 4, 4) == [1]                                       # small: whole
    assert partitions([MIN_PARTITION_BYTES // 4], 4, 2) == [2]
    assert partitions([2, MIN_PARTITION_BYTES], 4, 8) == [1, 8]
    assert partitions([3, 3], 4, 8, min_bytes=0) == [3, 1]                    # never more shards than entries


def test_packed_transfers_split_mid_sized_weights_to_even_out_each_ps_link():
    """Packed, a shard rides in its ps's one transfer: criteo's dense1/weights (56 KB, below the unpacked threshold)
    is split over every ps, so no ps carries most of the dense bytes a step (unpacked: ps:1 took 87% of them)."""
    from psworker.train.placement import MIN_PARTITION_BYTES, PACKED_MIN_PARTITION_BYTES, partitions
    from psworker.train.plan_report import placement_report

    assert partitions([221, 64], 4, 4) == [1, 1] and partitions([221, 64], 4, 4, PACKED_MIN_PARTITION_BYTES) == [4, 1]
    plain, packed = placement_report("criteo", 4), placement_report("criteo", 4, pack_transfers=True)
    assert (plain.split_from, packed.split_from) == (MIN_PARTITION_BYTES, PACKED_MIN_PARTITION_BYTES)
    assert not any(v.checkpoint_name == "dense1/weights" and v.is_shard for v in plain.variables)
    shards = [v for v in packed.variables if v.checkpoint_name == "dense1/weights"]
    assert sorted(v.ps for v in shards) == [0, 1, 2, 3] and sum(v.shape[0] for v in shards) == 221
    assert packed.trainable_parameters == plain.trainable_parameters

    def busiest(report) -> float:
        pulls = report.traffic.pull
        return max(pulls) * len(pulls) / sum(pulls)

    assert busiest(plain) > 3.0 and busiest(packed) < 1.5, (plain.traffic.pull, packed.traffic.pull)
    assert sum(packed.traffic.pull) == sum(plain.traffic.pull)


def test_greedy_strategy_counts_slots_on_their_variables_ps():
    import tensorflow as tf

    from psworker.train.placement import GreedyByteStrategy

    strategy = GreedyByteStrategy(2)
    with tf.Graph().as_default():
        v1 = tf.compat.v1
        with v1.device(v1.train.replica_device_setter(ps_tasks=2, ps_strategy=strategy)):
            big = v1.get_variable("big", [1000], initializer=v1.zeros_initializer())
            small = v1.get_variable("small", [10], initializer=v1.zeros_initializer())
            v1.train.ExponentialMovingAverage(0.9).apply([big, small])
    assert strategy.loads == [8000, 80]


def test_step_traffic_of_cifar10_counts_every_crossing_read_and_gradient():
    """Per worker step: every variable pulled once (the weight decay shares the matmuls' read of local3/local4: before
    issue #9 it read them again, 8.1 MB in all, as profile_step measured) and the global step, one gradient per
    variable pushed (4.27 MB) and the learning rate to each ps; the averages cross nothing."""
    from psworker.train.plan_report import placement_report

    params = 1_068_298
    for num_ps in (1, 2):
        traffic = placement_report("cifar10", num_ps).traffic
        assert sum(traffic.push) == params * 4 + 4 * num_ps
        assert sum(traffic.pull) == params * 4 + 8   # + the global step (the learning rate)
        assert all(p > 0 for p in traffic.pull) and all(p > 0 for p in traffic.push)


def test_network_load_and_ps_needed():
    from psworker.train.traffic import StepTraffic, describe, ps_load, ps_needed

    traffic = StepTraffic(pull=(6_000_000, 2_000_000), push=(3_000_000, 1_000_000))
    loads = ps_load(traffic, 5.0, 4)
    assert [(ld.out_bytes_per_sec, ld.in_bytes_per_sec) for ld in loads] == [(120e6, 60e6), (40e6, 20e6)]
    gbit10 = 10e9 / 8   # 1.25e9 bytes/s
    # 8 MB pulled per step x 5 steps/s x N workers, spread evenly over the ps links
    assert ps_needed(traffic, 5.0, 1, gbit10) == 1
    assert ps_needed(traffic, 5.0, 100, gbit10) == 4       # 4.0e9 / 1.25e9 = 3.2
    assert ps_needed(traffic, 5.0, 1000, gbit10) == 32     # exactly 32
    assert ps_needed(traffic, 5.0, 1000, gbit10, imbalance=1.05) == 34
    text = describe(traffic, steps_per_sec_per_worker=5.0, workers=4, bandwidth_gbps=10)
    assert "ps:0 at 5 steps/s x 4 workers: sends 120.0 MB/s, receives 60.0 MB/s" in text
    assert "1,000 workers: 32" in text
    with pytest.raises(ValueError):
        ps_needed(traffic, 5.0, 1, 0)
