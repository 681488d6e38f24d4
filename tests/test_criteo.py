"""The click-through workload (issue 28): the criteo model's graph keeps its table sparse (no tensor of a table's
size crosses between ps and worker, under staging, bfloat16 transfer and sync mode too), and real local clusters:
the planted signal learned, each ps holding its share of the table, the bytes on the ps links far below the table's,
the export scoring raw rows like eval in a process without psworker, a checkpoint of 2 ps restored onto 3."""

from __future__ import annotations

import json
import collections
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from psworker.data import criteo_synthetic
from psworker.launcher import netns
from psworker.spec import TrainConfig
from psworker.testing import assert_processes_gone, checkpoint_step, write_spec
from tests.cluster_utils import run_launcher, task_env

# The planted signal: the generator's oracle AUC on this data is ~0.95 (a model that learns nothing scores 0.5).
# A bound well below the oracle and well above chance; test_the_bound_is_below_what_the_data_allows checks it.
LEARNED_AUC = 0.7
ROWS_PER_DAY = 4000
AUC_LINE = re.compile(r"auc = ([0-9.]+), logloss = ([0-9.]+) \((\d+) examples, global step (\d+)\)")
TABLE_LINE = re.compile(r"sparse table embeddings \((\d+) rows x (\d+)\): gathered and updated by rows \(([^)]*)\)")
LINK = re.compile(r"ps:(\d) link \([^)]*\): ([0-9.]+) (MB|kB|B) to it, ([0-9.]+) (MB|kB|B) from it")
POOLED = re.compile(r"ps links \([^)]*pooled\): ([0-9.]+) (MB|kB|B) of gradients pulled from the workers")
UNITS = {"MB": 1e6, "kB": 1e3, "B": 1.0}


@pytest.fixture(scope="module")
def criteo_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("criteo")
    criteo_synthetic.write_synthetic(str(folder), days=3, rows_per_day=ROWS_PER_DAY, compress=True, seed=0)
    return folder


def test_the_bound_is_below_what_the_data_allows(criteo_dir):
    oracle = criteo_synthetic.read_info(str(criteo_dir)).oracle_auc
    assert oracle >= LEARNED_AUC + 0.15, oracle


# ---------------------------------------------------------------------------------------------- the graph


def _graph(num_ps: int, **train):
    import tensorflow as tf

    from psworker import models
    from psworker.train.graph import build_train_graph

    graph = tf.Graph()
    cluster = {"ps": [f"h:{i}" for i in range(num_ps)], "worker": ["h:9", "h:10"]}
    with graph.as_default():
        build_train_graph(models.get("criteo"), TrainConfig(model="criteo", data_dir="unused", **train),
                          cluster=cluster, task_index=0)
    return graph


def _crossing(graph):
    """Every (tensor, consumer) pair whose producer runs on a ps and consumer on the worker, or the other way."""
    from psworker.train.traffic import _Devices   # the placement rules `psworker plan` counts traffic with

    where = _Devices(graph)
    for op in graph.get_operations():
        for t in op.inputs:
            src, dst = where.of(t.op), where.of(op)
            if t.dtype.base_dtype.name != "resource" and ("/job:ps" in src) != ("/job:ps" in dst):
                yield t, op


@pytest.mark.parametrize("train", [{}, {"staged_vars": True, "transfer_dtype": "bfloat16"}, {"mode": "sync"},
                                   {"pack_transfers": True}])
def test_no_tensor_of_a_table_shard_crosses_the_wire(train, caplog, monkeypatch):
    """The table is split by rows over the 3 ps, each shard's Adagrad accumulator beside it; what crosses between
    ps and worker is rows (unknown leading dimension) and never a whole shard, whatever the transfer options. The
    gradient of the batch's dedup (a sum over every id) stays on the worker, so only distinct rows are pushed; packed,
    each ps gets the ids once (its gather's are its gradient's)."""
    monkeypatch.setattr("psworker.data.criteo.num_examples", lambda *a, **k: 1000)   # no data needed to build
    caplog.set_level(logging.INFO)
    graph = _graph(3, **train)
    shards = [v for v in graph.get_collection("variables") if v.op.name.startswith("embeddings/")]
    tables = {v.op.name: v.device for v in shards if "Adagrad" not in v.op.name}
    assert sorted(tables.values()) == [f"/job:ps/task:{i}" for i in range(3)], tables
    for v in shards:
        if "Adagrad" in v.op.name:
            assert v.device == tables[v.op.name.rsplit("/", 1)[0]]
    smallest = min(v.shape.num_elements() for v in shards)
    big = [(t.name, op.name) for t, op in _crossing(graph)
           if t.shape.is_fully_defined() and t.shape.num_elements() >= smallest]
    assert not big, big
    from psworker.train.traffic import _Devices

    where = _Devices(graph)
    ids = [(t.name, where.of(op)) for t, op in _crossing(graph) if t.dtype.is_integer and t.shape.rank == 1
           and "/job:ps" in where.of(op) and not t.op.name.startswith(("sync_", "dealer"))]
    if train.get("pack_transfers"):
        assert sorted(d for _, d in set(ids)) == [f"/job:ps/task:{i}" for i in range(3)], ids
    if train == {"pack_transfers": True}:   # each ps: its ids, then one push (rows' and dense gradients), no scalar
        pushed = {(t.name, where.of(op)) for t, op in _crossing(graph) if "/job:ps" in where.of(op)}
        assert sorted(d for _, d in pushed) == sorted(2 * [f"/job:ps/task:{i}" for i in range(3)]), pushed
    assert any(TABLE_LINE.search(r.getMessage()) for r in caplog.records)
    if train.get("staged_vars"):
        assert any("sparse table embeddings: read and updated by rows on its ps, not pulled whole" in r.getMessage()
                   for r in caplog.records)


@pytest.mark.parametrize("train", [{}, {"staged_vars": True, "transfer_dtype": "bfloat16"}, {"mode": "sync"},
                                   {"pack_transfers": True}])
def test_the_gradient_of_the_batch_dedup_stays_on_the_worker(train, monkeypatch):
    """With the table whole on 1 ps, the dedup's gradient (a sum of every id's row into the distinct rows) runs on
    the worker whatever the transfer options, so only the distinct rows' gradients are pushed, never every id's."""
    from psworker.train.traffic import _Devices

    monkeypatch.setattr("psworker.data.criteo.num_examples", lambda *a, **k: 1000)
    graph = _graph(1, **train)
    where = _Devices(graph)
    dedup = [op.name for op in graph.get_operations() if op.type == "UnsortedSegmentSum"
             and op.name.startswith("gradients")]
    assert dedup and not [name for name in dedup if "/job:ps" in where.of(graph.get_operation_by_name(name))], dedup


def test_plan_prints_each_ps_share_of_the_table_and_the_traffic_per_row():
    from psworker.models.criteo import CriteoModel
    from psworker.train import plan_report

    text = plan_report.describe("criteo", 3)
    rows = CriteoModel().table_rows
    shares = [int(n.replace(",", "")) for n in re.findall(r"embeddings/part_\d +\[(\d+), 8\]", text)]
    assert sorted(shares) == sorted([rows // 3 + (i < rows % 3) for i in range(3)]), text
    assert f"sparse table embeddings: {rows:,} rows x 8, {rows * 32:,} bytes over ps:0, ps:1, ps:2" in text, text
    assert "per distinct row a step touches: 40 bytes pulled (id, values), 40 pushed (id, gradient)" in text
    loads = [int(n.replace(",", "")) for n in re.findall(r"ps:\d holds ([\d,]+) bytes", text)]
    assert max(loads) / (sum(loads) / 3) < 1.02, text   # the table and its accumulators balance the ps


SPARSE_LINE = re.compile(r"sparse traffic per worker step, batch (\d+): ([\d,]+) distinct rows \(([^:]*):.*\): "
                         r"([\d,]+) bytes pulled, ([\d,]+) pushed; with the dense weights ([\d,]+) pulled")


def _ints(found: re.Match, *groups: int) -> list[int]:
    return [int(found[g].replace(",", "")) for g in groups]


def test_plan_counts_the_rows_a_step_touches_on_the_data_given_or_bounds_them(criteo_dir, tmp_path):
    """The plan's sparse line: the distinct rows of the run's batches read by the model's own input: 26 on files
    whose lines are all one line (one row per column), between that and the bound on the synthetic set; without data
    the bound (256 x 26); `--rows_per_step` as given (through the CLI). Each row moves its id and 8 floats both
    ways."""
    from psworker.data import criteo
    from psworker.train import plan_report

    same = tmp_path / "same"
    same.mkdir()
    line = criteo.format_line(1, list(range(13)), [f"{c:08x}" for c in range(26)])
    for day in range(2):
        (same / f"day_{day}").write_text(line * 300)
    report = plan_report.placement_report("criteo", 2)

    def sparse(**kw) -> re.Match:
        text = plan_report.sparse_traffic_line(report, 256, **kw)
        assert SPARSE_LINE.search(text or ""), text
        return SPARSE_LINE.search(text)

    one = sparse(data_dir=str(same))
    assert _ints(one, 1, 2, 4, 5) == [256, 26, 26 * 40, 26 * 40] and one[3] == "measured", one[0]
    synthetic = sparse(data_dir=str(criteo_dir))
    rows, pulled, with_dense = _ints(synthetic, 2, 4, 6)
    assert 26 * 20 < rows < 256 * 26 and pulled == rows * 40 and with_dense > pulled, synthetic[0]
    bound = sparse()
    assert _ints(bound, 2, 4) == [256 * 26, 256 * 26 * 40] and bound[3] == "at most", bound[0]
    spec = write_spec(tmp_path / "criteo.yaml", num_ps=2, num_workers=1, model="criteo", batch_size=256)
    run = subprocess.run([sys.executable, "-m", "psworker", "plan", str(spec), "--model", "criteo",
                          "--rows_per_step", "2300"], env=task_env(), capture_output=True, text=True, timeout=300)
    given = SPARSE_LINE.search(run.stdout)
    assert run.returncode == 0 and given, run.stdout[-3000:] + run.stderr[-3000:]
    assert _ints(given, 2, 5) == [2300, 92_000] and given[3] == "given", given[0]


# ---------------------------------------------------------------------------------------------- clusters


def _link_bytes(output: str) -> tuple[dict[int, float], float]:
    """Bytes each ps link moved (both ways), and the gradients the ps tasks pulled from the worker (pooled), from
    the launcher's `--ps_link_rate` report."""
    pooled = POOLED.search(output)
    assert pooled, output[-3000:]
    return ({int(m[1]): float(m[2]) * UNITS[m[3]] + float(m[4]) * UNITS[m[5]] for m in LINK.finditer(output)},
            float(pooled[1]) * UNITS[pooled[2]])


@pytest.fixture(scope="module")
def two_ps_run(criteo_dir, tmp_path_factory):
    """2 ps + 1 worker, 300 steps of 64, the ps links counted (`--ps_link_rate`, unshaped in practice)."""
    cwd = tmp_path_factory.mktemp("run2")
    spec = write_spec(cwd / "criteo.yaml", num_ps=2, num_workers=1, model="criteo", batch_size=64)
    shaped = ["--ps_link_rate", "10gbit"] if netns.available() else []
    run = run_launcher([str(spec), "--train_dir", str(cwd / "train"), "--data_dir", str(criteo_dir),
                        "--max_steps", "300", *shaped], cwd=cwd, timeout=300)
    assert run.returncode == 0, run.output[-4000:]
    assert_processes_gone(run.pids)
    return run, cwd / "train"


@pytest.mark.slow
def test_two_ps_learn_the_planted_signal_each_holding_half_the_table(two_ps_run):
    run, train_dir = two_ps_run
    m = AUC_LINE.search(run.output)
    assert m and float(m[1]) >= LEARNED_AUC and int(m[3]) == ROWS_PER_DAY, run.output[-3000:]
    table = TABLE_LINE.search(run.output)
    assert table, run.output[-3000:]
    rows, dim = int(table[1]), int(table[2])
    shares = sorted(re.findall(r"(\d+) rows on /job:ps/task:(\d)", table[3]), key=lambda s: s[1])
    assert [int(n) for n, _ in shares] == [rows // 2, rows - rows // 2] and [t for _, t in shares] == ["0", "1"]
    import tensorflow as tf

    shapes = tf.train.load_checkpoint(str(train_dir / "model.ckpt-300")).get_variable_to_shape_map()
    assert shapes["embeddings"] == [rows, dim] and shapes["embeddings/Adagrad"] == [rows, dim]   # whole, by name
    assert checkpoint_step(train_dir) == 300


@pytest.mark.slow
@pytest.mark.skipif(not netns.available(), reason="--ps_link_rate needs a network namespace and tc")
def test_the_bytes_on_the_ps_links_stay_far_below_the_table(two_ps_run, criteo_dir):
    """The tc counters of both ps links and of the gradients the ps tasks pulled, over the run (300 steps; each ps
    writes its own shards of a checkpoint, so saves cross nothing): per step far below one pull of the table."""
    run, _ = two_ps_run
    links, gradients = _link_bytes(run.output)
    assert sorted(links) == [0, 1] and gradients > 0, run.output[-3000:]
    rows, dim = (int(g) for g in TABLE_LINE.search(run.output).groups()[:2])
    table_bytes = rows * dim * 4
    per_step = (sum(links.values()) + gradients) / 300
    needed = _needed_per_step(criteo_dir, 64)
    print(f"bytes on the ps links per step: {per_step:,.0f} (both ways, both ps); what the step needs: "
          f"{needed:,.0f} ({per_step / needed:.2f}x); the table alone: {table_bytes:,}")
    assert per_step < table_bytes / 10, (per_step, table_bytes)
    assert per_step < 1.5 * needed, (per_step, needed)   # measured 1.01x; the benchmark goal is 1.2x


def _needed_per_step(criteo_dir: Path, batch: int, batches: int = 100) -> float:
    """What one step must move, on average over random batches of the training split: the dense weights pulled
    and their gradients pushed, and per distinct row touched its id to the ps (gather), its values back, its
    gradient and id pushed."""
    import numpy as np

    from psworker.data import criteo
    from psworker.models.criteo import HIDDEN, CriteoModel

    model = CriteoModel()
    rows = criteo.table_rows(criteo.load_split(str(criteo_dir), False).keys, model.buckets)
    rng = np.random.default_rng(0)
    touched = np.mean([len(np.unique(rows[rng.choice(len(rows), batch, replace=False)])) for _ in range(batches)])
    widths = (criteo.NUM_CAT * model.embedding_dim + criteo.NUM_INT, *HIDDEN, 1)
    dense = sum(a * b + b for a, b in zip(widths, widths[1:]))
    return 2 * 4 * dense + touched * (8 + 4 * model.embedding_dim + 4 * model.embedding_dim + 8)


@pytest.mark.slow
def test_the_export_scores_raw_rows_like_eval_without_psworker(two_ps_run, criteo_dir):
    run, train_dir = two_ps_run
    eval_auc = float(AUC_LINE.search(run.output)[1])
    script = r"""
import gzip, json, sys
import numpy as np, tensorflow as tf
model = tf.saved_model.load(sys.argv[1])
score = model.signatures["serving_default"]
lines = [l.rstrip("\n").split("\t") for l in gzip.open(sys.argv[2], "rt")]
labels = np.array([int(l[0]) for l in lines])
fields = tf.constant([l[1:] for l in lines])
probs = tf.nn.softmax(score(images=fields)["logits"])[:, 1].numpy()
order = np.argsort(probs, kind="mergesort"); ranks = np.empty(len(probs)); ranks[order] = np.arange(1, len(probs) + 1)
pos = labels.sum(); auc = (ranks[labels == 1].sum() - pos * (pos + 1) / 2) / (pos * (len(labels) - pos))
print(json.dumps({"auc": float(auc), "psworker": [m for m in sys.modules if m.startswith("psworker")]}))
"""
    done = subprocess.run([sys.executable, "-c", script, str(train_dir / "export" / "300"),
                           str(criteo_dir / "day_2.gz")], capture_output=True, text=True, timeout=180,
                          env=task_env(), cwd=train_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["psworker"] == []
    assert got["auc"] == pytest.approx(eval_auc, abs=2e-4)   # eval prints 4 decimals; ties are rare in float32


@pytest.mark.slow
def test_a_checkpoint_written_with_2_ps_restores_with_3(criteo_dir, tmp_path):
    """100 steps on 2 ps, then the same train dir on 3 ps, packed, to step 300: the restore splits each table 3
    ways, and dense1/weights, whole before, 3 ways too (`placement.min_partition_bytes`); training goes on from step
    100 to a model that still scores the planted signal, and the checkpoint holds each variable whole by name."""
    two = write_spec(tmp_path / "two.yaml", num_ps=2, num_workers=1, model="criteo", batch_size=64)
    three = write_spec(tmp_path / "three.yaml", num_ps=3, num_workers=1, model="criteo", batch_size=64)
    common = ["--train_dir", str(tmp_path / "train"), "--data_dir", str(criteo_dir)]
    first = run_launcher([str(two), *common, "--max_steps", "100", "--set", "pack_transfers=false"], cwd=tmp_path,
                         timeout=300)   # unpacked: dense1/weights stays whole (packed by default: split)
    assert first.returncode == 0 and checkpoint_step(tmp_path / "train") == 100, first.output[-3000:]
    second = run_launcher([str(three), *common, "--max_steps", "300", "--pack_transfers", "true"], cwd=tmp_path,
                          timeout=300)
    assert second.returncode == 0, second.output[-4000:]
    assert "restoring the checkpoint model.ckpt-100" in second.output, second.output[-3000:]
    table = TABLE_LINE.search(second.output)
    assert table and len(re.findall(r"rows on /job:ps/task:\d", table[3])) == 3, second.output[-3000:]
    m = AUC_LINE.search(second.output)
    assert m and int(m[4]) == 300 and float(m[1]) >= LEARNED_AUC, second.output[-3000:]
    chief = (tmp_path / "train" / "logs" / "worker-0.log").read_text()
    packs = re.findall(r"packed transfers: (\d+) variables and the rows read from embeddings/part_(\d) on "
                       r"/job:ps/task:(\d)", chief)
    # the 6 dense variables, dense1/weights as 3 shards, and each ps's table shard's rows: one pack on each ps
    assert sorted(t for _, _, t in packs) == ["0", "1", "2"] and sum(int(n) for n, _, _ in packs) == 8, chief[-3000:]
    assert sorted(shard for _, shard, _ in packs) == ["0", "1", "2"], packs
    import tensorflow as tf

    shapes = tf.train.load_checkpoint(str(tmp_path / "train" / "model.ckpt-300")).get_variable_to_shape_map()
    assert shapes["dense1/weights"] == [221, 64] and shapes["dense1/weights/Adagrad"] == [221, 64], shapes
    assert_processes_gone(first.pids | second.pids)


@pytest.mark.slow
def test_sync_workers_aggregate_sparse_gradients_and_learn(criteo_dir, tmp_path):
    """Sync mode, 2 ps + 2 workers: the table's gradients go through sparse conditional accumulators on the ps."""
    spec = write_spec(tmp_path / "sync.yaml", num_ps=2, num_workers=2, model="criteo", batch_size=64, mode="sync")
    run = run_launcher([str(spec), "--train_dir", str(tmp_path / "train"), "--data_dir", str(criteo_dir),
                        "--max_steps", "200"], cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.output[-4000:]
    m = AUC_LINE.search(run.output)
    assert m and int(m[4]) == 200 and float(m[1]) >= LEARNED_AUC, run.output[-3000:]
    assert_processes_gone(run.pids)


@pytest.mark.parametrize("num_ps", [1, 3])
@pytest.mark.parametrize("train", [{}, {"staged_vars": True, "transfer_dtype": "bfloat16"}, {"pack_transfers": True},
                                   {"pack_transfers": False}])
def test_the_ps_update_the_tables_rows_without_summing_them_again(num_ps, train, monkeypatch):
    """The pushed rows are distinct (the dedup's gradient ran on the worker): async, a ps applies them as they come,
    with no `Unique` and segment sum of its own, and by whole-block ops (`slots.gathered_adagrad`), not TF's per-row
    kernel, one at a time per shard (its `row_lock`, on its ps). (Sync's apply is built in a branch function; its accumulators' gradient is summed by row, as TF does.)"""
    from psworker.train.traffic import _Devices

    monkeypatch.setattr("psworker.data.criteo.num_examples", lambda *a, **k: 1000)
    graph = _graph(num_ps, **train)
    where = _Devices(graph)
    on_ps = collections.Counter(op.type for op in graph.get_operations() if "/job:ps" in where.of(op))
    assert on_ps["ResourceSparseApplyAdagrad"] == 0 and on_ps["ResourceScatterUpdate"] >= 2 * num_ps, on_ps
    assert on_ps["Unique"] == 0 and on_ps["UnsortedSegmentSum"] == 0, on_ps
    assert on_ps["MutexLock"] == num_ps and on_ps["MutexV2"] == num_ps, on_ps   # one update of a shard at a time


def _one_process_run(criteo_dir: Path, steps: int, **train) -> tuple[list, list]:
    """`steps` steps of criteo in one process (the batches' seed 1, the variables set from a seeded generator);
    every trainable variable after each step, and the table shards whose rows went with a pack."""
    import numpy as np
    import tensorflow as tf

    from psworker import models
    from psworker.train.graph import build_train_graph

    v1 = tf.compat.v1
    with tf.Graph().as_default():
        config = TrainConfig(model="criteo", data_dir=str(criteo_dir), seed=1, batch_size=64, **train)
        tg = build_train_graph(models.get("criteo"), config, cluster=None, task_index=0)
        trainable = v1.trainable_variables()
        with v1.train.MonitoredSession(session_creator=v1.train.ChiefSessionCreator()) as sess:
            raw = sess._tf_sess()   # pylint: disable=protected-access  (reads without running hooks)
            rng = np.random.default_rng(1)
            for v in trainable:
                v.load(rng.normal(0, 0.05, v.shape.as_list()).astype(np.float32), raw)
            values = []
            for _ in range(steps):
                sess.run(tg.train_op)
                values.append(raw.run(trainable))
    return values, tg.pulls.packed_rows if tg.pulls is not None else []


def test_the_rows_in_a_pack_train_exactly_as_gathered_alone(criteo_dir):
    """Packed, the table's rows travel with the dense weights (pulled in one tensor, their gradients pushed in
    one): 6 steps change every variable, table included, bit for bit as the unpacked graph does."""
    import numpy as np

    packed, rows = _one_process_run(criteo_dir, 6, pack_transfers=True)
    plain, none = _one_process_run(criteo_dir, 6, pack_transfers=False)
    assert [name for _, name in rows] == ["embeddings"] and none == [], (rows, none)
    assert all(np.array_equal(a, b) for step, again in zip(packed, plain) for a, b in zip(step, again))
    assert not np.array_equal(packed[0][0], packed[-1][0])   # the table did change
