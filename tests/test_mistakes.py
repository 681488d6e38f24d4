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


@pytest.mark.parametrize("argv, line", [
    (["local", str(SPEC), "--model", "critoe"],
     "psworker local: error: argument --model: 'critoe' is not one of mlp, cifar10, linear, criteo; did you mean "
     "'criteo'?"),
    (["local", str(SPEC), "--network", "hots"],
     "psworker local: error: argument --network: 'hots' is not one of auto, isolated, host; did you mean 'host'?"),
    (["local", str(SPEC), "--success_policy", "all-worker"],
     "psworker local: error: argument --success_policy: 'all-worker' is not one of chief-or-worker0, all-workers; "
     "did you mean 'all-workers'?"),
    (["tf-config", str(SPEC), "--job", "wroker", "--task_index", "0"],
     "psworker tf-config: error: argument --job: 'wroker' is not one of chief, ps, worker, evaluator; did you mean "
     "'worker'?"),
    (["data", "criteo-synthtic", "--data_dir", "d"],
     "psworker data: error: argument NAME: 'criteo-synthtic' is not one of cifar10, cifar10-synthetic, "
     "criteo-synthetic; did you mean 'criteo-synthetic'?"),
    (["slurm", "sbmit", str(SPEC)],
     "psworker slurm: error: argument SLURM_COMMAND: 'sbmit' is not one of submit, launch, status; did you mean "
     "'submit'?"),
])
def test_a_bad_choice_is_one_line_naming_the_closest(argv, line, capsys, tmp_path, monkeypatch):
    """A choice-valued flag (or a command's name) given wrong: one line, as a spec's bad value is, no usage."""
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == line + "\n"
    assert list(tmp_path.iterdir()) == []


def test_every_problem_of_a_spec_is_named_at_once(capsys, tmp_path, monkeypatch):
    """`wroker:` and `max_step:` (and a bad mode): each its own line with its field and the key meant, exit 2."""
    monkeypatch.chdir(tmp_path)
    spec = tmp_path / "typos.yaml"
    spec.write_text("cluster:\n  ps: [localhost:auto]\n  wroker: [localhost:auto]\ntrain:\n  max_step: 5\n"
                    "  mode: snyc\n")
    for argv in (["validate", str(spec)], ["local", str(spec)]):
        assert cli.main(argv) == 2
        lines = capsys.readouterr().err.splitlines()
        assert [line.partition(" (valid keys")[0] for line in lines] == [
            f"psworker: error: {spec}: cluster.wroker: unknown key 'wroker'; did you mean 'worker'?",
            f"psworker: error: {spec}: train.max_step: unknown key 'max_step'; did you mean 'max_steps'?",
            f"psworker: error: {spec}: train.mode: 'snyc' is not one of async, sync; did you mean 'sync'?"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["typos.yaml"]
