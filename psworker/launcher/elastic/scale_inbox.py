"""`psworker scale` and the launcher talk through files in the run dir, because the run dir is the one place both
reach on every backend (on Slurm, a shared file system seen from the login node; a unix socket there would not
cross hosts):

    <run_dir>/elastic.json       the launcher's state: pid, host, heartbeat, membership, last request, finished
    <run_dir>/scale/N.request    one request, {"seq": N, "workers": W}, created atomically (link, never replaced)
    <run_dir>/scale/N.ack        the launcher's answer to request N, {"seq", "accepted", "message"}

Each file is written whole (a temporary file renamed or linked into place), so a reader never sees a part.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from psworker.diskspace import write_atomically
from psworker.deadline import poll_until
from psworker.errors import PsworkerError, UsageError
from psworker.launcher.elastic.membership import out_of_range
from psworker.launcher.rundir import ELASTIC_FILE, SPEC_FILE, read_elastic_state, read_json

__all__ = ["ACK_TIMEOUT_SECS", "ScaleInbox", "ScaleRequest", "request_scale"]

logger = logging.getLogger(__name__)

REQUEST_DIR = "scale"
HEARTBEAT_SECS = 2.0          # the launcher rewrites its state file at least this often
STALE_SECS = 30.0             # a launcher on another host not heard from this long is gone
ACK_TIMEOUT_SECS = 60.0
_POLL_SECS = 0.1


@dataclass(frozen=True)
class ScaleRequest:
    """One `psworker scale` request: number `seq` of this run dir, for `workers` workers."""

    seq: int
    workers: int


def _seqs(folder: Path, suffix: str) -> list[int]:
    return sorted(int(p.stem) for p in folder.glob(f"*{suffix}") if p.stem.isdigit())


class ScaleInbox:
    """The launcher's end: new requests in order, answers, and the state file (with its heartbeat)."""

    def __init__(self, run_dir: Union[str, os.PathLike]) -> None:
        self._dir = Path(run_dir) / REQUEST_DIR
        self._dir.mkdir(parents=True, exist_ok=True)
        self._state = Path(run_dir) / ELASTIC_FILE
        seqs = _seqs(self._dir, ".request")
        self._last = seqs[-1] if seqs else 0          # an earlier launcher's requests are not this run's
        self._written: Optional[str] = None
        self._written_at = 0.0
        self._write_failed = False
        self._base = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}

    @property
    def last_seq(self) -> int:
        return self._last

    def requests(self) -> list[ScaleRequest]:
        """The requests not taken yet, oldest first (each is taken once)."""
        new = []
        for seq in _seqs(self._dir, ".request"):
            if seq <= self._last:
                continue
            self._last = seq
            body = read_json(self._dir / f"{seq}.request") or {}
            workers = body.get("workers")
            new.append(ScaleRequest(seq, workers if isinstance(workers, int) else -1))
        return new

    def answer(self, request: ScaleRequest, accepted: bool, message: str) -> None:
        write_atomically(self._dir / f"{request.seq}.ack",
                         json.dumps({"seq": request.seq, "accepted": accepted, "message": message}))

    def publish(self, members: dict, finished: Optional[str] = None) -> None:
        """Rewrites the state file when `members` or `finished` changed, or its heartbeat is due."""
        body = json.dumps({**self._base, "members": members, "last_request": self._last, "finished": finished},
                          sort_keys=True)
        now = time.time()
        if body == self._written and now - self._written_at < HEARTBEAT_SECS:
            return
        data = json.loads(body)
        data["heartbeat"] = now
        try:
            write_atomically(self._state, json.dumps(data, indent=1))
        except OSError as err:   # e.g. a full disk: `psworker scale` then finds no heartbeat; the run goes on
            if not self._write_failed:
                logger.warning("cannot write %s (%s); psworker scale will not reach this run until it can",
                               self._state, err)
            self._write_failed = True
            return
        self._written, self._written_at = body, now


def _launcher_gone(state: dict, now: float) -> Optional[str]:
    """Why the launcher that wrote `state` is no longer there, or None while it runs."""
    if state.get("finished"):
        return f"the run has finished ({state['finished']})"
    pid, host = state.get("pid"), state.get("host")
    if host == socket.gethostname() and isinstance(pid, int):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return f"its launcher (pid {pid} on {host}) is gone"
        except PermissionError:
            pass
    quiet = now - float(state.get("heartbeat", 0))
    if quiet > STALE_SECS:
        return f"its launcher (pid {pid} on {host}) has not been heard from for {quiet:.0f} s"
    return None


def _check_run(run_dir: Path, workers: int) -> dict:
    """The running launcher's state, once the request is known to be valid for this run.

    Raises:
        UsageError: no run dir, a job that is not elastic, `workers` out of range, a finished or orphaned run.
    """
    from psworker.spec import load_spec

    if not (run_dir / SPEC_FILE).is_file():
        raise UsageError(f"{run_dir}: not a run directory (no {SPEC_FILE}; give the train dir or the run dir "
                         "the launcher printed)")
    spec = load_spec(run_dir / SPEC_FILE)
    if spec.elastic is None:
        raise UsageError(f"{run_dir}: the job is not elastic (cluster.worker is a plain list of "
                         f"{len(spec.worker)}); an elastic job gives worker: {{addresses: [...], min: M, start: S}}")
    why = out_of_range(spec.elastic, workers)
    if why:
        raise UsageError(f"{run_dir}: {why}")
    state = read_elastic_state(run_dir)
    if state is None:
        raise UsageError(f"{run_dir}: no launcher runs this job ({ELASTIC_FILE} is missing)")
    gone = _launcher_gone(state, time.time())
    if gone:
        raise UsageError(f"{run_dir}: cannot scale: {gone}")
    return state


def _new_request(folder: Path, workers: int, after: int) -> int:
    """Creates the next request file (never replacing one); returns its number."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".request.{os.getpid()}.tmp"
    seq = max([after, *_seqs(folder, ".request")]) + 1
    tmp.write_text(json.dumps({"seq": seq, "workers": workers, "pid": os.getpid()}), encoding="utf-8")
    try:
        while True:
            try:
                os.link(tmp, folder / f"{seq}.request")
                return seq
            except FileExistsError:
                seq += 1
                tmp.write_text(json.dumps({"seq": seq, "workers": workers, "pid": os.getpid()}), encoding="utf-8")
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def request_scale(run_dir: Union[str, os.PathLike], workers: int, timeout_secs: float = ACK_TIMEOUT_SECS) -> str:
    """Asks the launcher of `run_dir` to run `workers` workers and waits for its answer.

    Returns:
        The launcher's answer (e.g. `scale 2 -> 4 workers (request 1)`).

    Raises:
        UsageError (exit 2): see `_check_run`, or the launcher refused the request (its reason).
        PsworkerError: no answer within `timeout_secs` (the request is withdrawn).
    """
    run_dir = Path(run_dir)
    state = _check_run(run_dir, workers)
    folder = run_dir / REQUEST_DIR
    seq = _new_request(folder, workers, int(state.get("last_request") or 0))

    def answer() -> Optional[str]:
        ack = read_json(folder / f"{seq}.ack")
        if ack is not None:
            if not ack.get("accepted"):
                raise UsageError(f"{run_dir}: the launcher refused request {seq}: {ack.get('message')}")
            return str(ack.get("message"))
        gone = _launcher_gone(read_elastic_state(run_dir) or {}, time.time())
        if gone:
            raise PsworkerError(f"{run_dir}: request {seq} not answered: {gone}")
        return None

    message = poll_until(answer, timeout_secs, interval=_POLL_SECS)
    if message is not None:
        return message
    with contextlib.suppress(OSError):
        (folder / f"{seq}.request").unlink()
    raise PsworkerError(f"{run_dir}: the launcher (pid {state.get('pid')} on {state.get('host')}) did not answer "
                        f"request {seq} within {timeout_secs:g} s; the request was withdrawn")
