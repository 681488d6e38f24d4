"""A full disk is a clear failure, never a crash (issue 24, section 2).

End to end: a `psworker local` run whose train dir is a small tmpfs mounted in a private mount namespace
(`unshare -m`, as root). Once the chief has written a checkpoint, the test fills the tmpfs (from inside that
namespace, with nsenter) so that the next checkpoint cannot be written; the launcher must exit non-zero with the
path in its report's first line, print no traceback of its own, leave nothing running, and the checkpoint before
stays usable: a second run on a bigger disk continues from it. Pure parts: `diskspace.disk_full` on real errors,
and the launcher's log copy into `/dev/full`.
"""

from __future__ import annotations

import collections
import errno
import io
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from psworker import diskspace, events
from psworker.errors import EXIT_DISK_FULL, DiskFull
from psworker.launcher.console.output import OutputCopier
from psworker.launcher.console.progress import Progress
from psworker.testing import assert_processes_gone, checkpoint_step, processes_naming
from tests.cluster_utils import Background, run_launcher

TMPFS_BYTES = 32 << 20        # the run fits easily (graph files ~6 MB, each checkpoint ~0.9 MB) until the test fills it
LEFT_FREE_BYTES = 16 << 10    # what the fill leaves: a few pages for the logs and the workers' summaries, less than a
                              # checkpoint's data (~77 KB for this MLP), whose write comes before anything of the save
                              # is deleted. With 256 KB left, runs that kept 5 checkpoints went on: TF's Saver deletes
                              # the oldest (~0.9 MB) once the new data and index are written, before the .meta.
SAVE_EVERY = 50
RUN_SECS = 420
CHECKPOINT_LINE = re.compile(r"worker:0: checkpoint of global step (\d+) saved")

# Run inside the namespace by nsenter: fills the file system of argv[1] with argv[1]/filler until argv[2] bytes are
# free (less when the run wrote meanwhile: each try asks for what is free now).
_FILL = ("import os, sys\nd, keep = sys.argv[1], int(sys.argv[2])\n"
         "fd = os.open(os.path.join(d, 'filler'), os.O_CREAT | os.O_WRONLY)\nfor _ in range(20):\n"
         "    st = os.statvfs(d)\n    n = os.fstat(fd).st_size + st.f_bavail * st.f_frsize - keep\n"
         "    try:\n        os.posix_fallocate(fd, 0, n)\n        break\n"
         "    except OSError:\n        continue\nelse:\n    sys.exit('could not fill ' + d)\nprint(n)\n")
# The driver: mounts the tmpfs on $1 (size $2), runs the launcher (the words after $3), then copies what the run
# left (without the filler) to $3: the next run's "bigger disk". Paths come as arguments, never inside the script.
_DRIVER = ('set -u; mnt=$1; size=$2; out=$3; shift 3; mount -t tmpfs -o "size=$size" psworker-test "$mnt" || exit 90; '
           '"$@"; rc=$?; rm -f "$mnt/filler"; cp -a "$mnt/." "$out/"; exit $rc')


def _can_mount_tmpfs() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("nsenter") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs -o size=1m psworker-probe /mnt"], capture_output=True, timeout=30)
    return probe.returncode == 0


needs_mount_ns = pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs root, unshare -m and nsenter (as on CI)")


def _spec(path: Path) -> Path:
    path.write_text("cluster:\n  ps: [\"localhost:auto\"]\n  worker: [\"localhost:auto\"]\n"
                    "train:\n  model: mlp\n  mode: async\n  batch_size: 32\n"
                    f"  save_checkpoint_steps: {SAVE_EVERY}\n")
    return path


@needs_mount_ns
def test_full_disk_fails_clearly_and_the_previous_checkpoint_restores(tmp_path):
    spec, mnt, after = _spec(tmp_path / "spec.yaml"), tmp_path / "mnt", tmp_path / "after"
    mnt.mkdir()
    after.mkdir()
    launcher = [sys.executable, "-m", "psworker", "local", str(spec), "--train_dir", str(mnt), "--max_steps", "1000000",
                "--network", "host", "--console", "plain", "--verbose"]
    run = Background(["unshare", "-m", "--propagation", "private", "sh", "-c", _DRIVER, "driver", str(mnt),
                str(TMPFS_BYTES), str(after), *launcher], tmp_path)
    try:
        saved = int(run.wait_for(CHECKPOINT_LINE, RUN_SECS, at_least=SAVE_EVERY).group(1))
        filled = subprocess.run(["nsenter", "-t", str(run.proc.pid), "-m", "--", sys.executable, "-c", _FILL,
                                 str(mnt), str(LEFT_FREE_BYTES)], capture_output=True, text=True, timeout=60)
        assert filled.returncode == 0, filled.stderr
        code = run.wait(RUN_SECS)
    finally:
        run.close()
    out = run.output
    assert code == EXIT_DISK_FULL, out[-4000:]
    first = next((line for line in out.splitlines() if line.startswith("psworker: run failed:")), None)
    assert first is not None, out[-4000:]
    assert "disk full" in first and f"{mnt}/model.ckpt-" in first and "free of" in first, first   # a checkpoint's
    assert not [line for line in out.splitlines() if line.startswith("Traceback")], out[-4000:]
    print(first)
    assert_processes_gone(run.pids)
    assert not processes_naming(mnt)
    # The checkpoint before the failed one is intact: a run on a bigger disk restores it and goes on.
    kept = checkpoint_step(after)
    assert kept >= saved, (kept, saved)
    again = run_launcher([str(spec), "--train_dir", str(after), "--max_steps", str(kept + SAVE_EVERY),
                          "--network", "host", "--console", "plain"], tmp_path, RUN_SECS)
    assert again.returncode == 0, again.output[-4000:]
    first_step = events.last(events.FirstStep, (after / "logs" / "worker-0.log").read_text(errors="replace"))
    assert first_step is not None and first_step.step >= kept, first_step
    assert checkpoint_step(after) == kept + SAVE_EVERY


def test_disk_full_reads_tensorflows_and_pythons_errors(tmp_path):
    import tensorflow as tf

    tf_error = tf.errors.ResourceExhaustedError(None, None, f"{tmp_path}/model.ckpt-9.meta.tmp1; No space left on device")
    found = diskspace.disk_full(tf_error)
    assert isinstance(found, DiskFull) and found.exit_code == EXIT_DISK_FULL
    assert found.path == f"{tmp_path}/model.ckpt-9.meta.tmp1"
    assert str(found).startswith(f"disk full: cannot write {tmp_path}/model.ckpt-9.meta.tmp1 (")
    assert "free of" in str(found)
    wrapped = RuntimeError("while saving")
    wrapped.__cause__ = OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), str(tmp_path / "x"))
    assert str(diskspace.disk_full(wrapped)).startswith(f"disk quota exceeded: cannot write {tmp_path / 'x'}")
    read_only = tf.errors.PermissionDeniedError(None, None, "/ro/events.out; Read-only file system")
    assert diskspace.disk_full(read_only).path == "/ro/events.out"
    assert diskspace.disk_full(OSError(errno.EIO, "Input/output error")) is None
    assert diskspace.disk_full(ValueError("No space left on device")) is None


def test_a_log_that_cannot_be_written_warns_once_and_the_console_goes_on(caplog):
    console = io.StringIO()
    copier = OutputCopier(console, None, Progress(["worker:0", "worker:1"]))
    with caplog.at_level(logging.DEBUG, logger="psworker.launcher.console.output"):
        for name in ("worker:0", "worker:1"):
            copier.pump(name, io.BytesIO(b"one\ntwo\nthree\n"), open("/dev/full", "ab", buffering=0),
                        collections.deque(maxlen=20))
    copier.close()
    assert console.getvalue().splitlines() == [f"[{n}] {line}" for n in ("worker:0", "worker:1")
                                               for line in ("one", "two", "three")]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "/dev/full" in warnings[0] and "No space left on device" in warnings[0], warnings
    assert copier.errors == []


def test_the_banner_warns_when_the_next_checkpoint_may_not_fit(tmp_path):
    for step, size in ((99, 10), (100, 20)):
        for suffix in ("index", "meta", "data-00000-of-00001"):
            (tmp_path / f"model.ckpt-{step}.{suffix}").write_bytes(b"x" * size)
    assert diskspace.newest_checkpoint_bytes(str(tmp_path)) == ("model.ckpt-100", 60)
    assert diskspace.space_warning(str(tmp_path)) is None          # 60 bytes fit twice on any disk here
    free = diskspace.free_space(str(tmp_path))[0]
    os.truncate(tmp_path / "model.ckpt-100.data-00000-of-00001", free)    # sparse: counts in st_size only
    warning = diskspace.space_warning(str(tmp_path))
    assert warning is not None and "model.ckpt-100" in warning and "may not fit" in warning, warning
    assert diskspace.space_warning(str(tmp_path / "none")) is None


# Run on a full tmpfs: TensorFlow's own failed writes, a checkpoint's data (SaveV2) and a summary (the events file
# writer's thread), each as `diskspace.disk_full` reads it.
_TF_WRITES = """
import os, sys
import tensorflow as tf
from psworker import diskspace
tf.compat.v1.disable_eager_execution()
d = sys.argv[1]
tf.compat.v1.get_variable("big", shape=[512, 1024], initializer=tf.compat.v1.zeros_initializer())
writer = tf.compat.v1.summary.FileWriter(os.path.join(d, "worker_0"))
fd = os.open(os.path.join(d, "filler"), os.O_CREAT | os.O_WRONLY)
os.posix_fallocate(fd, 0, os.statvfs(d).f_bavail * os.statvfs(d).f_frsize)
with tf.compat.v1.Session() as s:
    s.run(tf.compat.v1.global_variables_initializer())
    try:
        tf.compat.v1.train.Saver(sharded=True).save(s, os.path.join(d, "model.ckpt"), global_step=1)
    except Exception as e:
        print("SAVE", diskspace.disk_full(e), flush=True)
try:
    for i in range(10000):
        value = tf.compat.v1.Summary.Value(tag="x" * 200, simple_value=1.0)
        writer.add_summary(tf.compat.v1.Summary(value=[value]), i)
        writer.flush()
except Exception as e:
    print("SUMMARY", diskspace.disk_full(e), flush=True)
"""


@needs_mount_ns
def test_tensorflows_failed_checkpoint_and_summary_writes_are_disk_full(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    run = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                          'mount -t tmpfs -o size=512k psworker-test "$1" && shift && exec "$@"', "probe", str(mnt),
                          sys.executable, "-c", _TF_WRITES, str(mnt)], capture_output=True, text=True, timeout=300)
    lines = dict(line.split(" ", 1) for line in run.stdout.splitlines() if line.startswith(("SAVE ", "SUMMARY ")))
    saved = lines.get("SAVE", "")
    assert saved.startswith(f"disk full: cannot write {mnt}/model.ckpt-1_temp/"), run.stdout + run.stderr[-2000:]
    assert lines.get("SUMMARY", "").startswith(f"disk full: cannot write {mnt}/worker_0/events.out.tfevents."), lines
    assert "free of 512 KiB" in lines["SAVE"] and "free of 512 KiB" in lines["SUMMARY"], lines
