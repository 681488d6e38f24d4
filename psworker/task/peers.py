"""The sync chief's watch on the other workers: too few up for a step is an error, not a slow run.

`SyncReplicasOptimizer` counts gradients, not workers: when a worker dies while no token is out for it, the
survivors take its tokens and push its share, so a 2-of-2 sync run goes on at half speed with every step's
gradients from one worker; when it dies holding a token, every survivor waits for a token and the step times out.
Which of the two happens is chance (CI saw both). With this watch both end the same way: once fewer workers than
a step needs gradients from have been up for `--step_timeout_secs`, the chief stops with an error that names who is
down, and the others' next steps time out for want of a token. Only the chief watches (N-1 probes per interval,
not N^2 across the cluster). Backup workers (`--replicas_to_aggregate` below the workers) keep a run going while
enough are up.
"""

from __future__ import annotations

import threading
from typing import Optional

from psworker.task.shutdown import PEER_CHECK_SECS, GoneWatch


class SyncPeerWatch:
    """Probes the other workers' ports in a daemon thread (a context manager); `failure()` says when too few are up.

    Args:
        name: this worker's name for messages (`worker:0`).
        peers: `{index: "host:port"}` of the other workers.
        needed: the workers a step needs gradients from (`replicas_to_aggregate`, this one included).
        down_secs: how long too few may be up before `failure()` answers (`--step_timeout_secs`).
        never_seen_secs: the same for a worker not seen up since this one started (it may still be starting).
        every_secs: how often the ports are probed.
    """

    def __init__(self, name: str, peers: dict[int, str], *, needed: int, down_secs: float, never_seen_secs: float,
                 every_secs: float = PEER_CHECK_SECS, watch: Optional[GoneWatch] = None):
        self._name = name
        self._peers = dict(peers)
        self._needed = min(needed, len(peers) + 1)
        self._down_secs = down_secs
        self._never_seen_secs = never_seen_secs
        self._every = every_secs
        self._watch = watch or GoneWatch(self._peers, every_secs=0.0)
        self._lock = threading.Lock()
        self._failure: Optional[str] = None
        self._down = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="psworker-sync-peers", daemon=True)

    def __enter__(self) -> "SyncPeerWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _loop(self) -> None:
        while True:
            self._watch.update()
            failure = self.check()
            with self._lock:
                self._failure, self._down = failure, self._describe()
            if self._stop.wait(self._every):
                return

    def failure(self) -> Optional[str]:
        """The error message once fewer than `needed` workers have been up for the allowed time, else None (as of
        the last probe: a step pays for no probe)."""
        with self._lock:
            return self._failure

    def describe_down(self) -> str:
        """Who was down at the last probe, for an error message (empty when every worker was up)."""
        with self._lock:
            return self._down

    def _gone(self) -> dict[int, float]:
        return {i: secs for i in self._peers if (secs := self._watch.gone_for(i)) > 0}

    def _describe(self) -> str:
        return ", ".join(f"worker:{i} at {self._peers[i]} ({secs:.0f} s)" for i, secs in sorted(self._gone().items()))

    def check(self) -> Optional[str]:
        """Probes nothing: the failure message from the watch as it stands, else None (the thread calls it; public
        for tests)."""
        down = self._gone()
        total = len(self._peers) + 1
        up = total - len(down)
        if up >= self._needed:
            return None
        # Short of workers since the outage that left too few began: with outages longest first, the one after
        # the (total - needed) the run can do without.
        index, secs = sorted(down.items(), key=lambda kv: -kv[1])[total - self._needed]
        if secs < (self._down_secs if index in self._watch.seen else self._never_seen_secs):
            return None
        return (f"{self._name}: a sync step needs gradients from {self._needed} of {total} workers, and only {up} "
                f"have been up for {secs:.0f} s (--step_timeout_secs {self._down_secs:g}); down: {self._describe()}. "
                "Start them again (they rejoin), or run with fewer --replicas_to_aggregate than workers so that the "
                "others can go on without them")


__all__ = ["SyncPeerWatch"]
