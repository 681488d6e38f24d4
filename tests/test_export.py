"""SavedModel export: a real run exported and served raw inputs in a fresh process without psworker scores what
`psworker eval` scores; raw CIFAR-10 images get eval's classes; moving averages are what gets exported; exports are
never overwritten."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Optional

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
TF_PROCESS_TIMEOUT = 300   # a hang guard for one TF process; under heavy load its start-up alone took over 120 s
PRECISION_LINE = re.compile(r"precision @ 1 = ([0-9.]+) \((\d+) examples, global step (\d+)\)")

# Runs in a fresh interpreter, in an empty directory, where psworker cannot be imported: TensorFlow, numpy and
# scikit-learn only, as a client has them. Per export: an .npz of inputs keyed by signature name (`digits_rows`:
# those rows of `load_digits().data`, as scikit-learn gives them, for serving_default) -> an .npz of what came out.
SERVE_SCRIPT = textwrap.dedent("""
    import sys
    sys.modules["psworker"] = None   # any import of psworker fails
    import numpy as np
    import tensorflow as tf
    for export_dir, inputs, out in zip(*[iter(sys.argv[1:])] * 3):
        loaded, data, results = tf.saved_model.load(export_dir), dict(np.load(inputs)), {}
        if "digits_rows" in data:
            from sklearn.datasets import load_digits
            data["serving_default"] = load_digits().data[data.pop("digits_rows")].astype(np.float32)
        for signature, images in data.items():
            served = loaded.signatures[signature](images=tf.constant(images))
            spec = loaded.signatures[signature].structured_input_signature[1]["images"]
            results[signature + "/logits"] = served["logits"].numpy()
            results[signature + "/classes"] = served["classes"].numpy()
            results[signature + "/input"] = np.array(f"{spec.dtype.name} {spec.shape.as_list()}")
        np.savez(out, **results)
""")


def psworker(args, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "psworker", *args], cwd=cwd, env=task_env(), capture_output=True,
                          text=True, timeout=timeout)


def eval_arrays(model, data_dir) -> tuple[np.ndarray, np.ndarray]:
    """The model's held-out split exactly as `eval_dataset` yields it: `(images, labels)`."""
    images, labels = [], []
    for x, y in model.eval_dataset(data_dir, 128).as_numpy_iterator():
        images.append(x)
        labels.append(y)
    return np.concatenate(images), np.concatenate(labels)


def serve(requests: dict[str, dict[str, np.ndarray]], cwd: Path) -> dict[str, dict[str, np.ndarray]]:
    """Feeds each export (key) its inputs (signature name -> array) in one fresh process; returns what came out."""
    script = cwd / "serve.py"
    script.write_text(SERVE_SCRIPT)
    argv = []
    for i, (export_dir, inputs) in enumerate(requests.items()):
        np.savez(cwd / f"in{i}.npz", **inputs)
        argv += [export_dir, str(cwd / f"in{i}.npz"), str(cwd / f"out{i}.npz")]
    env = {k: v for k, v in task_env().items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, str(script), *argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=TF_PROCESS_TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    return {d: dict(np.load(cwd / f"out{i}.npz")) for i, d in enumerate(requests)}


def digits_held_out():
    """The rows of `load_digits().data` that eval scores, and their labels."""
    from sklearn.datasets import load_digits

    from psworker.data.digits import held_out_mask

    rows = np.flatnonzero(held_out_mask())
    return rows, load_digits().target[rows]


@pytest.mark.slow
@pytest.mark.timeout(600)   # a cluster, then four TF processes one after another: minutes on a loaded 2-core machine
def test_exported_run_scores_like_eval_in_a_fresh_process(tmp_path):
    train_dir = tmp_path / "run"
    trained = run_launcher([str(REPO / "cluster_specs/local.yaml"), "--max_steps", "200", "--train_dir",
                            str(train_dir)], tmp_path, 240)
    assert trained.returncode == 0, trained.output[-3000:]
    assert_no_processes(trained.pids)
    evaluated = psworker(["eval", "--once", "--train_dir", str(train_dir)], tmp_path, TF_PROCESS_TIMEOUT)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    precision, examples, step = PRECISION_LINE.search(evaluated.stdout).groups()

    # The chief exported at the end of training; `psworker export` writes the same model anywhere else.
    chief_export = train_dir / "export" / step
    assert sorted(os.listdir(train_dir / "export")) == [step]   # no temporary directory left behind
    exported = psworker(["export", "--train_dir", str(train_dir), "--export_dir", str(tmp_path / "exports")],
                        tmp_path, TF_PROCESS_TIMEOUT)
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert exported.stdout.strip().splitlines()[-1] == str(tmp_path / "exports" / step)

    from psworker.models import get
    preprocessed, labels = eval_arrays(get("mlp"), None)
    rows, raw_labels = digits_held_out()
    np.testing.assert_array_equal(raw_labels, labels)
    request = {"digits_rows": rows, "preprocessed": preprocessed}
    exports = (str(chief_export), str(tmp_path / "exports" / step))
    for export_dir, out in serve({d: request for d in exports}, tmp_path).items():
        raw = np.mean(out["serving_default/classes"] == labels)
        print(f"eval precision {precision} ({examples} examples, step {step}); {export_dir} served {raw:.6f} "
              f"on raw load_digits().data")
        assert f"{raw:.3f}" == precision
        np.testing.assert_array_equal(out["serving_default/classes"], out["preprocessed/classes"])
        np.testing.assert_allclose(out["serving_default/logits"], out["preprocessed/logits"], rtol=1e-5, atol=1e-5)
        assert str(out["serving_default/input"]) == "float32 [None, 64]"

    again = psworker(["export", "--train_dir", str(train_dir)], tmp_path, TF_PROCESS_TIMEOUT)
    assert again.returncode != 0 and "exist" in again.stderr


def write_checkpoint(train_dir: Path, step: int, *, model=None, favoured_class: Optional[int] = 3) -> str:
    """A checkpoint of `model` (default cifar10) with random weights, or weights that predict `favoured_class` always.

    Where the model keeps moving averages, the raw variables are NaN and the averages hold the weights. Random
    weights are He-scaled (biases near 0), so that the logits, and the classes, depend on the input."""
    model = model or Cifar10Model()
    with tf.Graph().as_default():
        global_step = v1.train.get_or_create_global_step()
        model.inference(tf.zeros([1, *model.image_shape]), training=False)
        ema = None
        if model.moving_average_decay:
            ema = v1.train.ExponentialMovingAverage(model.moving_average_decay, global_step)
            ema.apply(v1.trainable_variables())
        rng = np.random.default_rng(0)
        assigns = [global_step.assign(step)]
        for var in v1.trainable_variables():
            shape = var.shape.as_list()
            he = len(shape) > 1 and favoured_class is None
            scale = (2.0 / np.prod(shape[:-1])) ** 0.5 if he else 0.01
            value = rng.normal(0, scale, shape).astype(np.float32)
            if var.op.name == "softmax_linear/biases" and favoured_class is not None:
                value[favoured_class] = 100.0
            if ema is None:
                assigns.append(var.assign(value))
            else:
                assigns += [var.assign(np.full(shape, np.nan, np.float32)), ema.average(var).assign(value)]
        saver = v1.train.Saver(sharded=True)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            sess.run(assigns)
            return saver.save(sess, str(train_dir / "model.ckpt"), global_step=step)


def eval_path_logits(model, checkpoint: str, data_dir) -> np.ndarray:
    """The logits of the held-out split as eval computes them: `eval_dataset` into `inference`, averages restored."""
    images, _ = eval_arrays(model, data_dir)
    with tf.Graph().as_default() as graph:
        logits = model.inference(tf.constant(images), training=False)
        variables = (v1.train.ExponentialMovingAverage(model.moving_average_decay).variables_to_restore()
                     if model.moving_average_decay else v1.global_variables())
        with v1.Session(graph=graph) as sess:
            v1.train.Saver(variables).restore(sess, checkpoint)
            return sess.run(logits)


def test_export_restores_the_moving_averages(tmp_path):
    checkpoint = write_checkpoint(tmp_path, 42)
    path = export_saved_model(Cifar10Model(), checkpoint, str(tmp_path / "export"))
    assert path == str(tmp_path / "export" / "42")

    stored = tf.train.load_checkpoint(checkpoint)
    exported = tf.train.load_checkpoint(os.path.join(path, "variables", "variables"))
    for name in ("conv1/weights", "local3/biases", "softmax_linear/biases"):
        np.testing.assert_array_equal(exported.get_tensor(name),
                                      stored.get_tensor(f"{name}/ExponentialMovingAverage"))
    assert not any("ExponentialMovingAverage" in n for n in exported.get_variable_to_shape_map())

    serve = tf.saved_model.load(path).signatures["serving_default"]
    out = serve(images=tf.constant(np.random.default_rng(0).integers(0, 256, [5, 32, 32, 3], np.uint8)))
    assert out["classes"].numpy().tolist() == [3] * 5   # the raw (NaN) variables would give anything else

    with pytest.raises(ExportExistsError, match="never overwritten"):
        export_saved_model(Cifar10Model(), checkpoint, str(tmp_path / "export"))
    assert os.listdir(tmp_path / "export") == ["42"]


@pytest.mark.slow
def test_raw_inputs_served_give_the_classes_of_eval(tmp_path):
    """Random-weight cifar10 and mlp checkpoints, exported: raw uint8 CIFAR-10 images and raw digits, fed to
    `serving_default` in a fresh process without psworker, give eval's logits, classes and precision."""
    from psworker.data import cifar10 as cifar_data
    from psworker.models import get
    from psworker.train.evaluate import evaluate_checkpoint

    data_dir = tmp_path / "data"
    write_synthetic(str(data_dir), train_per_class=2, test_per_class=10)
    _, raw_images = cifar_data.read_records(cifar_data.test_files(str(data_dir))[0])
    rows, _ = digits_held_out()
    cases = {"cifar10": (str(data_dir), {"serving_default": raw_images}, "uint8 [None, 32, 32, 3]"),
             "mlp": (None, {"digits_rows": rows}, "float32 [None, 64]")}
    expected, requests = {}, {}
    for name, (data, inputs, signature) in cases.items():
        (tmp_path / name).mkdir()
        checkpoint = write_checkpoint(tmp_path / name, 7, model=get(name), favoured_class=None)
        export_dir = export_saved_model(get(name), checkpoint, str(tmp_path / name / "export"))
        expected[export_dir] = (get(name), checkpoint, data, signature)
        requests[export_dir] = {**inputs, "preprocessed": eval_arrays(get(name), data)[0]}
    for export_dir, out in serve(requests, tmp_path).items():
        model, checkpoint, data, signature = expected[export_dir]
        logits, labels = eval_path_logits(model, checkpoint, data), eval_arrays(model, data)[1]
        classes = out["serving_default/classes"]
        assert len(set(classes.tolist())) >= 4, classes   # the classes depend on the image
        np.testing.assert_array_equal(classes, logits.argmax(axis=1))
        np.testing.assert_allclose(out["serving_default/logits"], logits, rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(out["preprocessed/classes"], classes)
        assert str(out["serving_default/input"]) == signature
        precision = evaluate_checkpoint(model, checkpoint, data_dir=data).precision
        assert np.mean(classes == labels) == pytest.approx(precision)


def test_export_of_a_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(PsworkerError, match="cannot read checkpoint"):
        export_saved_model(Cifar10Model(), str(tmp_path / "model.ckpt-9"), str(tmp_path / "export"))
    assert not (tmp_path / "export").exists()


def test_export_command(tmp_path, capsys):
    from psworker.cli import main

    assert main(["export", "--train_dir", str(tmp_path)]) != 0
    assert f"no checkpoint in {tmp_path}" in capsys.readouterr().err
    checkpoint = write_checkpoint(tmp_path, 5)
    assert main(["export", "--train_dir", str(tmp_path), "--checkpoint", checkpoint, "--model", "cifar10"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "export" / "5")
    assert main(["export", "--train_dir", str(tmp_path), "--model", "cifar10"]) == 2   # a refusal: usage (exit 2)
    assert "exists already" in capsys.readouterr().err


NO_TENSORFLOW = ("import sys; sys.modules['tensorflow'] = None\n"   # any import of TensorFlow fails
                 "from psworker.cli import main\nsys.exit(main(sys.argv[1:]))\n")


def test_an_existing_export_is_refused_before_tensorflow_is_imported(tmp_path):
    """Each export records its checkpoint; `psworker export` of the same checkpoint (the latest, or named) is refused
    from that record, in a process where TensorFlow cannot even be imported: one line saying what to do, exit 2 (a
    refusal is a usage error; 1 is a bug)."""
    from psworker.models.linear import LinearModel

    checkpoint = write_checkpoint(tmp_path, 7, model=LinearModel(), favoured_class=None)
    path = export_saved_model(LinearModel(), checkpoint, str(tmp_path / "export"))
    for extra in ([], ["--checkpoint", checkpoint]):
        r = subprocess.run([sys.executable, "-c", NO_TENSORFLOW, "export", "--train_dir", str(tmp_path), *extra],
                           cwd=tmp_path, env=task_env(), capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and r.stderr == f"psworker: error: {path} exists already: exports are never " \
            "overwritten; load that one, or move it away (or pass --export_dir DIR) to export again\n", r.stderr
    write_checkpoint(tmp_path, 8, model=LinearModel(), favoured_class=None)   # the latest now: not exported yet
    r = subprocess.run([sys.executable, "-c", NO_TENSORFLOW, "export", "--train_dir", str(tmp_path)], cwd=tmp_path,
                       env=task_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "ModuleNotFoundError: import of tensorflow halted" in r.stderr, r.stderr
