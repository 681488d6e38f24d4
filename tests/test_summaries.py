"""Training and eval summaries, read back with TensorBoard's own event reader."""

from __future__ import annotations

from pathlib import Path

import pytest

tf = pytest.importorskip("tensorflow")
event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
plugin_event_multiplexer = pytest.importorskip("tensorboard.backend.event_processing.plugin_event_multiplexer")

from psworker.train import summaries  # noqa: E402
from psworker.train.evaluate import run_eval  # noqa: E402
from psworker.models import get  # noqa: E402

v1 = tf.compat.v1


def train_tiny(train_dir: Path, task_index: int, *, steps: int, every: int) -> summaries.WorkerSummaryHook:
    """A graph-mode loop (one variable, plain SGD) run under MonitoredSession with the worker summary hook."""
    with tf.Graph().as_default():
        global_step = v1.train.get_or_create_global_step()
        w = v1.get_variable("w", [], initializer=v1.constant_initializer(3.0))
        loss = tf.square(w)
        lr = tf.constant(0.1)
        train_op = v1.train.GradientDescentOptimizer(lr).minimize(loss, global_step=global_step)
        hook = summaries.WorkerSummaryHook(task_index, loss=loss, learning_rate=lr, global_step=global_step,
                                           logdir=summaries.worker_dir(str(train_dir), task_index),
                                           every_steps=every, examples_per_step=32)
        with v1.train.MonitoredSession(hooks=[hook, v1.train.StopAtStepHook(last_step=steps)]) as sess:
            while not sess.should_stop():
                sess.run(train_op)
    return hook


def scalars(logdir: str) -> dict[str, list]:
    acc = event_accumulator.EventAccumulator(logdir, size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return {tag: acc.Scalars(tag) for tag in acc.Tags()["scalars"]}


def test_worker_hook_writes_tagged_scalars_every_n_steps(tmp_path):
    hook = train_tiny(tmp_path, 1, steps=21, every=5)
    # the first step: the loss and learning rate (no interval for a rate yet); then all four every 5 local steps
    assert hook.writes == 5
    found = scalars(str(tmp_path / "worker_1"))
    assert set(found) == {"worker_1/loss", "worker_1/learning_rate", "worker_1/examples_per_sec",
                          "worker_1/global_steps_per_sec"}
    steps = [e.step for e in found["worker_1/loss"]]
    assert len(steps) == 5 and steps == sorted(set(steps)) and steps[0] <= 1 and 19 <= steps[-1] <= 21
    for tag, events in found.items():
        assert [e.step for e in events] == (steps if tag.endswith(("loss", "learning_rate")) else steps[1:]), tag
    assert all(e.value == pytest.approx(0.1) for e in found["worker_1/learning_rate"])
    losses = [e.value for e in found["worker_1/loss"]]
    assert losses == sorted(losses, reverse=True) and losses[-1] < 9.0
    assert all(e.value > 0 for e in found["worker_1/examples_per_sec"] + found["worker_1/global_steps_per_sec"])


def write_mlp_checkpoint(train_dir: Path, step: int) -> str:
    with tf.Graph().as_default():
        global_step = v1.train.get_or_create_global_step()
        get("mlp").inference(tf.zeros([1, 64]), training=False)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            sess.run(global_step.assign(step))
            return v1.train.Saver().save(sess, str(train_dir / "model.ckpt"), global_step=step)


def test_eval_and_worker_summaries_are_runs_of_one_logdir(tmp_path):
    """`psworker eval` (continuous) and `write_eval_summary` both write `precision@1` into `<train_dir>/eval`,
    beside the workers' runs: TensorBoard on the train dir shows them together."""
    train_tiny(tmp_path, 0, steps=6, every=5)
    write_mlp_checkpoint(tmp_path, 30)
    lines = []
    run_eval(train_dir=str(tmp_path), data_dir=None, model_name="mlp", once=False, max_evals=1,
             emit=lambda line, flush=False: lines.append(line), sleep=lambda s: None)
    summaries.write_eval_summary(str(tmp_path), 0.5, 40)

    multiplexer = plugin_event_multiplexer.EventMultiplexer()
    multiplexer.AddRunsFromDirectory(str(tmp_path))
    multiplexer.Reload()
    assert set(multiplexer.Runs()) == {"worker_0", "eval"}
    evals = scalars(str(tmp_path / summaries.EVAL_DIR))
    assert set(evals) == {summaries.PRECISION_TAG}
    assert [e.step for e in evals[summaries.PRECISION_TAG]] == [30, 40]
    assert f"precision @ 1 = {evals[summaries.PRECISION_TAG][0].value:.3f}" in lines[0]
