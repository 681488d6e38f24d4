"""The trainer's per-step hook (stop, progress line, NaN check, a gate for the chief's savers) and a watchdog that
reports slow steps."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Optional

from psworker import events

log = logging.getLogger(__name__)


def _hook_base():
    import tensorflow as tf

    return tf.compat.v1.train.SessionRunHook


CHECK_EVERY_STEPS = 10   # the most local steps between two runs of the loss check and the gated hooks


class TrainLoopHook(_hook_base()):
    """The trainer's one per-step hook: stop at `last_step`, the progress line, the NaN check, and a gate for other
    hooks (the chief's checkpoint saver), with as few fetches and as little Python as possible per step.

    Every step fetches the global step (a scalar in the step's own RPCs to the ps: no round trip of its own). *Check
    steps* (the first, every `every_steps`-th and every `CHECK_EVERY_STEPS`-th local step, and the step after the
    global step may have crossed a multiple of one of `align_steps`) also fetch the loss (NaN check: raises
    `NanLossDuringTrainingError`, so a NaN is caught within `CHECK_EVERY_STEPS` steps) and run the `gated` hooks'
    `before_run`/`after_run` (their `begin`, `after_create_session` and `end` always run). A fetched global step may
    predate the other workers' updates in the same step: it is taken to advance by at most `stride` per local step
    (the number of workers), or by the most any two fetches have shown since (a worker slowed by load sees the others
    run several steps per step of its own), and once that may reach `last_step` it is read again after the step.
    A worker runs a step only while the global step it last read is below `last_step`, so training stops there as
    TF's `StopAtStepHook` does: at `last_step`, or a step or so past it per other worker taking the last steps at once
    (a worker whose peers outran its stride within one of its steps may run one step more). With `claimed` (a bool
    tensor, `step_claim`) a step counts as a local step only if it claimed a global step.

    Every `every_steps` local steps it prints `step 120, loss = 0.42 (1830.2 examples/sec; 0.035 sec/batch)`, with
    dealt shards (`epochs`) also the epoch: `step 120, loss = 0.42, epoch 1.37 of 3 (...)`. At the end of a session
    that finished without error `final_global_step` holds the global step read once more.
    """

    def __init__(self, loss, global_step, *, last_step: int, every_steps: int, examples_per_step: int,
                 gated: tuple = (), align_steps: tuple = (), stride: int = 1, emit=print, name: str = "worker",
                 epochs: Optional[tuple] = None, extra_steps: Callable[[], int] = lambda: 0, claimed=None):
        self._name = name
        self._claimed = {} if claimed is None else {"claimed": claimed}   # fetched with every step
        self._extra_steps = extra_steps   # steps run beside this loop (threads), counted in examples/sec
        self._extra_at = 0
        self._epochs = epochs          # dealt shards: (examples-trained tensor, examples per epoch, num_epochs)
        self._loss = loss
        self._global_step = global_step
        self._last_step = last_step
        self._every = max(1, every_steps)
        self._examples = examples_per_step
        self._gated = list(gated)
        self._align = [a for a in align_steps if a]
        self._emit = emit
        self.local_steps = 0
        self.last_global_step = 0
        self.final_global_step: Optional[int] = None
        self._stride = max(1, stride)  # grows to the largest advance per local step seen between two fetches
        self._fetched_at = None        # the global step at the last fetch
        self._checked_at = -1          # the global step seen at the last check step
        self._check = False
        self._t0 = 0.0

    def begin(self):
        import tensorflow as tf

        for hook in self._gated:
            hook.begin()
        self._quiet = tf.compat.v1.train.SessionRunArgs({"step": self._global_step, **self._claimed})
        self._t0 = time.monotonic()

    def after_create_session(self, session, coord):
        for hook in self._gated:
            hook.after_create_session(session, coord)
        # A worker (re)started after training ended: stop before a step (one more would pass `last_step`).
        self.last_global_step = max(self.last_global_step, int(session.run(self._global_step)))
        if self.last_global_step >= self._last_step:
            coord.request_stop()

    def _is_check_step(self) -> bool:
        n = self.local_steps + 1
        if self.local_steps == 0 or n % self._every == 0 or n % CHECK_EVERY_STEPS == 0:
            return True
        return any(self.last_global_step // a > self._checked_at // a for a in self._align)

    def before_run(self, run_context):
        self._check = self._is_check_step()
        if not self._check:
            return self._quiet
        import tensorflow as tf

        fetches = {"step": self._global_step, "loss": self._loss, **self._claimed}
        if self._epochs is not None:
            fetches["examples"] = self._epochs[0]
        for i, hook in enumerate(self._gated):
            args = hook.before_run(run_context)
            if args is not None:
                fetches[i] = args.fetches   # (TF's savers ask for fetches only: no feeds, no options)
        return tf.compat.v1.train.SessionRunArgs(fetches)

    def after_run(self, run_context, run_values):
        results = run_values.results
        self.local_steps += bool(results.get("claimed", True))   # an unclaimed step updated nothing
        step = int(results["step"])
        self._learn_stride(step)
        self.last_global_step = step
        if self._check:
            self._checked_at = step
            loss = float(results["loss"])
            if loss != loss:
                import tensorflow as tf

                raise tf.compat.v1.train.NanLossDuringTrainingError
            for i, hook in enumerate(self._gated):
                if i in results:
                    hook.after_run(run_context, type(run_values)(results=results[i], options=run_values.options,
                                                                 run_metadata=run_values.run_metadata))
            if self.local_steps == 1:
                log.info("%s", events.FirstStep(self._name, step).render())
            if self.local_steps % self._every == 0:
                now, extra = time.monotonic(), self._extra_steps()
                duration = max(now - self._t0, 1e-9)
                steps = self._every + extra - self._extra_at
                self._t0, self._extra_at = now, extra
                epoch = None if self._epochs is None else int(results["examples"]) / self._epochs[1]
                self._emit(events.Step(step, loss, steps * self._examples / duration, duration / steps,
                                       epoch, None if self._epochs is None else self._epochs[2]).render(),
                           flush=True)
        if step + self._stride >= self._last_step:   # the fetched value may predate this step's update: read again
            step = int(run_context.session.run(self._global_step))
            self._fetched_at = self.last_global_step = step
            if step >= self._last_step:
                run_context.request_stop()

    def _learn_stride(self, step: int):
        if self._fetched_at is not None:
            self._stride = max(self._stride, step - self._fetched_at)
        self._fetched_at = step

    def end(self, session):
        self.final_global_step = int(session.run(self._global_step))
        self.last_global_step = max(self.last_global_step, self.final_global_step)
        for hook in self._gated:
            hook.end(session)


class StepWatchdog:
    """Logs while one training step runs for longer than `after_secs`, every `every_secs`, so that a wait (a sync
    step needs gradients from the other workers) is never silent; and ends a step that TensorFlow does not end. A
    context manager; its thread is joined on exit.

    Args:
        who: the task's name for messages (`worker:0`).
        why: a hint appended to the message (what the step may be waiting for).
        after_secs: how long a step may run before the first message.
        every_secs: interval between messages while the same step still runs.
        clock: monotonic clock (tests pass a fake).
        diagnose: `diagnose(running_secs) -> str`, run in the watchdog's thread (never the step loop's) before
            each message, whose answer is appended (which peer does not answer).
        give_up: `give_up(running_secs)`, run in the watchdog's thread once a step given a limit
            (`step_started(limit_secs=...)`) has run `grace_secs` past it: a wait TensorFlow's own deadline did not
            end (a session closed or created on a peer that does not answer). It is expected not to return (it
            ends the process); if it does, the watchdog stops watching.
        grace_secs: how long past its limit a step may run before `give_up`: TensorFlow's deadline, at the limit,
            gets that long to end the step first.
    """

    def __init__(self, who: str, why: str, *, after_secs: float = 10.0, every_secs: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, diagnose: Optional[Callable[[float], str]] = None,
                 give_up: Optional[Callable[[float], None]] = None, grace_secs: float = 5.0):
        self._who = who
        self._why = why
        self._after = after_secs
        self._every = every_secs
        self._clock = clock
        self._diagnose = diagnose
        self._give_up = give_up
        self._grace = grace_secs
        self._started: Optional[float] = None
        self._deadline: Optional[float] = None
        self._next_report = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="psworker-step-watchdog", daemon=True)

    def __enter__(self) -> "StepWatchdog":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def step_started(self, limit_secs: Optional[float] = None) -> None:
        """A step starts; with `limit_secs`, `give_up` runs once it has run `grace_secs` longer than that."""
        with self._lock:
            self._started = self._clock()
            self._next_report = self._started + self._after
            self._deadline = None if limit_secs is None else self._started + limit_secs + self._grace

    def extend(self, secs: float) -> None:
        """The running step (if it has a limit) may go on for `secs` more from now (a session being re-created)."""
        with self._lock:
            if self._started is not None and self._deadline is not None:
                self._deadline = max(self._deadline, self._clock() + secs + self._grace)

    def step_finished(self) -> None:
        with self._lock:
            self._started = None
            self._deadline = None

    def running_for(self) -> Optional[float]:
        """Seconds the current step has run; None between steps."""
        with self._lock:
            return None if self._started is None else self._clock() - self._started

    def overdue(self) -> Optional[float]:
        """The running step's seconds once it is past its limit and grace, else None (public for tests)."""
        with self._lock:
            if self._deadline is None or self._clock() < self._deadline:
                return None
            return self._clock() - self._started

    def check(self) -> Optional[str]:
        """The message to log now, if any (called by the thread; public for tests)."""
        with self._lock:
            if self._started is None:
                return None
            now = self._clock()
            if now < self._next_report:
                return None
            self._next_report = now + self._every
            return f"{self._who}: a training step has been running for {now - self._started:.0f} s; {self._why}"

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self._every / 4)):
            message = self.check()
            if message:
                found = self._diagnose(self.running_for() or 0.0) if self._diagnose is not None else ""
                message += f" ({found})" if found else ""
                log.warning("%s", message)
            running = self.overdue()
            if running is not None and self._give_up is not None:
                self._give_up(running)
                return


def _saver_hook_base():
    import tensorflow as tf

    return tf.compat.v1.train.CheckpointSaverHook


class ChiefCheckpointSaverHook(_saver_hook_base()):
    """TF's `CheckpointSaverHook` (the step-0 checkpoint when a session is made, then by steps or seconds), writing
    the graph files of a new session (`graph.pbtxt`, the graph and meta graph in the events file) from one
    `GraphDef` instead of three, and `graph.pbtxt` with protobuf's C text encoder: TF's took ~0.1 s of the chief's
    path to its first step, nearly all of it the pure-Python text format (docs/performance.md).

    Each checkpoint goes through `keeper` (`train.checkpoints.CheckpointKeeper`): named after the global step its
    files hold (TF names it after the step read before the save, which the other workers may have moved on from),
    and the old ones rotated away only once it is checked. The listeners get that step.
    """

    def __init__(self, checkpoint_dir: str, *, keeper=None, **kwargs):
        super().__init__(checkpoint_dir, **kwargs)
        self._keeper = keeper   # None: one over the checkpoints there now, keeping the saver's max_to_keep

    def after_create_session(self, session, coord):
        global_step = session.run(self._global_step_tensor)
        self._write_graph()
        self._save(session, global_step)   # the state at `global_step`, as TF's hook saves it
        self._timer.update_last_triggered_step(global_step)

    def _save(self, session, step):
        """TF's `_save` through the keeper; returns whether a listener asks to stop."""
        import tensorflow as tf

        for listener in self._listeners:
            listener.before_save(session, step)
        if self._keeper is None:
            from psworker.train import checkpoints

            kept = tuple(f.prefix for f in reversed(checkpoints.find(self._checkpoint_dir))
                         if f"{f.name}.index" in f.files)
            self._keeper = checkpoints.CheckpointKeeper(
                self._checkpoint_dir, keep=self._get_saver().saver_def.max_to_keep, kept=kept)
        saved = self._keeper.save(session, self._get_saver(), write_meta_graph=self._save_graph_def)
        if saved is None:
            return False
        path, held = saved
        self._summary_writer.add_session_log(
            tf.compat.v1.SessionLog(status=tf.compat.v1.SessionLog.CHECKPOINT, checkpoint_path=path), held)
        stops = [listener.after_save(session, held) for listener in self._listeners]
        return any(stops)

    def _write_graph(self) -> None:
        import tensorflow as tf

        v1 = tf.compat.v1
        graph_def = v1.get_default_graph().as_graph_def(add_shapes=True)
        if self._save_graph_def:
            write_text_proto(graph_def, os.path.join(self._checkpoint_dir, "graph.pbtxt"))
        saver = self._get_saver()
        meta_graph_def = v1.train.export_meta_graph(graph_def=graph_def, saver_def=saver.saver_def if saver else None)
        self._summary_writer.add_event(   # as add_graph writes it
            v1.Event(wall_time=time.time(), graph_def=graph_def.SerializeToString()))
        self._summary_writer.add_meta_graph(meta_graph_def)


def write_text_proto(message, path: str) -> None:
    """Writes `message` in protobuf text format, as `tf.io.write_graph(..., as_text=True)` does, but through the
    C++/upb encoder (`str(message)`: 4 ms for the CIFAR-10 graph against 40 ms in `text_format`; the same message
    when parsed back, map entries possibly in another order)."""
    import tensorflow as tf

    tf.io.gfile.makedirs(os.path.dirname(path) or ".")
    partial = f"{path}.tmp{os.getpid()}"
    with tf.io.gfile.GFile(partial, "w") as f:
        f.write(str(message))
    tf.io.gfile.rename(partial, path, overwrite=True)   # whole or not at all, as TF's own write is


def _listener_base():
    import tensorflow as tf

    return tf.compat.v1.train.CheckpointSaverListener


class CheckpointLogger(_listener_base()):
    """Logs `worker:0: checkpoint of global step N saved` once a checkpoint is complete on disk."""

    def __init__(self, name: str):
        self._name = name

    def after_save(self, session, global_step_value):
        log.info("%s", events.CheckpointSaved(self._name, int(global_step_value)).render())
