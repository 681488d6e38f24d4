"""Checked checkpoints on real clusters: a newest checkpoint with its `.index` gone or its `.data` cut in half is
given up with a warning and the previous one restored; with none usable the chief refuses (exit 3) and writes
nothing, unless `allow_fresh_start`; each checkpoint is named after the global step it holds. And the rotation
keeps the older checkpoints when a new one fails its check."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from psworker.errors import EXIT_TRAINING_FAILED
from psworker.testing import LocalCluster, checkpoint_step
from psworker.traindir_lock import LOCK_FILE

TRAIN = {"model": "linear", "mode": "async", "save_checkpoint_steps": 20, "log_every_steps": 20, "seed": 1}
FIRST_STEPS = 60      # the first run's checkpoints: 0, 20, 40, 60 (one worker: each at the step it was due)
TIMEOUT = 240


def _train(workdir: Path, train_dir: Path, *, num_workers: int = 1, **train) -> LocalCluster:
    """A 1-ps cluster training into `train_dir` to the end; returns it (closed) for its logs and exit codes."""
    settings = {**TRAIN, "train_dir": str(train_dir), **train}
    with LocalCluster(workdir, num_ps=1, num_workers=num_workers, train=settings) as cluster:
        cluster.wait_exit("worker:0", TIMEOUT)
    return cluster


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A train dir trained to FIRST_STEPS (copied by each test before it breaks it)."""
    base = tmp_path_factory.mktemp("first")
    cluster = _train(base / "run", base / "train", max_steps=FIRST_STEPS)
    assert cluster.exit_codes()["worker:0"] == 0, cluster.tails()
    assert _steps_on_disk(base / "train") == [0, 20, 40, 60]
    return base / "train"


def _copy(trained: Path, tmp_path: Path) -> Path:
    train_dir = tmp_path / "train"
    shutil.copytree(trained, train_dir)
    return train_dir


def _steps_on_disk(train_dir: Path) -> list[int]:
    return sorted(int(m.group(1)) for p in train_dir.iterdir() if (m := re.match(r"model\.ckpt-(\d+)\.index$", p.name)))


def _data_file(train_dir: Path, step: int) -> Path:
    (data,) = train_dir.glob(f"model.ckpt-{step}.data-*")
    return data


def _truncate_half(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def _snapshot(train_dir: Path) -> dict:
    """Every file's size and mtime, but the launcher's lock (traindir_lock), which each run takes."""
    return {str(p.relative_to(train_dir)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in train_dir.rglob("*") if p.name != LOCK_FILE}


def _held(train_dir: Path, step: int) -> int:
    import tensorflow as tf

    return int(tf.train.load_checkpoint(str(train_dir / f"model.ckpt-{step}")).get_tensor("global_step"))


@pytest.mark.parametrize("breakage", ["index deleted", "data truncated"])
def test_a_broken_newest_checkpoint_falls_back_to_the_previous_one_with_a_warning(trained, tmp_path, breakage):
    train_dir = _copy(trained, tmp_path)
    if breakage == "index deleted":
        (train_dir / "model.ckpt-60.index").unlink()
        why = r"\.index missing"
    else:
        _truncate_half(_data_file(train_dir, 60))
        why = r"variable \S+ unreadable \(\.data holds \d+ bytes, its index lists \d+\): Read less bytes than requested"

    cluster = _train(tmp_path / "run", train_dir, max_steps=100)

    log = cluster.log("worker:0")
    assert cluster.exit_codes()["worker:0"] == 0, cluster.tails()
    assert re.search(rf"WARNING.*worker:0: model\.ckpt-60: {why}; restoring model\.ckpt-40 instead "
                     r"\(20 steps given up\)", log), log
    assert "restoring the checkpoint model.ckpt-40" in log
    assert "initialising the model" not in log
    assert checkpoint_step(train_dir) == 100
    assert _held(train_dir, 60) == 60   # written again when training passed step 60: whole now


def test_with_every_checkpoint_unusable_the_chief_refuses_and_writes_nothing(trained, tmp_path):
    train_dir = _copy(trained, tmp_path)
    for step in (0, 20, 40, 60):
        _truncate_half(_data_file(train_dir, step))
    (train_dir / "model.ckpt-40.index").unlink()
    before = _snapshot(train_dir)

    cluster = _train(tmp_path / "run", train_dir, max_steps=100)

    assert cluster.exit_codes()["worker:0"] == EXIT_TRAINING_FAILED, cluster.tails()
    error = [line for line in cluster.log("worker:0").splitlines() if line.startswith("psworker: error: ")]
    assert len(error) == 1, cluster.tail("worker:0")
    assert re.search(r"model\.ckpt-60, model\.ckpt-20, model\.ckpt-0: variable linear/\S+ unreadable \(\.data holds "
                     r"\d+ bytes", error[0]), error
    assert "model.ckpt-40: .index missing" in error[0]
    assert "refusing to start from scratch, which would give up 60 steps" in error[0]
    assert "allow_fresh_start" in error[0]
    assert "Traceback" not in cluster.log("worker:0")
    assert _snapshot(train_dir) == before


def test_checkpoints_of_another_model_are_refused_naming_the_variables(trained, tmp_path):
    train_dir = _copy(trained, tmp_path)
    before = _snapshot(train_dir)

    cluster = _train(tmp_path / "run", train_dir, max_steps=100, model="mlp")

    assert cluster.exit_codes()["worker:0"] == EXIT_TRAINING_FAILED, cluster.tails()
    error = [line for line in cluster.log("worker:0").splitlines() if line.startswith("psworker: error: ")]
    assert len(error) == 1, cluster.tail("worker:0")
    assert re.search(r"\(model\.ckpt-60, model\.ckpt-40, model\.ckpt-20, model\.ckpt-0: variable hidden1/biases "
                     r"missing; variable hidden1/weights missing", error[0]), error
    assert _snapshot(train_dir) == before


def test_allow_fresh_start_starts_from_scratch_over_unusable_checkpoints(trained, tmp_path):
    train_dir = _copy(trained, tmp_path)
    for step in (0, 20, 40, 60):
        _truncate_half(_data_file(train_dir, step))

    cluster = _train(tmp_path / "run", train_dir, max_steps=40, allow_fresh_start=True)

    log = cluster.log("worker:0")
    assert cluster.exit_codes()["worker:0"] == 0, cluster.tails()
    assert re.search(r"WARNING.*worker:0: no usable checkpoint in \S+ \(model\.ckpt-60, model\.ckpt-40, "
                     r"model\.ckpt-20, model\.ckpt-0: variable linear/weights unreadable .*\); starting from "
                     r"scratch, as allow_fresh_start says", log), log
    assert checkpoint_step(train_dir) == 40
    assert [_held(train_dir, s) for s in (0, 20, 40)] == [0, 20, 40]   # the unusable ones written over


def test_each_checkpoint_is_named_after_the_global_step_it_holds(tmp_path):
    """Two async workers move the global step while the chief saves: TF named a checkpoint after the step read
    before the save (model.ckpt-0 held step 9)."""
    train_dir = tmp_path / "train"
    with LocalCluster(tmp_path / "run", num_ps=1, num_workers=2,
                      train={**TRAIN, "train_dir": str(train_dir), "max_steps": 200}) as cluster:
        assert cluster.wait_exits(TIMEOUT) == {"ps:0": 0, "worker:0": 0, "worker:1": 0}, cluster.tails()
    logged = [int(s) for s in re.findall(r"worker:0: checkpoint of global step (\d+) saved", cluster.log("worker:0"))]
    on_disk = _steps_on_disk(train_dir)
    assert on_disk and set(on_disk) <= set(logged), (on_disk, logged)
    assert [_held(train_dir, step) for step in on_disk] == on_disk
    assert max(on_disk) >= 200   # async: the other worker's last step may land after the 200th
    assert not list(train_dir.glob("model.ckpt-partial*"))


def test_the_rotation_keeps_the_older_checkpoints_when_a_new_one_fails_its_check(tmp_path, caplog):
    """A save whose files come out short (cut after the write) is not named nor listed, and deletes nothing."""
    import tensorflow as tf

    from psworker.train import checkpoints

    v1 = tf.compat.v1

    class ShortWritingSaver(v1.train.Saver):   # the real Saver; its files are damaged once written
        cut = False

        def save(self, sess, save_path, **kwargs):
            path = super().save(sess, save_path, **kwargs)
            if self.cut:
                (data,) = Path(save_path).parent.glob(Path(save_path).name + ".data-*")
                _truncate_half(data)
            return path

    with tf.Graph().as_default():
        step = v1.train.get_or_create_global_step()
        v1.get_variable("weights", initializer=tf.zeros([100]))
        bump = v1.assign_add(step, 1)
        saver = ShortWritingSaver(sharded=True)
        keeper = checkpoints.CheckpointKeeper(str(tmp_path), keep=2)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for _ in range(3):
                sess.run(bump)
                keeper.save(sess, saver)
            assert _steps_on_disk(tmp_path) == [2, 3]
            listed = tf.train.get_checkpoint_state(str(tmp_path)).all_model_checkpoint_paths
            assert [os.path.basename(p) for p in listed] == ["model.ckpt-2", "model.ckpt-3"]
            saver.cut = True
            sess.run(bump)
            assert keeper.save(sess, saver) is None
    assert "the checkpoint just written is unusable (model.ckpt-partial: .data holds" in caplog.text
    assert _steps_on_disk(tmp_path) == [2, 3]
    assert tf.train.latest_checkpoint(str(tmp_path)) == os.path.join(str(tmp_path), "model.ckpt-3")


def test_a_damaged_checkpoint_does_not_prove_training_complete(tmp_path):
    """A worker waiting for its ps (and a ps with no workers) asks whether the train dir shows training over: a
    newest checkpoint at max_steps whose data is cut says nothing (it would skip the training for good)."""
    import tensorflow as tf

    from psworker.task.shutdown import checkpoint_at_max_steps

    v1 = tf.compat.v1
    with tf.Graph().as_default():
        step = v1.train.get_or_create_global_step()
        v1.get_variable("weights", initializer=tf.zeros([1000]))
        saver = v1.train.Saver()
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for target in (5, 10):
                sess.run(v1.assign(step, target))
                saver.save(sess, str(tmp_path / "model.ckpt"), global_step=target)
    assert checkpoint_at_max_steps(str(tmp_path), 10) == 10
    _truncate_half(_data_file(tmp_path, 10))
    assert checkpoint_at_max_steps(str(tmp_path), 10) is None
    assert checkpoint_at_max_steps(str(tmp_path), 5) == 5
