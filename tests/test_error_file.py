"""Failures as data (issue 26 §3): a task's one error exit writes `logs/<task>.error.json` where the launcher asks
(`psworker.errorfile`), and the launcher's report takes its root cause from that record, not from the log. Real
processes: psworker's own commands failing for a known reason, and programs under `psworker run`."""

from __future__ import annotations

import errno
import json
import re
import sys
import time

import pytest

from psworker import errorfile
from psworker.diskspace import disk_full
from psworker.errors import EXIT_DISK_FULL, EXIT_TRAINING_FAILED, EXIT_USAGE, TrainingFailed
from psworker.launcher.console.report import format_report
from psworker.testing import ProgramTask, assert_processes_gone
from tests.cluster_utils import REPO, run_launcher

RECORD_FIELDS = {"exit_code", "exit_class", "exception_type", "message", "time", "when", "global_step", "traceback"}


class _NoData(TrainingFailed):
    """A subclass defined outside errors.py: its exit class is still errors.py's."""


def test_a_record_names_the_errors_class_that_chose_the_exit_code():
    record = errorfile.record_of(_NoData("no data"), EXIT_TRAINING_FAILED, now=0.0)
    assert (record.exit_class, record.exception_type, record.message) == (
        "TrainingFailed", f"{__name__}._NoData", "no data")
    assert record.when == "1970-01-01T00:00:00+00:00" and record.traceback == ()
    assert record.describe() == "TrainingFailed, exit 3"


def test_a_full_disk_records_the_exception_that_was_raised():
    raised = OSError(errno.ENOSPC, "No space left on device", "/tmp/x/model.ckpt-5.index")
    record = errorfile.record_of(disk_full(raised), EXIT_DISK_FULL, cause=raised)
    assert (record.exit_class, record.exception_type) == ("DiskFull", "OSError")
    assert "cannot write /tmp/x/model.ckpt-5.index" in record.message


def test_a_bug_keeps_the_end_of_its_traceback():
    try:
        {}["missing"]
    except KeyError as e:
        record = errorfile.record_of(e, 1)
    assert record.exit_class is None and record.exception_type == "KeyError"
    assert record.traceback[0].startswith("Traceback") and record.traceback[-1] == "KeyError: 'missing'"
    assert record.describe() == "unexpected KeyError, exit 1"


def test_a_record_written_is_read_back_and_anything_else_is_none(tmp_path):
    record = errorfile.record_of(TrainingFailed("nan"), 3)
    path = errorfile.write_record(record, str(tmp_path / "w.error.json"))
    assert set(json.loads(path.read_text())) == RECORD_FIELDS
    assert errorfile.read_record(path) == record
    (tmp_path / "bad.json").write_text('{"exit_code": 3}')
    assert errorfile.read_record(tmp_path / "bad.json") is None
    assert errorfile.read_record(tmp_path / "absent.json") is None
    assert errorfile.write_record(record, str(tmp_path / "no" / "dir" / "x.json")) is None   # warned, not raised


def _psworker(job: str, index: int, *args: str) -> ProgramTask:
    return ProgramTask(job, index, (sys.executable, "-m", "psworker", job, *args))


def test_a_psworker_task_that_fails_writes_its_record_and_the_report_reads_it(make_supervisor, tmp_path):
    """`psworker worker` with a spec that is not there: exit 2 through the one error exit, its record beside its
    log, the report's first line its message, and no log tail."""
    missing = tmp_path / "missing.yaml"
    sup = make_supervisor([_psworker("worker", 0, "--spec", str(missing), "--task_index", "0")], start=True)
    result = sup.wait(timeout=120)
    failure = result.failure
    path = sup.log_dir / "worker-0.error.json"
    assert failure.error_file == str(path) and failure.record == errorfile.read_record(path)
    record = failure.record
    assert (record.exit_code, record.exit_class, record.exception_type, record.global_step) == (
        EXIT_USAGE, "SpecError", "psworker.errors.SpecError", None)
    assert record.message == f"{missing}: no such file" == failure.error
    report = format_report(result)
    first = report.splitlines()[0]
    assert first.startswith("psworker: run failed: worker:0 exited with exit code 2") and first.endswith(
        f": {missing}: no such file"), report
    assert f"--- worker:0's error: SpecError, exit 2 ({path}; full log: " in report
    assert "lines of worker:0" not in report


# Attempt 1 writes a record and exits 143 (retried); attempt 2 exits 3 and writes none.
TWO_ATTEMPTS = """
import os, pathlib, sys
from psworker import errorfile
from psworker.errors import StepTimeout
seen = pathlib.Path(sys.argv[1])
if not seen.exists():
    seen.touch()
    errorfile.write_record(errorfile.record_of(StepTimeout("attempt 1 timed out"), 143))
    sys.exit(143)
print("attempt 2 fails without a record", flush=True)
sys.exit(3)
"""


def test_an_earlier_attempts_record_is_not_taken_for_the_current_one(make_supervisor, tmp_path):
    from psworker.launcher.policy import RestartPolicy

    task = ProgramTask("worker", 0, (sys.executable, "-c", TWO_ATTEMPTS, str(tmp_path / "seen")))
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    (log_dir / "worker-0.error.json").write_text("left by an earlier run")
    sup = make_supervisor([task], start=True, log_dir=log_dir,
                          restart_policy=RestartPolicy(max_restarts=1, backoff_secs=0))
    result = sup.wait(timeout=60)
    assert result.exits["worker:0"].restarts == 1 and result.failure.returncode == 3
    assert result.failure.record is None and not (log_dir / "worker-0.error.json").exists()
    report = format_report(result)
    assert "attempt 1 timed out" not in report and "attempt 2 fails without a record" in report, report


# A user's program may write the record too: its message, not the log's, is the root cause.
OWN_RECORD = """
import os, sys
from psworker import errorfile
from psworker.errors import TrainingFailed
if os.environ["PSWORKER_JOB_NAME"] == "ps":
    import time; time.sleep(60)
errorfile.write_record(errorfile.record_of(TrainingFailed("said in the error file"), 3))
print("psworker: error: said in the log", flush=True)
sys.exit(3)
"""


def test_the_report_takes_the_message_from_the_error_file_not_the_log(tmp_path):
    spec = tmp_path / "c.yaml"
    spec.write_text("cluster: {ps: ['localhost:auto'], worker: ['localhost:auto']}\n")
    run_dir = tmp_path / "run"
    run = run_launcher([str(spec), "--train_dir", str(run_dir), "--console", "plain", "--", sys.executable, "-c", OWN_RECORD],
                       cwd=tmp_path, timeout=120, command="run")
    assert run.returncode == 3, run.output
    first = next(line for line in run.output.splitlines() if line.startswith("psworker: run failed"))
    assert first.startswith("psworker: run failed: worker:0 exited with exit code 3") and first.endswith(
        ": said in the error file"), run.output
    assert f"worker:0's error: TrainingFailed, exit 3 ({run_dir}/logs/worker-0.error.json" in run.output
    assert "said in the log" in (run_dir / "logs" / "worker-0.log").read_text()
    assert_processes_gone(run.pids)


@pytest.mark.slow
def test_a_real_run_that_diverges_reports_the_nan_from_the_error_file(tmp_path):
    """`psworker local` training the MLP with a learning rate that makes the loss NaN: the worker that sees it exits
    3 through the one error exit, its record names TrainingFailed and the global step, the report's first line is
    its message, and every process is gone."""
    run_dir = tmp_path / "run"
    started = time.time()
    run = run_launcher([str(REPO / "cluster_specs" / "local.yaml"), "--train_dir", str(run_dir), "--console", "plain",
                        "--learning_rate", "1e30"], cwd=tmp_path, timeout=300)
    assert run.returncode == EXIT_TRAINING_FAILED, run.output[-4000:]
    first = next(line for line in run.output.splitlines() if line.startswith("psworker: run failed"))
    m = re.match(r"psworker: run failed: (worker:\d) exited with exit code 3 \(first failure, at [\d:.]+\): "
                 r"(worker:\d): the loss became NaN \(lower --learning_rate\?\)$", first)
    assert m and m.group(1) == m.group(2), first
    name = m.group(1)
    record = errorfile.read_record(run_dir / "logs" / f"{name.replace(':', '-')}.error.json")
    assert (record.exit_code, record.exit_class, record.exception_type) == (
        EXIT_TRAINING_FAILED, "TrainingFailed", "psworker.errors.TrainingFailed")
    assert record.message == f"{name}: the loss became NaN (lower --learning_rate?)"
    assert started <= record.time <= time.time() and record.traceback == ()
    assert isinstance(record.global_step, int) and record.global_step >= 1, record
    assert f"{name}'s error: TrainingFailed, exit 3, at global step {record.global_step} (" in run.output
    assert_processes_gone(run.pids)


def test_a_tensorflow_error_is_named_by_its_cause_not_its_graph_execution_header():
    """TF 2's OpError messages start "Graph execution error:" and a blank line; the one line psworker logs and
    reports (a done queue read, a restore, a start-up timeout) is the cause after them. A real timed-out run."""
    import tensorflow as tf

    from psworker.errors import op_error_line

    with tf.Graph().as_default():
        dequeue = tf.queue.FIFOQueue(1, tf.int32).dequeue()
        with tf.compat.v1.Session() as sess, pytest.raises(tf.errors.DeadlineExceededError) as caught:
            sess.run(dequeue, options=tf.compat.v1.RunOptions(timeout_in_ms=100))
    assert caught.value.message.startswith("Graph execution error:")
    assert op_error_line(caught.value) == "Timed out waiting for notification"
