"""`--num_devices N|auto` (parsing, resolution against the visible GPUs, tower devices) and the linear scaling rule."""

from __future__ import annotations

import dataclasses

import pytest

from psworker import models
from psworker.errors import SpecError, UsageError
from psworker.spec import TrainConfig, merge_train, parse_spec
from psworker.train import devices, scaling

CLUSTER = "cluster:\n  ps: ['localhost:2222']\n  worker: ['localhost:2223', 'localhost:2224']\n"


def test_num_devices_accepts_a_positive_int_or_auto():
    assert parse_spec(CLUSTER + "train:\n  num_devices: auto\n", "s.yaml").train.num_devices == "auto"
    assert parse_spec(CLUSTER + "train:\n  num_devices: 3\n", "s.yaml").train.num_devices == 3
    assert merge_train(TrainConfig(), {"num_devices": "AUTO"}).num_devices == "auto"
    assert merge_train(TrainConfig(), {"num_devices": "2"}).num_devices == 2


@pytest.mark.parametrize("value, fragment", [
    ("0", "must be >= 1, got 0 (or 'auto'"), ("-1", "expected a number of towers or 'auto', got str '-1'"),
    ("all", "expected a number of towers or 'auto', got str 'all'"), ("1.5", "got str '1.5'"),
])
def test_bad_num_devices_flags_name_the_field(value, fragment):
    with pytest.raises(SpecError, match="--num_devices") as err:
        merge_train(TrainConfig(), {"num_devices": value})
    assert fragment in str(err.value) and err.value.exit_code == 2


def test_bad_num_devices_in_a_spec_names_the_field():
    with pytest.raises(SpecError, match=r"train\.num_devices.*got bool true"):
        parse_spec(CLUSTER + "train:\n  num_devices: true\n", "s.yaml")


def test_scale_learning_rate_is_a_boolean_field_and_flag():
    assert TrainConfig().scale_learning_rate is True
    assert parse_spec(CLUSTER + "train:\n  scale_learning_rate: false\n", "s").train.scale_learning_rate is False
    assert merge_train(TrainConfig(), {"scale_learning_rate": "false"}).scale_learning_rate is False
    assert merge_train(TrainConfig(), {"scale_learning_rate": "True"}).scale_learning_rate is True
    with pytest.raises(SpecError, match="--scale_learning_rate: expected true or false, got 'maybe'"):
        merge_train(TrainConfig(), {"scale_learning_rate": "maybe"})
    with pytest.raises(SpecError, match="train.scale_learning_rate: expected true or false, got 1"):
        parse_spec(CLUSTER + "train:\n  scale_learning_rate: 1\n", "s")


def test_auto_resolves_to_the_gpus_or_one_cpu_tower():
    assert devices.resolve_num_devices("auto", 0) == 1
    assert devices.resolve_num_devices("auto", 4) == 4
    assert devices.resolve_num_devices(2, 0) == 2          # CPU towers, as before
    assert devices.resolve_num_devices(2, 4) == 2
    with pytest.raises(UsageError, match="requested 3 towers, only 2 GPUs visible"):
        devices.resolve_num_devices(3, 2)


def test_tower_device_names_and_the_log_line():
    assert devices.device_names(2, 2) == ["/gpu:0", "/gpu:1"]
    assert devices.device_names(2, 0) == ["/cpu:0", "/cpu:1"]
    assert devices.describe(2, 4) == "towers: 2 on /gpu:0, /gpu:1"
    assert devices.describe(1, 0) == "towers: 1 on /cpu:0 (no GPU visible)"


def test_auto_on_this_machine():
    """Resolved in this process from TensorFlow's visible GPUs: one CPU tower when there is none."""
    pytest.importorskip("tensorflow")
    gpus = devices.visible_gpus()
    config, server_config = devices.for_worker(TrainConfig(num_devices="auto"), "worker:0")
    assert config.num_devices == max(1, gpus)
    assert server_config.gpu_options.allow_growth == bool(gpus)
    assert devices.ps_server_config().device_count["GPU"] == 0


CIFAR = models.get("cifar10")


@pytest.mark.parametrize("settings, workers, batch", [
    ({"batch_size": 32}, 2, 32),                                        # async: each worker applies its own batch
    ({"batch_size": 32, "num_devices": 2}, 2, 64),                      # towers average into one update
    ({"batch_size": 32, "mode": "sync"}, 3, 96),                        # sync: every worker by default
    ({"batch_size": 32, "mode": "sync", "replicas_to_aggregate": 2}, 3, 64),
    ({"batch_size": 16, "num_devices": 2, "replication": "in-graph"}, 4, 128),
])
def test_global_batch_in_each_mode(settings, workers, batch):
    config = TrainConfig(model="cifar10", **settings)
    assert scaling.global_batch(config, workers) == batch
    rate = scaling.learning_rate(CIFAR, config, workers)
    assert rate.scaled and rate.value == pytest.approx(0.1 * batch / 128)


def test_the_rate_and_its_log_line():
    rate = scaling.learning_rate(CIFAR, TrainConfig(model="cifar10", batch_size=32), 2)
    assert rate.describe() == ("learning rate 0.025 (0.1 x 32/128, linear scaling; "
                               "--set scale_learning_rate=false to turn off)")
    given = scaling.learning_rate(CIFAR, TrainConfig(model="cifar10", batch_size=256, learning_rate=0.05), 2)
    assert given.value == pytest.approx(0.1) and "0.05 x 256/128" in given.describe()
    off = scaling.learning_rate(CIFAR, TrainConfig(model="cifar10", batch_size=32, scale_learning_rate=False), 2)
    assert (off.value, off.scaled) == (0.1, False)
    assert off.describe() == ("learning rate 0.1 (not scaled: --set scale_learning_rate=false; global batch 32, "
                              "the model's reference 128)")
    mlp = scaling.learning_rate(models.get("mlp"), TrainConfig(batch_size=32), 2)
    assert (mlp.value, mlp.scaled) == (0.1, False) and "no reference batch" in mlp.describe()


def test_the_graph_uses_the_scaled_rate(cifar_dir):
    """The learning-rate tensor of a built worker graph holds the scaled rate (before any decay)."""
    tf = pytest.importorskip("tensorflow")
    from psworker.train.graph import build_train_graph

    for scale, want in ((True, 0.025), (False, 0.1)):
        config = dataclasses.replace(TrainConfig(model="cifar10", batch_size=32, data_dir=str(cifar_dir),
                                                 num_devices="auto"), scale_learning_rate=scale)
        with tf.Graph().as_default():
            tg = build_train_graph(CIFAR, config, cluster=None, task_index=0)
            with tf.compat.v1.Session() as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                assert sess.run(tg.learning_rate) == pytest.approx(want)


def test_auto_and_the_opt_out_round_trip_through_a_dumped_spec():
    from psworker.spec import dump_spec

    spec = parse_spec(CLUSTER + "train:\n  num_devices: auto\n  scale_learning_rate: false\n", "s.yaml")
    again = parse_spec(dump_spec(spec), "dumped")
    assert again == spec and (again.train.num_devices, again.train.scale_learning_rate) == ("auto", False)


def test_thread_spinning_is_tensorflows_default_unless_the_environment_turns_it_off(monkeypatch):
    """Issue 19: PSWORKER_TF_THREAD_SPINNING=ps-off|off turns the thread pools' spinning off on the ps / every task."""
    assert [devices.thread_spinning(job, {}) for job in ("ps", "worker")] == [True, True]
    assert [devices.thread_spinning(job, {devices.SPINNING_ENV: "ps-off"}) for job in ("ps", "worker")] == [False, True]
    assert [devices.thread_spinning(job, {devices.SPINNING_ENV: "OFF"}) for job in ("ps", "worker")] == [False, False]
    pytest.importorskip("tensorflow")
    monkeypatch.delenv(devices.SPINNING_ENV, raising=False)
    assert devices.ps_server_config().experimental.disable_thread_spinning is False
    assert devices.server_config(1, 0).experimental.disable_thread_spinning is False
    monkeypatch.setenv(devices.SPINNING_ENV, "ps-off")
    assert devices.ps_server_config().experimental.disable_thread_spinning is True
    assert devices.server_config(1, 0).experimental.disable_thread_spinning is False
    monkeypatch.setenv(devices.SPINNING_ENV, "off")
    assert devices.server_config(2, 0).experimental.disable_thread_spinning is True   # also with CPU towers
    assert devices.server_config(2, 0).device_count["CPU"] == 2


def test_a_bad_thread_spinning_value_names_the_variable():
    with pytest.raises(UsageError, match="PSWORKER_TF_THREAD_SPINNING='sometimes': expected one of on, ps-off, off"):
        devices.thread_spinning("ps", {devices.SPINNING_ENV: "sometimes"})


def test_tasks_sharing_a_host_divide_its_cpus_among_their_thread_pools():
    """Loopback addresses are one host; a ps's pools get the host's CPUs over every task there, a worker's over the
    workers there (its ps mostly waits on RPCs)."""
    spec = parse_spec(CLUSTER, "s.yaml")   # 1 ps + 2 workers on localhost
    assert [devices.tasks_on_host(spec, "worker", i) for i in range(2)] == [3, 3]
    assert devices.tasks_on_host(spec, "ps", 0, ("worker",)) == 2
    assert devices.thread_budget(spec, "ps", 0, cpus=2, env={}) == (
        1, "2 CPUs shared by the spec's 3 ps and worker tasks here")
    assert devices.thread_budget(spec, "worker", 1, cpus=16, env={}) == (
        8, "16 CPUs shared by the spec's 2 worker tasks here")
    one_worker = parse_spec("cluster:\n  ps: ['localhost:2222']\n  worker: ['localhost:2223']\n", "s.yaml")
    assert devices.thread_budget(one_worker, "worker", 0, cpus=2, env={}) == (
        None, "TensorFlow's own: the only worker on this host")
    assert devices.thread_budget(one_worker, "ps", 0, cpus=2, env={})[0] == 1
    mixed = parse_spec("cluster:\n  ps: ['127.0.0.1:2222', '10.0.0.2:2222']\n  worker: ['127.0.0.3:2223', "
                       "'10.0.0.2:2223', 'node-c:2223', '[::1]:2224']\n", "s.yaml")
    assert [devices.tasks_on_host(mixed, "ps", i) for i in range(2)] == [3, 2]
    assert devices.tasks_on_host(mixed, "worker", 2) == 1
    assert devices.thread_budget(mixed, "worker", 2, cpus=8, env={}) == (
        None, "TensorFlow's own: no other task of the spec on this host")
    assert devices.budget_line(spec, cpus=2, env={}) == (
        "TensorFlow threads per pool: on this machine (2 CPUs) 1 per ps, 1 per worker; "
        "PSWORKER_TF_THREADS=tf keeps one per CPU")
    assert devices.budget_line(mixed, cpus=8, env={}) == (
        "TensorFlow threads per pool: on this machine (8 CPUs) 2 per ps, 4 per worker; on a host several tasks "
        "share, its CPUs over its workers (a ps: over all); PSWORKER_TF_THREADS=tf keeps one per CPU")
    assert devices.budget_line(spec, env={devices.THREADS_ENV: "tf"}) == (
        "TensorFlow threads per pool: one per CPU: TensorFlow's own (PSWORKER_TF_THREADS=tf)")
    assert devices.thread_budget(spec, "ps", 0, cpus=2, env={devices.THREADS_ENV: "4"}) == (4, "PSWORKER_TF_THREADS")
    assert devices.thread_budget(spec, "ps", 0, cpus=2, env={"TF_NUM_INTRAOP_THREADS": "3"}) == (
        None, "TensorFlow's, from TF_NUM_INTRAOP_THREADS")
    with pytest.raises(UsageError, match=r"PSWORKER_TF_THREADS='0': expected auto, tf or a number of threads"):
        devices.thread_budget(spec, "ps", 0, env={devices.THREADS_ENV: "0"})
    pytest.importorskip("tensorflow")
    config = devices.ps_server_config(1)
    assert (config.inter_op_parallelism_threads, config.intra_op_parallelism_threads) == (1, 1)
    assert devices.server_config(2, 0, 3).intra_op_parallelism_threads == 3
    assert devices.server_config(1, 0).inter_op_parallelism_threads == 0   # None: TensorFlow's own
