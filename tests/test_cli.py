"""CLI tests: `python -m psworker ...` as subprocesses, and argument errors caught before any TF work.

The `ps`, `worker`, `local` and `eval` commands run for real in the end-to-end tests."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from psworker import cli
from psworker.spec import TrainConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
SPECS = ROOT / "cluster_specs"
BAD = ROOT / "tests" / "bad_specs"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "psworker", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def _env() -> dict:
    import os

    return {**os.environ, "PYTHONPATH": str(ROOT)}


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


# ------------------------------------------------------------- in-process: errors raised before any TF work


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.delenv("PSWORKER_SPEC", raising=False)


def test_worker_bad_flag_value_is_a_spec_error(clean_env, capsys):
    rc = cli.main(["worker", "--spec", str(SPECS / "two-ps.yaml"), "--task_index", "0", "--batch_size", "zero"])
    assert rc == 2
    assert "psworker: error: --flags: --batch_size: expected an integer, got 'zero'" in capsys.readouterr().err


def test_worker_flags_are_generated_from_train_config():
    parser = cli.build_parser()
    args = parser.parse_args(["worker"])
    for name in TrainConfig.__dataclass_fields__:
        assert getattr(args, name) is None


def test_ps_with_no_cluster_source(clean_env, capsys):
    assert cli.main(["ps", "--task_index", "0"]) == 2
    assert "PSWORKER_SPEC" in capsys.readouterr().err


def test_data_writes_synthetic_cifar10_in_the_official_layout(tmp_path):
    r = subprocess.run([sys.executable, "-m", "psworker", "data", "cifar10-synthetic", "--data_dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=120, env=_env())
    assert r.returncode == 0, r.stderr
    files = sorted(p.name for p in (tmp_path / "cifar-10-batches-bin").iterdir() if p.suffix == ".bin")
    assert files == [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
    assert all((tmp_path / "cifar-10-batches-bin" / f).stat().st_size % 3073 == 0 for f in files)


def test_the_chief_needs_a_train_dir(clean_env, capsys):
    """No silent shared default: a rerun would resume from (or collide with) another run's checkpoints."""
    assert cli.main(["worker", "--spec", str(SPECS / "two-ps.yaml"), "--task_index", "0"]) == 2
    assert "worker 0 (the chief) needs --train_dir" in capsys.readouterr().err
