"""docs/models.md's "Your own model": its example module, taken out of the page, trains with the page's own command
line in a real local cluster (`psworker local`), and scores on its held-out split. The example cannot drift."""

from __future__ import annotations

import re
import shlex

import pytest

from psworker import events
from tests import docs_pages
from tests.cluster_utils import REPO, run_launcher

MODULE_FIRST_LINE = "# iris_model.py:"
COMMAND_PREFIX = "PYTHONPATH=$PWD PSWORKER_MODELS=iris_model psworker local "


def readme_section() -> str:
    return docs_pages.section(docs_pages.page("models.md"), "Your own model")


def example_module() -> str:
    """The one ```python block of the section that starts with the module's name."""
    blocks = re.findall(r"```python\n(.*?)```", readme_section(), re.S)
    modules = [b for b in blocks if b.startswith(MODULE_FIRST_LINE)]
    assert len(modules) == 1, f"expected one python block starting {MODULE_FIRST_LINE!r}, found {len(modules)}"
    return modules[0]


def example_argv() -> list[str]:
    """The page's command line after `psworker local`."""
    lines = [line for line in readme_section().splitlines() if line.startswith(COMMAND_PREFIX)]
    assert len(lines) == 1, f"expected one line starting {COMMAND_PREFIX!r}"
    return shlex.split(lines[0][len(COMMAND_PREFIX):])


def test_the_section_documents_every_class_attribute_and_method():
    from psworker.models import Model

    section = readme_section()
    attributes = [n for n, v in vars(Model).items() if not n.startswith("_") and not callable(v)]
    methods = [n for n, v in vars(Model).items() if not n.startswith("_") and callable(v)]
    assert set(attributes) >= {"name", "image_shape", "raw_input_dtype"}, attributes
    for name in (*attributes, *methods):
        assert f"`{name}" in section, name


@pytest.mark.slow
def test_the_readme_model_trains_in_a_local_cluster(tmp_path, monkeypatch):
    (tmp_path / "iris_model.py").write_text(example_module())
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("PSWORKER_MODELS", "iris_model")
    train_dir = tmp_path / "train"
    run = run_launcher([*example_argv(), "--train_dir", str(train_dir), "--console", "plain"], REPO, timeout=420)
    assert run.returncode == 0, run.output[-3000:]
    precision = events.last(events.Precision, run.output)
    assert precision is not None, run.output[-3000:]
    assert precision.examples == 30 and precision.precision >= 0.8, precision
