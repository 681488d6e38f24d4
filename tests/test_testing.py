"""psworker.testing: a real local cluster for tests, including one training a model registered by its user."""

from __future__ import annotations

import pytest

from psworker.errors import SpecError
from psworker.models import registry
from psworker.spec import TrainConfig, merge_train
from psworker.testing import LocalCluster, assert_processes_gone, checkpoint_step

PLUGIN = '''
from psworker.models import register
from psworker.models.linear import LinearModel


class TinyLinear(LinearModel):
    name = "tiny_linear"


register("tiny_linear", TinyLinear)
'''


@pytest.fixture
def scoped_models():
    """The models a test registers are gone after it (`registry.scoped`)."""
    with registry.scoped():
        yield


def test_a_model_registered_at_run_time_is_accepted_by_the_spec(scoped_models):
    from psworker import models

    with pytest.raises(SpecError, match="'runtime_model' is not one of mlp, cifar10, linear, criteo"):
        merge_train(TrainConfig(), {"model": "runtime_model"})
    models.register("runtime_model", models.get("mlp").__class__)
    assert merge_train(TrainConfig(), {"model": "runtime_model"}).model == "runtime_model"
    with pytest.raises(ValueError, match="already registered"):
        models.register("mlp", models.get("mlp").__class__)


def test_a_scoped_registration_leaves_no_trace():
    from psworker import models

    with registry.scoped():
        models.register("scoped_model", models.get("mlp").__class__)
        assert "scoped_model" in models.names()
    assert "scoped_model" not in models.names()
    with pytest.raises(KeyError, match="unknown model 'scoped_model'"):
        models.get("scoped_model")
    with registry.scoped():
        models.register("scoped_model", models.get("mlp").__class__)   # the name is free again


def test_plan_names_and_extra_args_without_starting(tmp_path):
    cluster = LocalCluster(tmp_path, num_ps=2, num_workers=3, train={"max_steps": 5},
                           args={"ps:1": ["--keep_ps_running"]}, start=False)
    try:
        assert cluster.names == ["ps:0", "ps:1", "worker:0", "worker:1", "worker:2"]
        assert cluster.train_dir == tmp_path / "train" and cluster.spec.train.max_steps == 5
        assert cluster.exit_codes() == {} and cluster.pids == set()
        with pytest.raises(RuntimeError, match="never started"):
            cluster.kill("worker:0")
    finally:
        cluster.close()
    with pytest.raises(ValueError, match="args for unknown tasks: worker:9"):
        LocalCluster(tmp_path / "x", args={"worker:9": ["--x"]}, start=False).close()


@pytest.mark.slow
def test_a_users_model_trains_on_a_local_cluster(tmp_path, monkeypatch, scoped_models):
    """A model module named in PSWORKER_MODELS registers itself in every task process (and in this one, for the
    spec); the cluster trains it to max_steps, and every task exits 0."""
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "tiny_linear_model.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path / "plugins"))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "plugins"))
    monkeypatch.setenv("PSWORKER_MODELS", "tiny_linear_model")
    with LocalCluster(tmp_path / "run", num_workers=1,
                      train={"model": "tiny_linear", "max_steps": 20, "log_every_steps": 10}) as cluster:
        assert cluster.wait_for_step(10, 180) >= 10
        assert cluster.wait_exits(180) == {"ps:0": 0, "worker:0": 0}, cluster.tails()
        assert checkpoint_step(cluster.train_dir) == 20
    assert_processes_gone(cluster.pids)
