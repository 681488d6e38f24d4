"""End to end: the start scripts and the local launcher run real clusters of real TensorFlow servers."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cluster_utils import REPO, assert_no_processes, descendants, task_env, write_spec

pytestmark = pytest.mark.slow

STEP_LINE = re.compile(r"step (\d+), loss = [0-9.]+ \([0-9.]+ examples/sec; [0-9.]+ sec/batch\)")
PRECISION = re.compile(r"precision @ 1 = ([0-9.]+)")


def checkpoint_step(train_dir: Path) -> int:
    import tensorflow as tf

    path = tf.train.latest_checkpoint(str(train_dir))
    assert path, f"no checkpoint in {train_dir}: {sorted(p.name for p in train_dir.iterdir())}"
    return int(tf.train.load_checkpoint(path).get_tensor("global_step"))


def run_launcher(args, cwd: Path, timeout: float, on_line=None):
    """Runs `psworker local ARGS`, collecting every descendant pid it ever had; returns (rc, output, pids)."""
    proc = subprocess.Popen([sys.executable, "-m", "psworker", "local", *args], cwd=cwd, env=task_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    pids: set[int] = set()
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    import threading

    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        while proc.poll() is None:
            pids.update(descendants(proc.pid))
            if on_line is not None and on_line(lines, proc):
                on_line = None
            if time.monotonic() > deadline:
                raise AssertionError(f"launcher still running after {timeout:g} s:\n" + "".join(lines[-40:]))
            time.sleep(0.2)
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    return proc.returncode, "".join(lines), pids


def test_start_scripts_train_a_cluster(tmp_path, cluster):
    """ps and workers started by hand, as on real hosts: through the classic flags, PSWORKER_SPEC and TF_CONFIG."""
    train_dir = tmp_path / "train"
    spec = write_spec(tmp_path / "cluster.yaml", max_steps=300, batch_size=32, log_every_steps=50,
                      save_checkpoint_steps=100, train_dir=str(train_dir))
    tf_config = subprocess.run([sys.executable, "-m", "psworker", "tf-config", str(spec), "--job", "worker",
                                "--task_index", "1"], capture_output=True, text=True, env=task_env(), check=True)
    assert json.loads(tf_config.stdout)["task"] == {"type": "worker", "index": 1}

    from psworker.interop import to_flags
    from psworker.spec import load_spec

    classic = to_flags(load_spec(spec), "ps", 0)   # --ps_hosts=... --worker_hosts=... --job_name=ps --task_index=0
    ps = cluster.start("ps", 0, classic, via_script=True)
    chief = cluster.start("worker", 0, ["--task_index", "0"], via_script=True,
                          env=task_env(PSWORKER_SPEC=str(spec), PSWORKER_PYTHON=sys.executable))
    # TF_CONFIG carries only the cluster: training settings come as flags, as they would on a real host.
    other = cluster.start("worker", 1, ["--max_steps", "300", "--batch_size", "32", "--log_every_steps", "50",
                                        "--train_dir", str(train_dir)], via_script=True,
                          env=task_env(TF_CONFIG=tf_config.stdout, PSWORKER_PYTHON=sys.executable))
    assert chief.wait(240) == 0, chief.tail()
    assert other.wait(60) == 0, other.tail()
    assert ps.wait(60) == 0, ps.tail()
    assert checkpoint_step(train_dir) >= 300
    for worker in (chief, other):
        steps = [int(m.group(1)) for m in STEP_LINE.finditer(worker.log())]
        assert steps and steps == sorted(steps) and max(steps) <= 300 + 2, worker.tail()
    assert PRECISION.search(chief.log()), chief.tail()
    assert_no_processes(cluster.all_pids)


def test_local_launcher_runs_the_default_job(tmp_path):
    """The README's first command: 1 ps + 2 workers on real digits data, evaluated at the end."""
    train_dir = tmp_path / "train"
    rc, out, pids = run_launcher([str(REPO / "cluster_specs" / "local.yaml"), "--train_dir", str(train_dir)],
                                 cwd=tmp_path, timeout=300)
    assert rc == 0, out[-4000:]
    precision = float(PRECISION.search(out).group(1))
    assert precision >= 0.95, out[-2000:]
    assert checkpoint_step(train_dir) >= 2000
    for prefix in ("[ps:0] ", "[worker:0] ", "[worker:1] "):
        assert prefix in out
    assert {p.name for p in (train_dir / "logs").iterdir()} >= {"ps-0.log", "worker-0.log", "worker-1.log"}
    assert (train_dir / "cluster.yaml").exists()
    assert len(pids) >= 3
    assert_no_processes(pids)


def test_a_failing_task_tears_the_cluster_down(tmp_path):
    """worker:1's port is taken: it fails to start; the launcher stops the rest and names it."""
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    port = blocker.getsockname()[1]
    spec = tmp_path / "bad.yaml"
    spec.write_text(f"cluster:\n  ps: ['localhost:auto']\n  worker: ['localhost:auto', 'localhost:{port}']\n"
                    "train:\n  max_steps: 100000\n")
    try:
        rc, out, pids = run_launcher([str(spec), "--train_dir", str(tmp_path / "t"), "--grace_period_secs", "3"],
                                     cwd=tmp_path, timeout=180)
    finally:
        blocker.close()
    assert rc != 0
    report = out[out.find("first failure"):] if "first failure" in out else out
    assert "worker:1" in report, out[-3000:]
    assert_no_processes(pids)


def test_sigint_to_the_launcher_leaves_no_process(tmp_path):
    def interrupt_once_training(lines, proc):
        if any(STEP_LINE.search(line) for line in lines):
            proc.send_signal(signal.SIGINT)
            return True
        return False

    rc, out, pids = run_launcher([str(REPO / "cluster_specs" / "local.yaml"), "--train_dir", str(tmp_path / "t"),
                                  "--max_steps", "1000000", "--log_every_steps", "20", "--grace_period_secs", "5"],
                                 cwd=tmp_path, timeout=240, on_line=interrupt_once_training)
    assert rc == 130, out[-3000:]
    assert STEP_LINE.search(out)
    assert len(pids) >= 3
    assert_no_processes(pids)
