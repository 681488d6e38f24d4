"""The CIFAR-10 workload on real local clusters (synthetic data): training + evaluation, towers, and the plan report."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from psworker import events
from psworker.launcher.console.lines import by_task
from psworker.testing import assert_processes_gone, checkpoint_step
from tests.cluster_utils import REPO, run_launcher, task_env

SPEC = REPO / "cluster_specs" / "cifar10.yaml"
PRECISION = re.compile(r"precision @ 1 = ([0-9.]+)")
NUM_PARAMS = 1_068_298
# Short runs: 3 TF processes share 2 cores. The learning rate is the tutorial's 0.1 scaled to the global batch.
SHORT = ["--batch_size", "32", "--log_every_steps", "50"]
# Batch 32 with two async workers, 400 steps, on learnable synthetic data: the scaled rate (0.025) reaches ~1.0;
# unscaled (0.1) it scored 0.40 at step 400 (another run diverged near step 240; docs/models.md). Batch 128
# at 0.1 scores 1.0 as well (measured by hand: 4x the compute), so 0.9 is "as well as batch 128" with a margin.
LEARNED = 0.9


CIFAR_PER_CLASS = (300, 50)   # synthetic examples per class (train, test) for the cifar_dir fixture


def _psworker(*args: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "psworker", *args], cwd=cwd, env=task_env(), capture_output=True,
                          text=True, timeout=timeout)


def _checkpoint_variables(train_dir: Path) -> set[str]:
    import tensorflow as tf

    return set(tf.train.load_checkpoint(tf.train.latest_checkpoint(str(train_dir))).get_variable_to_shape_map())


@pytest.mark.slow
def test_batch_32_learns_with_the_scaled_learning_rate(tmp_path, cifar_dir):
    """The shipped spec (1 ps + 2 async workers) at --batch_size 32 for 400 steps: the rate is scaled to 0.025 and
    `psworker eval --once` scores the result as well as batch 128 does; `--num_devices auto` is one CPU tower here."""
    train_dir = tmp_path / "train"
    run = run_launcher([str(SPEC), "--train_dir", str(train_dir), "--data_dir", str(cifar_dir), "--max_steps", "400",
                        "--save_checkpoint_steps", "200", "--num_devices", "auto", *SHORT],
                       cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.output[-4000:]
    assert "[worker:0] step " in run.output and "[worker:1] step " in run.output
    shown = by_task(run.output)     # a line both workers print at once is shown once: `[worker:0-1] ...`
    for worker in ("worker:0", "worker:1"):
        assert any(re.search(r"learning rate 0.025 \(0.1 x 32/128, linear scaling; --set scale_learning_rate=false to "
                             r"turn off\)", line) for line in shown[worker]), run.output[-4000:]
    if not _gpus():
        assert "[worker:1] " in run.output and "towers: 1 on /cpu:0 (no GPU visible)" in run.output
    assert 400 <= checkpoint_step(train_dir) <= 402   # async: each worker may finish the step it was running
    assert len(run.pids) >= 3
    assert_processes_gone(run.pids)

    evaluated = _psworker("eval", "--train_dir", str(train_dir), "--data_dir", str(cifar_dir), "--model", "cifar10",
                          "--once", cwd=tmp_path, timeout=120)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    match = PRECISION.search(evaluated.stdout)
    assert match, evaluated.stdout
    assert float(match.group(1)) >= LEARNED, evaluated.stdout   # chance is 0.1
    assert "(500 examples" in evaluated.stdout


def _gpus() -> int:
    import tensorflow as tf

    return len(tf.config.list_physical_devices("GPU"))


@pytest.mark.slow
def test_gpu_towers_train_and_report_their_throughput(tmp_path, cifar_dir):
    """On a GPU host: 2 workers with `--num_devices 1`, then `auto` (a tower on every GPU), both train; prints the
    cluster's examples/s (the sum of each worker's last progress line) for each."""
    gpus = _gpus()
    if not gpus:
        pytest.skip("no GPU visible")
    rates = {}
    for towers, devices in (("1", "/gpu:0"), ("auto", ", ".join(f"/gpu:{i}" for i in range(gpus)))):
        train_dir = tmp_path / f"train-{towers}"
        run = run_launcher([str(SPEC), "--train_dir", str(train_dir), "--data_dir", str(cifar_dir), "--max_steps",
                            "600", "--batch_size", "128", "--num_devices", towers, "--log_every_steps", "100"],
                           cwd=tmp_path, timeout=300)
        assert run.returncode == 0, run.output[-4000:]
        assert f"towers: {devices.count('/gpu:')} on {devices}" in by_task(run.output)["worker:0"], run.output[-4000:]
        last = {who: r[-1] for who, r in events.rates_by_task(events.step_records(run.output)).items() if who}
        assert last, run.output[-4000:]
        rates[towers] = sum(last.values())
    print(f"\ncifar10, 2 async workers, batch 128 per tower, {gpus} GPUs: examples/s with 1 tower per worker "
          f"{rates['1']:.0f}, with {gpus} towers per worker {rates['auto']:.0f}")


@pytest.mark.slow
def test_towers_cluster_run(tmp_path, cifar_dir):
    """--num_devices 2: each worker splits its batch over 2 CPU towers that share the variables on the ps."""
    train_dir = tmp_path / "train"
    run = run_launcher([str(SPEC), "--train_dir", str(train_dir), "--data_dir", str(cifar_dir), "--max_steps", "30",
                        "--num_devices", "2", *SHORT], cwd=tmp_path, timeout=240)
    assert run.returncode == 0, run.output[-4000:]
    assert 30 <= checkpoint_step(train_dir) <= 32
    names = _checkpoint_variables(train_dir)
    assert {"conv1/weights", "local3/weights", "local3/weights/ExponentialMovingAverage"} <= names
    assert not [n for n in names if "tower" in n], names   # one shared set of variables, not one per tower
    assert PRECISION.search(run.output), run.output[-3000:]
    assert_processes_gone(run.pids)


def test_plan_reports_the_cifar10_placement():
    """`psworker plan SPEC --model cifar10`: every variable with its bytes and ps, bytes per ps, the total."""
    done = _psworker("plan", str(SPEC), "--model", "cifar10", cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert f"{NUM_PARAMS:,} trainable parameters" in out
    rows = {m.group(1): (int(m.group(2).replace(",", "")), int(m.group(3)))
            for m in re.finditer(r"^\s+(\S+)\s+\[[0-9, ]*\]\s+([0-9,]+)\s+ps:(\d+)", out, re.MULTILINE)}
    for layer in ("conv1", "conv2", "local3", "local4", "softmax_linear"):
        assert f"{layer}/weights" in rows and f"{layer}/biases" in rows, out
    assert rows["local3/weights"] == (2304 * 384 * 4, 0)
    assert rows["local3/weights/ExponentialMovingAverage"] == (2304 * 384 * 4, 0)
    trainable_bytes = sum(b for name, (b, _) in rows.items() if "/" in name and "Moving" not in name)
    assert trainable_bytes == NUM_PARAMS * 4
    held = re.search(r"ps:0 holds ([0-9,]+) bytes \(100\.0%\)", out)
    assert held and int(held.group(1).replace(",", "")) == sum(b for b, _ in rows.values())


def test_placement_report_on_two_ps_matches_the_trainer():
    """The report reads the trainer's own graph: bytes per ps add up, moving averages sit with their variables."""
    from psworker.train.plan_report import placement_report

    report = placement_report("cifar10", 2)
    assert report.trainable_parameters == NUM_PARAMS
    by_name = {v.name: v for v in report.variables}
    assert by_name["global_step"].ps == 0
    for v in report.variables:
        if v.name.endswith("/ExponentialMovingAverage"):
            assert v.ps == by_name[v.name.rsplit("/", 1)[0]].ps
    assert sum(report.bytes_per_ps) == sum(v.nbytes for v in report.variables)
    assert all(load > 0 for load in report.bytes_per_ps)


def _spec(path: Path, num_ps: int) -> Path:
    import yaml

    path.write_text(yaml.safe_dump({"cluster": {"ps": ["localhost:auto"] * num_ps, "worker": ["localhost:auto"]},
                                    "train": {"model": "cifar10", "mode": "async", "batch_size": 16}}))
    return path


@pytest.mark.slow
def test_checkpoint_of_two_ps_restores_into_three_ps(tmp_path, cifar_dir):
    """Split variables are saved whole (full names and shapes), and a 3-ps run continues a 2-ps run's checkpoint."""
    import tensorflow as tf

    train_dir = tmp_path / "train"
    common = ["--train_dir", str(train_dir), "--data_dir", str(cifar_dir), "--save_checkpoint_steps", "10",
              "--log_every_steps", "10"]
    run = run_launcher([str(_spec(tmp_path / "two.yaml", 2)), "--max_steps", "20", *common], cwd=tmp_path,
                       timeout=240)
    assert run.returncode == 0, run.output[-4000:]
    assert_processes_gone(run.pids)
    shapes = tf.train.load_checkpoint(tf.train.latest_checkpoint(str(train_dir))).get_variable_to_shape_map()
    assert shapes["local3/weights"] == [2304, 384]
    assert shapes["local3/weights/ExponentialMovingAverage"] == [2304, 384]
    assert shapes["conv2/weights"] == [5, 5, 64, 64]
    assert not [name for name in shapes if "part_" in name], sorted(shapes)
    before = tf.train.load_checkpoint(tf.train.latest_checkpoint(str(train_dir))).get_tensor("local3/weights")

    run = run_launcher([str(_spec(tmp_path / "three.yaml", 3)), "--max_steps", "30", *common], cwd=tmp_path,
                       timeout=240)
    assert run.returncode == 0, run.output[-4000:]
    assert_processes_gone(run.pids)
    assert re.search(r"\[worker:0\] .*restoring the checkpoint model\.ckpt-2\d", run.output), run.output[-4000:]
    log = (train_dir / "logs" / "worker-0.log").read_text()
    assert re.search(r"first step done at global step 2\d", log), log[-4000:]
    assert 30 <= checkpoint_step(train_dir) <= 31
    after = tf.train.load_checkpoint(tf.train.latest_checkpoint(str(train_dir))).get_tensor("local3/weights")
    assert after.shape == before.shape and 0 < abs(after - before).max() < 1.0   # trained on from, not re-initialised
