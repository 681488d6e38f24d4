"""What the launcher's console shows of a task's output (lines copied from a real run's logs)."""

from psworker.launcher.console.lines import for_console

HIDDEN = [
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "I0000 00:00:1796091826.657988    2432 port.cc:153] oneDNN custom operations are on. You may see slightly",
    "E0000 00:00:1796236452.434074    7818 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error: Failed "
    "call to cuInit: UNKNOWN ERROR (303)",
    "To enable the following instructions: AVX2 AVX512F AVX512_VNNI AVX512_BF16 AVX_VNNI FMA, in other operations, "
    "rebuild TensorFlow with the appropriate compiler flags.",
    "W0000 00:00:1796091832.372185    2885 local_rendezvous.cc:412] Local rendezvous is aborting with status: "
    "ABORTED: Cleanup 25307370291026197 [type.googleapis.com/tensorflow.DerivedStatus='']",
    "2026-12-01 02:23:51,599 INFO tensorflow: Create CheckpointSaverHook.",
    "2026-12-01 02:23:52,077 INFO tensorflow: Saving checkpoints for 0 into runs/x/model.ckpt.",
    "2026-12-01 02:23:51,105 INFO psworker.task: worker:0: TensorFlow imported in 4.732 s",
]


def test_tensorflow_chatter_stays_in_the_log_file():
    for line in HIDDEN:
        assert for_console(line) is None, line


def test_psworker_lines_lose_their_timestamp_and_task_name():
    assert for_console("2026-12-01 02:23:52,039 INFO psworker.session: worker:1: waiting for the chief's model") \
        == "waiting for the chief's model"
    assert for_console("2026-12-01 02:23:52,039 WARNING psworker.server: ps:0: worker:1 is unreachable") \
        == "warning: worker:1 is unreachable"


def test_steps_results_errors_and_fatal_lines_are_shown_as_they_are():
    for line in ["step 183, loss = 0.12 (6510.8 examples/sec; 0.010 sec/batch)",
                 "2026-12-01 02:23:57: precision @ 1 = 0.969 (359 examples, global step 2000)",
                 "Traceback (most recent call last):",
                 "F0000 00:00:1796091832.372185    2885 session.cc:1] Check failed",
                 "2026-12-01 02:23:52,077 ERROR tensorflow: something the user must see"]:
        assert for_console(line) == line


# A worker's log around a ps killed and restarted (a real run's, shortened), and a deprecation warning
PS_KILLED = """\
step 181, loss = 0.09, epoch 4.03 (5757.6 examples/sec; 0.006 sec/batch)
W0000 00:00:1796457712.719518    8575 grpc_remote_master.cc:160] RPC failed with status = "UNAVAILABLE: recvmsg:Conn\
ection reset by peer", maybe retrying the RPC
2026-12-05 08:01:52,727 INFO tensorflow: An error was raised. This may be due to a preemption in a connected worker \
or parameter server. Error: Graph execution error:

=====================
UNAVAILABLE: From /job:worker/replica:0/task:0:
recvmsg:Connection reset by peer
Additional GRPC error information from remote target /job:ps/replica:0/task:0 while calling /tensorflow.WorkerServi\
ce/RecvTensor:
:UNKNOWN:Error received from peer  {grpc_status:14, grpc_message:"recvmsg:Connection reset by peer"}
\t [[{{node global_step/Read/ReadVariableOp_S147}}]]
Recent warning and error logs:
  W0000 00:00:1796457711.859629    8606 local_rendezvous.cc:412] Local rendezvous is aborting with status: ABORTED
UNAVAILABLE: From /job:ps/replica:0/task:0:
recvmsg:Connection reset by peer
=====================
2026-12-05 08:05:56,916 INFO psworker.task.server: worker:0: waiting for ps:0 at 127.0.0.1:39731 (0 s of 120 s)
W0000 00:00:1796457715.424388    8575 op_kernel.cc:1845] UNKNOWN: FailedPreconditionError: Graph execution error:
Could not find variable psworker_data/ring_start. This could mean that the variable has been deleted.
From /job:ps/replica:0/task:0:
Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/tensorflow/python/client/session.py", line 1407, in _do_call
    return fn(*args)
tensorflow.python.framework.errors_impl.FailedPreconditionError: Graph execution error:
2026-12-05 08:06:05,032 INFO psworker.train.session: worker:0: restoring the checkpoint model.ckpt-115
2026-12-05 08:06:05,033 INFO tensorflow: Restoring parameters from /tmp/st/train/model.ckpt-115
2026-12-05 08:06:06,050 WARNING tensorflow: From /venv/lib/python3.11/site-packages/x.py:12: some_op (from \
tensorflow.python.ops) is deprecated and will be removed in a future version.
Instructions for updating:
Use `tf.something_else` instead.
step 190, loss = 0.10, epoch 4.23 (6180.6 examples/sec; 0.005 sec/batch)
"""


def test_a_ps_killed_is_one_lost_line_and_no_tensorflow_text_on_the_console():
    from psworker.launcher.console.lines import ConsoleFilter

    shown_by = ConsoleFilter(own_tasks=True)
    shown = [text for text in (shown_by(line, "worker:0") for line in PS_KILLED.splitlines()) if text is not None]
    assert shown == ["step 181, loss = 0.09, epoch 4.03 (5757.6 examples/sec; 0.006 sec/batch)",
                     "lost ps:0 (TensorFlow's gRPC errors are in the task logs)",
                     "waiting for ps:0 at 127.0.0.1:39731 (0 s of 120 s)",
                     "restoring the checkpoint model.ckpt-115",
                     "step 190, loss = 0.10, epoch 4.23 (6180.6 examples/sec; 0.005 sec/batch)"]


def test_a_users_command_keeps_its_own_lines_without_tensorflows_fragments():
    from psworker.launcher.console.lines import ConsoleFilter

    shown_by = ConsoleFilter(own_tasks=False)
    shown = [text for text in (shown_by(line, "worker:0") for line in PS_KILLED.splitlines()) if text is not None]
    assert "lost ps:0 (TensorFlow's gRPC errors are in the task logs)" in shown
    assert "Use `tf.something_else` instead." in shown and "Traceback (most recent call last):" in shown
    assert not [t for t in shown if "{{node" in t or t.startswith(("=====", "Instructions for updating",
                                                                      "Additional GRPC"))], shown


def test_the_lost_ps_line_folds_across_workers():
    from psworker.launcher.console import folds

    fold, _ = folds.match("lost ps:0 (TensorFlow's gRPC errors are in the task logs)")
    render = folds.renderer(fold)
    assert render([("worker:0", "lost ps:0 (TensorFlow's gRPC errors are in the task logs)"),
                   ("worker:1", "lost ps:1 (TensorFlow's gRPC errors are in the task logs)")]) == \
        "[worker:0-1] lost ps:0-1 (TensorFlow's gRPC errors are in the task logs)"
    assert folds.kind("lost ps:0-1 (TensorFlow's gRPC errors are in the task logs)") == "lost ps"
