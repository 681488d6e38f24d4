"""Shared fixtures: a real-process cluster that is always torn down."""

from __future__ import annotations

import sys

import pytest

from tests.cluster_utils import Cluster
from tests.fake_tasks.fakes import HERE


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.stop_all()


@pytest.fixture
def fake_python(tmp_path):
    """An executable that run_local can use as `python`: it runs tests/fake_tasks/fake_psworker.py."""
    exe = tmp_path / "bin" / "python"
    exe.parent.mkdir()
    exe.write_text(f"#!{sys.executable}\n"
                   "import runpy, sys\n"
                   f"sys.argv[0] = {str(HERE / 'fake_psworker.py')!r}\n"
                   "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    exe.chmod(0o755)
    return str(exe)
