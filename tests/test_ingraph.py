"""In-graph replication: the one-client graph (placement, no servers) and a real 1 ps + 2 worker run."""

from __future__ import annotations

import re

import pytest

from psworker.errors import EXIT_PEER_GONE
from psworker.testing import assert_processes_gone, checkpoint_step, console_steps
from tests.cluster_utils import REPO, run_launcher

SPEC = REPO / "cluster_specs" / "cifar10.yaml"


CIFAR_PER_CLASS = (100, 20)   # synthetic examples per class (train, test) for the cifar_dir fixture


@pytest.mark.parametrize("num_devices", [1, 2])
def test_graph_puts_a_tower_on_every_worker_and_variables_on_the_ps(cifar_dir, num_devices):
    import tensorflow as tf

    from psworker import models
    from psworker.train.ingraph import build_in_graph_train_graph
    from psworker.train.plan_report import placement_report
    from psworker.spec import TrainConfig

    cluster = {"ps": ["p0:1", "p1:1"], "worker": ["w0:1", "w1:1", "w2:1"]}
    config = TrainConfig(model="cifar10", batch_size=4, data_dir=str(cifar_dir), num_devices=num_devices)
    with tf.Graph().as_default() as graph:
        tg = build_in_graph_train_graph(models.get("cifar10"), config, cluster=cluster)
        variables = tf.compat.v1.global_variables()
        # one set of model variables (plus moving averages and the global step), all on the ps tasks; the large
        # ones split into a shard per ps
        trainable = tf.compat.v1.trainable_variables()
        assert len({v._save_slice_info.full_name if v._save_slice_info else v.op.name for v in trainable}) == 10
        assert len(trainable) == 13   # conv2, local3 and local4 weights in 2 shards
        assert all(tf.DeviceSpec.from_string(v.device).job == "ps" for v in variables)
        expected = {v.name: v.ps for v in placement_report("cifar10", 2).variables}
        assert {v.op.name: tf.DeviceSpec.from_string(v.device).task for v in variables} == expected
        # each worker's input and towers run on that worker, one tower per device
        for i in range(3):
            # (variable reads carry no device: TF places them with their variable, on the ps)
            ops = [op for op in graph.get_operations()
                   if op.name.startswith(f"worker_{i}/") and op.type != "ReadVariableOp"]
            assert ops and {tf.DeviceSpec.from_string(op.device).task for op in ops} == {i}
            convs = [op for op in ops if op.type == "Conv2D" and "gradients" not in op.name]
            assert len(convs) == 2 * num_devices
            assert {tf.DeviceSpec.from_string(op.device).device_index for op in convs} == set(range(num_devices))
        assert tg.sync_optimizer is None
        # one update per step: a single apply op per variable (shard) for the averaged gradients
        applies = [op for op in graph.get_operations() if op.type.startswith("ResourceApplyGradientDescent")]
        assert len(applies) == 13


@pytest.mark.slow
def test_in_graph_cluster_run(tmp_path, cifar_dir):
    """worker:0 drives both workers' towers; worker:1 only serves and exits when told; so does the ps."""
    train_dir = tmp_path / "train"
    run = run_launcher([str(SPEC), "--train_dir", str(train_dir), "--data_dir", str(cifar_dir),
                        "--replication", "in-graph", "--max_steps", "30", "--batch_size", "16",
                        "--log_every_steps", "10"], cwd=tmp_path, timeout=240)
    assert run.returncode == 0, run.output[-4000:]
    # one update from both workers' batches: the tutorial's rate scaled to a global batch of 2 x 16
    assert "[worker:0] learning rate 0.025 (0.1 x 32/128, linear scaling" in run.output, run.output[-4000:]
    assert checkpoint_step(train_dir) == 30   # synchronous by construction: exactly max_steps updates
    steps = console_steps(run.output)
    assert steps and {who for who, _ in steps} == {"worker:0"}, run.output[-3000:]   # one client
    assert re.search(r"\[worker:0\] .*precision @ 1 = [0-9.]+", run.output), run.output[-3000:]
    assert "[worker:1] " in run.output and "serving for the client" in run.output
    assert len(run.pids) >= 3
    assert_processes_gone(run.pids)


@pytest.mark.slow
def test_serving_worker_gives_up_when_the_client_never_comes(make_cluster):
    cluster = make_cluster(train=dict(replication="in-graph", startup_timeout_secs=3), start=False)
    cluster.start("worker:1")
    assert cluster.wait_exit("worker:1", 120) == EXIT_PEER_GONE, cluster.tail("worker:1")
    assert re.search(r"psworker: error: worker:1: the in-graph client worker:0 at \S+ has been unreachable for 3 s",
                     cluster.log("worker:1")), cluster.tail("worker:1")
    assert_processes_gone(cluster.pids)
