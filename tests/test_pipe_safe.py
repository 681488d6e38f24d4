"""`psworker local ... | head`: the console's reader goes, the run does not."""

import os
import subprocess
import sys

import pytest

from psworker.launcher.pipe_safe import PipeSafe
from tests.cluster_utils import task_env


def test_writes_after_the_reader_closed_the_pipe_are_dropped_not_raised():
    read, write = os.pipe()
    stream = os.fdopen(write, "w", buffering=1)
    console = PipeSafe(stream)
    console.write("first\n")
    console.flush()
    assert os.read(read, 100) == b"first\n"
    os.close(read)
    console.write("after the reader left\n")
    console.flush()
    assert console.closed_by_reader
    assert not console.isatty()


def test_other_write_errors_still_raise(tmp_path):
    stream = open(tmp_path / "f", "w")
    stream.close()
    with pytest.raises(ValueError):
        PipeSafe(stream).write("x")


WORKER = """import os, pathlib, sys, time
if os.environ["PSWORKER_JOB_NAME"] == "ps":
    time.sleep(120)
go = pathlib.Path(sys.argv[1])
deadline = time.monotonic() + 60
while not go.exists():
    if time.monotonic() > deadline:
        sys.exit("the test never wrote " + str(go))
    time.sleep(0.05)
"""


def test_a_launcher_piped_into_head_ends_with_its_run_s_exit_and_no_traceback(tmp_path):
    """`head` goes after the first line; the worker exits 0 only then, so the launcher's last lines meet a closed
    pipe."""
    spec = tmp_path / "c.yaml"
    spec.write_text("cluster: {ps: ['localhost:auto'], worker: ['localhost:auto']}\n")
    go = tmp_path / "go"
    launcher = subprocess.Popen([sys.executable, "-m", "psworker", "run", str(spec), "--train_dir",
                                 str(tmp_path / "run"), "--console", "plain", "--", sys.executable, "-c", WORKER, str(go)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=task_env(), cwd=tmp_path)
    try:
        first = launcher.stdout.readline()
        assert first.startswith(b"psworker: starting"), first
        launcher.stdout.close()
        go.touch()
        _, err = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
        launcher.wait()
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()[-2000:]
    assert launcher.returncode == 0, err.decode()[-2000:]
