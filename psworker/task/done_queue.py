"""The done-token queues: every task that waits for others to finish owns a FIFO queue, shared by name, on its own
device; a finished task enqueues its index there (`send_done`, `signal_done`), and the owner reads it from a thread
whose every run has a timeout (`DoneReader`), so that waiting never blocks in TensorFlow."""

from __future__ import annotations

import logging
import queue as pyqueue
import threading
import time
from typing import Callable, Iterable, Optional

from psworker.errors import op_error_line
from psworker.spec import ClusterSpec
from psworker.states import TaskState

log = logging.getLogger(__name__)

# How often the reader looks again when its queue was empty (or a run failed). Each look is a session run on the
# ps: at 0.05 s they cost the ps ~23% of its CPU while it served a CNN worker (benchmarks/overlap.py); a done or
# membership token is now seen up to 0.25 s later.
POLL_SECS = 0.25
SEND_DONE_SECS = 5.0          # one done-token enqueue
SEND_DONE_AFTER_FAILURE_SECS = 2.0   # the same, from a worker that is failing (be quick)
QUEUE_RUN_SECS = 5.0          # one run on a task's own done queue (its size, or one dequeue)
READER_STALL_SECS = 10.0      # the done-queue reader has not answered this long: said in the log (once per stall)
DONE_QUEUE_PREFIX = "psworker_done_"

# What a token says about its sender, an elastic job's membership included: a token is `base + worker index`.
_TOKEN_BASE = {TaskState.DONE: 0, TaskState.JOINED: 1 << 20, TaskState.LEFT: 2 << 20}


def encode(kind: str, index: int) -> int:
    """The token of worker `index` saying `kind` (DONE's token is the index itself, as before elastic jobs)."""
    return _TOKEN_BASE[kind] + index


def decode(token: int) -> tuple[str, int]:
    """`(kind, worker index)` of a token."""
    for kind, base in sorted(_TOKEN_BASE.items(), key=lambda kv: -kv[1]):
        if token >= base:
            return kind, token - base
    raise ValueError(f"not a done-queue token: {token}")


def done_queue(job: str, index: int, num_workers: int):
    """The FIFO queue on task `job:index` into which finished tasks put their index (shared by name)."""
    import tensorflow as tf

    with tf.device(f"/job:{job}/task:{index}"):
        return tf.queue.FIFOQueue(
            capacity=max(16, 4 * num_workers), dtypes=[tf.int32], shapes=[[]],
            shared_name=f"{DONE_QUEUE_PREFIX}{job}{index}", name=f"done_queue_{job}{index}",
        )


def send_done(target: str, sender: int, receivers: Iterable[tuple[str, int]], num_workers: int, *,
              timeout_secs: float = SEND_DONE_SECS, kind: str = TaskState.DONE) -> None:
    """From worker `sender`'s session at `target`: puts its `kind` token (by default: done) into each receiver's
    done queue.

    A receiver that cannot be reached is logged, not fatal: it watches the sender's port as well.
    """
    import tensorflow as tf

    receivers = list(receivers)
    graph = tf.Graph()
    with graph.as_default():
        token = tf.constant(encode(kind, sender), tf.int32)
        enqueues = [done_queue(job, i, num_workers).enqueue(token) for job, i in receivers]
    filters = sorted({f"/job:{job}/task:{i}" for job, i in receivers} | {f"/job:worker/task:{sender}"})
    config = tf.compat.v1.ConfigProto(device_filters=filters)
    options = tf.compat.v1.RunOptions(timeout_in_ms=int(timeout_secs * 1000))
    with tf.compat.v1.Session(target, graph=graph, config=config) as sess:
        for (job, i), op in zip(receivers, enqueues):
            try:
                sess.run(op, options=options)
            except tf.errors.OpError as exc:
                log.warning("worker:%d could not tell %s:%d that it is %s: %s", sender, job, i,
                            "done" if kind == TaskState.DONE else f"{kind} the job", op_error_line(exc))


def signal_done(target: str, spec: ClusterSpec, worker: int, *, timeout_secs: float = SEND_DONE_SECS,
                kind: str = TaskState.DONE) -> None:
    """Tells every ps that worker `worker` is done (or, in an elastic job, has `JOINED` or `LEFT` it)."""
    send_done(target, worker, [("ps", p) for p in range(len(spec.ps))], len(spec.worker), timeout_secs=timeout_secs,
              kind=kind)


class DoneReader:
    """Reads task `job:index`'s own done queue in a daemon thread of its own, so that the waiting loop (and its
    `GoneWatch`) never blocks in TensorFlow: every run has a timeout (`QUEUE_RUN_SECS`), and a run that fails or
    times out is logged and tried again, never fatal.

    Issue #7: a ps whose only worker was killed mid-step sometimes never exited; its log ended in the rendezvous
    aborts of that step, without the watch's "gone" line, as when the one loop that also ran the watch sat in a run
    on its own server (those runs had no timeout). Now no run can keep the watch from running.

    Tokens are kept until `get` takes them, also across `serve_until_done` calls (`--keep_ps_running`).
    """

    def __init__(self, target: str, job: str, index: int, num_workers: int, *,
                 run_secs: float = QUEUE_RUN_SECS, clock: Callable[[], float] = time.monotonic):
        self._target, self._job, self._index, self._num_workers = target, job, index, num_workers
        self._run_secs = run_secs
        self._clock = clock
        self._tokens: "pyqueue.Queue[int]" = pyqueue.Queue()
        self._stop = threading.Event()
        self.answered_at = clock()      # when a run on the queue last returned (a heartbeat)
        self.failures = 0
        self._thread = threading.Thread(target=self._loop, name=f"done-reader-{job}{index}", daemon=True)
        self._thread.start()

    def get(self, timeout: float) -> Optional[int]:
        """The next sender's index, or None when none came within `timeout` seconds."""
        try:
            return self._tokens.get(timeout=timeout)
        except pyqueue.Empty:
            return None

    def stalled_for(self) -> float:
        """Seconds since a run on the queue last returned."""
        return self._clock() - self.answered_at

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        import tensorflow as tf

        who = f"{self._job}:{self._index}"
        graph = tf.Graph()
        with graph.as_default():
            queue = done_queue(self._job, self._index, self._num_workers)
            dequeue, size = queue.dequeue(), queue.size()
        config = tf.compat.v1.ConfigProto(device_filters=[f"/job:{self._job}/task:{self._index}"],
                                          operation_timeout_in_ms=int(self._run_secs * 1000))
        options = tf.compat.v1.RunOptions(timeout_in_ms=int(self._run_secs * 1000))
        sess = None   # left open at the end: the process leaves through os._exit
        while not self._stop.is_set():
            try:
                if sess is None:
                    sess = tf.compat.v1.Session(self._target, graph=graph, config=config)
                # Poll the size rather than dequeue with a timeout: a timed-out dequeue logs a warning every time.
                waiting = sess.run(size, options=options)
                if waiting and not self._stop.is_set():
                    self._tokens.put(int(sess.run(dequeue, options=options)))
                self.answered_at = self._clock()
            except tf.errors.OpError as exc:
                self.failures += 1
                log.warning("%s: reading its done queue failed (%s); trying again", who,
                            f"{type(exc).__name__}: {op_error_line(exc)}")
                waiting = 0
            if not waiting:
                self._stop.wait(POLL_SECS)


__all__ = ["encode", "decode", "done_queue", "send_done", "signal_done", "DoneReader", "SEND_DONE_SECS",
           "SEND_DONE_AFTER_FAILURE_SECS"]
