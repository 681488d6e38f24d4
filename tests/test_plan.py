"""Pure tests of the plan: which tasks, in which order, with which argv and env."""

from __future__ import annotations

import dataclasses

import pytest

from psworker.spec.plan import Task, format_plan, plan
from psworker.spec import parse_spec

SPEC = parse_spec({"cluster": {"ps": ["localhost:2222", "localhost:2223"],
                               "worker": ["localhost:2224", "localhost:2225", "localhost:2226"]}}, "two.yaml")


def test_ps_first_then_workers_and_worker0_is_chief():
    tasks = plan(SPEC, "two.yaml", python="py")
    assert [t.name for t in tasks] == ["ps:0", "ps:1", "worker:0", "worker:1", "worker:2"]
    assert [t.is_chief for t in tasks] == [False, False, True, False, False]
    assert [t.role for t in tasks] == ["ps", "ps", "worker (chief)", "worker", "worker"]
    assert [t.address for t in tasks] == list(SPEC.ps + SPEC.worker)


def test_argv_runs_the_task_command_with_the_spec_file():
    tasks = plan(SPEC, "dir with space/two.yaml", python="/usr/bin/python3")
    assert tasks[3].argv == ("/usr/bin/python3", "-m", "psworker", "worker", "--spec", "dir with space/two.yaml",
                             "--task_index", "1")
    assert tasks[0].argv[3] == "ps"
    assert not any(a.startswith("--max_steps") for t in tasks for a in t.argv)


def test_env_has_unbuffered_output_and_extra_env():
    tasks = plan(SPEC, "s.yaml", extra_env={"A": "1"})
    assert dict(tasks[0].env) == {"PYTHONUNBUFFERED": "1", "A": "1"}
    tasks = plan(SPEC, "s.yaml", extra_env=[("B", "2")])
    assert ("B", "2") in tasks[-1].env and ("PYTHONUNBUFFERED", "1") in tasks[-1].env


def test_plan_is_pure_and_tasks_are_frozen():
    assert plan(SPEC, "s.yaml", python="p") == plan(SPEC, "s.yaml", python="p")
    task = plan(SPEC, "s.yaml")[0]
    assert isinstance(task, Task) and isinstance(task.argv, tuple) and isinstance(task.env, tuple)
    with pytest.raises(dataclasses.FrozenInstanceError):
        task.index = 3  # type: ignore[misc]


def test_format_plan_shows_roles_commands_and_shell_lines():
    text = format_plan(SPEC, plan(SPEC, "two.yaml", python="py"))
    lines = text.splitlines()
    chief = next(line for line in lines if line.startswith("worker:0 "))
    assert "localhost:2224" in chief and "worker (chief)" in chief
    assert "py -m psworker worker --spec two.yaml --task_index 0" in chief
    assert "launch/start_ps.sh --spec two.yaml --task_index 1" in text
    assert "launch/start_worker.sh --spec two.yaml --task_index 2" in text
    assert "2 ps, 3 workers" in lines[0]


def test_format_plan_marks_auto_ports():
    spec = parse_spec({"cluster": {"ps": ["localhost:auto"], "worker": ["localhost:auto"]}}, "l.yaml")
    text = format_plan(spec, plan(spec, "l.yaml"))
    assert "localhost:auto" in text and "chosen when `psworker local` starts" in text
