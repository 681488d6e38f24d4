"""The event protocol: every line that crosses a process boundary renders and parses back, real lines as tasks
write them (behind the console's and the log's prefixes) parse, and a user's own step lines give the launcher its
progress."""

import dataclasses
import io
import logging
import math
import subprocess

import pytest

from psworker import events
from psworker.launcher.console.lines import for_console
from psworker.launcher.console.progress import Progress
from psworker.train.evaluate import EvalResult, format_result

SAMPLES = [
    events.Step(120, 0.42, 1830.2, 0.035),
    events.Step(7, 1.5),
    events.Step(3),
    events.Step(120, 0.42, 1830.2, 0.035, 1.37, 3),
    events.Step(8, 0.5, epoch=0.25),
    events.DataDealt("worker:0", 900, 3, 3.0, 3, 300),
    events.DataDealt("worker:0", 1800, 0, 3.0, 3, 600, 45),
    events.CheckpointSaved("worker:0", 4016),
    events.ModelStart("worker:0", "model.ckpt-4016"),
    events.ModelStart("worker:0", None),
    events.DataDealt(None, 640, 0, 2.13, None, 300),
    events.FirstStep("worker:1", 23),
    events.WorkerDone("worker:0", 401, 97, 19.8),
    events.FoundComplete("worker:2", 300, 300),
    events.FoundComplete("worker:1", 300, 300, "/tmp/run dir/train"),
    events.PsDone("ps:0"),
    events.PsDone("ps:1", training_complete=True),
    events.PsDone("ps:1", still_serving=True),
    events.PsDone("ps:3", peak_rss=612 * 2 ** 20),
    events.TfImported("ps:0", 4.732),
    events.Precision(0.947, 359, 401, "2026-12-01 21:21:34"),
    events.Precision(0.5),
    events.AucResult(0.8561, 0.4628, 4000, 300, "2026-12-02 22:27:59"),
    events.AucResult(0.5, 0.6931),
    events.Exported("r3/model.ckpt-401", 401, "/data/r 3/export/401", "worker:0"),
    events.Exported("train/model.ckpt-20", 20, "out/20"),
    events.StopSaved("worker:0", "SIGTERM", 4042, "/data/r 3"),
    events.StopSaved(None, "SIGINT", 0, "train"),
    events.Restart(2, "exit code 170 (a peer went away) after injected kill:worker:0@step=30", "2026-12-01T12:00:00.123"),
    events.NewRun("worker:0", "2026-12-01T12:00:00.123"),
    events.RemotePid(4242),
    events.TaskError("worker:1: timed out (after 60 s): ps:0 at 127.0.0.1:2222"),
    events.Traceback(),
]

# Lines copied from real runs' logs and consoles (README's run, task logs with their log-record prefix).
REAL = {
    "[worker:1] step 195, loss = 0.13 (9507.5 examples/sec; 0.007 sec/batch)": events.Step(195, 0.13, 9507.5, 0.007),
    "2026-12-01 21:21:14,012 INFO psworker.train.hooks: worker:1: first step done at global step 2":
        events.FirstStep("worker:1", 2),
    "2026-12-01 21:21:33,902 INFO psworker.task.runner: worker:1: done at global step 400 after 387 local steps in "
    "20.1 s": events.WorkerDone("worker:1", 400, 387, 20.1),
    "[worker:0] done at global step 401 after 97 local steps in 19.8 s": events.WorkerDone("worker:0", 401, 97, 19.8),
    "[worker:0] 2026-12-01 21:21:34: precision @ 1 = 0.947 (359 examples, global step 401)":
        events.Precision(0.947, 359, 401, "2026-12-01 21:21:34"),
    "psworker: precision @ 1 = 0.947 (359 examples, global step 401)": events.Precision(0.947, 359, 401),
    "[worker:0] 2026-12-02 22:27:59: auc = 0.8561, logloss = 0.4628 (4000 examples, global step 300)":
        events.AucResult(0.8561, 0.4628, 4000, 300, "2026-12-02 22:27:59"),
    "psworker: auc = 0.8561, logloss = 0.4628 (4000 examples, global step 300)":
        events.AucResult(0.8561, 0.4628, 4000, 300),
    "2026-12-01 21:21:34,501 INFO psworker.train.export: exported r3/model.ckpt-401 (global step 401) to "
    "r3/export/401": events.Exported("r3/model.ckpt-401", 401, "r3/export/401"),
    "[ps:0] every worker is done; exiting": events.PsDone("ps:0"),
    "2026-12-01 21:21:35,010 INFO psworker.task.main: ps:0: training is complete; exiting":
        events.PsDone("ps:0", training_complete=True),
    "2026-12-03 08:21:25,562 INFO psworker.task.main: ps:0: every worker is done; exiting (peak RSS 2453.6 MiB)":
        events.PsDone("ps:0", peak_rss=int(2453.6 * 2 ** 20)),
    "2026-12-01 02:23:51,105 INFO psworker.task: worker:0: TensorFlow imported in 4.732 s":
        events.TfImported("worker:0", 4.732),
    "2026-12-01 21:30:02,441 INFO psworker.task.runner: worker:1: training is already complete: the global step on "
    "the ps tasks is 300 (--max_steps 300); no step to run": events.FoundComplete("worker:1", 300, 300),
    "--- restart 1 (injected kill:ps:0@step=250) at 2026-12-01T21:21:16.118 ---":
        events.Restart(1, "injected kill:ps:0@step=250", "2026-12-01T21:21:16.118"),
    "psworker-remote-pid 31337\r\n": events.RemotePid(31337),
    "psworker: error: worker:1: the loss became NaN": events.TaskError("worker:1: the loss became NaN"),
    "[worker:0] Traceback (most recent call last):": events.Traceback(),
}

NOT_EVENTS = [
    "[worker:1] last step done (387 local steps)",
    "2026-12-01 21:21:14,012 WARNING psworker.launcher.backends.slurm.backend: worker:0: step 12.3 not seen in squeue within 30 s",
    "I0000 00:00:1796091826.657988    2432 port.cc:153] oneDNN custom operations are on.",
    "2026-12-01 02:23:52,077 INFO tensorflow: Saving checkpoints for 0 into runs/x/model.ckpt.",
    "the loss at step 5 is 0.3",
    "stepping up the learning rate",
    "",
]


def _same(a, b) -> bool:
    return a == b or (type(a) is type(b) and all(
        x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))
        for x, y in zip(vars(a).values(), vars(b).values())))


def test_every_kind_has_a_sample():
    assert {type(e) for e in SAMPLES} == set(events.KINDS)


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: type(e).__name__)
def test_every_event_renders_and_parses_back(event):
    line = event.render()
    assert "\n" not in line
    assert events.parse_line(line) == event
    assert type(event).parse(line) == event
    assert list(type(event).finditer(f"noise\n{line}\nmore noise\n{line}\n")) == [event, event]


@pytest.mark.parametrize("event", [e for e in SAMPLES if not isinstance(e, (events.Restart, events.NewRun,
                                                                           events.RemotePid, events.TaskError,
                                                                           events.Traceback))],
                         ids=lambda e: type(e).__name__)
def test_task_lines_parse_behind_the_console_and_log_prefixes(event):
    """What a task prints or logs, as its log file (a record of psworker's LOG_FORMAT, Python's default format,
    absl's) and the console (`[worker:0] ` before it) hold it."""
    record = logging.LogRecord("psworker.task.runner", logging.INFO, __file__, 1, "%s", (event.render(),), None)
    on_console = event   # a line without a task name gets the console's
    if getattr(event, "task", "") is None:
        on_console = dataclasses.replace(event, task="worker:3")
    for fmt in (events.LOG_FORMAT, "%(levelname)s:%(name)s:%(message)s"):
        logged = logging.Formatter(fmt).format(record)
        assert events.parse_line(logged) == event, logged
        assert events.parse_line(f"[worker:3] {logged}") == on_console
    absl = f"I1201 21:21:34.123456   4242 runner.py:112] {event.render()}"
    assert events.parse_line(absl) == event


def test_the_console_prefix_names_the_task_when_the_line_does_not():
    """The console drops the task name from psworker's own lines (`[worker:0] done at ...`); it is still known."""
    logged = "2026-12-01 21:21:33,902 INFO psworker.task.runner: " + events.WorkerDone("worker:0", 401, 97, 1.0).render()
    shown = f"[worker:0] {for_console(logged)}"
    assert shown == "[worker:0] done at global step 401 after 97 local steps in 1.0 s"
    assert events.parse_line(shown) == events.WorkerDone("worker:0", 401, 97, 1.0)


@pytest.mark.parametrize("line", list(REAL), ids=range(len(REAL)))
def test_real_lines_parse(line):
    assert _same(events.parse_line(line), REAL[line]), events.parse_line(line)


@pytest.mark.parametrize("line", NOT_EVENTS)
def test_other_lines_are_no_event(line):
    assert events.parse_line(line) is None


def test_first_step_and_done_are_told_apart():
    """`psworker status` once needed a look-behind so that `first step done at` did not read as done."""
    assert isinstance(events.parse_line("worker:0: first step done at global step 5"), events.FirstStep)
    assert isinstance(events.parse_line("worker:0: done at global step 5"), events.WorkerDone)


def test_a_users_plain_step_lines():
    """What a script under `psworker run` plausibly prints: the global step and the loss; the rate is optional."""
    out = io.StringIO()
    for i, loss in [(10, 2.302585092994046), (20, 0.5), (30, float("nan"))]:
        print(f"step {i}, loss = {loss}", file=out)
    print("Step 40: loss=0.25", file=out)
    print("step 50", file=out)
    print("INFO:tensorflow:loss = 0.125, step = 60 (0.512 sec)", file=out)   # TF Estimator's LoggingTensorHook
    print("step 70/1000, loss: 0.0625, lr = 0.1", file=out)
    parsed = [events.parse_line(line) for line in out.getvalue().splitlines()]
    assert [p.step for p in parsed] == [10, 20, 30, 40, 50, 60, 70]
    assert parsed[0].loss == 2.302585092994046 and math.isnan(parsed[2].loss)
    assert [p.loss for p in parsed[3:]] == [0.25, None, 0.125, 0.0625]
    assert all(p.examples_per_sec is None for p in parsed)

    progress = Progress(["worker:0"])
    for line in out.getvalue().splitlines():
        progress.feed("worker:0", line, now=1.0)
    task = progress.snapshot()["worker:0"]
    assert progress.global_step() == 70 and task.loss == 0.0625 and task.state == "training"


def test_the_evaluation_line_is_the_tutorials():
    line = format_result(EvalResult(precision=0.97222, examples=360, global_step=2000, checkpoint="m.ckpt-2000"))
    event = events.parse_line(line)
    assert isinstance(event, events.Precision) and event.render() == line
    assert line.endswith(": precision @ 1 = 0.972 (360 examples, global step 2000)")
    assert event.summary == "precision @ 1 = 0.972 (360 examples, global step 2000)"


def test_the_remote_pid_line_printed_by_a_real_shell():
    """The ssh backend's wrapper runs `shell_echo` in `sh` and then execs the task: the line names that pid."""
    proc = subprocess.run(["sh", "-c", f'{events.RemotePid.shell_echo()}; exec "$@"', "sh", "echo", "task output"],
                          capture_output=True, text=True, timeout=30)
    first, second = proc.stdout.splitlines()
    assert isinstance(events.parse_line(first), events.RemotePid) and second == "task output"
    assert events.parse_line(first).pid > 1


def test_current_attempt_last_and_log_time():
    log = "\n".join([events.Step(1).render(), events.Restart.now(1, "killed by SIGKILL").render(),
                     events.Step(5).render(), events.NewRun.now("worker:0").render(), events.Step(9).render(),
                     events.Precision(0.5, 10, 9, "2026-12-01 00:00:00").render(), events.Step(10).render(), ""])
    current = events.current_attempt(log)
    assert current.startswith("--- new run of worker:0 at ") and [e.step for e in events.Step.finditer(current)] == [9, 10]
    assert events.current_attempt("step 1\nstep 2\n") == "step 1\nstep 2\n"
    assert events.last(events.Step, log) == events.Step(10)
    assert events.last(events.Step, log.splitlines()) == events.Step(10)
    assert events.last(events.Exported, log) is None
    assert events.log_time("step 1") is None


def test_log_records_parse_and_render_as_logging_writes_them():
    record = logging.LogRecord("psworker.task.runner", logging.WARNING, __file__, 1, "%s: %s", ("worker:2", "slow"),
                               None)
    record.created, record.msecs = 1796091831.25, 250.0
    line = logging.Formatter(events.LOG_FORMAT).format(record)
    parsed = events.LogRecord.parse(line)
    assert parsed == events.LogRecord(pytest.approx(1796091831.25), "WARNING", "psworker.task.runner", "worker:2",
                                      "slow")
    assert parsed.render() == line and events.log_time(line) == parsed.time
    assert events.LogRecord.parse(f"[worker:2] {line}") == parsed
    assert events.LogRecord.parse("step 1") is None


def test_the_stack_dump_lines_render_and_parse_back():
    ready = events.StacksReady(4242)
    assert events.StacksReady.parse(ready.render()) == ready
    asked = events.StacksRequested.now("worker:1", "stalled: no step line for 10 s", "SIGUSR1")
    assert events.StacksRequested.parse(asked.render()) == asked
    assert list(events.StacksRequested.finditer(f"x\n{asked.render()}\r\ny")) == [asked]


def test_step_records_carry_each_lines_task_step_and_time():
    """The step line read back in bulk (benchmarks, tests): the console's task, the `Step` (the epoch field of dealt
    shards included), a log record's time; other lines are left out."""
    rendered = [events.Step(10, 0.5, 100.0, 0.01, 0.5, 2).render(), events.Step(20, 0.4, 300.0, 0.01).render()]
    logged = events.LogRecord(1796091831.25, "INFO", "root", None, rendered[1]).render()
    text = "\n".join([f"[worker:0] {rendered[0]}", "[worker:0] TensorFlow imported in 1.0 s", f"[worker:1] {logged}",
                      f"[worker:0] {rendered[1]}", rendered[0]])
    records = events.step_records(text)
    assert [(r.task, r.step.step, r.step.epoch) for r in records] == [("worker:0", 10, 0.5), ("worker:1", 20, None),
                                                                        ("worker:0", 20, None), (None, 10, 0.5)]
    assert records[1].time == pytest.approx(1796091831.25) and records[0].time is None
    assert events.step_records(text.splitlines(), task="worker:1") == [records[1]]
    assert events.parse_step("psworker: status: step 20/100") is None
    assert events.rates_by_task(records) == {"worker:0": [100.0, 300.0], "worker:1": [300.0], None: [100.0]}
    assert events.rates_by_task(records, skip=1) == {"worker:0": [300.0]}
    assert events.steady_rates(records) == {"worker:0": 300.0}
