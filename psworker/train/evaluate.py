"""Evaluation of a checkpoint over the whole held-out split, once or as new checkpoints appear: precision@1, or for
a click-through model (`Model.eval_metric == "auc"`) AUC and logloss of its click probabilities."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Optional

from psworker import events
from psworker.errors import TrainingFailed, UsageError, op_error_line

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalResult:
    precision: float
    examples: int
    global_step: int
    checkpoint: str
    auc: Optional[float] = None        # a click-through model's (`Model.eval_metric == "auc"`)
    logloss: Optional[float] = None


def evaluate_checkpoint(model, checkpoint: str, *, data_dir: Optional[str], batch_size: int = 128) -> EvalResult:
    """Restores `checkpoint` (its moving averages, where the model keeps them) and counts top-1 hits in batches;
    for a click-through model also gathers every click probability (softmax's second class) for AUC and logloss."""
    import numpy as np
    import tensorflow as tf

    from psworker import metrics

    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        dataset = model.eval_dataset(data_dir, batch_size)
        images, labels = v1.data.make_one_shot_iterator(dataset).get_next()
        logits = model.inference(images, training=False)
        hits = tf.cast(tf.nn.in_top_k(predictions=logits, targets=tf.cast(labels, tf.int32), k=1), tf.int32)
        clicks = tf.nn.softmax(logits)[:, -1] if model.eval_metric == "auc" else tf.zeros_like(hits, tf.float32)
        global_step = v1.train.get_or_create_global_step()
        saver = restore_saver(model)
        with v1.Session(graph=graph) as sess:
            saver.restore(sess, checkpoint)
            step = int(sess.run(global_step))
            got = _all_batches(sess, (hits, clicks, labels))
    if not len(got[0]):
        raise TrainingFailed("the evaluation split is empty")
    result = EvalResult(precision=float(np.mean(got[0])), examples=len(got[0]), global_step=step,
                        checkpoint=checkpoint)
    if model.eval_metric == "auc":
        result = dataclasses.replace(result, auc=metrics.auc(got[1], got[2]), logloss=metrics.logloss(got[1], got[2]))
    return result


def _all_batches(sess, fetches) -> list:
    """Runs `fetches` (per-example tensors) until the input ends; each concatenated over the batches."""
    import numpy as np
    import tensorflow as tf

    parts: list = [[] for _ in fetches]
    while True:
        try:
            values = sess.run(list(fetches))
        except tf.errors.OutOfRangeError:
            break
        for part, value in zip(parts, values):
            part.append(value)
    return [np.concatenate(p) if p else np.zeros(0) for p in parts]


def restore_saver(model):
    """A `Saver` of the default graph's model that restores the moving averages where the model keeps them (the
    tutorial evaluates and serves those), else the variables themselves."""
    import tensorflow as tf

    v1 = tf.compat.v1
    if model.moving_average_decay:
        return v1.train.Saver(v1.train.ExponentialMovingAverage(model.moving_average_decay).variables_to_restore())
    return v1.train.Saver(v1.global_variables())


def format_result(result: EvalResult) -> str:
    """The tutorial's line: `2026-11-30 12:00:00: precision @ 1 = 0.972`, plus what was evaluated; a click-through
    model's `... auc = 0.853, logloss = 0.412 (...)`."""
    if result.auc is not None:
        return events.AucResult(result.auc, result.logloss, result.examples, result.global_step,
                                events.Precision.now()).render()
    return events.Precision(result.precision, result.examples, result.global_step, events.Precision.now()).render()


def latest_checkpoint(train_dir: str) -> Optional[str]:
    """The newest usable checkpoint the state file lists (`train.checkpoints.choose`), with a warning when a newer
    one is unusable; None when there is none."""
    from psworker.train import checkpoints

    choice = checkpoints.choose(train_dir, listed_only=True)
    if choice.rejected:
        bad = checkpoints.describe_rejected(choice.rejected)
        log.warning("%s", checkpoints.fallback_message(choice) if choice.path else f"no usable checkpoint ({bad})")
    return choice.path


def run_eval(*, train_dir: str, data_dir: Optional[str], model_name: Optional[str], once: bool,
             eval_interval_secs: float = 60.0, batch_size: Optional[int] = None, max_evals: Optional[int] = None,
             emit=print, sleep=time.sleep) -> int:
    """`psworker eval`: evaluates the latest checkpoint once, or each new one every `eval_interval_secs`.

    In continuous mode each result is also written as a `precision@1` summary at the checkpoint's global step
    into `<train_dir>/eval` (for TensorBoard). Graphs are built explicitly, so this needs no global graph mode.

    Args:
        train_dir: where the chief writes checkpoints.
        data_dir: the data; None: the `data_dir` of the `cluster.yaml` a local run left in `train_dir`.
        model_name: the model; None: the one named in that `cluster.yaml`, else the default.
        once: evaluate the latest checkpoint and return.
        eval_interval_secs: how often to look for a new checkpoint.
        batch_size: evaluation batch (bounded memory); None: 128.
        max_evals: continuous mode returns after this many evaluations (None: runs until stopped).
        emit: where the result lines go.
        sleep: waits between looks (tests pass a fake).

    Returns:
        0.

    Raises:
        UsageError: no train_dir.
        TrainingFailed: (`once`) no checkpoint in it, or it cannot be read; missing data.
    """
    from psworker import models

    if not os.path.isdir(train_dir):
        raise UsageError(f"--train_dir {train_dir} does not exist")
    recorded = _train_settings(train_dir)
    model = models.get(model_name or (recorded.model if recorded else "mlp"))
    if data_dir is None and recorded is not None:
        data_dir = recorded.data_dir
    batch_size = batch_size or 128
    seen: Optional[str] = None
    evals = 0
    writer = None
    try:
        while True:
            checkpoint = latest_checkpoint(train_dir)
            if checkpoint is None and once:
                raise TrainingFailed(f"no checkpoint in {train_dir}: train first (the chief writes them there)")
            if checkpoint is not None and checkpoint != seen:
                result = _evaluate_new(model, checkpoint, data_dir, batch_size, once, eval_interval_secs)
                if result is not None:
                    emit(format_result(result), flush=True)
                    seen, evals = checkpoint, evals + 1
                    writer = _write_precision(writer, train_dir, result)
                    if once or (max_evals is not None and evals >= max_evals):
                        return 0
            elif checkpoint is None:
                log.info("no checkpoint in %s yet; checking again in %g s", train_dir, eval_interval_secs)
            sleep(eval_interval_secs)
    finally:
        if writer is not None:
            writer.close()


def _evaluate_new(model: Any, checkpoint: str, data_dir: Optional[str], batch_size: int, once: bool,
                  eval_interval_secs: float) -> Optional["EvalResult"]:
    """`evaluate_checkpoint`, or None when the checkpoint vanished before it could be read (continuous mode)."""
    import tensorflow as tf

    try:
        return evaluate_checkpoint(model, checkpoint, data_dir=data_dir, batch_size=batch_size)
    except tf.errors.NotFoundError as exc:
        if once:
            raise TrainingFailed(f"cannot read {checkpoint}: {op_error_line(exc)}") from None
        # The chief keeps only the last few checkpoints: this one was deleted while we looked.
        log.warning("%s vanished before it could be read; looking again in %g s", checkpoint, eval_interval_secs)
        return None


def _write_precision(writer: Any, train_dir: str, result: "EvalResult") -> Any:
    """Adds the result as a `precision@1` summary at its global step to `<train_dir>/eval` (the writer, made on
    first use, is returned)."""
    from psworker.train import summaries

    if writer is None:
        writer = summaries.make_writer(os.path.join(train_dir, summaries.EVAL_DIR))
    values = {summaries.PRECISION_TAG: result.precision}
    if result.auc is not None:
        values.update({"auc": result.auc, "logloss": result.logloss})
    writer.add_summary(summaries.scalar_summary(values), result.global_step)
    writer.flush()
    return writer


def _train_settings(train_dir: str):
    """The train section of the `cluster.yaml` the local launcher leaves in the train dir, or None."""
    path = os.path.join(train_dir, "cluster.yaml")
    if not os.path.exists(path):
        return None
    from psworker.spec import load_spec

    return load_spec(path).train
