"""SavedModel export: a checkpoint (its moving averages, where the model keeps them) as a servable model.

Two signatures, each with one input `images` and the outputs `logits` (float32 `[batch, num_classes]`) and `classes`
(int64 `[batch]`, the arg-max):
- `serving_default` takes examples **as the data set gives them** (`model.raw_input_dtype`, `[batch,
  *model.raw_input_shape]`: digits, float32 `[batch, 64]` pixel values 0..16; cifar10, uint8 `[batch, 32, 32, 3]`)
  and applies the eval preprocessing in the graph (`model.serving_preprocess`), the training split's statistics
  stored as constants, so a client needs nothing from psworker;
- `preprocessed` takes `[batch, *model.image_shape]` of `model.preprocessed_dtype` (float32; the criteo model's
  int64 table rows), preprocessed exactly as `eval_dataset` yields them.

A click-through model's `serving_default` takes Criteo's 39 raw feature fields as strings (`[batch, 39]`: the
integers as text, the hex strings, '' where empty) and hashes them in the graph; its tables are restored whole and
read by rows (gathers) in the serving graph as in training.
"""

from __future__ import annotations

import glob
import logging
import os
import re
import shutil
import uuid
from typing import Optional

from psworker import events
from psworker.errors import ExportExistsError, TrainingFailed, UsageError, op_error_line
from psworker.train.evaluate import restore_saver

log = logging.getLogger(__name__)

SIGNATURE_KEY = "serving_default"
PREPROCESSED_SIGNATURE_KEY = "preprocessed"
INPUT_KEY = "images"
PREPROCESSED_INPUT_NAME = "preprocessed_images"
OUTPUT_KEYS = ("logits", "classes")
EXPORT_SUBDIR = "export"
SOURCE_RECORD = os.path.join("assets.extra", "psworker_checkpoint")   # the checkpoint an export came from


def checkpoint_global_step(checkpoint: str) -> int:
    """The `global_step` stored in `checkpoint` (a checkpoint prefix).

    Raises:
        TrainingFailed: the checkpoint cannot be read or holds no global step.
    """
    import tensorflow as tf

    try:
        reader = tf.train.load_checkpoint(checkpoint)
    except (tf.errors.NotFoundError, ValueError) as exc:
        raise TrainingFailed(f"cannot read checkpoint {checkpoint}: {str(exc).splitlines()[0]}") from None
    if not reader.has_tensor("global_step"):
        raise TrainingFailed(f"checkpoint {checkpoint} has no global_step")
    return int(reader.get_tensor("global_step"))


def export_saved_model(model, checkpoint: str, export_base: str) -> str:
    """Exports `checkpoint` as a SavedModel into `<export_base>/<global_step>/` and returns that path.

    Builds a fresh graph with both signatures (`model.inference(training=False)` on the raw input after
    `model.serving_preprocess`, and again, variables shared, on a preprocessed input), restores the moving-average
    shadow variables into the model's variables when `model.moving_average_decay` is set (else the variables
    themselves), and writes it with `tf.compat.v1.saved_model.Builder` into a temporary directory beside the target,
    renamed into place when complete, so that a reader never sees a partial export.

    Args:
        model: a `psworker.models.Model`.
        checkpoint: a checkpoint prefix, e.g. `train_dir/model.ckpt-200`.
        export_base: the parent directory, usually `<train_dir>/export`.

    Returns:
        The export directory, `<export_base>/<global_step>`.

    Raises:
        ExportExistsError: that directory exists already.
        TrainingFailed: the checkpoint cannot be read, or does not match the model.
    """
    step = checkpoint_global_step(checkpoint)
    final = os.path.join(export_base, str(step))
    if os.path.exists(final):
        raise ExportExistsError(exists_message(final), path=final)
    os.makedirs(export_base, exist_ok=True)
    temp = os.path.join(export_base, f".{step}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        _write(model, checkpoint, temp)
        _record_source(checkpoint, temp)
        try:
            os.rename(temp, final)
        except OSError as exc:
            raise ExportExistsError(f"cannot move the export into {final}: {exc.strerror}") from None
    finally:
        if os.path.exists(temp):
            shutil.rmtree(temp, ignore_errors=True)
    log.info("%s", events.Exported(checkpoint, step, final).render())
    return final


def _checkpoint_identity(checkpoint: str) -> Optional[str]:
    """Which checkpoint this is, read without TensorFlow: its index file's absolute path, size and mtime (None: no
    such file)."""
    try:
        st = os.stat(checkpoint + ".index")
    except OSError:
        return None
    return f"{os.path.abspath(checkpoint)}.index {st.st_size} {st.st_mtime_ns}"


def _record_source(checkpoint: str, export_dir: str) -> None:
    """Writes the checkpoint's identity into the export's `assets.extra/` (extra files, which loaders ignore)."""
    identity = _checkpoint_identity(checkpoint)
    if identity is not None:
        os.makedirs(os.path.join(export_dir, "assets.extra"), exist_ok=True)
        with open(os.path.join(export_dir, SOURCE_RECORD), "w", encoding="utf-8") as f:
            f.write(identity + "\n")


def _latest_checkpoint_name(train_dir: str) -> Optional[str]:
    """The latest checkpoint prefix the `checkpoint` state file names, read as text (None: none found)."""
    try:
        with open(os.path.join(train_dir, "checkpoint"), encoding="utf-8") as f:
            found = re.search(r'^model_checkpoint_path: "(.*)"$', f.read(), re.M)
    except OSError:
        return None
    return None if found is None else os.path.join(train_dir, found.group(1))


def existing_export(checkpoint: Optional[str], train_dir: str, export_base: str) -> Optional[str]:
    """The export an earlier `psworker export` made of `checkpoint` (default: the latest in `train_dir`), found
    without importing TensorFlow by the source each export records; None when there is none (or it cannot tell)."""
    checkpoint = checkpoint or _latest_checkpoint_name(train_dir)
    identity = checkpoint and _checkpoint_identity(checkpoint)
    if not identity:
        return None
    for record in sorted(glob.glob(os.path.join(glob.escape(export_base), "*", SOURCE_RECORD))):
        with open(record, encoding="utf-8") as f:
            if f.read().strip() == identity:
                return os.path.dirname(os.path.dirname(record))
    return None


def _signature(model, images, *, preprocess: bool):
    """A predict SignatureDef: `images` (raw when `preprocess`) -> `logits`, `classes`."""
    import tensorflow as tf

    v1 = tf.compat.v1
    with v1.variable_scope(v1.get_variable_scope(), reuse=v1.AUTO_REUSE):   # both signatures share the variables
        logits = model.inference(model.serving_preprocess(images) if preprocess else images, training=False)
    classes = tf.argmax(logits, axis=1, name="classes")
    return v1.saved_model.signature_def_utils.predict_signature_def(
        inputs={INPUT_KEY: images}, outputs={"logits": logits, "classes": classes})


def _write(model, checkpoint: str, path: str) -> None:
    """Builds the serving graph, restores `checkpoint` into it and writes the SavedModel to `path`."""
    import tensorflow as tf
    from tensorflow.python.util import deprecation

    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default(), deprecation.silence():   # TF's "designed for TensorFlow v1" notes: nothing to act on
        raw = v1.placeholder(tf.as_dtype(model.raw_input_dtype), [None, *(model.raw_input_shape or model.image_shape)],
                             name=INPUT_KEY)
        preprocessed = v1.placeholder(tf.as_dtype(model.preprocessed_dtype), [None, *model.image_shape],
                                      name=PREPROCESSED_INPUT_NAME)
        signatures = {SIGNATURE_KEY: _signature(model, raw, preprocess=True),
                      PREPROCESSED_SIGNATURE_KEY: _signature(model, preprocessed, preprocess=False)}
        saver = restore_saver(model)
        with v1.Session(graph=graph) as sess:
            try:
                saver.restore(sess, checkpoint)
            except (tf.errors.NotFoundError, tf.errors.InvalidArgumentError) as exc:
                raise TrainingFailed(f"cannot restore {checkpoint} into model {model.name!r}: "
                                     f"{op_error_line(exc)}") from None
            builder = v1.saved_model.Builder(path)
            builder.add_meta_graph_and_variables(sess, [v1.saved_model.tag_constants.SERVING],
                                                 signature_def_map=signatures, strip_default_attrs=True)
            builder.save()


def run_export(*, train_dir: str, checkpoint: Optional[str] = None, model_name: Optional[str] = None,
               export_base: Optional[str] = None) -> str:
    """`psworker export`: exports `checkpoint` (default: the latest in `train_dir`) into `<train_dir>/export/<step>`.

    Args:
        train_dir: the run's train dir.
        checkpoint: a checkpoint prefix; None: the latest in `train_dir`.
        model_name: the model; None: the one in `<train_dir>/cluster.yaml` (left by a local run), else mlp.
        export_base: where the `<step>` directories go; None: `<train_dir>/export`.

    Returns:
        The export directory.

    Raises:
        UsageError, TrainingFailed, ExportExistsError: no train dir or unknown model; no checkpoint; the export exists.
    """
    if not os.path.isdir(train_dir):
        raise UsageError(f"--train_dir {train_dir} does not exist")
    export_base = export_base or os.path.join(train_dir, EXPORT_SUBDIR)
    done = existing_export(checkpoint, train_dir, export_base)   # before TensorFlow's import (seconds)
    if done is not None:
        raise ExportExistsError(exists_message(done), path=done)
    from psworker import models

    if checkpoint is None:
        from psworker.train.evaluate import latest_checkpoint

        checkpoint = latest_checkpoint(train_dir)
        if checkpoint is None:
            raise TrainingFailed(f"no checkpoint in {train_dir}: train first (the chief writes them there)")
    if model_name is None:
        model_name = recorded_model(train_dir) or "mlp"
    try:
        model = models.get(model_name)
    except KeyError as exc:
        raise UsageError(str(exc.args[0])) from None
    return export_saved_model(model, checkpoint, export_base)


def exists_message(path: str) -> str:
    """The refusal of an export over an existing one, saying what to do."""
    return (f"{path} exists already: exports are never overwritten; load that one, or move it away (or pass "
            "--export_dir DIR) to export again")


def recorded_model(train_dir: str) -> Optional[str]:
    """The model named in the `cluster.yaml` a local run leaves in `train_dir`, or None."""
    path = os.path.join(train_dir, "cluster.yaml")
    if not os.path.exists(path):
        return None
    from psworker.spec import load_spec

    return load_spec(path).train.model


__all__ = ["export_saved_model", "run_export", "checkpoint_global_step", "recorded_model", "exists_message",
           "ExportExistsError",
           "SIGNATURE_KEY", "PREPROCESSED_SIGNATURE_KEY", "INPUT_KEY", "OUTPUT_KEYS", "EXPORT_SUBDIR"]
