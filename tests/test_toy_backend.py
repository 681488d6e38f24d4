"""docs/architecture.md's "adding a backend", checked: a toy backend written for this test is one folder
(tests/toy_backend/) and one registry line, and psworker's skeleton runs a real training run through it (the plan,
cluster.yaml, per-task logs, supervision, teardown and report are all psworker's)."""

from __future__ import annotations

import io

import pytest

from psworker.launcher import backends
from psworker.launcher.config import LaunchConfig
from psworker.launcher.launch import launch
from psworker.spec import load_spec
from psworker.testing import checkpoint_step, processes_naming, write_spec
from tests.toy_backend.backend import ToyOptions

pytestmark = pytest.mark.slow


def test_a_backend_is_one_folder_and_one_registry_line(tmp_path):
    run_dir = tmp_path / "run"
    spec = load_spec(write_spec(tmp_path / "c.yaml", max_steps=30, train_dir=str(run_dir)))
    console = io.StringIO()
    with backends.scoped():
        backends.register("toy", "tests.toy_backend.backend:ToyBackend")
        assert "toy" in backends.names()
        code = launch(LaunchConfig(spec=spec, backend=ToyOptions(), live=False, grace_period_secs=5.0),
                      console=console, install_signal_handlers=False)
    assert "toy" not in backends.names()
    out = console.getvalue()
    assert code == 0, out[-4000:]
    assert f"psworker: starting 3 toy tasks, each in its own dir under {run_dir.resolve()}/hosts" in out, out
    assert "psworker: all 2 workers finished in " in out, out
    assert sorted(p.name for p in (run_dir / "hosts").iterdir()) == ["ps-0", "worker-0", "worker-1"]
    assert sorted(p.name for p in (run_dir / "logs").glob("*.log")) == ["ps-0.log", "worker-0.log", "worker-1.log"]
    assert (run_dir / "cluster.yaml").is_file() and checkpoint_step(run_dir) >= 30   # async: one may overshoot
    assert not processes_naming(run_dir), "a task of the toy backend outlived its run"
