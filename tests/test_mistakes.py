"""Common mistakes get one clear line and exit 2 before anything starts: a misspelt flag (with the flag meant), a
bad `PSWORKER_*` value, a fixed port that another process holds."""

from __future__ import annotations

import socket

import pytest

from psworker import cli, environment
from psworker.errors import UsageError
from psworker.launcher.ports import pick_free_ports, ports_in_use
from tests.cluster_utils import REPO, run_launcher

SPEC = REPO / "cluster_specs" / "local.yaml"


@pytest.mark.parametrize("argv, line", [
    (["local", str(SPEC), "--max_stesp", "5"],
     "psworker local: error: unrecognized arguments: --max_stesp 5; did you mean --max_steps?"),
    (["local", str(SPEC), "--batchsize=8", "--mode", "sync"],
     "psworker local: error: unrecognized arguments: --batchsize=8; did you mean --batch_size?"),
    (["worker", "--tsk_index", "1", "--modee", "sync"],
     "psworker worker: error: unrecognized arguments: --tsk_index 1 --modee sync; did you mean --task_index or "
     "--mode?"),
    (["slurm", "submit", str(SPEC), "--nodess", "2"],
     "psworker slurm submit: error: unrecognized arguments: --nodess 2; did you mean --nodes?"),
    (["validate", str(SPEC), "--zzzz"], "psworker validate: error: unrecognized arguments: --zzzz"),
])
def test_an_unknown_flag_names_the_closest_one(argv, line, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.splitlines()[-1] == line
    assert list(tmp_path.iterdir()) == []


def test_the_words_after_double_dash_are_the_commands_own(tmp_path, capsys):
    """`-- python train.py --max_stesp` goes to the user's program unchecked: its flags are not ours."""
    argv = ["slurm", "submit", str(SPEC), "--run_dir", str(tmp_path / "run"), "--dry_run", "--", "python3",
            "train.py", "--max_stesp", "5"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    assert "train.py --max_stesp 5" in (tmp_path / "run" / "psworker.sbatch").read_text()


@pytest.mark.parametrize("name, value, problem", [
    ("PSWORKER_TF_THREAD_SPINNING", "bogus", "expected one of on, ps-off, off"),
    ("PSWORKER_SPEC", "no/such/spec.yaml", "no such file"),
    ("PSWORKER_PYTHON", "no-such-python3", "no such program (the launch/ scripts run it as the interpreter)"),
])
def test_a_bad_environment_value_stops_the_launcher_before_it_starts(name, value, problem, capsys, tmp_path,
                                                                       monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(name, value)
    assert cli.main(["local", str(SPEC), "--max_steps", "5", "--train_dir", "train"]) == 2
    assert capsys.readouterr().err == f"psworker: error: {name}={value!r}: {problem}\n"
    assert list(tmp_path.iterdir()) == []


def test_every_variable_is_checked_and_good_values_pass():
    good = {"PSWORKER_TF_THREAD_SPINNING": " PS-OFF ", "PSWORKER_SPEC": str(SPEC), "PSWORKER_PYTHON": "python3",
            "PSWORKER_MODELS": "any.module", "PSWORKER_JOB_NAME": "set by psworker run: not a setting"}
    environment.check(good)
    assert {v.name for v in environment.VARIABLES} == set(good) - {"PSWORKER_JOB_NAME"}
    with pytest.raises(UsageError, match="PSWORKER_TF_THREAD_SPINNING='sometimes'"):
        environment.check({**good, "PSWORKER_TF_THREAD_SPINNING": "sometimes"})
    assert environment.spinning_setting({}) == "on"


def test_ports_in_use_are_those_a_socket_listens_on():
    free = pick_free_ports(1)[0]
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        held = listener.getsockname()[1]
        assert ports_in_use([free, held]) == [held]
    assert ports_in_use([held]) == []


def test_a_fixed_port_in_use_is_named_before_any_task_starts(tmp_path):
    ps_port, worker_port = pick_free_ports(2)
    spec = tmp_path / "fixed.yaml"
    spec.write_text(f"cluster:\n  ps: ['localhost:{ps_port}']\n  worker: ['localhost:{worker_port}', "
                    "'localhost:auto']\ntrain:\n  max_steps: 5\n")
    with socket.socket() as listener:   # another program holding the ps's port
        listener.bind(("127.0.0.1", ps_port))
        listener.listen()
        run = run_launcher([str(spec), "--network", "host", "--train_dir", str(tmp_path / "train"), "--no_live"],
                           tmp_path, timeout=120)
    assert run.returncode == 2, run.output
    assert (f"psworker: error: {spec}: port {ps_port} (ps:0) is in use on this machine: stop what listens there, "
            "or give the spec free ports ('auto')") in run.output.splitlines()
    assert run.pids == set() or "starting" not in run.output
    assert not (tmp_path / "train" / "logs").exists() or list((tmp_path / "train" / "logs").iterdir()) == []
