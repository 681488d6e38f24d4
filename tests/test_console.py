"""What the launcher's console shows of a task's output (lines copied from a real run's logs)."""

from psworker.launcher.console import for_console

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
