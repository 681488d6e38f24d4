"""Session creation for between-graph workers: fast readiness polling, and a chief that never rolls back a live ps."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Optional

from psworker import events
from psworker.errors import op_error_line

log = logging.getLogger(__name__)

RECOVERY_WAIT_SECS = 0.1   # TF's default is 30 s: a non-chief would sleep that long before its first step
CLOSE_WAIT_SECS = 10.0     # a session's close that takes longer is left to finish (or not) in the background


def _base_creator():
    import tensorflow as tf

    return tf.compat.v1.train.SessionCreator


def _bounded(call: Callable[[], None], secs: float) -> bool:
    """Runs `call()` in a daemon thread for at most `secs`: True once it returned (its exception re-raised here),
    False if it still runs. A gRPC session's close waits on every task it ran on (`MasterSession::Close`), without
    a deadline: after a ps is lost for good, it was seen to wait for minutes (2 of 17 runs)."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as e:   # noqa: BLE001 - handed to the caller's thread
            raised.append(e)

    thread = threading.Thread(target=run, name="psworker-session-close", daemon=True)
    thread.start()
    thread.join(secs)
    if raised:
        raise raised[0]
    return not thread.is_alive()


class FastSessionCreator(_base_creator()):
    """Creates (and, after a ps failure, re-creates) a worker's session.

    - The chief, when the ps tasks already hold an initialised model (the chief was restarted while they lived),
      continues from it; only when they do not (first start, or a ps was restarted) does it restore the latest
      checkpoint in `checkpoint_dir`, or initialise.
      Before the session is handed over (and the hooks' `after_create_session` run), `on_live_model(session)`
      runs on that path only: sync mode resets the `SyncReplicasOptimizer`'s state on the ps there; on the other
      path `on_new_model(session)` runs after the restore or initialisation (sync mode: the push slots).
    - The checkpoint restored is the newest usable one (`train.checkpoints.choose`: `first_choice` the first time,
      chosen again for a later restore); one that is not the newest is restored with a warning naming the files
      given up, and the state file then lists it as the latest. Files there but none usable: `TrainingFailed`
      (exit 3), or, with `allow_fresh_start`, a fresh model and a warning. A restore that fails anyway raises
      `TrainingFailed` naming the checkpoint and the variable.
    - Non-chief workers poll for the model every `RECOVERY_WAIT_SECS` instead of TF's 30 s, in one session (TF's
      `SessionManager` makes a new one per poll), and give up after `max_wait_secs` with a `DeadlineExceededError`.
    - With `warm_up` (the input batch's tensors), each session made here starts by fetching one batch in a thread,
      while the chief initialises the model or a non-chief waits for it: the input pipeline's first fill (the
      CIFAR-10 shuffle buffer: 0.15 s) is then off the first step's path. That batch is not trained on.
    - With `restore(session, checkpoint)`, the chief restores through it instead of the scaffold's Saver (dealt
      shards: a checkpoint without the data position still restores).
    - Once `abandon_on_close()` was called, closing a session it made does nothing: the process is about to leave
      through `os._exit`, and `tf.Session.close()` of a gRPC session was measured at 1.7-2.4 s in about a third of
      the runs (the master waits on its workers), the bulk of the time between a worker's last step and its exit.
      The sessions are kept referenced so that garbage collection cannot close them either.
    - Any other close (MonitoredSession's, after a ps failure, before it makes a new session) waits at most
      `CLOSE_WAIT_SECS`, then leaves the close running and goes on, with a warning (`_bounded`).
    """

    def __init__(self, scaffold, *, master: str, config, is_chief: bool, checkpoint_dir: Optional[str],
                 max_wait_secs: float, name: str, before_create: Optional[Callable[[], None]] = None,
                 on_live_model: Optional[Callable[[object], None]] = None, warm_up=None,
                 restore: Optional[Callable[[object, str], None]] = None, first_choice=None,
                 allow_fresh_start: bool = False, on_new_model: Optional[Callable[[object], None]] = None):
        self._scaffold = scaffold
        self._master = master
        self._config = config
        self._is_chief = is_chief
        self._checkpoint_dir = checkpoint_dir
        self._max_wait_secs = max_wait_secs
        self._name = name
        self._before_create = before_create
        self._on_live_model = on_live_model
        self._on_new_model = on_new_model
        self._warm_up = warm_up
        self._first_choice = first_choice   # checkpoints.Choice made before the hooks wrote anything
        self._allow_fresh_start = allow_fresh_start
        self._restore_fn = restore or (lambda sess, checkpoint: self._scaffold.saver.restore(sess, checkpoint))
        self.sessions_created = 0
        self.current = None                 # the session made last, once ready (the raw one MonitoredSession wraps)
        self._abandon = False
        self._abandoned: list = []

    def abandon_on_close(self) -> None:
        """From now on, `close()` on the sessions made here leaves them open (see the class docstring)."""
        self._abandon = True

    def _closable(self, sess):
        real_close = sess.close

        def close():
            if self._abandon:
                self._abandoned.append(sess)
            elif not _bounded(real_close, CLOSE_WAIT_SECS):
                self._abandoned.append(sess)
                log.warning("%s: closing the session did not finish within %g s (TensorFlow waits on a task that "
                            "does not answer); going on without waiting for it", self._name, CLOSE_WAIT_SECS)

        sess.close = close   # MonitoredSession's wrappers call `close()` on the object we return
        return sess

    def create_session(self):
        return self._closable(self._create_session())

    def _create_session(self):
        import tensorflow as tf

        self._scaffold.finalize()
        if self._before_create is not None:
            # Also after a ps failure: without this, TF re-creates sessions against a dead ps forever.
            self._before_create()
        graph = tf.compat.v1.get_default_graph()
        self.sessions_created += 1
        sess = self._new_session(graph)
        try:
            if not self._is_chief:
                self._wait_for_model(sess)
            elif self._model_is_live(sess):
                log.info("%s: the ps tasks already hold a model; continuing from it (no checkpoint restore)",
                         self._name)
                self._local_init(sess)
                if self._on_live_model is not None:
                    self._on_live_model(sess)
            else:
                self._restore_or_initialise(sess)
                self._local_init(sess)
                if self._on_new_model is not None:
                    self._on_new_model(sess)
            self.current = sess
            return sess
        except Exception:
            sess.close()
            raise

    def _new_session(self, graph):
        import tensorflow as tf

        sess = tf.compat.v1.Session(self._master, graph=graph, config=self._config)
        if self._warm_up is not None:
            threading.Thread(target=_fetch_quietly, args=(sess, self._warm_up, self._name),
                             name="psworker-input-warm-up", daemon=True).start()
        return sess

    def _model_is_live(self, sess) -> bool:
        """Every global variable is initialised (`ready_for_local_init_op`: `ready_op` also lists this worker's own
        local variables, such as sync mode's `sync_rep_local_step`, which a restarted chief has not initialised)."""
        return not sess.run(self._scaffold.ready_for_local_init_op).size

    def _restore_or_initialise(self, sess) -> None:
        from psworker.train import checkpoints

        choice = self._choose()
        if choice is not None and choice.path:
            if choice.rejected:
                log.warning("%s: %s", self._name, checkpoints.fallback_message(choice))
                checkpoints.write_state(self._checkpoint_dir, choice.kept)
            log.info("%s", events.ModelStart(self._name, os.path.basename(choice.path)).render())
            self._restore(sess, choice.path)
            return
        if choice is not None and choice.refused:
            if not self._allow_fresh_start:
                raise checkpoints.refusal(self._checkpoint_dir, choice)
            bad = checkpoints.describe_rejected(choice.rejected)
            log.warning("%s: no usable checkpoint in %s (%s); starting from scratch, as allow_fresh_start says",
                        self._name, self._checkpoint_dir, bad)
        else:
            log.info("%s", events.ModelStart(self._name, None).render())
        sess.run(self._scaffold.init_op, feed_dict=self._scaffold.init_feed_dict)
        if self._scaffold.init_fn is not None:
            self._scaffold.init_fn(sess)

    def _choose(self):
        """The checkpoints.Choice for this restore (None: no checkpoint dir)."""
        from psworker.train import checkpoints

        choice, self._first_choice = self._first_choice, None
        if choice is not None and self.sessions_created == 1:   # later, newer checkpoints may be there
            return choice
        if not self._checkpoint_dir:
            return None
        return checkpoints.choose(self._checkpoint_dir, checkpoints.expected_variables())

    def _restore(self, sess, path: str) -> None:
        """`saver.restore`; a failure other than a peer's (which MonitoredSession retries) is a TrainingFailed
        naming the checkpoint and, where the files show it, the variable."""
        import tensorflow as tf

        from psworker.errors import TrainingFailed
        from psworker.train import checkpoints

        try:
            self._restore_fn(sess, path)
        except (tf.errors.UnavailableError, tf.errors.AbortedError, tf.errors.DeadlineExceededError,
                tf.errors.CancelledError):
            raise
        except tf.errors.OpError as exc:
            found = next((f for f in checkpoints.find(os.path.dirname(path)) if f.prefix == path), None)
            why = checkpoints.problem(found, checkpoints.expected_variables()) if found else None
            detail = why or op_error_line(exc)
            raise TrainingFailed(f"{self._name}: restoring the checkpoint {path} failed: {detail}") from None

    def _local_init(self, sess) -> None:
        if self._scaffold.local_init_op is not None:
            sess.run(self._scaffold.local_init_op, feed_dict=self._scaffold.local_init_feed_dict)
        not_ready = sess.run(self._scaffold.ready_op)
        if not_ready.size:
            raise RuntimeError(f"{self._name}: the model is not ready after its local init: {not_ready}")

    def _wait_for_model(self, sess) -> None:
        """Polls until the chief has initialised the model, then runs this worker's local init (one session
        throughout, unlike TF's `SessionManager.wait_for_session`, so that the input warm-up keeps running)."""
        import tensorflow as tf

        log.info("%s: waiting for the chief's model on the ps tasks", self._name)
        deadline = time.monotonic() + self._max_wait_secs
        while not self._model_is_live(sess):
            if time.monotonic() + RECOVERY_WAIT_SECS > deadline:
                raise tf.errors.DeadlineExceededError(
                    None, None, f"the chief's model was not ready after {self._max_wait_secs:g} s "
                    "(--startup_timeout_secs): is the chief, worker 0, running?")
            time.sleep(RECOVERY_WAIT_SECS)
        self._local_init(sess)


def _fetch_quietly(sess, fetches, name: str) -> None:
    """One run of `fetches`; an error is the training step's to report (it runs the same input)."""
    try:
        sess.run(fetches)
    except Exception as exc:   # noqa: BLE001 - the first step meets the same error and reports it
        log.debug("%s: input warm-up: %s", name, exc)
