"""Criteo's format: lines parsed (empty fields, negative integers, bad lines), day files plain and gzipped, the
train/held-out split, the synthetic writer's files read back through the same reader, and the graph's preprocessing
(integers, hashed rows within each column's range of the fused table)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import numpy as np
import pytest

from psworker.data import criteo, criteo_synthetic
from psworker.errors import TrainingFailed
from psworker.metrics import auc, logloss
from tests.cluster_utils import task_env

LINE = "1\t5\t\t-1\t0" + "\t" * 9 + "\t68fd1e64\t" + "\t".join(f"{i:08x}" for i in range(24)) + "\t\n"


def test_a_line_parses_with_empty_and_negative_fields():
    label, ints, cats = criteo.parse_line(LINE)
    assert label == 1
    assert ints == [5, None, -1, 0] + [None] * 9
    assert cats[0] == "68fd1e64" and cats[1:25] == [f"{i:08x}" for i in range(24)] and cats[25] == ""
    assert criteo.format_line(label, ints, cats) == LINE


@pytest.mark.parametrize("line, says", [("1\t2\t3\n", "3 tab-separated fields"),
                                        ("2" + LINE[1:], "label '2' is not 0 or 1")])
def test_a_bad_line_is_refused(line, says):
    with pytest.raises(ValueError, match=says):
        criteo.parse_line(line)


def _write_days(folder, lines_per_day, compress_days=()):
    folder.mkdir(exist_ok=True)
    for day, lines in enumerate(lines_per_day):
        name = f"day_{day}" + (".gz" if day in compress_days else "")
        with (gzip.open(folder / name, "wt") if day in compress_days else open(folder / name, "w")) as f:
            f.writelines(lines)


def test_day_files_plain_and_gzipped_split_into_train_and_the_last_day(tmp_path):
    rows = [[criteo.format_line(d % 2, [d, None] + [7] * 11, [f"{d:08x}"] * 25 + [""]) for _ in range(d + 1)]
            for d in range(3)]
    _write_days(tmp_path / "d", rows, compress_days=(1,))
    (tmp_path / "d" / "day_10").write_text("".join(rows[0]))   # day 10 sorts after day 2 by number, not by text
    train, held_out = criteo.split_files(str(tmp_path / "d"))
    assert [p.rsplit("/", 1)[1] for p in train] == ["day_0", "day_1.gz", "day_2"]
    assert [p.rsplit("/", 1)[1] for p in held_out] == ["day_10"]
    split = criteo.read_split(train)
    assert split.labels.tolist() == [0, 1, 1, 0, 0, 0] and len(split) == 6
    assert split.ints.shape == (6, 13) and split.keys.shape == (6, 26)
    assert split.ints[1, :3].tolist() == [1, 0, 7]   # the empty integer is 0
    assert split.keys[1, 0] == int.from_bytes(b"00000001", "little") and split.keys[1, 25] == 0   # '' is 0
    assert criteo.num_examples(str(tmp_path / "d")) == 6 and criteo.num_examples(str(tmp_path / "d"), True) == 1


def test_missing_or_broken_data_fails_with_what_to_do(tmp_path):
    with pytest.raises(TrainingFailed, match=r"0 day_N file\(s\).*psworker data criteo-synthetic --data_dir"):
        criteo.split_files(str(tmp_path))
    _write_days(tmp_path / "d", [[LINE], [LINE, "1\tx\n"]])
    with pytest.raises(TrainingFailed, match=r"day_1:2: not a Criteo line \(2 tab-separated fields"):
        criteo.read_split(criteo.day_files(str(tmp_path / "d")))
    _write_days(tmp_path / "both", [[LINE], [LINE]], compress_days=())
    _write_days(tmp_path / "both", [[LINE]], compress_days=(0,))
    with pytest.raises(TrainingFailed, match="both plain and gzipped"):
        criteo.day_files(str(tmp_path / "both"))
    long_value = criteo.format_line(0, [1] * 13, ["68fd1e64"] * 3 + ["68fd1e6400"] + ["68fd1e64"] * 22)
    _write_days(tmp_path / "long", [[LINE, LINE, long_value], [LINE]])
    with pytest.raises(TrainingFailed, match=r"day_0:3: categorical C4 is 10 bytes \(b'68fd1e6400'\); Criteo's are 8 "
                                             r"hex digits"):
        criteo.read_split(criteo.split_files(str(tmp_path / "long"))[0])
    not_int = criteo.format_line(0, [1] * 13, ["68fd1e64"] * 26).replace("\t1\t", "\t1x\t", 1)
    _write_days(tmp_path / "int", [[LINE, not_int], [LINE]])
    with pytest.raises(TrainingFailed, match=r"day_0:2: integer field I1 is b'1x', not an integer"):
        criteo.read_split(criteo.split_files(str(tmp_path / "int"))[0])


def test_synthetic_files_are_criteo_lines_with_zipf_columns_and_a_planted_signal(tmp_path):
    info = criteo_synthetic.write_synthetic(str(tmp_path / "s"), days=2, rows_per_day=3000, max_cardinality=500,
                                            compress=True, seed=3)
    assert [p.rsplit("/", 1)[1] for p in info.files] == ["day_0.gz", "day_1.gz"]
    parsed = [criteo.parse_line(line) for line in gzip.open(info.files[0], "rt")]
    assert len(parsed) == 3000
    cats = np.array([c for _, _, c in parsed])
    assert all(len(v) in (0, 8) and int(v or "0", 16) >= 0 for v in cats.ravel())
    assert (cats == "").any() and any(i is None for _, ints, _ in parsed for i in ints)   # empty fields occur
    for column in range(criteo.NUM_CAT):
        values, counts = np.unique(cats[:, column][cats[:, column] != ""], return_counts=True)
        assert len(values) <= info.cardinalities[column] == min(criteo.CARDINALITIES[column], 500)
        if info.cardinalities[column] >= 100:   # Zipf: the commonest value far above an even share
            assert counts.max() > 10 * len(cats) / info.cardinalities[column]
    assert 0.1 < info.click_rate < 0.6
    assert info.oracle_auc > 0.85   # the planted features decide much of the label
    assert json.loads((tmp_path / "s" / criteo_synthetic.META_FILE).read_text())["oracle_auc"] == info.oracle_auc
    again = criteo_synthetic.write_synthetic(str(tmp_path / "t"), days=2, rows_per_day=3000, max_cardinality=500,
                                             seed=3)
    assert open(again.files[1]).read() == gzip.open(info.files[1], "rt").read()   # deterministic per seed


def test_the_data_command_writes_synthetic_criteo_and_refuses_its_flags_elsewhere(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "psworker", "data", *args], capture_output=True, text=True,
                              env=task_env(), timeout=120)
    done = run("criteo-synthetic", "--data_dir", str(tmp_path / "c"), "--days", "3", "--rows_per_day", "50",
               "--max_cardinality", "100", "--seed", "0")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["criteo_synthetic.json", "day_0", "day_1", "day_2"]
    assert len((tmp_path / "c" / "day_2").read_text().splitlines()) == 50
    bad = run("cifar10-synthetic", "--data_dir", str(tmp_path / "x"), "--gzip")
    assert bad.returncode == 2 and "--gzip: only criteo-synthetic takes these options" in bad.stderr, bad.stderr


def test_preprocessing_parses_integers_and_hashes_each_column_into_its_own_rows():
    import tensorflow as tf

    buckets = [3 + c for c in range(criteo.NUM_CAT)]
    offsets = criteo.table_offsets(buckets)
    fields = np.array([criteo.format_line(0, [5, None, -1] + [0] * 10, ["abc"] * 25 + [""]).rstrip("\n")
                       .split("\t")[1:]], dtype=bytes)
    got = criteo.preprocess_fields(tf.constant(fields), buckets).numpy()
    assert got.dtype == np.int64 and got.shape == (1, 39)
    assert got[0, :13].tolist() == [5, 0, -1] + [0] * 10
    rows = got[0, 13:]
    assert ((rows >= offsets) & (rows < offsets + np.array(buckets))).all()
    assert rows.tolist() == criteo.table_rows(criteo.category_keys(fields[:, 13:]), buckets)[0].tolist()


def test_the_graph_and_numpy_hash_every_value_to_the_same_row_spread_over_the_buckets():
    """The input hashes in numpy, the export in graph ops: the same rows for 8-byte hex strings, shorter values, ''
    and every byte value, and near-even use of a column's buckets."""
    import tensorflow as tf

    rng = np.random.default_rng(0)
    values = [f"{v:08x}".encode() for v in rng.integers(0, 2 ** 32, 20_000)]
    values += [b"", b"a", b"\xff" * 8, b"\x01\x00\x80", bytes(range(1, 9))]
    values = np.array(values + [b""] * (-len(values) % criteo.NUM_CAT), dtype=bytes).reshape(-1, criteo.NUM_CAT)
    buckets = [1 + 997 * c for c in range(criteo.NUM_CAT)]
    ints = np.zeros((len(values), criteo.NUM_INT), dtype=bytes)
    graph = criteo.preprocess_fields(tf.constant(np.concatenate([ints, values], axis=1)), buckets).numpy()
    rows = criteo.table_rows(criteo.category_keys(values), buckets)
    assert graph[:, criteo.NUM_INT:].tolist() == rows.tolist()
    column = rows[:, -1] - criteo.table_offsets(buckets)[-1]   # 769 values into 24,926 buckets: few collisions
    assert len(np.unique(column)) > 0.98 * len(column)
    counts = np.bincount(rows[:, 5] - criteo.table_offsets(buckets)[5], minlength=buckets[5])   # 769 into 4,986
    assert counts.max() <= 3
    with pytest.raises(tf.errors.InvalidArgumentError, match="longer than 8 bytes"):
        criteo.preprocess_fields(tf.constant([[b"1"] * criteo.NUM_INT + [b"123456789"] * criteo.NUM_CAT]), buckets)


def test_auc_and_logloss_against_known_values():
    assert auc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == 0.75
    assert auc([0.5, 0.5], [0, 1]) == 0.5 and auc([1, 2], [1, 1]) == 0.5
    assert logloss([0.5, 0.5], [0, 1]) == pytest.approx(np.log(2))
