"""`psworker ssh` against the real test sshd on 127.0.0.1-3 (psworker/testing_sshd.py): the default job end to end,
Ctrl-C mid-run with nothing left on any host, and a refused host reported before anything starts."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from psworker import stackdump
from psworker.deadline import wait_for
from psworker.testing import checkpoint_step, processes_naming
from tests.cluster_utils import run_launcher, steps_lost, task_env

pytestmark = pytest.mark.slow

HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")     # ps:0, worker:0, worker:1


def _free_ports(n: int) -> list[int]:
    """Ports free on every interface (TensorFlow's servers bind all of them), distinct."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _spec(tmp_path: Path, hosts=HOSTS, **train) -> Path:
    ports = _free_ports(len(hosts))
    addresses = [f"{h}:{p}" for h, p in zip(hosts, ports)]
    path = tmp_path / "hosts.yaml"
    path.write_text(yaml.safe_dump({"cluster": {"ps": addresses[:1], "worker": addresses[1:]},
                                    "train": {"model": "mlp", "batch_size": 32, "log_every_steps": 10,
                                              "train_dir": str(tmp_path / "train"), **train}}))
    return path


def _wait_gone(marker: str, timeout: float = 20.0) -> None:
    wait_for(lambda: not processes_naming(marker), timeout, f"every process naming {marker} to end after the launcher")


@pytest.mark.timeout(600)
def test_default_job_end_to_end_over_ssh(sshd, tmp_path):
    spec = _spec(tmp_path, max_steps=200)
    run = run_launcher([str(spec), "--ssh_config", str(sshd.client_config), "--console", "plain"], cwd=tmp_path,
                       timeout=420, command="ssh")
    out = run.output
    assert run.returncode == 0, out[-4000:] + sshd.log_tail()
    assert "starting 3 tasks over ssh (ps:0=127.0.0.1:" in out
    assert re.search(r"^psworker: precision @ 1 = ", out, re.MULTILINE), out[-3000:]
    assert re.search(r"^\[worker:1\] step \d+, loss", out, re.MULTILINE), out[-3000:]
    assert "\r" not in out and "psworker-remote-pid" not in out
    assert checkpoint_step(tmp_path / "train") >= 200
    log = (tmp_path / "train" / "logs" / "worker-0.log").read_text()
    assert "\r" not in log and "precision @ 1" in log
    _wait_gone(str(tmp_path / "train"))
    status = subprocess.run([sys.executable, "-m", "psworker", "status", str(tmp_path / "train"), "--json"],
                            capture_output=True, text=True, env=task_env(), timeout=60)
    tasks = json.loads(status.stdout)["tasks"]      # each task's remote pid (not its ssh client's) and host
    assert {n: (t["state"], t["exit"]) for n, t in tasks.items()} == {n: ("done", "exit code 0") for n in tasks}, tasks
    assert all(isinstance(t["pid"], int) and t["pid"] not in run.pids and t["host"] for t in tasks.values()), tasks


@pytest.mark.timeout(600)
def test_ctrl_c_mid_run_leaves_nothing_on_any_host(sshd, tmp_path):
    spec = _spec(tmp_path, max_steps=1_000_000)
    marker = str(tmp_path / "train")
    seen: dict[str, list] = {}

    def interrupt_when_training(lines, proc) -> bool:     # both: the chief's step lines make the stop save
        if not all(any(re.match(rf"\[worker:{i}\] step \d+", line) for line in lines) for i in (0, 1)):
            return False
        seen["remote"] = [p.info["cmdline"] for p in processes_naming(marker) if p.info["cmdline"][0] != "ssh"]
        os.killpg(proc.pid, signal.SIGINT)          # what Ctrl-C in a terminal does
        return True

    run = run_launcher([str(spec), "--ssh_config", str(sshd.client_config), "--console", "plain", "--grace_period_secs", "5"],
                       cwd=tmp_path, timeout=420, on_line=interrupt_when_training, command="ssh")
    assert run.returncode == 130, run.output[-4000:]
    assert len({" ".join(cmd[-5:]) for cmd in seen["remote"]}) == 3, seen   # the 3 remote tasks were running
    assert "launcher received SIGINT" in run.output
    assert "closing their connections" not in run.output, run.output[-3000:]   # the remote SIGTERM sufficed
    saved = re.search(r"^psworker: stopped; checkpoint of step ([\d,]+) saved in (.+); the same command goes on "
                      r"from it$", run.output, re.MULTILINE)     # the chief saved before its ps went
    assert saved and checkpoint_step(tmp_path / "train") == int(saved.group(1).replace(",", "")), run.output[-3000:]
    lost = steps_lost(tmp_path / "train" / "logs", int(saved.group(1).replace(",", "")))
    print(f"stop/resume: SIGINT, ssh, async: checkpoint of step {saved.group(1)}, {lost} steps lost")
    assert lost == 0
    _wait_gone(marker)


@pytest.mark.timeout(120)
def test_refused_host_is_named_and_nothing_starts(sshd, tmp_path):
    spec = _spec(tmp_path, hosts=("127.0.0.1", "127.0.0.4", "127.0.0.2"), max_steps=200)
    run = run_launcher([str(spec), "--ssh_config", str(sshd.client_config), "--console", "plain"], cwd=tmp_path,
                       timeout=60, command="ssh")     # how soon it gives up: benchmarks/response_times.py
    assert run.returncode != 0
    assert "127.0.0.4" in run.output and "Connection refused" in run.output and "nothing was started" in run.output
    assert "127.0.0.1:" not in run.output.split("nothing was started")[1]
    assert not (tmp_path / "train" / "logs").exists()


@pytest.mark.timeout(600)
def test_injected_kill_restarts_the_task_over_a_new_connection(sshd, tmp_path):
    spec = _spec(tmp_path, mode="sync", max_steps=200)
    run = run_launcher([str(spec), "--ssh_config", str(sshd.client_config), "--console", "plain", "--max_restarts", "1",
                        "--restart_backoff_secs", "0.5", "--inject", "kill:worker:1@step=60"], cwd=tmp_path,
                       timeout=420, command="ssh")
    out = run.output
    assert run.returncode == 0, out[-4000:]
    assert "restarting worker:1 (restart 1: injected kill:worker:1@step=60)" in out, out[-3000:]
    assert checkpoint_step(tmp_path / "train") == 200
    _wait_gone(str(tmp_path / "train"))


@pytest.mark.timeout(600)
def test_a_failed_task_stops_the_others_on_every_host(sshd, tmp_path):
    spec = _spec(tmp_path, max_steps=1_000_000)
    run = run_launcher([str(spec), "--ssh_config", str(sshd.client_config), "--console", "plain", "--max_restarts", "1",
                        "--inject", "exit:worker:1@step=50,code=3"], cwd=tmp_path, timeout=420, command="ssh")
    assert run.returncode == 3, run.output[-4000:]
    assert "psworker: run failed: worker:1 " in run.output, run.output[-3000:]
    assert re.search(r"^  ps:0\s+stopped by launcher", run.output, re.MULTILINE), run.output[-3000:]
    assert "closing their connections" not in run.output, run.output[-3000:]
    # before it stopped them, the launcher asked each for its stacks (`kill -USR1` over ssh): in its pumped log
    for name in ("ps:0", "worker:0"):
        log = (tmp_path / "train" / "logs" / f"{name.replace(':', '-')}.log").read_text()
        asked = log.rfind(f"--- stacks of {name} asked for by SIGUSR1 (stopping: worker:1 failed) at ")
        dump = stackdump.last_dump(log[asked:]) if asked >= 0 else None
        assert dump is not None and dump.is_complete, log[-3000:]
        assert any(f.file.endswith("psworker/task/main.py") for f in dump.main_thread.frames), dump.render()
        assert re.search(rf"^  {name}\s+stopped by launcher.*\n\s+was in \S+ \(.*\) \(every thread's stack in its log\)$",
                         run.output, re.MULTILINE), run.output[-3000:]
    _wait_gone(str(tmp_path / "train"))


# -- a user's own program over ssh (`psworker ssh SPEC -- COMMAND`) -----------------------------------------------

SCRIPTS = Path(__file__).resolve().parent / "user_scripts"


@pytest.mark.timeout(600)
def test_a_classic_tf1_script_runs_over_ssh_with_its_flags_filled_in(sshd, tmp_path):
    """The tutorial's flags per task, on the task's host; the chief's exit ends the run; nothing left anywhere."""
    spec = _spec(tmp_path)
    checkpoints = tmp_path / "ckpt"
    run = run_launcher([str(spec), "--ssh_config", str(sshd.client_config), "--console", "plain", "--",
                        sys.executable, str(SCRIPTS / "classic_tf1.py"), "--ps_hosts={ps_hosts}",
                        "--worker_hosts={worker_hosts}", "--job_name={job_name}", "--task_index={task_index}",
                        "--train_dir", str(checkpoints), "--max_steps", "200", "--recovery_wait_secs", "1"],
                       cwd=tmp_path, timeout=420, command="ssh")
    out = run.output
    assert run.returncode == 0, out[-4000:] + sshd.log_tail()
    assert "starting 3 tasks over ssh (ps:0=127.0.0.1:" in out
    assert "[worker:0] worker 0 done" in out, out[-3000:]
    assert checkpoint_step(checkpoints) >= 200
    assert "psworker-remote-pid" not in out and "\r" not in out
    log = (tmp_path / "train" / "logs" / "worker-1.log").read_text()
    assert "worker 1" in log and "\r" not in log
    _wait_gone(str(tmp_path))


@pytest.mark.timeout(600)
def test_a_tf2_parameter_server_strategy_script_runs_over_ssh_from_tf_config(sshd, tmp_path):
    """TF_CONFIG travels to each host with the task: a chief, a ps and two workers on three hosts."""
    ports = _free_ports(4)
    spec = tmp_path / "pss.yaml"
    spec.write_text(yaml.safe_dump({"cluster": {"chief": [f"127.0.0.1:{ports[0]}"], "ps": [f"127.0.0.2:{ports[1]}"],
                                                "worker": [f"127.0.0.3:{ports[2]}", f"127.0.0.1:{ports[3]}"]},
                                    "train": {"train_dir": str(tmp_path / "train")}}))
    script = tmp_path / "tf2_ps_strategy.py"    # a copy: the tasks' command lines name this run's directory
    shutil.copyfile(SCRIPTS / "tf2_ps_strategy.py", script)
    run = run_launcher([str(spec), "--ssh_config", str(sshd.client_config), "--console", "plain", "--", sys.executable,
                        str(script)], cwd=tmp_path, timeout=420, command="ssh")
    out = run.output
    assert run.returncode == 0, out[-4000:] + sshd.log_tail()
    assert "[chief:0] step 100, loss = " in out and "[chief:0] chief done: w = 3.00, b = 1.00" in out, out[-3000:]
    assert "every chief task finished" in out
    _wait_gone(str(tmp_path))
