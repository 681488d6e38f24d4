"""CLI tests: `python -m psworker validate/plan/tf-config` as subprocesses, other commands with fakes."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import types

import pytest

from psworker import cli
from psworker.spec import ClusterSpec, TrainConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
SPECS = ROOT / "cluster_specs"
BAD = ROOT / "tests" / "bad_specs"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "psworker", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def test_validate_ok():
    r = run("validate", *sorted(SPECS.glob("*.yaml")))
    assert r.returncode == 0, r.stderr
    assert f"OK {SPECS / 'two-ps.yaml'} (2 ps, 3 workers)" in r.stdout.splitlines()


def test_validate_bad_exits_2_with_each_error_on_stderr():
    r = run("validate", SPECS / "local.yaml", BAD / "port_out_of_range.yaml", BAD / "bad_mode.yaml")
    assert r.returncode == 2
    assert "OK" in r.stdout and "local.yaml" in r.stdout
    assert "cluster.worker[1]: port 70000 is out of range 1-65535" in r.stderr
    assert "train.mode: 'synch' is not one of async, sync" in r.stderr
    assert "Traceback" not in r.stderr


def test_validate_yaml_syntax_and_missing_file():
    r = run("validate", BAD / "yaml_syntax.yaml", "no/such.yaml")
    assert r.returncode == 2 and "line 3" in r.stderr and "no/such.yaml: no such file" in r.stderr
    assert "Traceback" not in r.stderr


def test_plan_prints_table():
    r = run("plan", SPECS / "two-ps.yaml")
    assert r.returncode == 0, r.stderr
    assert "worker (chief)" in r.stdout and "launch/start_worker.sh" in r.stdout
    assert "-m psworker ps --spec" in r.stdout


def test_tf_config_prints_the_task():
    r = run("tf-config", SPECS / "two-ps.yaml", "--job", "worker", "--task_index", "1")
    assert r.returncode == 0, r.stderr
    config = json.loads(r.stdout)
    assert config["task"] == {"type": "worker", "index": 1}
    assert config["cluster"]["ps"] == ["localhost:2222", "localhost:2223"]


def test_tf_config_index_out_of_range():
    r = run("tf-config", SPECS / "two-ps.yaml", "--job", "ps", "--task_index", "2")
    assert r.returncode == 2 and "--task_index 2 but the spec has 2 ps tasks" in r.stderr
    assert "Traceback" not in r.stderr


def test_usage_errors_exit_2_without_traceback():
    r = run("tf-config", SPECS / "two-ps.yaml", "--job", "chief", "--task_index", "0")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert run().returncode == 2


# ------------------------------------------------------------------- in-process, with fake lower layers

@pytest.fixture
def fake(monkeypatch):
    """Installs fake psworker.task / backends.local / placement / data / evaluate modules; records calls."""
    calls: list[tuple[str, tuple, dict]] = []

    def recorder(name, result=0):
        def fn(*args, **kwargs):
            calls.append((name, args, kwargs))
            return result
        return fn

    mods = {
        "psworker.task": dict(run_ps=recorder("run_ps"), run_worker=recorder("run_worker")),
        "psworker.backends.local": dict(run_local=recorder("run_local", 3)),
        "psworker.placement": dict(describe=recorder("describe", "PLACEMENT")),
        "psworker.data.cifar10": dict(download_and_extract=recorder("download"),
                                      write_synthetic=recorder("synthetic")),
        "psworker.evaluate": dict(run_eval=recorder("run_eval")),
    }
    for name, attrs in mods.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
        parent, _, child = name.rpartition(".")
        if parent in sys.modules:  # `from psworker import task` prefers the attribute over sys.modules
            monkeypatch.setattr(sys.modules[parent], child, module, raising=False)
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.delenv("PSWORKER_SPEC", raising=False)
    return calls


def test_worker_merges_flags_over_the_spec(fake):
    rc = cli.main(["worker", "--spec", str(SPECS / "cifar10.yaml"), "--task_index", "1", "--max_steps", "7",
                   "--learning_rate", "0.5", "--train_dir", "/tmp/x"])
    assert rc == 0
    (name, args, kwargs), = fake
    spec, index, config = args
    assert name == "run_worker" and isinstance(spec, ClusterSpec) and index == 1
    assert (config.model, config.max_steps, config.learning_rate, config.batch_size) == ("cifar10", 7, 0.5, 128)
    assert config.train_dir == "/tmp/x" and kwargs == {"allow_public_bind": False}


def test_worker_bad_flag_value_is_a_spec_error(fake, capsys):
    rc = cli.main(["worker", "--spec", str(SPECS / "local.yaml"), "--task_index", "0", "--batch_size", "zero"])
    assert rc == 2 and not fake
    assert "psworker: error: --flags: --batch_size: expected an integer, got 'zero'" in capsys.readouterr().err


def test_worker_flags_are_generated_from_train_config():
    parser = cli.build_parser()
    args = parser.parse_args(["worker"])
    for name in TrainConfig.__dataclass_fields__:
        assert getattr(args, name) is None


def test_ps_from_classic_flags(fake):
    rc = cli.main(["ps", "--ps_hosts", "localhost:2222", "--worker_hosts", "localhost:2223", "--job_name", "ps",
                   "--task_index", "0", "--keep_ps_running", "--startup_timeout_secs", "5"])
    assert rc == 0
    (name, (spec, index), kwargs), = fake
    assert name == "run_ps" and index == 0 and len(spec.worker) == 1
    assert kwargs == {"keep_running": True, "startup_timeout_secs": 5.0, "allow_public_bind": False}


def test_ps_with_no_cluster_source(fake, capsys):
    assert cli.main(["ps", "--task_index", "0"]) == 2
    assert "PSWORKER_SPEC" in capsys.readouterr().err and not fake


def test_worker_from_tf_config(fake, monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"ps": ["a:1"], "worker": ["b:2", "c:3"]},
                                                "task": {"type": "worker", "index": 1}}))
    assert cli.main(["worker", "--allow_public_bind"]) == 0
    (_, (spec, index, config), kwargs), = fake
    assert index == 1 and kwargs["allow_public_bind"] and config.train_dir  # a default train_dir is chosen


def test_local_passes_the_merged_spec(fake):
    rc = cli.main(["local", str(SPECS / "local.yaml"), "--mode", "sync", "--grace_period_secs", "2"])
    assert rc == 3
    (name, (spec,), kwargs), = fake
    assert name == "run_local" and spec.train.mode == "sync" and kwargs == {"grace_period_secs": 2.0}
    assert spec.train.train_dir is None   # run_local makes a fresh runs/<spec>-<time>


def test_plan_with_model_calls_placement(fake, capsys):
    assert cli.main(["plan", str(SPECS / "two-ps.yaml"), "--model", "mlp"]) == 0
    assert fake == [("describe", ("mlp", 2), {})]
    assert "PLACEMENT" in capsys.readouterr().out


def test_data_and_eval_dispatch(fake):
    assert cli.main(["data", "cifar10-synthetic", "--data_dir", "d"]) == 0
    assert cli.main(["eval", "--train_dir", "t", "--once", "--batch_size", "32"]) == 0
    assert fake[0] == ("synthetic", ("d",), {})
    assert fake[1] == ("run_eval", (), dict(train_dir="t", data_dir=None, model_name="mlp", once=True,
                                            eval_interval_secs=60.0, batch_size=32))


def test_keyboard_interrupt_exits_130(fake, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(sys.modules["psworker.backends.local"], "run_local", interrupted)
    assert cli.main(["local", str(SPECS / "local.yaml")]) == 130
