"""Serve a run dir with TensorBoard for as long as a `with` block lasts (a subprocess bound to 127.0.0.1)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.request
from typing import Any, Iterator, Optional

from psworker.deadline import poll_until
from psworker.errors import TensorBoardError, UsageError
from psworker.launcher.children import die_with_parent
from psworker.launcher.rundir import LOG_SUBDIR

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
MAX_PORT = 65535
RUN_RELOAD_SECS = 2.0    # a run's TensorBoard rereads its event files this often (each reread reads what is new)


def command(logdir: str, port: int, *, reload_interval_secs: float = 5.0) -> list[str]:
    """The argv that serves `logdir` on 127.0.0.1:`port` (pure-Python loader: no extra data-server process)."""
    return [sys.executable, "-m", "tensorboard.main", "--logdir", logdir, "--host", HOST, "--port", str(port),
            "--load_fast", "false", "--reload_interval", f"{reload_interval_secs:g}"]


@contextlib.contextmanager
def serve(logdir: str, port: int = 0, *, timeout_secs: float = 60.0, reload_interval_secs: float = 5.0,
          log_path: Optional[str] = None, stop_timeout_secs: float = 10.0) -> Iterator[str]:
    """Starts TensorBoard on `logdir`, yields its URL once it answers, and stops it (TERM, then KILL) on exit.

    Args:
        logdir: the directory whose event files (and subdirectories, one run each) TensorBoard shows.
        port: the port on 127.0.0.1; 0 picks a free one.
        timeout_secs: how long to wait for the first answer.
        reload_interval_secs: how often TensorBoard rereads the event files.
        log_path: where TensorBoard's output goes; None: a temporary file, removed afterwards.
        stop_timeout_secs: how long TensorBoard gets to exit after SIGTERM before SIGKILL.

    Yields:
        `http://127.0.0.1:<port>/`.

    Raises:
        TensorBoardError: TensorBoard is missing, exits early, or does not answer within `timeout_secs`.
    """
    port, url = _address(port)
    own_log = log_path is None
    if own_log:
        fd, log_path = tempfile.mkstemp(prefix="psworker-tensorboard-", suffix=".log")
        os.close(fd)
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(command(logdir, port, reload_interval_secs=reload_interval_secs),
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=die_with_parent())
    try:
        _wait_until_up(proc, url, timeout_secs, log_path)
        log.info("TensorBoard on %s at %s (pid %d)", logdir, url, proc.pid)
        yield url
    finally:
        _stop(proc, stop_timeout_secs)
        if own_log:
            with contextlib.suppress(OSError):
                os.remove(log_path)


def start_detached(logdir: str, port: int = 0, *, timeout_secs: float = 60.0) -> tuple[int, str]:
    """Starts TensorBoard on `logdir` for a whole `psworker local` run; returns its pid and URL once it answers.

    For a launcher that then re-executes itself in a private network namespace (same pid, so TensorBoard stays its
    child, and stays reachable on this host's 127.0.0.1): the launcher ends it with `stop_pid`. Its output goes to
    `<logdir>/logs/tensorboard.log`.
    """
    port, url = _address(port)
    log_path = os.path.join(logdir, LOG_SUBDIR, "tensorboard.log")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(command(logdir, port, reload_interval_secs=RUN_RELOAD_SECS), stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=die_with_parent())
    try:
        _wait_until_up(proc, url, timeout_secs, log_path)
    except BaseException:
        _stop(proc, 5.0)
        raise
    proc.returncode = 0          # never waited on through this handle again; `stop_pid` reaps it
    return proc.pid, url


def keeps_serving(console: Any) -> bool:
    """Whether `psworker local --tensorboard` serves on after its run until Ctrl-C: when a person can press it, that
    is when the console is a terminal and this is the main thread. Elsewhere (CI, a pipe, a file, a library call)
    TensorBoard stops with the run, and the launcher prints the `psworker tensorboard` command that serves it."""
    isatty = getattr(console, "isatty", lambda: False)
    return bool(isatty()) and threading.current_thread() is threading.main_thread()


def serve_until_interrupted(pid: int, poll_secs: float = 1.0) -> None:
    """Returns at Ctrl-C (SIGINT), SIGTERM or SIGHUP, or once TensorBoard (`start_detached`'s `pid`, our child) has
    exited by itself; the old signal handlers return after. Call it from the main thread."""
    stop = threading.Event()
    old = {sig: signal.signal(sig, lambda signum, frame: stop.set())
           for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        while not stop.wait(poll_secs):
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    log.warning("TensorBoard (pid %d) exited by itself", pid)
                    return
            except ChildProcessError:
                return
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def stop_pid(pid: int, timeout_secs: float = 10.0) -> None:
    """Ends a TensorBoard started by `start_detached` in this process (before an exec): TERM, then KILL; reaped."""
    def reaped() -> bool:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return True
        return bool(done)

    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)
        if poll_until(reaped, timeout_secs, interval=0.1):
            return
    log.error("TensorBoard (pid %d) survived SIGKILL", pid)


def _address(port: int) -> tuple[int, str]:
    """The port (a free one for 0) and URL to serve on; fails first if the port is out of range or TensorBoard is
    not installed."""
    import importlib.util

    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= MAX_PORT:
        raise UsageError(f"TensorBoard port {port!r} is out of range 0-{MAX_PORT} (0: a free one)")

    if importlib.util.find_spec("tensorboard") is None:
        raise TensorBoardError("TensorBoard is not installed (TensorFlow 2.21 no longer brings it): "
                               "pip install 'tensorboard==2.21.*'")
    if port == 0:
        from psworker.launcher.ports import pick_free_ports

        port = pick_free_ports(1, HOST)[0]
    return port, f"http://{HOST}:{port}/"


def _wait_until_up(proc: subprocess.Popen, url: str, timeout_secs: float, log_path: str) -> None:
    def answers() -> bool:
        code = proc.poll()
        if code is not None:
            raise TensorBoardError(f"TensorBoard exited with code {code} before answering at {url}; its output:\n"
                                   f"{_tail(log_path)}")
        try:
            with urllib.request.urlopen(url + "data/runs", timeout=2.0) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    if not poll_until(answers, timeout_secs, interval=0.25):
        raise TensorBoardError(f"TensorBoard did not answer at {url} within {timeout_secs:g} s; its output:\n"
                               f"{_tail(log_path)}")


def _stop(proc: subprocess.Popen, timeout_secs: float) -> None:
    """SIGTERM to TensorBoard's process group, SIGKILL after `timeout_secs`; always reaps it."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=timeout_secs)
        except subprocess.TimeoutExpired:
            if sig == signal.SIGKILL:
                log.error("TensorBoard (pid %d) survived SIGKILL for %g s", proc.pid, timeout_secs)
            continue
    # Anything TensorBoard started in its group goes with it.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _tail(path: str, lines: int = 20) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "(no output)"


__all__ = ["serve", "command", "start_detached", "keeps_serving", "serve_until_interrupted", "stop_pid",
           "TensorBoardError", "HOST"]
