"""Staged variables (`--staged_vars`), the transfer dtype (`--transfer_dtype bfloat16`) and packed transfers
(`--pack_transfers`): the rules, the graph's wire, the update rule in one process against SGD computed by hand
(plain gradient descent: undelayed; any other optimizer: delayed exactly one step), and a real cluster trained
through them (its ps link's tc counters)."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

from psworker.errors import SpecError
from psworker.spec import TrainConfig, merge_train
from tests.cluster_utils import REPO, run_launcher, task_env

PRECISION = re.compile(r"precision @ 1 = ([0-9.]+)")
LINK = re.compile(r"ps:0 link \([^)]*\): ([0-9.]+) (MB|kB) to it, ([0-9.]+) (MB|kB) from it")


def test_staged_vars_are_refused_in_sync_mode_and_in_graph():
    with pytest.raises(SpecError, match=r"--staged_vars: staged variables are for async mode only"):
        merge_train(TrainConfig(mode="sync"), {"staged_vars": "true"})
    with pytest.raises(SpecError, match=r"--transfer_dtype: transfer_dtype is for between-graph"):
        merge_train(TrainConfig(replication="in-graph"), {"transfer_dtype": "bfloat16"})
    with pytest.raises(SpecError, match=r"--transfer_dtype: 'float16' is not one of float32, bfloat16"):
        merge_train(TrainConfig(), {"transfer_dtype": "float16"})
    config = merge_train(TrainConfig(mode="sync"), {"transfer_dtype": "bfloat16"})   # a dtype is fine in sync
    assert (config.mode, config.transfer_dtype, config.staged_vars) == ("sync", "bfloat16", False)


def test_the_command_line_refuses_staged_vars_in_sync_mode_with_exit_2(tmp_path):
    done = subprocess.run([sys.executable, "-m", "psworker", "local", str(REPO / "cluster_specs" / "local-sync.yaml"),
                           "--staged_vars", "true", "--train_dir", str(tmp_path / "t")],
                          capture_output=True, text=True, env=task_env(), cwd=tmp_path, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "--staged_vars: staged variables are for async mode only" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "t").exists()


def _mlp_graph(cluster=None, **train):
    import tensorflow as tf

    from psworker import models
    from psworker.train.graph import build_train_graph

    graph = tf.Graph()
    with graph.as_default():
        tg = build_train_graph(models.get("mlp"), TrainConfig(model="mlp", **train),
                               cluster=cluster or {"ps": ["h:1"], "worker": ["h:2"]}, task_index=0)
    return graph, tg


def test_bfloat16_halves_what_crosses_and_every_crossing_tensor_is_bfloat16():
    """Read off the between-graph graph: float32 crosses as the variables' bytes (the MLP's learning rate is a
    constant, copied to the ps: nothing crosses for it, `transfer.local_constants`); bfloat16 as half of them, and
    every non-scalar tensor between ps and worker is bfloat16."""
    from psworker.train import traffic

    graph32, _ = _mlp_graph()
    graph16, tg16 = _mlp_graph(transfer_dtype="bfloat16", staged_vars=True)
    params = sum(int(np.prod(v.shape)) for v in graph32.get_collection("trainable_variables"))
    assert traffic.step_traffic(graph32, 1) == traffic.StepTraffic(pull=(4 * params,), push=(4 * params,))
    assert traffic.step_traffic(graph16, 1) == traffic.StepTraffic(pull=(2 * params,), push=(2 * params,))
    crossing = [t for op in _step_ops(tg16.train_op) for t in op.inputs
                if t.shape.rank and _job(t.op) != _job(op) and "resource" not in t.dtype.name]
    assert crossing and {t.dtype.name for t in crossing} == {"bfloat16"}, crossing
    assert len(tg16.pulls.areas) == len(graph16.get_collection("trainable_variables"))


def _step_ops(train_op) -> list:
    """The ops a step runs: the train op and everything it depends on."""
    seen, todo = {}, [train_op]
    while todo:
        op = todo.pop()
        if op.name not in seen:
            seen[op.name] = op
            todo += [t.op for t in op.inputs] + list(op.control_inputs)
    return list(seen.values())


def _device(op) -> str:
    """The op's device, or (a resource op placed by the variable it reads) its resource input's."""
    return op.device or next((t.op.device for t in op.inputs if t.dtype.name == "resource"), "")


def _job(op) -> str:
    return "ps" if "/job:ps" in _device(op) else "worker"


def _task(op) -> int:
    device = _device(op)
    return int(device.split("/task:")[1].split("/")[0]) if "/task:" in device else -1


def _linear_run(steps: int, model=None, **train) -> tuple[list, list, list]:
    """Trains the linear model (or `model`) in one process; returns each step's batch `(x, y)`, learning rate, and
    the variables `(w, b)` before the first step and after every step."""
    import tensorflow as tf

    from psworker import models
    from psworker.train.graph import build_train_graph

    v1 = tf.compat.v1
    with tf.Graph().as_default():
        tg = build_train_graph(model or models.get("linear"), TrainConfig(model="linear", seed=1, batch_size=16,
                                                                           **train),
                               cluster=None, task_index=0)
        w, b = v1.trainable_variables()
        sizes = [area.size() for area, _ in tg.pulls.areas] if tg.pulls is not None else []
        with v1.train.MonitoredSession(session_creator=v1.train.ChiefSessionCreator()) as sess:
            raw = sess._tf_sess()   # pylint: disable=protected-access  (reads without running hooks)
            params, batches, rates = [raw.run([w, b])], [], []
            for _ in range(steps):
                _, (x, y), lr = sess.run([tg.train_op, tg.inputs, tg.learning_rate])
                batches.append((x, y))
                rates.append(float(lr))
                params.append(raw.run([w, b]))
                assert all(n == 1 for n in raw.run(sizes)), "an area holds one step's values, never two"
    return batches, rates, params


def _sgd_by_hand(batches, rates, start, delay: int) -> list:
    """Softmax regression's SGD in float64: step t's gradient taken at the variables as they were `delay` updates
    before the current ones (the first steps at the initial values); the variables after every step."""
    params = [tuple(np.float64(p) for p in start)]
    for t, ((x, y), lr) in enumerate(zip(batches, rates)):
        w, b = params[max(0, t - delay)]
        logits = x @ w + b
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        p[np.arange(len(y)), y] -= 1.0
        gw, gb = x.T @ p / len(y), p.mean(axis=0)
        params.append((params[-1][0] - lr * gw, params[-1][1] - lr * gb))
    return params


def _first_step_off(got, want) -> "int | None":
    """The first step after which `got`'s variables differ from `want`'s (float32 against float64), or None."""
    for t, (gs, ws) in enumerate(zip(got, want)):
        if not all(np.allclose(g, w, rtol=1e-4, atol=1e-5) for g, w in zip(gs, ws)):
            return t
    return None


def _momentum_zero_linear():
    """The linear model under `MomentumOptimizer(momentum=0)`: the same updates as plain gradient descent, but an
    optimizer whose own update the staged copy does not add (so it computes one step stale)."""
    import tensorflow as tf

    from psworker.models.linear import LinearModel

    class MomentumZero(LinearModel):
        def optimizer(self, learning_rate):
            return tf.compat.v1.train.MomentumOptimizer(learning_rate, momentum=0.0)

    return MomentumZero()


def test_staged_sgd_adds_its_own_update_so_one_process_trains_exactly_as_plain_sgd(caplog):
    """In one process under plain gradient descent, the staged copy is the pulled values plus this worker's own
    update: the linear model's run equals undelayed SGD computed by hand, step by step, and so does plain
    training; SGD delayed by one step departs from both by the second step."""
    steps = 12
    for train in ({"staged_vars": True}, {}):
        with caplog.at_level("WARNING", logger="psworker.train.graph"):
            batches, rates, got = _linear_run(steps, **train)
        assert "staged variables with" not in caplog.text
        assert _first_step_off(got, _sgd_by_hand(batches, rates, got[0], 0)) is None, train
        assert _first_step_off(got, _sgd_by_hand(batches, rates, got[0], 1)) == 2, train


def test_staged_vars_under_another_optimizer_compute_exactly_one_update_stale(caplog):
    """An optimizer other than plain gradient descent (momentum 0: the same updates) gets no own update in the
    staged copy, and a warning says so: each step's gradient is taken at the variables before the previous step's
    update, exactly (the pull reads each variable before this step's update is applied, never after: no race)."""
    steps = 12
    with caplog.at_level("WARNING", logger="psworker.train.graph"):
        batches, rates, got = _linear_run(steps, model=_momentum_zero_linear(), staged_vars=True)
    assert "staged variables with MomentumOptimizer: only plain gradient descent's own update" in caplog.text
    assert _first_step_off(got, _sgd_by_hand(batches, rates, got[0], 1)) is None
    assert _first_step_off(got, _sgd_by_hand(batches, rates, got[0], 0)) == 2


@pytest.mark.parametrize("train", [{}, {"staged_vars": True}, {"transfer_dtype": "bfloat16"}])
def test_packed_transfers_cross_once_per_ps_each_way(train, caplog):
    """The MLP's variables over 2 ps, packed: from each ps one tensor reaches the worker (its variables' values,
    concatenated, or its one variable), and one reaches it (their gradients) besides the learning rate; the bytes in
    all are the unpacked graph's."""
    from psworker.train import traffic

    caplog.set_level("INFO", logger="psworker.train.transfer")
    cluster = {"ps": ["h:1", "h:3"], "worker": ["h:2"]}
    plain, _ = _mlp_graph(cluster=cluster, pack_transfers=False, **train)
    graph, tg = _mlp_graph(cluster=cluster, pack_transfers=True, **train)
    crossing = {(t.name, _job(op), _task(op if _job(op) == "ps" else t.op)) for op in _step_ops(tg.train_op)
                for t in op.inputs if _job(t.op) != _job(op) and "resource" not in t.dtype.name}
    pulls = sorted(task for _, job, task in crossing if job == "worker")
    pushes = sorted(task for name, job, task in crossing if job == "ps" and not name.startswith("learning_rate"))
    assert pulls == pushes == [0, 1], crossing
    by_ps: dict = {}
    for v in graph.get_collection("trainable_variables"):
        by_ps.setdefault(v.device, []).append(v.op.name)
    assert sorted(by_ps) == ["/job:ps/task:0", "/job:ps/task:1"] and max(map(len, by_ps.values())) > 1, by_ps
    assert tg.pulls.packs == [(d, names) for d, names in by_ps.items() if len(names) > 1], tg.pulls.packs
    assert caplog.text.count("packed transfers:") == len(tg.pulls.packs)
    packed, unpacked = traffic.step_traffic(graph, 2), traffic.step_traffic(plain, 2)
    assert (sum(packed.pull), sum(packed.push)) == (sum(unpacked.pull), sum(unpacked.push))
    # packed, the MLP's 64 KB weights are split too (`placement.min_partition_bytes`): the busiest ps carries less
    assert max(packed.pull) < max(unpacked.pull) and max(packed.push) < max(unpacked.push), (packed, unpacked)


@pytest.mark.parametrize("train", [{}, {"staged_vars": True}])
def test_packed_transfers_train_exactly_as_unpacked_in_one_process(train):
    """The linear model's two variables packed into one pull and one push: every step's variables equal the
    unpacked run's, bit for bit, staged or not."""
    _, _, packed = _linear_run(12, pack_transfers=True, **train)
    _, _, plain = _linear_run(12, **train)
    assert all(np.array_equal(a, b) for ps, qs in zip(packed, plain) for a, b in zip(ps, qs))


def test_packed_staged_momentum_computes_exactly_one_update_stale():
    """Packed and staged under momentum 0: each variable's update still waits for this step's read of the pack
    (`push`), so each step's gradient is taken exactly one update stale, never a racing zero or two."""
    batches, rates, got = _linear_run(12, model=_momentum_zero_linear(), staged_vars=True, pack_transfers=True)
    assert _first_step_off(got, _sgd_by_hand(batches, rates, got[0], 1)) is None


def test_staged_bfloat16_rounds_the_same_sequence():
    """bfloat16 on the wire rounds the pulled weights and pushed gradients (8 bits of mantissa): the staged run
    stays within rounding of undelayed SGD, far closer than one-step-delayed SGD."""
    batches, rates, got = _linear_run(12, staged_vars=True, transfer_dtype="bfloat16")
    fresh, delayed = (_sgd_by_hand(batches, rates, got[0], d) for d in (0, 1))
    err, off = ([max(np.abs(g - w).max() for g, w in zip(gs, ws)) for gs, ws in zip(got, want)]
                for want in (fresh, delayed))
    assert max(err) < 0.005 and max(err) < max(off) / 10, (err, off)


@pytest.mark.slow
def test_a_cluster_trains_staged_in_bfloat16_to_float32s_precision_on_half_the_wire(tmp_path):
    """1 ps + 2 workers on the digits, the same seed and steps, float32 then staged + bfloat16; the ps link's tc
    counters (psworker local --ps_link_rate) give the bytes that crossed it each way."""
    seen = {}
    for name, flags in (("float32", []), ("staged-bf16", ["--staged_vars", "true", "--transfer_dtype", "bfloat16"])):
        run = run_launcher([str(REPO / "cluster_specs" / "local.yaml"), "--train_dir", str(tmp_path / name),
                            "--max_steps", "400", "--seed", "1", "--ps_link_rate", "10gbit", *flags],
                           cwd=tmp_path, timeout=400)
        assert run.returncode == 0, run.output[-4000:]
        link = LINK.search(run.output)
        assert link, run.output[-2000:]
        to_ps, from_ps = (float(link.group(i)) * (1e6 if link.group(i + 1) == "MB" else 1e3) for i in (1, 3))
        seen[name] = (float(PRECISION.search(run.output).group(1)), to_ps, from_ps)
    (p32, to32, from32), (p16, to16, from16) = seen["float32"], seen["staged-bf16"]
    assert p32 >= 0.9 and p16 >= p32 - 0.04, seen
    assert 0.4 < from16 / from32 < 0.6 and 0.4 < to16 / to32 < 0.6, seen
