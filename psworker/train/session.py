"""Session creation for between-graph workers: fast readiness polling, and a chief that never rolls back a live ps."""

from __future__ import annotations

import logging
import os
from typing import Callable, Optional

log = logging.getLogger(__name__)

RECOVERY_WAIT_SECS = 0.1   # TF's default is 30 s: a non-chief would sleep that long before its first step


def _base_creator():
    import tensorflow as tf

    return tf.compat.v1.train.SessionCreator


class FastSessionCreator(_base_creator()):
    """Creates (and, after a ps failure, re-creates) a worker's session.

    - The chief, when the ps tasks already hold an initialised model (the chief was restarted while they lived),
      continues from it; only when they do not (first start, or a ps was restarted) does it restore the latest
      checkpoint in `checkpoint_dir`, or initialise.
      Before the session is handed over (and the hooks' `after_create_session` run), `on_live_model(session)`
      runs on that path only: sync mode resets the `SyncReplicasOptimizer`'s state on the ps there.
    - Non-chief workers poll for the model every `RECOVERY_WAIT_SECS` instead of TF's 30 s, and give up after
      `max_wait_secs` with a `DeadlineExceededError`.
    - Once `abandon_on_close()` was called, closing a session it made does nothing: the process is about to leave
      through `os._exit`, and `tf.Session.close()` of a gRPC session was measured at 1.7-2.4 s in about a third of
      the runs (the master waits on its workers), the bulk of the time between a worker's last step and its exit.
      The sessions are kept referenced so that garbage collection cannot close them either.
    """

    def __init__(self, scaffold, *, master: str, config, is_chief: bool, checkpoint_dir: Optional[str],
                 max_wait_secs: float, name: str, before_create: Optional[Callable[[], None]] = None,
                 on_live_model: Optional[Callable[[object], None]] = None):
        self._scaffold = scaffold
        self._master = master
        self._config = config
        self._is_chief = is_chief
        self._checkpoint_dir = checkpoint_dir
        self._max_wait_secs = max_wait_secs
        self._name = name
        self._before_create = before_create
        self._on_live_model = on_live_model
        self.sessions_created = 0
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
                return
            real_close()

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
        manager = tf.compat.v1.train.SessionManager(
            local_init_op=self._scaffold.local_init_op,
            local_init_feed_dict=self._scaffold.local_init_feed_dict,
            ready_op=self._scaffold.ready_op,
            ready_for_local_init_op=self._scaffold.ready_for_local_init_op,
            graph=graph,
            recovery_wait_secs=RECOVERY_WAIT_SECS,
        )
        self.sessions_created += 1
        if not self._is_chief:
            log.info("%s: waiting for the chief's model on the ps tasks", self._name)
            return manager.wait_for_session(self._master, config=self._config, max_wait_secs=self._max_wait_secs)
        sess = self._live_model_session(graph)
        if sess is not None:
            log.info("%s: the ps tasks already hold a model; continuing from it (no checkpoint restore)", self._name)
            if self._on_live_model is not None:
                try:
                    self._on_live_model(sess)
                except Exception:
                    sess.close()
                    raise
            return sess
        checkpoint = tf.train.latest_checkpoint(self._checkpoint_dir) if self._checkpoint_dir else None
        if checkpoint:
            log.info("%s: restoring the checkpoint %s", self._name, os.path.basename(checkpoint))
        else:
            log.info("%s: no checkpoint to restore; initialising the model", self._name)
        return manager.prepare_session(
            self._master,
            saver=self._scaffold.saver,
            checkpoint_dir=self._checkpoint_dir,
            init_op=self._scaffold.init_op,
            init_feed_dict=self._scaffold.init_feed_dict,
            init_fn=self._scaffold.init_fn,
            config=self._config,
        )

    def _live_model_session(self, graph):
        """A session on the live model when every global variable is already initialised, else None.

        Global variables only (`ready_for_local_init_op`): `ready_op` also lists this worker's own local variables
        (sync mode's `sync_rep_local_step`), which a restarted chief has not initialised yet.
        """
        import tensorflow as tf

        sess = tf.compat.v1.Session(self._master, graph=graph, config=self._config)
        try:
            if sess.run(self._scaffold.ready_for_local_init_op).size:
                sess.close()
                return None
            if self._scaffold.local_init_op is not None:
                sess.run(self._scaffold.local_init_op, feed_dict=self._scaffold.local_init_feed_dict)
            not_ready = sess.run(self._scaffold.ready_op)
            if not_ready.size:
                raise RuntimeError(f"{self._name}: the live model is not ready after local init: {not_ready}")
            return sess
        except Exception:
            sess.close()
            raise
