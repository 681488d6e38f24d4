"""TrainLoopHook in a real in-process MonitoredSession: exact stop, progress lines, NaN check, gated hooks."""

from __future__ import annotations

import pytest


def _run(steps_limit: int, *, every: int = 4, loss_value: float = 1.0, stride: int = 1, gated=(), align=(),
         run_steps: int = 1000, advance: int = 0, later: tuple = ()):
    """Trains a graph whose train op adds `advance` (default: `stride`, what the hook is told) to the global step, or
    from global step `later[0]` on `later[1]`; returns (hook, lines, steps run)."""
    import tensorflow as tf

    from psworker.train.hooks import TrainLoopHook

    v1 = tf.compat.v1
    lines = []
    with tf.Graph().as_default():
        step = v1.train.get_or_create_global_step()
        loss = tf.constant(loss_value) + tf.cast(step, tf.float32) * 0.0
        by = tf.constant(advance or stride, step.dtype)
        if later:
            by = tf.where(step < later[0], by, tf.constant(later[1], step.dtype))
        train_op = v1.assign_add(step, by)
        hook = TrainLoopHook(loss, step, last_step=steps_limit, every_steps=every, examples_per_step=8,
                             gated=gated, align_steps=align, stride=stride,
                             emit=lambda line, flush=False: lines.append(line), name="worker:0")
        ran = 0
        with v1.train.MonitoredSession(hooks=[hook]) as sess:
            while not sess.should_stop() and ran < run_steps:
                sess.run(train_op)
                ran += 1
    return hook, lines, ran


def test_stops_exactly_at_the_last_step_and_prints_progress():
    hook, lines, ran = _run(37, every=10)
    assert ran == 37 and hook.final_global_step == 37 and hook.local_steps == 37
    # the step shown is the global step fetched with the step: it may predate the step's own update
    assert [int(line.split(",")[0].split()[1]) // 2 for line in lines] in ([5, 10, 15], [4, 9, 14]), lines
    assert "loss = 1.00 (" in lines[0] and "examples/sec" in lines[0]


def test_stops_exactly_when_the_global_step_moves_by_several_per_step():
    hook, _, ran = _run(40, stride=4)
    assert ran == 10 and hook.final_global_step == 40


def test_stops_at_the_last_step_when_the_others_run_more_steps_than_the_stride_says():
    """A worker slowed by load: told 2 workers (stride 2), it sees the global step move by 7 per step of its own.
    It learns that from its fetches and still stops at the first step past the limit (the CI race of a batch-32
    run that checkpointed at 403 of 400)."""
    hook, _, ran = _run(400, every=50, stride=2, advance=7)
    assert ran == 58 and hook.final_global_step == 406   # 57 x 7 = 399 < 400 <= 406


def test_stops_at_the_next_step_when_the_others_speed_up_late_in_the_run():
    """The others' pace changes after the first steps (a loaded host frees up): from global step 350 the step moves by
    7 per local step. Every step fetches the global step, so the worker stops at the first step past the limit, not
    after blind steps until its next check (the CI race of a 300-step run whose slow worker ended at 307)."""
    hook, _, ran = _run(400, every=50, stride=2, advance=1, later=(350, 7))
    assert hook.final_global_step == 406 and ran == 350 + 8   # 350 + 7 x 7 = 399 < 400 <= 406


def test_nan_loss_fails_training():
    import tensorflow as tf

    with pytest.raises(tf.compat.v1.train.NanLossDuringTrainingError):
        _run(100, loss_value=float("nan"))


class _Counting:
    """A gated hook that records the steps it saw (a stand-in for the chief's savers)."""

    def __init__(self):
        self.seen = []
        self.ended = False
        self._step = None

    def begin(self):
        import tensorflow as tf

        self._step = tf.compat.v1.train.get_global_step()

    def after_create_session(self, session, coord):
        pass

    def before_run(self, run_context):
        import tensorflow as tf

        return tf.compat.v1.train.SessionRunArgs(self._step)

    def after_run(self, run_context, run_values):
        self.seen.append(int(run_values.results))

    def end(self, session):
        self.ended = True


def test_gated_hooks_run_on_check_steps_only_with_their_own_fetches():
    from psworker.train.hooks import CHECK_EVERY_STEPS

    gated = _Counting()
    hook, _, ran = _run(60, every=25, gated=(gated,), align=(7,))
    assert ran == 60 and gated.ended
    seen = set(gated.seen)   # global steps fetched with the step (may predate its own update: -1)
    assert seen & {0, 1}                                             # the first step
    assert seen & {CHECK_EVERY_STEPS - 1, CHECK_EVERY_STEPS}         # every 10th local step
    assert seen & {24, 25}                                           # every `every`-th local step
    assert seen & {7, 8} and seen & {14, 15}                         # right after a multiple of align_steps
    assert len(gated.seen) < ran / 2                                 # most steps run no gated hook


def test_chief_savers_gated_write_checkpoints_and_summaries(tmp_path):
    """TF's CheckpointSaverHook and SummarySaverHook work behind the gate (steps, final save, summaries)."""
    import tensorflow as tf

    from psworker.train.hooks import TrainLoopHook

    v1 = tf.compat.v1
    with tf.Graph().as_default():
        step = v1.train.get_or_create_global_step()
        loss = tf.cast(step, tf.float32)
        v1.summary.scalar("loss", loss)
        train_op = v1.assign_add(step, 1)
        scaffold = v1.train.Scaffold()
        savers = [v1.train.CheckpointSaverHook(str(tmp_path), save_steps=20, scaffold=scaffold),
                  v1.train.SummarySaverHook(save_steps=10, output_dir=str(tmp_path), scaffold=scaffold)]
        hook = TrainLoopHook(loss, step, last_step=45, every_steps=10, examples_per_step=1, gated=savers,
                             align_steps=(10, 20), emit=lambda *a, **k: None)
        with v1.train.MonitoredSession(session_creator=v1.train.ChiefSessionCreator(scaffold=scaffold),
                                       hooks=[hook]) as sess:
            while not sess.should_stop():
                sess.run(train_op)
    state = tf.train.get_checkpoint_state(str(tmp_path))
    assert state.model_checkpoint_path.endswith("model.ckpt-45")
    saved = {int(p.rsplit("-", 1)[1]) for p in state.all_model_checkpoint_paths}
    assert {20, 40, 45} <= saved or {21, 41, 45} <= saved, saved
    events = list(tmp_path.glob("events.out.tfevents.*"))
    steps = {e.step for path in events for e in tf.compat.v1.train.summary_iterator(str(path))
             if e.summary.value and e.summary.value[0].tag == "loss"}
    assert len(steps) >= 4, steps
