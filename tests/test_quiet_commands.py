"""One-shot commands that import TensorFlow (`plan --model`, `eval`, `export`) show none of its C++ start-up chatter
(`I0000 ... oneDNN`, `E0000 ... failed call to cuInit`), as the launcher's console does; other lines pass, in order."""

from __future__ import annotations

import subprocess
import sys

from psworker.launcher.console.lines import is_noise
from tests.cluster_utils import REPO, task_env

CHATTER = ("WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
           "I0000 00:00:1796236408.632685    4703 port.cc:153] oneDNN custom operations are on.",
           "E0000 00:00:1796236452.434074    7818 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error")
WRITER = f"""
import os, sys
from psworker.cli.quiet import cpp_chatter_hidden
with cpp_chatter_hidden():
    print("before", file=sys.stderr, flush=True)
    for line in {CHATTER!r}:
        os.write(2, (line + "\\n").encode())
    os.write(2, b"F0000 00:00:1.0 1 x.cc:1] a fatal line stays\\n")
    print("after", file=sys.stderr, flush=True)
    print(os.environ["TF_CPP_MIN_LOG_LEVEL"], flush=True)
os.write(2, b"{CHATTER[1]}\\n")
"""


def _psworker(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "psworker", *argv], cwd=REPO, env=task_env(), capture_output=True,
                          text=True, timeout=300)


def test_descriptor_2_is_filtered_inside_and_restored_after():
    r = subprocess.run([sys.executable, "-c", WRITER], cwd=REPO, env=task_env(), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines() == ["before", "F0000 00:00:1.0 1 x.cc:1] a fatal line stays", "after", CHATTER[1]]
    assert r.stdout == "1\n"


def test_plan_with_a_model_and_export_print_no_tensorflow_chatter(tmp_path):
    plan = _psworker("plan", str(REPO / "cluster_specs" / "local.yaml"), "--model", "mlp")
    assert plan.returncode == 0 and "total: 19,210 trainable parameters" in plan.stdout, plan.stderr
    assert not [line for line in plan.stderr.splitlines() if is_noise(line) or line.startswith("To enable")], \
        plan.stderr
    # criteo's graph (a table's gathers) drew TF's colocation deprecation, whose advice lines are not noise-shaped
    criteo = _psworker("plan", str(REPO / "cluster_specs" / "criteo-2x2.yaml"), "--model", "criteo")
    assert criteo.returncode == 0 and "sparse table embeddings" in criteo.stdout, criteo.stderr
    assert [line for line in criteo.stderr.splitlines() if not line.startswith("psworker: ")] == [], criteo.stderr
    export = _psworker("export", "--train_dir", str(tmp_path))    # imports TensorFlow to find the checkpoint
    assert export.returncode == 3 and export.stderr == (f"psworker: error: no checkpoint in {tmp_path}: train first "
                                                        "(the chief writes them there)\n")


def test_the_data_commands_talk_as_every_command_does(tmp_path):
    """`psworker data` writes its set and says so in `psworker: ...` lines, as the launchers do: no logging-style
    line (`2026-... INFO psworker.cli.outputs: ...`)."""
    criteo = _psworker("data", "criteo-synthetic", "--data_dir", str(tmp_path / "criteo"), "--rows_per_day", "20")
    cifar = _psworker("data", "cifar10-synthetic", "--data_dir", str(tmp_path / "cifar"))
    assert criteo.returncode == 0 and criteo.stderr == "", criteo.stderr
    assert criteo.stdout == f"psworker: criteo-synthetic ready in {tmp_path / 'criteo'}\n"
    assert cifar.returncode == 0 and cifar.stdout == f"psworker: cifar10-synthetic ready in {tmp_path / 'cifar'}\n"
    assert cifar.stderr == (f"psworker: wrote synthetic CIFAR-10 (5000 train, 1000 test) to "
                            f"{tmp_path / 'cifar' / 'cifar-10-batches-bin'}\n"), cifar.stderr
