"""Evaluation: moving averages restored, continuous mode and its summaries, defaults from a local run's spec."""

from __future__ import annotations

import glob
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from psworker.errors import PsworkerError  # noqa: E402
from psworker.train.evaluate import evaluate_checkpoint, run_eval  # noqa: E402
from psworker.models.cifar10 import Cifar10Model  # noqa: E402
from psworker.testing import assert_processes_gone  # noqa: E402
from tests.cluster_utils import task_env  # noqa: E402

v1 = tf.compat.v1
PRECISION_LINE = re.compile(r"precision @ 1 = ([0-9.]+) \((\d+) examples, global step (\d+)\)")


CIFAR_PER_CLASS = (10, 20)   # synthetic examples per class (train, test): 200 test images


def write_checkpoint(train_dir: Path, step: int, *, favoured_class: int = 3, raw_value: float = 0.0) -> str:
    """A cifar10 checkpoint, as the trainer writes one (sharded, with moving averages), whose averages make every
    prediction `favoured_class`; the raw variables are all `raw_value` (NaN: any evaluation of them scores 0)."""
    model = Cifar10Model()
    with tf.Graph().as_default():
        global_step = v1.train.get_or_create_global_step()
        model.inference(tf.zeros([1, 24, 24, 3]), training=False)
        ema = v1.train.ExponentialMovingAverage(model.moving_average_decay, global_step)
        ema.apply(v1.trainable_variables())
        assigns = [global_step.assign(step)]
        for var in v1.trainable_variables():
            average = ema.average(var)
            value = np.zeros(var.shape.as_list(), np.float32)
            if var.op.name == "softmax_linear/biases":
                value[favoured_class] = 1.0
            assigns += [var.assign(np.full(var.shape.as_list(), raw_value, np.float32)), average.assign(value)]
        saver = v1.train.Saver(sharded=True, max_to_keep=5)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            sess.run(assigns)
            return saver.save(sess, str(train_dir / "model.ckpt"), global_step=step)


def test_evaluation_restores_the_moving_averages(tmp_path, cifar_dir):
    checkpoint = write_checkpoint(tmp_path, 7, raw_value=float("nan"))
    result = evaluate_checkpoint(Cifar10Model(), checkpoint, data_dir=str(cifar_dir), batch_size=64)
    # 200 test images in batches of 64 (last one partial); the averages predict class 3, right for 1 in 10
    assert (result.examples, result.global_step) == (200, 7)
    assert result.precision == pytest.approx(0.1)


def test_continuous_eval_evaluates_each_new_checkpoint_and_writes_summaries(tmp_path, cifar_dir):
    write_checkpoint(tmp_path, 5)
    lines: list[str] = []
    waits: list[float] = []

    def emit(line: str, flush: bool = False) -> None:
        lines.append(line)
        if len(lines) == 1:   # a new checkpoint appears while the evaluator waits
            write_checkpoint(tmp_path, 9)

    assert run_eval(train_dir=str(tmp_path), data_dir=str(cifar_dir), model_name="cifar10", once=False,
                    eval_interval_secs=30.0, max_evals=2, emit=emit, sleep=waits.append) == 0
    assert [int(PRECISION_LINE.search(line).group(3)) for line in lines] == [5, 9]
    assert waits == [30.0]   # looked once, found the new checkpoint after one interval
    events = glob.glob(str(tmp_path / "eval" / "events.out.tfevents.*"))
    assert len(events) == 1
    values = [(e.step, v.tag, v.simple_value) for e in v1.train.summary_iterator(events[0]) for v in e.summary.value]
    assert [(step, tag) for step, tag, _ in values] == [(5, "precision@1"), (9, "precision@1")]
    assert all(value == pytest.approx(0.1) for _, _, value in values)


def test_eval_once_without_a_checkpoint_says_to_train_first(tmp_path, cifar_dir):
    with pytest.raises(PsworkerError, match="no checkpoint"):
        run_eval(train_dir=str(tmp_path), data_dir=str(cifar_dir), model_name="cifar10", once=True)
    with pytest.raises(PsworkerError, match="does not exist"):
        run_eval(train_dir=str(tmp_path / "missing"), data_dir=None, model_name="cifar10", once=True)


def test_model_and_data_dir_come_from_the_spec_a_local_run_leaves(tmp_path, cifar_dir):
    (tmp_path / "cluster.yaml").write_text(
        "cluster:\n  ps: ['127.0.0.1:2222']\n  worker: ['127.0.0.1:2223']\n"
        f"train:\n  model: cifar10\n  data_dir: {cifar_dir}\n")
    write_checkpoint(tmp_path, 4)
    lines: list[str] = []
    assert run_eval(train_dir=str(tmp_path), data_dir=None, model_name=None, once=True,
                    emit=lambda line, flush=False: lines.append(line)) == 0
    assert PRECISION_LINE.search(lines[0]).group(2, 3) == ("200", "4")


@pytest.mark.slow
def test_eval_command_in_continuous_mode_writes_a_summary(tmp_path, cifar_dir):
    """`psworker eval` without --once keeps running and writes an eval summary; stopped by the test."""
    write_checkpoint(tmp_path, 12)
    proc = subprocess.Popen([sys.executable, "-m", "psworker", "eval", "--train_dir", str(tmp_path), "--data_dir",
                             str(cifar_dir), "--model", "cifar10", "--eval_interval_secs", "0.5"],
                            env=task_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not glob.glob(str(tmp_path / "eval" / "events.out.tfevents.*")):
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "no eval summary after 90 s"
            time.sleep(0.2)
        time.sleep(1.0)
        assert proc.poll() is None   # still waiting for the next checkpoint
    finally:
        proc.kill()
        output = proc.communicate(timeout=30)[0]
    assert PRECISION_LINE.search(output).group(3) == "12", output[-3000:]
    events = glob.glob(str(tmp_path / "eval" / "events.out.tfevents.*"))
    assert [(e.step, v.tag) for e in v1.train.summary_iterator(events[0]) for v in e.summary.value] == [
        (12, "precision@1")]
    assert_processes_gone([proc.pid])
