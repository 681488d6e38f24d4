"""`PSWORKER_MODELS`: a model module that imports registers its models in every command; one that fails to import
(an ImportError of its own, not on the path, any other exception) fails every command at once, exit 2, with the
module's error, before any flag is read or any process starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from psworker.errors import UsageError
from psworker.models import registry
from tests.cluster_utils import REPO, task_env

SPEC = REPO / "cluster_specs" / "local.yaml"

GOOD = '''
from psworker.models import register
from psworker.models.linear import LinearModel


class Wide(LinearModel):
    name = "wide_deep"


register("wide_deep", Wide)
'''
BROKEN = "import no_such_dependency_of_wide_deep\n"
RAISES = "raise RuntimeError('wide_deep: the config file is missing')\n"

# Every command family: spec checks, the task processes, the launchers, the one-shot commands.
COMMANDS = [
    ("validate", str(SPEC)),
    ("plan", str(SPEC)),
    ("tf-config", str(SPEC), "--job_name", "ps", "--task_index", "0"),
    ("ps", "--spec", str(SPEC), "--task_index", "0"),
    ("worker", "--spec", str(SPEC), "--task_index", "0", "--train_dir", "train"),
    ("local", str(SPEC), "--max_steps", "5", "--train_dir", "train"),
    ("run", str(SPEC), "--train_dir", "train", "--", sys.executable, "-c", "pass"),
    ("status", "train"),
    ("eval", "--train_dir", "train", "--once"),
    ("export", "--train_dir", "train"),
    ("data", "cifar10-synthetic", "--data_dir", "data"),
]


def _psworker(argv, cwd: Path, plugins: Path, modules: str) -> subprocess.CompletedProcess:
    env = task_env(PSWORKER_MODELS=modules)
    env["PYTHONPATH"] = f"{REPO}:{plugins}"
    return subprocess.run([sys.executable, "-m", "psworker", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture
def plugins(tmp_path: Path) -> Path:
    d = tmp_path / "plugins"
    d.mkdir()
    (d / "wide_deep.py").write_text(GOOD)
    (d / "broken_model.py").write_text(BROKEN)
    (d / "raising_model.py").write_text(RAISES)
    return d


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: a[0])
def test_a_module_that_fails_to_import_fails_every_command_at_once(tmp_path, plugins, argv):
    work = tmp_path / "work"
    work.mkdir()
    r = _psworker(argv, work, plugins, "wide_deep, broken_model")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr == ("psworker: error: PSWORKER_MODELS: cannot import the model module 'broken_model': "
                        "ModuleNotFoundError: No module named 'no_such_dependency_of_wide_deep'\n"), r.stderr
    assert r.stdout == "" and list(work.iterdir()) == []     # nothing started, nothing written


def test_a_module_not_on_the_path_says_so(tmp_path, plugins):
    r = _psworker(["validate", str(SPEC)], tmp_path, tmp_path / "elsewhere", "wide_deep")
    assert r.returncode == 2
    assert ("cannot import the model module 'wide_deep': ModuleNotFoundError: No module named 'wide_deep' (is its "
            "directory on PYTHONPATH? every task process imports it too)") in r.stderr
    assert "Traceback" not in r.stderr and "OK" not in r.stdout


def test_any_exception_of_the_module_is_its_failure(tmp_path, plugins):
    r = _psworker(["local", str(SPEC), "--model", "wide_deep"], tmp_path, plugins, "raising_model")
    assert r.returncode == 2
    assert r.stderr == ("psworker: error: PSWORKER_MODELS: cannot import the model module 'raising_model': "
                        "RuntimeError: wide_deep: the config file is missing\n")


def test_a_module_that_imports_registers_its_model(tmp_path, plugins):
    spec = tmp_path / "wide.yaml"
    spec.write_text(SPEC.read_text().replace("model: mlp", "model: wide_deep"))
    r = _psworker(["validate", str(spec)], tmp_path, plugins, " wide_deep ,")
    assert r.returncode == 0 and r.stdout.startswith("OK "), r.stderr
    r = _psworker(["validate", str(spec)], tmp_path, plugins, "")
    assert r.returncode == 2 and "'wide_deep' is not one of mlp, cifar10, linear, criteo" in r.stderr


def test_a_failed_import_fails_again_at_the_next_call(tmp_path, plugins, monkeypatch):
    """The registry marks a module imported only once it has imported: a second look fails the same way."""
    monkeypatch.syspath_prepend(str(plugins))
    monkeypatch.setenv("PSWORKER_MODELS", "broken_model")
    for _ in range(2):
        with pytest.raises(UsageError, match="'broken_model': ModuleNotFoundError"):
            registry.names()
    from psworker import cli

    assert cli.main(["validate", str(SPEC)]) == 2
