"""The ps memory model (issue 37): the chief's saver writes a checkpoint that restores as before, reading each
variable without a copy and the large ones one at a time; `benchmarks/ps_memory_model.py --quick` measures real
capped ps across a save and a restore and prints its fitted line."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from psworker.launcher import cgroups
from tests.cluster_utils import REPO, task_env

NO_MEMCG = cgroups.unavailable()
FIT = re.compile(r"^fit: peak anonymous memory = (\d+) MiB \+ (-?\d+\.\d+) x variable bytes \((\d+) ps; ", re.M)
POINT = re.compile(r"^table ([\d,]+) buckets, 1 ps, ps:0: variables ([\d,]+) MiB; peak anonymous ([\d,]+) MiB", re.M)


def _graph(tmp_path, mode: str) -> str:
    """A child process: two 8 MiB resource tables and a small variable on one in-process server, a sparse update,
    a save with `saving.saver`, a restore after another update; prints what it saw."""
    code = f"""
import os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import tensorflow as tf
from psworker.train import saving
v1 = tf.compat.v1
v1.disable_eager_execution()
tables = [v1.get_variable(f"t{{i}}", [512 * 1024, 4], initializer=v1.zeros_initializer()) for i in range(2)]
small = v1.get_variable("small", [3], initializer=v1.ones_initializer())
push = tf.group(*[v1.scatter_add(t, [1, 7], tf.ones([2, 4])) for t in tables], small.assign_add([1., 1., 1.]))
saver = saving.saver()
ops = {{op.type for op in v1.get_default_graph().get_operations()}}
with v1.Session() as s:
    s.run(v1.global_variables_initializer())
    s.run(push)
    saver.save(s, r"{tmp_path}/ck")
    s.run(push)
    saver.restore(s, r"{tmp_path}/ck")
    print("values", s.run(tables[0][7]).tolist(), s.run(tables[1][1]).tolist(), s.run(small).tolist())
print("DisableCopyOnRead" in ops, sorted(f for f in os.listdir(r"{tmp_path}") if f.startswith("ck.")))
"""
    run = subprocess.run([sys.executable, "-c", code], env={**task_env(), "PSWORKER_SAVER": mode},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def test_the_sequenced_saver_writes_each_large_variable_alone_and_restores_it(tmp_path):
    """Each 8 MiB table in its own shard, the small variable in a third; the restore brings back the saved values."""
    out = _graph(tmp_path, "")
    assert "values [1.0, 1.0, 1.0, 1.0] [1.0, 1.0, 1.0, 1.0] [2.0, 2.0, 2.0]" in out, out
    assert "True ['ck.data-00000-of-00003', 'ck.data-00001-of-00003', 'ck.data-00002-of-00003', 'ck.index'" in out, out


def test_the_plain_saver_is_tensorflows_own(tmp_path):
    """`PSWORKER_SAVER=plain` (the benchmark's 'before'): one shard, no DisableCopyOnRead, the same values."""
    out = _graph(tmp_path, "plain")
    assert "values [1.0, 1.0, 1.0, 1.0] [1.0, 1.0, 1.0, 1.0] [2.0, 2.0, 2.0]" in out, out
    assert "False ['ck.data-00000-of-00001', 'ck.index'" in out, out


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(NO_MEMCG is not None, reason=f"no memory cgroup here: {NO_MEMCG}")
def test_the_memory_model_benchmark_quick_mode_prints_its_fit():
    """Two real 1-ps runs per size (train and save; restore and save), sampled in their cgroups: each ps holds more
    than its variables, and the line through the two sizes rises (two small points: the slope itself is noisy)."""
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "ps_memory_model.py"), "--quick"],
                         env=task_env(), capture_output=True, text=True, timeout=600, cwd=REPO)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    fit = FIT.search(run.stdout)
    assert fit, run.stdout[-3000:]
    assert int(fit[3]) == 2 and float(fit[2]) > 0 and int(fit[1]) > 100, fit[0]
    points = POINT.findall(run.stdout)
    assert len(points) == 2, run.stdout[-3000:]
    for _, variables, peak in points:
        assert int(peak.replace(",", "")) > int(variables.replace(",", "")), points
