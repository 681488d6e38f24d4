"""CLI tests: `python -m psworker ...` as subprocesses, and argument errors caught before any TF work.

The `ps`, `worker`, `local` and `eval` commands run for real in the end-to-end tests."""

from __future__ import annotations

import json
import os
import pathlib
import re
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

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PSWORKER_MODELS", None)
    return env


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
    cpus = len(os.sched_getaffinity(0))   # two-ps.yaml: 2 ps + 3 workers, all on localhost
    assert (f"TensorFlow threads per pool: on this machine ({cpus} CPUs) {max(1, cpus // 5)} per ps, "
            f"{max(1, cpus // 3)} per worker;") in r.stdout


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


def test_worker_bad_flag_value_is_a_usage_error(clean_env, capsys):
    rc = cli.main(["worker", "--spec", str(SPECS / "two-ps.yaml"), "--task_index", "0", "--batch_size", "zero"])
    assert rc == 2
    assert "psworker worker: error: argument --batch_size: expected an integer, got 'zero'" in capsys.readouterr().err


def test_rules_between_flags_are_checked_with_the_spec(clean_env, capsys):
    """Each value is checked alone by argparse; rules that need the spec (its worker count) come after it."""
    rc = cli.main(["worker", "--spec", str(SPECS / "two-ps.yaml"), "--task_index", "0", "--train_dir", "t",
                   "--replicas_to_aggregate", "4"])
    assert rc == 2
    assert "--replicas_to_aggregate: 4 is not between 1 and the number of workers (3)" in capsys.readouterr().err


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


# ------------------------------------------------------- flags that explain themselves and refuse bad values

LOCAL = ["local", str(SPECS / "local.yaml")]
SUBMIT = ["slurm", "submit", str(SPECS / "local.yaml"), "--dry_run"]
BAD_VALUES = [
    # training settings, on every command that takes them
    (LOCAL + ["--max_steps", "0"], "--max_steps", "must be >= 1, got 0"),
    (LOCAL + ["--batch_size", "many"], "--batch_size", "expected an integer, got 'many'"),
    (LOCAL + ["--learning_rate", "-0.1"], "--learning_rate", "must be > 0"),
    (LOCAL + ["--mode", "synch"], "--mode", "'synch' is not one of async, sync; did you mean 'sync'?"),
    (LOCAL + ["--replication", "ingraph"], "--replication", "did you mean 'in-graph'?"),
    (LOCAL + ["--model", "cifar"], "--model", "did you mean 'cifar10'?"),
    (LOCAL + ["--num_devices", "0"], "--num_devices", "must be >= 1"),
    (LOCAL + ["--scale_learning_rate", "maybe"], "--scale_learning_rate", "expected true or false"),
    (LOCAL + ["--train_dir", " "], "--train_dir", "must not be empty"),
    (["worker", "--seed", "-1"], "--seed", "must be >= 0"),
    (SUBMIT + ["--step_timeout_secs", "inf"], "--step_timeout_secs", "finite"),
    (["ssh", str(SPECS / "local.yaml"), "--log_every_steps", "0"], "--log_every_steps", "must be >= 1"),
    (["k8s", "manifest", str(SPECS / "local.yaml"), "--image", "i", "--mode", "x"], "--mode", "not one of"),
    (["slurm", "launch", str(SPECS / "local.yaml"), "--save_checkpoint_secs", "0"], "--save_checkpoint_secs",
     "must be > 0"),
    (["eval", "--train_dir", "t", "--model", "nope"], "--model", "not one of mlp"),
    (["plan", str(SPECS / "local.yaml"), "--model", "nope"], "--model", "not one of mlp"),
    # ports: one shared type
    (LOCAL + ["--tensorboard", "99999"], "--tensorboard", "port 99999 is out of range 0-65535"),
    (LOCAL + ["--tensorboard", "http"], "--tensorboard", "expected a port number, got 'http'"),
    (["tensorboard", "--logdir", ".", "--port", "-1"], "--port", "port -1 is out of range 0-65535"),
    (SUBMIT + ["--port_base", "65536"], "--port_base", "port 65536 is out of range 1-65535"),
    (SUBMIT + ["--port_base", "0"], "--port_base", "port 0 is out of range 1-65535"),
    (["slurm", "launch", str(SPECS / "local.yaml"), "--port_base", "x"], "--port_base", "expected a port number"),
    (["k8s", "manifest", str(SPECS / "local.yaml"), "--image", "i", "--port", "0"], "--port", "out of range"),
    # sbatch values: checked as Slurm reads them, before the script is written
    (SUBMIT + ["--nodes", "zero"], "--nodes", "'zero' is not a node count"),
    (SUBMIT + ["--nodes", "0"], "--nodes", "'0' is not a node count"),
    (SUBMIT + ["--nodes", "4-2"], "--nodes", "goes backwards"),
    (SUBMIT + ["--time", "1h"], "--time", "'1h' is not a Slurm time limit: use MM, MM:SS, HH:MM:SS, D-HH"),
    (SUBMIT + ["--time", "1-2:3:4:5"], "--time", "is not a Slurm time limit"),
    (SUBMIT + ["--partition", "gpu\n#SBATCH --qos=high"], "--partition", "cannot be empty or hold whitespace"),
    (SUBMIT + ["--account", "a b"], "--account", "whitespace"),
    (SUBMIT + ["--job_name", "it's"], "--job_name", "quotes"),
    (SUBMIT + ["--output", "out#1"], "--output", "'#'"),
    # sizes
    (LOCAL + ["--ps_memory_limit", "1.5 gigs"], "--ps_memory_limit",
     "'1.5 gigs' is not a size: a number and a unit, e.g. 1.5GB or 800MiB"),
    (LOCAL + ["--ps_memory_limit", "512"], "--ps_memory_limit", "a memory limit must be at least 1 MiB"),
    (["plan", str(SPECS / "local.yaml"), "--ps_memory_limit", "lots"], "--ps_memory_limit", "'lots' is not a size"),
    # other numbers
    (["plan", str(SPECS / "local.yaml"), "--tasks_per_node", "0"], "--tasks_per_node", "must be >= 1, got 0"),
    (["plan", str(SPECS / "local.yaml"), "--step_rate", "0"], "--step_rate", "must be a number > 0"),
    (["tf-config", str(SPECS / "local.yaml"), "--job", "ps", "--task_index", "-1"], "--task_index", ">= 0"),
    (["worker", "--task_index", "one"], "--task_index", "expected an integer, got 'one'"),
    (["eval", "--train_dir", "t", "--eval_interval_secs", "nan"], "--eval_interval_secs", "must be a number > 0"),
    (["status", ".", "--silent_secs", "-5"], "--silent_secs", "must be a number > 0"),
    (["k8s", "manifest", str(SPECS / "local.yaml"), "--image", "i", "--retries", "-1"], "--retries", ">= 0"),
    (["k8s", "logs", "run", "--tail", "0"], "--tail", "must be >= 1"),
    (["k8s", "manifest", str(SPECS / "local.yaml"), "--image", "i", "--memory", "4GB"], "--memory",
     "'4GB' is not a Kubernetes quantity"),
    (["k8s", "manifest", str(SPECS / "local.yaml"), "--image", "i", "--cpu", "0"], "--cpu", "must be > 0"),
]


@pytest.mark.parametrize("argv, flag, message", BAD_VALUES, ids=[f"{a[0]}{a[1]}" for a in BAD_VALUES])
def test_a_bad_value_is_a_usage_error_naming_its_flag(tmp_path, monkeypatch, capsys, argv, flag, message):
    """`main(argv)`: exit 2, `argument --flag: message`, nothing written."""
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"error: argument {flag}: " in err and message in err, err
    assert list(tmp_path.iterdir()) == []          # no run dir, no script


@pytest.mark.parametrize("argv", [LOCAL + ["--tensorboard", "99999"], SUBMIT + ["--nodes", "zero"],
                                  ["worker", "--mode", "synch"]])
def test_a_bad_value_from_the_command_line(tmp_path, argv):
    """The real `python -m psworker`: exit 2, the flag named, no traceback, nothing written."""
    r = subprocess.run([sys.executable, "-m", "psworker", *argv], cwd=tmp_path, capture_output=True, text=True,
                       timeout=60, env=_env())
    assert r.returncode == 2 and f"error: argument {argv[-2]}: " in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and list(tmp_path.iterdir()) == []


def _help(*argv: str) -> str:
    """`psworker ARGV --help`, unwrapped (wide COLUMNS: argparse also breaks lines at hyphens)."""
    r = subprocess.run([sys.executable, "-m", "psworker", *argv, "--help"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60, env={**_env(), "COLUMNS": "2000"})
    assert r.returncode == 0, r.stderr
    return " ".join(r.stdout.split())


def test_local_help_explains_every_training_setting():
    help_text = _help("local")
    from psworker.models import registry
    from psworker.spec.train_config import TRAIN_FIELDS, setting_doc

    # the subprocess imports no plugin model; this process may have (another test imported one)
    assert "--model {" + ",".join(registry.BUILTIN) + "}" in help_text
    for fragment in ("--mode {async,sync} async: each worker applies its own gradients",
                     "--num_devices {N,auto}", "--allow_fresh_start {true,false}",
                     "--learning_rate FLOAT the base learning rate, before scale_learning_rate (default: the model's)",
                     "(default: every worker)", "(default: every 60 s)", "(default: off, different each run)",
                     "--max_steps INT train until the global step reaches this (default: 2000)",
                     "--tensorboard [PORT]", "--checkpoint_every {Nsteps,Ns,Nm}", "--set NAME=VALUE"):
        assert fragment in help_text, fragment
    for name in TRAIN_FIELDS:
        doc = setting_doc(name)
        shown = f"--{name} " in help_text and f"{doc.meaning} (default: {doc.default})" in help_text
        assert shown == doc.flag, name          # a spec setting is `--set NAME=VALUE`, not a flag of its own
    assert "built-in default" not in help_text


def test_local_has_at_most_25_flags_and_the_old_spellings_still_work_with_a_hint():
    """The flags of `local` are what people change; a spec setting's old flag still parses, saying once how to
    write it now, and `--set`/`--checkpoint_every` reach the same settings (the spec `plan` prints shows them)."""
    flags = set(re.findall(r"(?<![\w-])--[a-z_]+", _help("local").split("options:", 1)[1]))
    assert len(flags) <= 25, sorted(flags)
    spec = ROOT / "cluster_specs" / "local.yaml"
    manifest = [sys.executable, "-m", "psworker", "k8s", "manifest", str(spec), "--image", "i"]
    old = subprocess.run([*manifest, "--step_timeout_secs", "30", "--save_checkpoint_steps", "40"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, env=_env())
    new = subprocess.run([*manifest, "--set", "step_timeout_secs=30", "--checkpoint_every", "40steps"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, env=_env())
    assert old.returncode == new.returncode == 0, old.stderr + new.stderr
    assert old.stdout == new.stdout and "- step_timeout_secs=30.0" in new.stdout, new.stdout
    assert "- save_checkpoint_steps=40" in new.stdout, new.stdout
    assert ("psworker: note: --step_timeout_secs is old spelling; write --set step_timeout_secs=30, or "
            "step_timeout_secs: 30 in the spec's train section") in old.stderr, old.stderr
    assert "--checkpoint_every NUMBERsteps" in old.stderr and "note" not in new.stderr, new.stderr
    bad = subprocess.run([sys.executable, "-m", "psworker", "local", str(spec), "--set", "step_timout_secs=3"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60, env=_env())
    assert bad.returncode == 2 and "did you mean step_timeout_secs?" in bad.stderr, bad.stderr


def test_every_command_with_training_settings_explains_them(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "2000")
    for argv in (["worker"], ["run"], ["ssh"], ["slurm", "submit"], ["slurm", "launch"], ["k8s", "manifest"]):
        assert cli.main([*argv, "--help"]) == 0
        text = " ".join(capsys.readouterr().out.split())
        if argv == ["run"]:    # `run` starts your own program: only its run dir
            assert "--mode" not in text and "--train_dir" in text
            continue
        assert "--mode {async,sync} async: each worker" in text and "(default: every worker)" in text, argv


def test_model_choices_follow_the_registry(tmp_path):
    """A model registered by a PSWORKER_MODELS module is offered and accepted; the help is not a copy."""
    (tmp_path / "mymodels.py").write_text("from psworker.models import registry\nregistry.register('tiny', object)\n")
    env = {**_env(), "PYTHONPATH": f"{ROOT}:{tmp_path}", "PSWORKER_MODELS": "mymodels", "COLUMNS": "2000"}
    r = subprocess.run([sys.executable, "-m", "psworker", "local", "--help"], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert "--model {mlp,cifar10,linear,criteo,tiny}" in r.stdout
    r = subprocess.run([sys.executable, "-m", "psworker", "slurm", "submit", str(SPECS / "local.yaml"), "--model",
                        "tiny", "--run_dir", str(tmp_path / "run"), "--dry_run"], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert "--model tiny" in (tmp_path / "run" / "psworker.sbatch").read_text()


def test_the_default_checkpoint_interval_in_words_is_the_trainers():
    from psworker.task.session_setup import DEFAULT_SAVE_CHECKPOINT_SECS
    from psworker.spec.train_config import DEFAULT_SAVE_CHECKPOINT_SECS as documented

    assert documented == DEFAULT_SAVE_CHECKPOINT_SECS


@pytest.mark.parametrize("text", ["1", "2-4", "16", "3-3"])
def test_sbatch_nodes_accepted(text):
    from psworker.launcher.backends.slurm.script import check_nodes
    assert check_nodes(text) == text


@pytest.mark.parametrize("text", ["0", "zero", "", "2-", "-2", "2 ", "4-2", "0-2", "1,2", "1-9:4", "02"])
def test_sbatch_nodes_refused(text):
    from psworker.launcher.backends.slurm.script import check_nodes
    with pytest.raises(ValueError, match="node count|backwards"):
        check_nodes(text)


@pytest.mark.parametrize("text", ["0", "90", "10:30", "1:00:00", "100:59:59", "2-12", "2-12:30", "2-12:30:15",
                                  "1:75", "UNLIMITED", "infinite", "-1"])
def test_sbatch_time_accepted(text):
    from psworker.launcher.backends.slurm.script import check_time
    assert check_time(text) == text


@pytest.mark.parametrize("text", ["", "1h", "1:2:3:4", "1-2:3:4:5", "-2", "1.5", "2-", "-1:00", " 1:00:00",
                                  "1:00:00\n", "1:"])
def test_sbatch_time_refused(text):
    from psworker.launcher.backends.slurm.script import check_time
    with pytest.raises(ValueError, match="is not a Slurm time limit"):
        check_time(text)


@pytest.mark.parametrize("text, ok", [("debug", True), ("gpu,cpu", True), ("/shared/out-%j.log", True),
                                      ("", False), ("a b", False), ("a\tb", False), ("a\n#SBATCH", False),
                                      ("a\x00", False), ('"q"', False), ("a\\b", False), ("a#b", False)])
def test_sbatch_values(text, ok):
    from psworker.launcher.backends.slurm.script import check_sbatch_value
    if ok:
        assert check_sbatch_value(text) == text
    else:
        with pytest.raises(ValueError, match="#SBATCH value"):
            check_sbatch_value(text)


@pytest.mark.parametrize("text, ok", [("2", True), ("500m", True), ("4Gi", True), ("1.5G", True), ("1e9", True),
                                      (".5", True), ("4GB", False), ("two", False), ("-1", False), ("0", False),
                                      ("0.0Gi", False), ("4 Gi", False), ("", False)])
def test_k8s_quantities(text, ok):
    from psworker.cli.k8s import check_quantity
    if ok:
        assert check_quantity(text) == text
    else:
        with pytest.raises(ValueError, match="Kubernetes quantity|must be > 0"):
            check_quantity(text)


def test_every_setting_written_as_a_flag_passes_the_flag_check():
    """k8s manifests and `slurm submit` write each set value as `--name str(value)`: the worker's flags take it."""
    from psworker.spec import TrainConfig, merge_train

    config = TrainConfig(learning_rate=1e-05, train_dir="/t", data_dir="/d", save_checkpoint_steps=5,
                         replicas_to_aggregate=2, num_devices="auto", replication="in-graph", seed=0,
                         scale_learning_rate=False, mode="sync", model="linear", step_timeout_secs=0.5)
    argv = ["worker"] + [part for name, value in vars(config).items() if value is not None
                         for part in (f"--{name}", str(value))]
    args = cli.build_parser().parse_args(argv)
    assert merge_train(TrainConfig(), {name: getattr(args, name) for name in vars(config)}) == config


def test_the_subcommand_and_the_user_command_are_two_fields():
    args = cli._parse(["run", "c.yaml", "--", "python", "train.py"])
    assert args.command == "run" and args.user_command == ["python", "train.py"]


def test_every_launcher_takes_its_settings_with_set_as_its_old_spelling_note_says(capsys):
    """The old-spelling note of a launcher setting says `--set NAME=VALUE`: every launcher command takes it (`run`
    too, which has no training settings and refuses one by name)."""
    parser = cli.build_parser()
    for argv in (["local", "s.yaml"], ["run", "s.yaml"], ["ssh", "s.yaml"], ["slurm", "launch", "s.yaml"],
                 ["slurm", "submit", "s.yaml"]):
        args = parser.parse_args([*argv, "--set", "grace_period_secs=3", "--set", "metrics_linger_secs=0"])
        assert (args.grace_period_secs, args.metrics_linger_secs) == (3.0, 0.0), argv
    with pytest.raises(SystemExit):
        parser.parse_args(["run", "s.yaml", "--set", "step_timeout_secs=3"])
    assert "expected NAME=VALUE with NAME a setting (grace_period_secs, " in capsys.readouterr().err
    args = parser.parse_args(["run", "s.yaml", "--metrics_linger_secs", "0"])
    assert args.metrics_linger_secs == 0.0
    assert "--metrics_linger_secs is old spelling; write --set metrics_linger_secs=0" in capsys.readouterr().err
