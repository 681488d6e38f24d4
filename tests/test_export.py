"""SavedModel export: a real run exported and served in a fresh process scores what `psworker eval` scores;
moving averages are what gets exported; exports are never overwritten."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from psworker.data.cifar10_files import write_synthetic  # noqa: E402
from psworker.errors import PsworkerError  # noqa: E402
from psworker.train.export import ExportExistsError, export_saved_model  # noqa: E402
from psworker.models.cifar10 import Cifar10Model  # noqa: E402
from psworker.testing import assert_processes_gone as assert_no_processes  # noqa: E402
from tests.cluster_utils import run_launcher, task_env  # noqa: E402

v1 = tf.compat.v1
REPO = Path(__file__).resolve().parents[1]
PRECISION_LINE = re.compile(r"precision @ 1 = ([0-9.]+) \((\d+) examples, global step (\d+)\)")

# Runs in a fresh interpreter, in an empty directory, with no psworker import: only TensorFlow and numpy.
SERVE_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    import tensorflow as tf
    export_dir, data = sys.argv[1], np.load(sys.argv[2])
    serve = tf.saved_model.load(export_dir).signatures["serving_default"]
    out = serve(images=tf.constant(data["images"]))
    assert out["logits"].shape == (len(data["labels"]), 10), out["logits"].shape
    hits = int((out["classes"].numpy() == data["labels"]).sum())
    assert not [m for m in sys.modules if m.split(".")[0] == "psworker"]
    print(f"served precision = {hits / len(data['labels']):.6f} ({len(data['labels'])} examples)")
""")


def psworker(args, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "psworker", *args], cwd=cwd, env=task_env(), capture_output=True,
                          text=True, timeout=timeout)


def eval_arrays(model, data_dir, path: Path) -> Path:
    """Saves the model's held-out split, exactly as `eval_dataset` yields it, to an .npz for the fresh process."""
    images, labels = [], []
    for x, y in model.eval_dataset(data_dir, 128).as_numpy_iterator():
        images.append(x)
        labels.append(y)
    np.savez(path, images=np.concatenate(images), labels=np.concatenate(labels))
    return path


def serve_precision(export_dir: str, npz: Path, cwd: Path) -> float:
    script = cwd / "serve.py"
    script.write_text(SERVE_SCRIPT)
    env = {k: v for k, v in task_env().items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, str(script), export_dir, str(npz)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return float(re.search(r"served precision = ([0-9.]+)", done.stdout).group(1))


@pytest.mark.slow
def test_exported_run_scores_like_eval_in_a_fresh_process(tmp_path):
    train_dir = tmp_path / "run"
    trained = run_launcher([str(REPO / "cluster_specs/local.yaml"), "--max_steps", "200", "--train_dir",
                            str(train_dir)], tmp_path, 240)
    assert trained.returncode == 0, trained.output[-3000:]
    assert_no_processes(trained.pids)
    evaluated = psworker(["eval", "--once", "--train_dir", str(train_dir)], tmp_path, 120)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    precision, examples, step = PRECISION_LINE.search(evaluated.stdout).groups()

    # The chief exported at the end of training; `psworker export` writes the same model anywhere else.
    chief_export = train_dir / "export" / step
    assert sorted(os.listdir(train_dir / "export")) == [step]   # no temporary directory left behind
    exported = psworker(["export", "--train_dir", str(train_dir), "--export_dir", str(tmp_path / "exports")],
                        tmp_path, 120)
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert exported.stdout.strip().splitlines()[-1] == str(tmp_path / "exports" / step)

    from psworker.models import get
    npz = eval_arrays(get("mlp"), None, tmp_path / "eval.npz")
    for export_dir in (str(chief_export), str(tmp_path / "exports" / step)):
        served = serve_precision(export_dir, npz, tmp_path)
        print(f"eval precision {precision} ({examples} examples, step {step}); {export_dir} served {served:.6f}")
        assert f"{served:.3f}" == precision

    again = psworker(["export", "--train_dir", str(train_dir)], tmp_path, 120)
    assert again.returncode != 0 and "exist" in again.stderr


def write_ema_checkpoint(train_dir: Path, step: int, *, favoured_class: int = 3) -> str:
    """A cifar10 checkpoint whose raw variables are NaN and whose moving averages predict `favoured_class` always."""
    model = Cifar10Model()
    with tf.Graph().as_default():
        global_step = v1.train.get_or_create_global_step()
        model.inference(tf.zeros([1, 24, 24, 3]), training=False)
        ema = v1.train.ExponentialMovingAverage(model.moving_average_decay, global_step)
        ema.apply(v1.trainable_variables())
        rng = np.random.default_rng(0)
        assigns = [global_step.assign(step)]
        for var in v1.trainable_variables():
            shape = var.shape.as_list()
            value = rng.normal(0, 0.01, shape).astype(np.float32)
            if var.op.name == "softmax_linear/biases":
                value[favoured_class] = 100.0
            assigns += [var.assign(np.full(shape, np.nan, np.float32)), ema.average(var).assign(value)]
        saver = v1.train.Saver(sharded=True)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            sess.run(assigns)
            return saver.save(sess, str(train_dir / "model.ckpt"), global_step=step)


def test_export_restores_the_moving_averages(tmp_path):
    checkpoint = write_ema_checkpoint(tmp_path, 42)
    path = export_saved_model(Cifar10Model(), checkpoint, str(tmp_path / "export"))
    assert path == str(tmp_path / "export" / "42")

    stored = tf.train.load_checkpoint(checkpoint)
    exported = tf.train.load_checkpoint(os.path.join(path, "variables", "variables"))
    for name in ("conv1/weights", "local3/biases", "softmax_linear/biases"):
        np.testing.assert_array_equal(exported.get_tensor(name),
                                      stored.get_tensor(f"{name}/ExponentialMovingAverage"))
    assert not any("ExponentialMovingAverage" in n for n in exported.get_variable_to_shape_map())

    serve = tf.saved_model.load(path).signatures["serving_default"]
    out = serve(images=tf.random.normal([5, 24, 24, 3]))
    assert out["classes"].numpy().tolist() == [3] * 5   # the raw (NaN) variables would give anything else

    with pytest.raises(ExportExistsError, match="never overwritten"):
        export_saved_model(Cifar10Model(), checkpoint, str(tmp_path / "export"))
    assert os.listdir(tmp_path / "export") == ["42"]


@pytest.mark.slow
def test_cifar10_export_scores_like_eval(tmp_path):
    from psworker.train.evaluate import evaluate_checkpoint

    data_dir = tmp_path / "data"
    write_synthetic(str(data_dir), train_per_class=2, test_per_class=10)
    checkpoint = write_ema_checkpoint(tmp_path, 7, favoured_class=5)
    expected = evaluate_checkpoint(Cifar10Model(), checkpoint, data_dir=str(data_dir), batch_size=32)
    path = export_saved_model(Cifar10Model(), checkpoint, str(tmp_path / "export"))
    served = serve_precision(path, eval_arrays(Cifar10Model(), str(data_dir), tmp_path / "eval.npz"), tmp_path)
    assert served == pytest.approx(expected.precision) == pytest.approx(0.1)


def test_export_of_a_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(PsworkerError, match="cannot read checkpoint"):
        export_saved_model(Cifar10Model(), str(tmp_path / "model.ckpt-9"), str(tmp_path / "export"))
    assert not (tmp_path / "export").exists()


def test_export_command(tmp_path, capsys):
    from psworker.cli import main

    assert main(["export", "--train_dir", str(tmp_path)]) != 0
    assert f"no checkpoint in {tmp_path}" in capsys.readouterr().err
    checkpoint = write_ema_checkpoint(tmp_path, 5)
    assert main(["export", "--train_dir", str(tmp_path), "--checkpoint", checkpoint, "--model", "cifar10"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "export" / "5")
    assert main(["export", "--train_dir", str(tmp_path), "--model", "cifar10"]) != 0
    assert "exists already" in capsys.readouterr().err
