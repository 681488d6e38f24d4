"""Common mistakes get one clear line and exit 2 before anything starts: a misspelt flag (with the flag meant), a
bad `PSWORKER_*` value, a fixed port that another process holds, a bad choice, every typo of a spec at once, a batch
larger than the data, data that is not there, a train dir holding another model's run (left byte for byte as it
was)."""

from __future__ import annotations

import dataclasses
import hashlib
import socket

import pytest

from psworker import cli, environment
from psworker.errors import UsageError
from psworker.launcher.ports import pick_free_ports, ports_in_use
from psworker.models import registry
from tests.cluster_utils import REPO, run_launcher

SPEC = REPO / "cluster_specs" / "local.yaml"


@pytest.mark.parametrize("argv, line", [
    (["local", str(SPEC), "--max_stesp", "5"],
     "psworker local: error: unrecognized arguments: --max_stesp 5; did you mean --max_steps?"),
    (["local", str(SPEC), "--batchsize=8", "--mode", "sync"],
     "psworker local: error: unrecognized arguments: --batchsize=8; did you mean --batch_size?"),
    (["worker", "--tsk_index", "1", "--modee", "sync"],
     "psworker worker: error: unrecognized arguments: --tsk_index 1 --modee sync; did you mean --task_index or "
     "--mode or --model?"),
    (["local", str(SPEC), "--modle", "mlp"],       # a swapped pair is one slip, as a dropped letter is
     "psworker local: error: unrecognized arguments: --modle mlp; did you mean --mode or --model?"),
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
    ("PSWORKER_TF_THREADS", "0", "expected auto, tf or a number of threads (>= 1)"),
    ("PSWORKER_SPEC", "no/such/spec.yaml", "no such file"),
    ("PSWORKER_PYTHON", "no-such-python3", "no such program (the launch/ scripts run it as the interpreter)"),
    ("PSWORKER_PEERS_STOP_SECS", "soon", "expected a number of seconds > 0"),
    ("PSWORKER_SLOW_STEP_SECS", "0", "expected a number of seconds > 0"),
    ("PSWORKER_GIVE_UP_GRACE_SECS", "-1", "expected a number of seconds > 0"),
])
def test_a_bad_environment_value_stops_the_launcher_before_it_starts(name, value, problem, capsys, tmp_path,
                                                                       monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(name, value)
    assert cli.main(["local", str(SPEC), "--max_steps", "5", "--train_dir", "train"]) == 2
    assert capsys.readouterr().err == f"psworker: error: {name}={value!r}: {problem}\n"
    assert list(tmp_path.iterdir()) == []


def test_every_variable_is_checked_and_good_values_pass():
    good = {"PSWORKER_TF_THREAD_SPINNING": " PS-OFF ", "PSWORKER_TF_THREADS": "3", "PSWORKER_SPEC": str(SPEC),
            "PSWORKER_PYTHON": "python3", "PSWORKER_MODELS": "any.module", "PSWORKER_PEERS_STOP_SECS": "3",
            "PSWORKER_SLOW_STEP_SECS": " 2.5 ", "PSWORKER_GIVE_UP_GRACE_SECS": "1",
            "PSWORKER_JOB_NAME": "set by psworker run: not a setting"}
    environment.check(good)
    assert {v.name for v in environment.VARIABLES} == set(good) - {"PSWORKER_JOB_NAME"}
    with pytest.raises(UsageError, match="PSWORKER_TF_THREAD_SPINNING='sometimes'"):
        environment.check({**good, "PSWORKER_TF_THREAD_SPINNING": "sometimes"})
    assert environment.spinning_setting({}) == "on"
    assert environment.threads_setting({}) == "auto"
    assert environment.threads_setting({"PSWORKER_TF_THREADS": " TF"}) == "tf"
    assert environment.seconds("PSWORKER_SLOW_STEP_SECS", 10.0, good) == 2.5
    assert environment.seconds("PSWORKER_SLOW_STEP_SECS", 10.0, {}) == 10.0


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
        run = run_launcher([str(spec), "--network", "host", "--train_dir", str(tmp_path / "train"), "--console", "plain"],
                           tmp_path, timeout=120)
    assert run.returncode == 2, run.output
    assert (f"psworker: error: {spec}: port {ps_port} (ps:0) is in use on this machine: stop what listens there, "
            "or give the spec free ports ('auto')") in run.output.splitlines()
    assert run.pids == set() or "starting" not in run.output
    assert not (tmp_path / "train" / "logs").exists() or list((tmp_path / "train" / "logs").iterdir()) == []


@pytest.mark.parametrize("argv, line", [
    (["local", str(SPEC), "--model", "critoe"],
     "psworker local: error: argument --model: 'critoe' is not one of {models}; did you mean 'criteo'?"),
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
    # the registry's models: an earlier test may have registered a plugin (tests/test_model_plugins.py)
    assert capsys.readouterr().err == line.replace("{models}", ", ".join(registry.names())) + "\n"
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
    ports = tmp_path / "ports.yaml"     # keys all known: a bad address is named beside a bad train value
    ports.write_text("cluster:\n  ps: [localhost:70000]\n  worker: [localhost:auto]\ntrain:\n  mode: snyc\n")
    assert cli.main(["validate", str(ports)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"psworker: error: {ports}: train.mode: 'snyc' is not one of async, sync; did you mean 'sync'?",
        f"psworker: error: {ports}: cluster.ps[0]: port 70000 is out of range 1-65535"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ports.yaml", "typos.yaml"]


# -- the training's own mistakes: refused by the launcher before any task starts (issue 38) -----------------------


@pytest.fixture(scope="module")
def criteo_dir(tmp_path_factory):
    """A synthetic Criteo set of 8,000 training rows (2 days of 4,000, the third held out)."""
    from psworker.data.criteo_synthetic import write_synthetic

    folder = tmp_path_factory.mktemp("criteo")
    write_synthetic(str(folder), days=3, rows_per_day=4000)
    return folder


def refused(argv: list[str], capsys) -> str:
    """Runs `psworker ARGV` in-process; asserts exit 2 and returns its stderr."""
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    return err


@pytest.mark.parametrize("extra, line", [
    (["--model", "criteo", "--data_dir", "{criteo}", "--batch_size", "100000"],
     "--batch_size 100000: a worker reads 100,000 examples a step, more than the 8,000 of model criteo's training "
     "split in {criteo}; give --batch_size 8000 or less"),
    (["--batch_size", "10000000"],
     "--batch_size 10000000: a worker reads 10,000,000 examples a step, more than the 1,438 of model mlp's training "
     "split; give --batch_size 1438 or less"),
    (["--batch_size", "800", "--num_devices", "2"],
     "--batch_size 800: a worker reads 1,600 examples a step (--batch_size 800 x 2), more than the 1,438 of model "
     "mlp's training split; give --batch_size 719 or less"),
    (["--batch_size", "100", "--set", "shard_examples=50"],
     "shard_examples 50 is below a worker's batch of 100 examples: a shard holds one batch at least; give "
     "--set shard_examples=100 or more, or leave it out (default: the smaller of 2048 and an eighth of the split, 8 "
     "batches at least)"),
    (["--model", "criteo", "--data_dir", "{tmp}/nowhere"],
     "Criteo data not found: 0 day_N file(s) in {tmp}/nowhere, at least 2 needed (the last is held out). Put "
     "Criteo's day_N files (optionally .gz) there, or write a synthetic set with `psworker data criteo-synthetic "
     "--data_dir {tmp}/nowhere`."),
    (["--model", "cifar10"],
     "CIFAR-10 data not found: missing --data_dir (no data directory given). Download it with `psworker data "
     "cifar10 --data_dir D`, or write a small offline synthetic set with `psworker data cifar10-synthetic "
     "--data_dir D`."),
])
def test_a_batch_or_data_that_cannot_train_is_refused_before_any_task_starts(extra, line, criteo_dir, capsys,
                                                                            tmp_path, monkeypatch):
    """One line naming the batch and the data (or what is missing) and what to do, exit 2; no run dir is made, so
    no task started."""
    monkeypatch.chdir(tmp_path)
    fill = {"criteo": str(criteo_dir), "tmp": str(tmp_path)}
    argv = ["local", str(SPEC), "--max_steps", "5", *(word.format(**fill) for word in extra)]
    assert refused(argv, capsys) == f"psworker: error: {line.format(**fill)}\n"
    assert list(tmp_path.iterdir()) == []


def test_criteo_files_whose_first_line_is_not_criteos_are_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "data"
    data.mkdir()
    for day in range(2):
        (data / f"day_{day}").write_text("label,i1,i2\n1,2,3\n")
    err = refused(["local", str(SPEC), "--model", "criteo", "--data_dir", str(data)], capsys)
    assert err == (f"psworker: error: {data}/day_0:1: not a Criteo line (1 tab-separated fields, Criteo's lines have "
                   "40): the day_N files hold Criteo's tab-separated lines; `psworker data criteo-synthetic "
                   "--data_dir D` writes a synthetic set\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def test_the_batch_is_checked_against_the_data_a_launcher_sees(criteo_dir):
    """ssh and Slurm: a data_dir visible here is checked; one that is not is the hosts' (left to their tasks); a
    model that needs one and has none is refused everywhere."""
    from psworker.cli.preflight import check_training
    from psworker.spec import load_spec, merge_train

    spec = load_spec(SPEC)

    def with_train(**values):
        return dataclasses.replace(spec, train=merge_train(spec.train, values))

    with pytest.raises(UsageError, match="more than the 8,000 of model criteo's training split"):
        check_training(with_train(model="criteo", data_dir=str(criteo_dir), batch_size="9000"), data_here=False)
    check_training(with_train(model="criteo", data_dir="/on/the/hosts", batch_size="9000"), data_here=False)
    with pytest.raises(UsageError, match="no --data_dir given"):
        check_training(with_train(model="criteo"), data_here=False)
    check_training(with_train(model="criteo", data_dir=str(criteo_dir), batch_size="8000"), data_here=True)
    with pytest.raises(UsageError, match="a worker reads 16,000 examples a step .--batch_size 8000 x 2."):
        check_training(with_train(model="criteo", data_dir=str(criteo_dir), batch_size="8000",
                                  replication="in-graph"), data_here=True)


def snapshot(folder) -> dict:
    """Every file under `folder` (hidden ones too): its bytes' hash and its modification time."""
    return {str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def criteo_run(tmp_path):
    """The train dir a criteo run leaves: its cluster.yaml, checkpoints, logs, end record and lock file."""
    run = tmp_path / "criteo-run"
    (run / "logs").mkdir(parents=True)
    (run / "cluster.yaml").write_text("cluster:\n  ps: [127.0.0.1:4001]\n  worker: [127.0.0.1:4002]\ntrain:\n"
                                      "  model: criteo\n  max_steps: 31\n")
    for name in ("model.ckpt-0.index", "model.ckpt-31.index", "model.ckpt-31.data-00000-of-00001", "checkpoint"):
        (run / name).write_bytes(b"saved " + name.encode())
    (run / "logs" / "worker-0.log").write_text("step 31\n")
    (run / "ended.json").write_text('{"outcome": "succeeded"}\n')
    (run / ".psworker.lock").write_text('{"pid": 1, "host": "h", "since": 0, "role": "launcher"}')
    return run


def test_a_run_of_another_model_in_a_train_dir_is_refused_and_changes_nothing(criteo_run, criteo_dir, capsys):
    """`psworker local local.yaml --train_dir <a criteo run's dir>`: refused, naming the model there and what to do;
    every file of the dir byte for byte and mtime as it was (cluster.yaml was rewritten as model mlp before)."""
    before = snapshot(criteo_run)
    err = refused(["local", str(SPEC), "--train_dir", str(criteo_run), "--console", "plain"], capsys)
    assert err == (f"psworker: error: train dir {criteo_run} holds a run of model criteo (its cluster.yaml; "
                   "checkpoints up to global step 31), not mlp: pass --model criteo to go on with it, or give "
                   "another --train_dir (--allow_fresh_start true starts mlp there afresh, over its checkpoints)\n")
    assert snapshot(criteo_run) == before
    # the same model, refused later by the launcher (an injection naming no task): still nothing written
    err = refused(["local", str(SPEC), "--train_dir", str(criteo_run), "--model", "criteo", "--data_dir",
                   str(criteo_dir), "--inject", "kill:worker:7@step=3", "--console", "plain", "--network", "host"], capsys)
    assert err.splitlines()[-1].startswith("psworker: error: --inject 'kill:worker:7@step=3': no task worker:7")
    assert snapshot(criteo_run) == before


@pytest.mark.slow
def test_a_worker_started_without_a_launcher_refuses_a_batch_larger_than_the_data(make_cluster):
    """A task started by hand (or by a start script) is not checked by a launcher: the worker itself exits 2 (a
    usage error, not retried) with the one line, at once, instead of waiting for a batch that never fills until
    --step_timeout_secs and exiting 170 (retryable) with "is a ps task overloaded?"."""
    cluster = make_cluster(num_workers=1, train={"batch_size": 10000000, "max_steps": 5})
    assert cluster.wait_exit("worker:0", 120) == 2, cluster.tails()
    assert ("psworker: error: --batch_size 10000000: a worker reads 10,000,000 examples a step, more than the 1,438 "
            "of the training split; give --batch_size 1438 or less") in cluster.log("worker:0").splitlines()


def test_slurm_submit_refuses_a_batch_larger_than_the_data_before_queueing(tmp_path, capsys, monkeypatch):
    """Refused on the login node, not once the job has waited in the queue: no batch script, no run dir."""
    monkeypatch.chdir(tmp_path)
    err = refused(["slurm", "submit", str(SPEC), "--batch_size", "10000000", "--dry_run", "--run_dir", "run"], capsys)
    assert err == ("psworker: error: --batch_size 10000000: a worker reads 10,000,000 examples a step, more than the "
                   "1,438 of model mlp's training split; give --batch_size 1438 or less\n")
    assert list(tmp_path.iterdir()) == []


def test_cifar10_files_that_are_not_whole_records_are_refused(tmp_path, capsys, monkeypatch):
    """The CIFAR-10 files there, but one cut short (or grown): refused naming it; whole ones pass on to the batch."""
    from psworker.data.cifar10_files import write_synthetic

    monkeypatch.chdir(tmp_path)
    folder = write_synthetic(str(tmp_path / "cifar"), train_per_class=5, test_per_class=1)
    argv = ["local", str(REPO / "cluster_specs" / "cifar10.yaml"), "--data_dir", str(tmp_path / "cifar")]
    assert refused(argv, capsys) == (
        "psworker: error: --batch_size 128: a worker reads 128 examples a step, more than the 50 of model cifar10's "
        f"training split in {tmp_path / 'cifar'}; give --batch_size 50 or less\n")
    cut = tmp_path / "cifar" / "cifar-10-batches-bin" / "data_batch_3.bin"
    assert str(cut) == f"{folder}/data_batch_3.bin"
    with open(cut, "ab") as f:
        f.write(b"x")
    assert refused(argv, capsys) == (
        f"psworker: error: {cut}: not CIFAR-10's binary format (30731 bytes, records of 3073, the first label "
        f"{cut.read_bytes()[0]}). Download it with `psworker data cifar10 "
        f"--data_dir {tmp_path / 'cifar'}`, or write a small offline synthetic set with `psworker data "
        f"cifar10-synthetic --data_dir {tmp_path / 'cifar'}`.\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cifar"]
