"""docs/criteo.md's section "Click-through: the criteo workload": the commands of its ```bash blocks, taken out of
the page, run in order as written, so the section cannot drift: the spec it names is shipped, the data command
writes the data and the run trains to its auc line.

One override, so that runs do not share files: `/tmp/criteo` becomes a directory of the test's own, and the commands
run in a temporary directory holding a link to the repository's cluster_specs/ (the run's fresh `runs/<spec>-<time>/`
is made there). `psworker` is this interpreter's (`python -m psworker`). The section "Tables larger than one ps"
(a criteo_big module of your own; memory caps that need root and cgroup v1) is tested by tests/test_memory_cap.py.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest

from psworker import events
from psworker.spec import load_spec
from psworker.testing import assert_processes_gone
from tests import docs_pages
from tests.cluster_utils import REPO, run_launcher

HEADING = "Click-through: the criteo workload"
DATA_DIR = "/tmp/criteo"


def readme_section(subsections: bool) -> str:
    """The section or, with `subsections`, the whole page (the section on tables larger than one ps included)."""
    text = docs_pages.page("criteo.md")
    return text if subsections else docs_pages.section(text, HEADING)


def section_commands() -> list[list[str]]:
    """Each command of the section's ```bash blocks as argv (`#` comments dropped, `\\` continuations joined)."""
    return docs_pages.bash_commands(readme_section(subsections=False))


def test_the_section_runs_psworker_on_shipped_specs():
    commands = section_commands()
    assert [argv[:2] for argv in commands] == [["psworker", "data"], ["psworker", "local"]], commands
    assert all(DATA_DIR in argv for argv in commands), "every command uses the data dir that the test overrides"
    # every spec the section names, subsections included, is shipped and valid
    named = re.findall(r"[\w./-]+\.yaml", readme_section(subsections=True))
    assert "cluster_specs/criteo-2x2.yaml" in named, named
    for path in named:
        assert (REPO / path).is_file(), f"docs/criteo.md names {path}, which is not in the repository"
        spec = load_spec(REPO / path)
        assert spec.train.model == "criteo" or path == "cluster_specs/local.yaml", path


@pytest.mark.slow
def test_every_command_of_the_section_runs_as_written(tmp_path):
    data, cwd = tmp_path / "criteo", tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "cluster_specs").symlink_to(REPO / "cluster_specs", target_is_directory=True)
    for argv in section_commands():
        args = [arg.replace(DATA_DIR, str(data)) for arg in argv[1:]]
        if args[0] != "local":
            done = subprocess.run([sys.executable, "-m", "psworker", *args], cwd=cwd, capture_output=True, text=True,
                                  timeout=300)
            assert done.returncode == 0, f"{shlex.join(argv)}: exit {done.returncode}\n{done.stderr[-3000:]}"
            continue
        run = run_launcher(args[1:], cwd, timeout=420)
        assert_processes_gone(run.pids)
        assert run.returncode == 0, f"{shlex.join(argv)}: exit {run.returncode}\n{run.output[-3000:]}"
        result = events.last(events.AucResult, run.output)
        assert result is not None, run.output[-3000:]
        # the spec's 300 steps (the global step passes max_steps by the steps in flight), scored on the held-out day
        assert result.examples == 4000 and 300 <= result.global_step <= 310 and result.auc > 0.75, result
        (run_dir,) = (cwd / "runs").iterdir()
        assert run_dir.name.startswith("criteo-2x2-") and (run_dir / "checkpoint").is_file()
