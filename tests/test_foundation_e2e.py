"""End to end: the start scripts and the local launcher run real clusters of real TensorFlow servers (signals to the
launcher, faults, the status views and `--network isolated`: tests/test_real_launcher.py)."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time

import pytest
import yaml

from psworker.events import TfImported, WorkerDone
from psworker.testing import assert_processes_gone, checkpoint_step, port_listening, write_spec
from tests.cluster_utils import LAUNCH, REPO, run_launcher, task_env

pytestmark = pytest.mark.slow

PRECISION = re.compile(r"precision @ 1 = ([0-9.]+)")


def test_start_scripts_train_a_cluster(tmp_path, make_cluster):
    """ps and workers started by hand, as on real hosts: through the classic flags, PSWORKER_SPEC and TF_CONFIG."""
    from psworker.spec.interop import to_flags
    from psworker.spec import load_spec

    train_dir = tmp_path / "train"
    spec_path = write_spec(tmp_path / "cluster.yaml", max_steps=300, batch_size=32, log_every_steps=50,
                           save_checkpoint_steps=100, train_dir=str(train_dir))
    tf_config = subprocess.run([sys.executable, "-m", "psworker", "tf-config", str(spec_path), "--job", "worker",
                                "--task_index", "1"], capture_output=True, text=True, env=task_env(), check=True)
    assert json.loads(tf_config.stdout)["task"] == {"type": "worker", "index": 1}
    spec = load_spec(spec_path)

    def by_hand(task, extra):   # `env` (not a shell) sets each host's own environment
        script = str(LAUNCH / f"start_{task.job}.sh")
        if task.name == "ps:0":   # --ps_hosts=... --worker_hosts=... --job_name=ps --task_index=0
            return [script, *to_flags(spec, "ps", 0)]
        if task.name == "worker:0":
            return ["env", f"PSWORKER_SPEC={spec_path}", script, "--task_index", "0"]
        # TF_CONFIG carries only the cluster: training settings come as flags, as they would on a real host.
        return ["env", f"TF_CONFIG={tf_config.stdout.strip()}", script, "--max_steps", "300", "--batch_size", "32",
                "--log_every_steps", "50", "--train_dir", str(train_dir)]

    # Started together, as hosts would be (each worker waits for the ps), so that the three imports of TensorFlow
    # overlap; the ps's port is reachable while they train (started by hand, outside any namespace: the control).
    cluster = make_cluster(spec=spec_path, argv=by_hand)
    deadline = time.monotonic() + 120
    while not port_listening(spec.ps[0].port):
        assert time.monotonic() < deadline and "ps:0" not in cluster.exit_codes(), cluster.tail("ps:0")
        time.sleep(0.05)
    assert cluster.wait_exits(300) == {"worker:0": 0, "worker:1": 0, "ps:0": 0}, cluster.tails()
    assert checkpoint_step(train_dir) >= 300
    for worker in ("worker:0", "worker:1"):
        # Each worker trained. Under load one may run only a few local steps while the other runs most of the 300,
        # and print no step line (every 50 global steps): its done line counts its local steps.
        steps = cluster.steps(worker)
        assert steps == sorted(steps) and max(steps, default=0) <= 300 + 2, cluster.tail(worker)
        done = list(WorkerDone.finditer(cluster.log(worker)))
        assert done and done[-1].local_steps >= 1 and done[-1].step <= 300 + 2, cluster.tail(worker)
    assert PRECISION.search(cluster.log("worker:0")), cluster.tail("worker:0")
    assert_processes_gone(cluster.pids)


def test_local_launcher_runs_the_default_job(tmp_path):
    """The README's first command: 1 ps + 2 workers on real digits data, evaluated at the end; its train dir as
    TensorBoard reads it."""
    train_dir = tmp_path / "train"
    run = run_launcher([str(REPO / "cluster_specs" / "local.yaml"), "--train_dir", str(train_dir)],
                                 cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.output[-4000:]
    precision = float(PRECISION.search(run.output).group(1))
    assert precision >= 0.95, run.output[-2000:]
    assert checkpoint_step(train_dir) >= 2000
    for prefix in ("[ps:0] ", "[worker:0] ", "[worker:1] "):
        assert prefix in run.output
    assert {p.name for p in (train_dir / "logs").iterdir()} >= {"ps-0.log", "worker-0.log", "worker-1.log"}
    for log in ("ps-0.log", "worker-0.log", "worker-1.log"):   # each task timed its own TensorFlow import
        imported = [e for e in TfImported.finditer((train_dir / "logs" / log).read_text()) if e.seconds > 0.5]
        assert len(imported) == 1, log
    assert (train_dir / "cluster.yaml").exists()
    assert len(run.pids) >= 3
    assert_processes_gone(run.pids)
    assert_tensorboard_runs(train_dir, num_workers=2)


def assert_tensorboard_runs(train_dir, *, num_workers: int) -> None:
    """TensorBoard's own reader on a finished run: one scalar run per worker and `eval`, each tag once, without
    TensorFlow's uniquifying `_N` suffix; the train dir itself (run `.`) holds the chief's graph and no scalars."""
    from tensorboard.backend.event_processing.plugin_event_multiplexer import EventMultiplexer

    from psworker.train import summaries

    multiplexer = EventMultiplexer()
    multiplexer.AddRunsFromDirectory(str(train_dir))
    multiplexer.Reload()
    assert set(multiplexer.Runs()) == {".", summaries.EVAL_DIR, *(f"worker_{i}" for i in range(num_workers))}
    assert multiplexer.Runs()["."]["graph"]
    scalars = {run: set(tags) for run, tags in multiplexer.PluginRunToTagToContent("scalars").items()}
    expected = {f"worker_{i}": set(summaries.worker_tags(i).values()) for i in range(num_workers)}
    assert scalars == {**expected, summaries.EVAL_DIR: {summaries.PRECISION_TAG}}, scalars
    uniquified = [f"{run}: {tag}" for run, tags in scalars.items() for tag in tags if re.search(r"_\d+$", tag)]
    assert not uniquified, uniquified
    for run in scalars:
        for tag in scalars[run]:
            assert multiplexer.Tensors(run, tag), f"{run}: {tag} has no value"


FAILING_WORKER = """
import os, sys, time
if os.environ["PSWORKER_JOB_NAME"] == "worker" and os.environ["PSWORKER_TASK_INDEX"] == "1":
    print("worker 1: cannot read its data", flush=True)
    sys.exit(1)
time.sleep(120)
"""


def test_a_failing_task_tears_the_cluster_down(tmp_path):
    """worker:1 exits 1 at once while ps:0 and worker:0 would run for minutes: the launcher stops them, names
    worker:1 as the first failure and shows the tail of its log."""
    spec = tmp_path / "c.yaml"
    spec.write_text("cluster:\n  ps: ['localhost:auto']\n  worker: ['localhost:auto', 'localhost:auto']\n")
    started = time.monotonic()
    run = run_launcher([str(spec), "--train_dir", str(tmp_path / "t"), "--grace_period_secs", "3", "--console", "plain",
                        "--", sys.executable, "-c", FAILING_WORKER], cwd=tmp_path, timeout=180, command="run")
    assert run.returncode == 1, run.output[-3000:]
    assert re.search(r"psworker: run failed: worker:1 exited with exit code 1 \(first failure", run.output), \
        run.output[-3000:]
    assert "worker 1: cannot read its data" in run.output, run.output[-3000:]   # the tail of worker:1's log
    assert time.monotonic() - started < 100, "the others ran on instead of being stopped"
    assert_processes_gone(run.pids)


def test_a_task_started_by_hand_on_a_taken_port_names_it(tmp_path):
    """On a real host no launcher checks the ports first: `start_worker.sh` on a port something else listens on
    exits 1 with an error naming the task and the address (and starts no training)."""
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    port = blocker.getsockname()[1]
    spec = write_spec(tmp_path / "c.yaml", max_steps=10)
    cluster = yaml.safe_load(spec.read_text())
    cluster["cluster"]["worker"][1] = f"127.0.0.1:{port}"
    spec.write_text(yaml.safe_dump(cluster))
    try:
        run = subprocess.run(["env", f"PSWORKER_SPEC={spec}", str(LAUNCH / "start_worker.sh"), "--task_index", "1"],
                             capture_output=True, text=True, env=task_env(), timeout=120, cwd=tmp_path)
    finally:
        blocker.close()
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    assert f"worker:1 could not start its server at 127.0.0.1:{port}" in run.stderr, run.stderr[-2000:]
