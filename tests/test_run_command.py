"""`psworker run SPEC -- COMMAND`: users' own distributed-TensorFlow scripts (tests/user_scripts), run end to end,
with no process left; plus the task environment and placeholders over a fake program (no TensorFlow)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from psworker.launcher.command import command_tasks
from psworker.spec import parse_spec
from psworker.testing import assert_processes_gone as assert_no_processes, checkpoint_step
from tests.cluster_utils import REPO, run_launcher, task_env

SCRIPTS = REPO / "tests" / "user_scripts"


def write(path, text):
    path.write_text(text)
    return path


def test_each_task_gets_tf_config_env_and_placeholders():
    spec = parse_spec({"cluster": {"chief": ["127.0.0.1:2220"], "ps": ["127.0.0.1:2221"],
                                   "worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}}, "t.yaml")
    tasks = command_tasks(spec, ["python", "t.py", "--job_name={job_name}", "--task_index={task_index}",
                                 "--ps_hosts={ps_hosts}", "--worker_hosts", "{worker_hosts}", "{other}"])
    assert [t.name for t in tasks] == ["chief:0", "ps:0", "worker:0", "worker:1"]
    assert [t.is_chief for t in tasks] == [True, False, False, False]
    w1 = tasks[3]
    assert w1.argv == ("python", "t.py", "--job_name=worker", "--task_index=1", "--ps_hosts=127.0.0.1:2221",
                       "--worker_hosts", "127.0.0.1:2222,127.0.0.1:2223", "{other}")
    env = dict(w1.env)
    assert json.loads(env["TF_CONFIG"]) == {
        "cluster": {"chief": ["127.0.0.1:2220"], "ps": ["127.0.0.1:2221"],
                    "worker": ["127.0.0.1:2222", "127.0.0.1:2223"]},
        "task": {"type": "worker", "index": 1}}
    assert (env["PSWORKER_JOB_NAME"], env["PSWORKER_TASK_INDEX"]) == ("worker", "1")
    assert env["PSWORKER_PS_HOSTS"] == "127.0.0.1:2221"
    assert env["PSWORKER_WORKER_HOSTS"] == "127.0.0.1:2222,127.0.0.1:2223"


def test_run_without_a_command_is_a_usage_error(tmp_path):
    spec = write(tmp_path / "c.yaml", "cluster: {ps: ['localhost:auto'], worker: ['localhost:auto']}\n")
    out = subprocess.run([sys.executable, "-m", "psworker", "run", str(spec)], capture_output=True, text=True,
                         env=task_env(), timeout=60)
    assert out.returncode == 2 and "needs a command after '--'" in out.stderr


def test_a_permanent_failure_fails_the_run(tmp_path):
    spec = write(tmp_path / "c.yaml", "cluster: {ps: ['localhost:auto'], worker: ['localhost:auto']}\n")
    run = run_launcher([str(spec), "--train_dir", str(tmp_path / "run"), "--console", "plain", "--max_restarts", "2", "--",
                        sys.executable, "-c", "import os, sys, time\n"
                        "if os.environ['PSWORKER_JOB_NAME'] == 'ps': time.sleep(60)\n"
                        "sys.exit(3)"], cwd=tmp_path, timeout=60, command="run")
    assert run.returncode == 3, run.output
    assert "run failed: worker:0 exited with exit code 3" in run.output
    assert_no_processes(run.pids)


WORKERS_SCRIPT = """
import os, pathlib, sys, time
job, index, train_dir = os.environ["PSWORKER_JOB_NAME"], int(os.environ["PSWORKER_TASK_INDEX"]), sys.argv[1]
if train_dir != "-":
    assert train_dir == os.environ["PSWORKER_TRAIN_DIR"] and os.path.isdir(train_dir), train_dir
marks = pathlib.Path(os.environ["MARKS"])
if job == "ps":
    time.sleep(60)
elif index == 0:     # the chief: succeeds once the others have done what they do
    deadline = time.monotonic() + 60
    while not all((marks / f"ready-{k}").exists() for k in (1, 2, 3)):
        if time.monotonic() > deadline:
            sys.exit("the other workers did not get ready")
        time.sleep(0.05)
    print("step 5, loss = 0.5")
elif index == 1:     # trains, then never exits by itself
    print("step 3, loss = 0.7", flush=True)
    (marks / "ready-1").touch()
    time.sleep(60)
elif index == 2:     # waits forever without a step, like a TF1 non-chief without device filters
    (marks / "ready-2").touch()
    time.sleep(60)
else:                # exits 0 without a step line
    (marks / "ready-3").touch()
"""


@pytest.mark.parametrize("given_train_dir", [True, False])
def test_the_report_names_workers_without_steps_or_stopped_and_knows_the_train_dir(tmp_path, monkeypatch,
                                                                                     given_train_dir):
    spec = write(tmp_path / "c.yaml", "cluster: {ps: ['localhost:auto'], worker: [" +
                 ", ".join(["'localhost:auto'"] * 4) + "]}\n")
    (tmp_path / "marks").mkdir()
    monkeypatch.setenv("MARKS", str(tmp_path / "marks"))
    run_dir = tmp_path / "run"
    run = run_launcher([str(spec), "--train_dir", str(run_dir), "--console", "plain", "--worker_exit_grace_secs", "0.5", "--",
                        sys.executable, "-c", WORKERS_SCRIPT, "{train_dir}" if given_train_dir else "-"],
                       cwd=tmp_path, timeout=120, command="run")
    assert run.returncode == 0, run.output
    lines = run.output.splitlines()
    assert ("psworker: warning: worker:2: no step line, and the launcher stopped it: it may never have trained (a "
            "TF1 non-chief without device filters waits for the chief's session forever; see docs/running.md, "
            "'psworker run')") in lines, run.output
    assert "psworker: warning: worker:3: exited without printing a step line (no progress seen)" in lines
    assert ("psworker: warning: worker:1: did not exit by itself; the launcher stopped it after the run had "
            "succeeded") in lines
    assert not [line for line in lines if "warning: worker:0" in line]
    if given_train_dir:
        assert f"psworker: checkpoints and summaries in {run_dir}/, task logs in {run_dir}/logs/" in lines
    else:
        assert (f"psworker: task logs in {run_dir}/logs/ (checkpoints and summaries: wherever your command writes "
                f"them; pass it {{train_dir}} to have them in {run_dir}/)") in lines
        assert "checkpoints and summaries in" not in run.output.replace("checkpoints and summaries: wherever", "")
    assert_no_processes(run.pids)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_classic_tf1_script_runs_unchanged(tmp_path):
    spec = write(tmp_path / "cluster.yaml",
                 "cluster:\n  ps: ['localhost:auto']\n  worker: ['localhost:auto', 'localhost:auto']\n")
    train_dir = tmp_path / "ckpt"
    run = run_launcher([str(spec), "--train_dir", str(tmp_path / "run"), "--console", "plain", "--",
                        sys.executable, str(SCRIPTS / "classic_tf1.py"), "--ps_hosts={ps_hosts}",
                        "--worker_hosts={worker_hosts}", "--job_name={job_name}", "--task_index={task_index}",
                        "--train_dir", str(train_dir), "--max_steps", "200", "--recovery_wait_secs", "1"], cwd=tmp_path, timeout=240,
                       command="run")
    assert run.returncode == 0, run.output[-4000:]
    assert "[worker:0] worker 0 done" in run.output and "[worker:1] worker 1 done" in run.output
    assert "all 2 workers finished" in run.output
    assert checkpoint_step(train_dir) >= 200
    assert_no_processes(run.pids)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_tf2_parameter_server_strategy_script_runs_from_tf_config(tmp_path):
    spec = write(tmp_path / "cluster.yaml",
                 "cluster:\n  chief: ['localhost:auto']\n  ps: ['localhost:auto']\n"
                 "  worker: ['localhost:auto', 'localhost:auto']\n")
    run = run_launcher([str(spec), "--train_dir", str(tmp_path / "run"), "--console", "plain", "--",
                        sys.executable, str(SCRIPTS / "tf2_ps_strategy.py")], cwd=tmp_path, timeout=240,
                       command="run")
    assert run.returncode == 0, run.output[-4000:]
    assert "[chief:0] step 100, loss = " in run.output
    assert "[chief:0] chief done: w = 3.00, b = 1.00" in run.output
    assert "every chief task finished" in run.output
    assert_no_processes(run.pids)


def test_chief_and_evaluator_jobs_validate_plan_and_give_tf_config(tmp_path):
    spec_path = REPO / "cluster_specs" / "ps-strategy.yaml"
    out = subprocess.run([sys.executable, "-m", "psworker", "validate", str(spec_path)], capture_output=True,
                         text=True, env=task_env(), timeout=60)
    assert out.returncode == 0 and "(1 chief, 1 ps, 2 workers)" in out.stdout, out.stderr
    out = subprocess.run([sys.executable, "-m", "psworker", "plan", str(spec_path)], capture_output=True,
                         text=True, env=task_env(), timeout=60)
    assert out.returncode == 0 and "chief:0" in out.stdout and '{"type": "chief", "index": 0}' in out.stdout
    fixed = write(tmp_path / "f.yaml", "cluster: {chief: ['h0:2220'], ps: ['h1:2221'], worker: ['h2:2222'],"
                                       " evaluator: ['h3:2223']}\n")
    out = subprocess.run([sys.executable, "-m", "psworker", "tf-config", str(fixed), "--job", "evaluator",
                          "--task_index", "0"], capture_output=True, text=True, env=task_env(), timeout=60)
    assert json.loads(out.stdout) == {"cluster": {"chief": ["h0:2220"], "ps": ["h1:2221"], "worker": ["h2:2222"],
                                                  "evaluator": ["h3:2223"]},
                                      "task": {"type": "evaluator", "index": 0}}


def test_psworker_own_trainer_refuses_a_chief_job_and_two_chiefs_are_invalid():
    from psworker.errors import SpecError
    from psworker.spec.plan import plan

    spec = parse_spec({"cluster": {"chief": ["h:1"], "ps": ["h:2"], "worker": ["h:3"]}}, "c.yaml")
    with pytest.raises(SpecError, match=r"cluster\.chief: .*worker 0 is the chief.*psworker run"):
        plan(spec, "c.yaml")
    with pytest.raises(SpecError, match=r"cluster\.chief: has 2 addresses; TensorFlow allows one chief task"):
        parse_spec({"cluster": {"chief": ["h:1", "h:4"], "ps": ["h:2"], "worker": ["h:3"]}}, "c.yaml")
    with pytest.raises(SpecError, match=r"cluster\.evaluator\[0\]: duplicate address h:2"):
        parse_spec({"cluster": {"evaluator": ["h:2"], "ps": ["h:2"], "worker": ["h:3"]}}, "c.yaml")


CHIEF_EVALUATES = """
import os, sys, time
job = os.environ["PSWORKER_JOB_NAME"]
if job == "ps":
    time.sleep(60)
if job == "chief":
    print("precision @ 1 = 0.875 (64 examples, global step 9)", flush=True)
"""


def test_the_success_report_reads_the_chief_job_s_log(tmp_path):
    """With a chief job the chief is chief:0, not worker:0 (`plan.chief_name`): its evaluation line is repeated."""
    spec = write(tmp_path / "c.yaml", "cluster: {chief: ['localhost:auto'], ps: ['localhost:auto'], "
                                      "worker: ['localhost:auto']}\n")
    run = run_launcher([str(spec), "--train_dir", str(tmp_path / "run"), "--console", "plain", "--", sys.executable, "-c",
                        CHIEF_EVALUATES], cwd=tmp_path, timeout=120, command="run")
    assert run.returncode == 0, run.output
    assert "psworker: precision @ 1 = 0.875 (64 examples, global step 9)" in run.output, run.output
    assert_no_processes(run.pids)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_tf1_script_reads_dealt_shards_through_script_dealing(tmp_path):
    """`tests/user_scripts/dealt_tf1.py` (300 examples, 2 epochs) under `psworker run` with 1 ps + 2 workers: its
    `ScriptDealing` deals every position to one of the workers exactly twice, the run ends by itself when the epochs
    are dealt and trained, and the chief reports 600 examples trained, none again. Its non-chief polls for the
    chief's model every second (`--recovery_wait_secs 1`, as classic_tf1.py's tests do): with TensorFlow's 30 s it
    could sleep through the whole run and read nothing (seen here: 55 s, the deal the chief's alone; 24 s now)."""
    import collections

    spec = write(tmp_path / "cluster.yaml",
                 "cluster:\n  ps: ['localhost:auto']\n  worker: ['localhost:auto', 'localhost:auto']\n")
    positions = tmp_path / "positions"
    positions.mkdir()
    run = run_launcher([str(spec), "--train_dir", str(tmp_path / "run"), "--console", "plain", "--",
                        sys.executable, str(SCRIPTS / "dealt_tf1.py"), "--ps_hosts={ps_hosts}",
                        "--worker_hosts={worker_hosts}", "--job_name={job_name}", "--task_index={task_index}",
                        "--train_dir", str(tmp_path / "ckpt"), "--positions_dir", str(positions),
                        "--recovery_wait_secs", "1"],
                       cwd=tmp_path, timeout=240, command="run")
    assert run.returncode == 0, run.output[-4000:]
    read = collections.Counter()
    for path in positions.iterdir():
        for line in path.read_text().splitlines():
            read.update(int(p) for p in line.split())
    assert collections.Counter(read.get(p, 0) for p in range(300)) == {2: 300}, sorted(read.items())[:20]
    assert "[worker:0] data: 600 examples trained, 0 of them again; epoch 2.00 of 2" in run.output, \
        run.output[-4000:]
    assert "[worker:0] worker 0 done (deal over: True)" in run.output, run.output[-4000:]
    assert checkpoint_step(tmp_path / "ckpt") == 60
    assert_no_processes(run.pids)
