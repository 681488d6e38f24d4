"""Criteo's display-advertising logs: the file format, the train and held-out splits, tf.data input by position.

One example per line, tab-separated: the label (0 or 1), 13 integer features, 26 categorical features as hex
strings (e.g. `68fd1e64`); any feature may be empty. The Terabyte set ships as `day_0` .. `day_23`, each optionally
gzipped (`day_0.gz`). The split: the highest-numbered day file is the held-out split, every other day file is the
training split (Criteo's own convention: train on days 0-22, test on day 23). Positions in the training split are
line numbers counted across its files in day order.

The reader keeps each split in memory, parsed (split once per process; 312 bytes a line): fine up to a few million
lines; the full Terabyte set needs a streaming reader (not written yet). Training, evaluation and the exported model
map a line to the same int64 features: the integers (empty: 0), then each categorical's row in one fused table, its
column's offset plus a hash of its bytes modulo the column's buckets. The input computes them in numpy from the
parsed split (`table_rows`), so no string reaches TensorFlow per batch; the export computes them in graph ops from
the raw strings (`preprocess_fields`), bit for bit the same.

Synthetic data in exactly this format: `criteo_synthetic.write_synthetic`.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import os
import re
from typing import Optional, Sequence

import numpy as np

from psworker.errors import TrainingFailed

NUM_INT = 13
NUM_CAT = 26
NUM_FEATURES = NUM_INT + NUM_CAT        # the raw fields of one example, without its label
NUM_FIELDS = 1 + NUM_FEATURES
# Distinct values per categorical column in Criteo's Kaggle set (the DLRM reference's counts): a few columns hold
# millions of values, most a few hundred or thousand.
CARDINALITIES = (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
                 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572)
DAY_FILE = re.compile(r"^day_(\d+)(\.gz)?$")
KEY_BYTES = 8                           # a categorical's bytes at most: Criteo's are 8 hex digits
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB   # splitmix64's constants


# ---------------------------------------------------------------------------------------------- files


def day_files(data_dir: Optional[str]) -> list[str]:
    """The `day_N` / `day_N.gz` files in `data_dir`, in day order.

    Raises:
        TrainingFailed: no data dir, or fewer than two day files (one is held out); the message says how to get them.
    """
    if not data_dir:
        raise _missing(None, "no --data_dir given")
    folder = os.path.expanduser(str(data_dir))
    found = sorted(((int(m[1]), name) for name in (os.listdir(folder) if os.path.isdir(folder) else ())
                    if (m := DAY_FILE.match(name))))
    days = [d for d, _ in found]
    if len(set(days)) != len(days):
        raise TrainingFailed(f"{folder}: a day is there both plain and gzipped: {', '.join(n for _, n in found)}")
    if len(found) < 2:
        raise _missing(data_dir, f"{len(found)} day_N file(s) in {folder}, at least 2 needed (the last is held out)")
    return [os.path.join(folder, name) for _, name in found]


def _missing(data_dir: Optional[str], what: str) -> TrainingFailed:
    where = data_dir or "D"
    return TrainingFailed(f"Criteo data not found: {what}. Put Criteo's day_N files (optionally .gz) there, or write "
                          f"a synthetic set with `psworker data criteo-synthetic --data_dir {where}`.")


def split_files(data_dir: Optional[str]) -> tuple[list[str], list[str]]:
    """`(train files, held-out files)`: every day but the last, and the last."""
    files = day_files(data_dir)
    return files[:-1], files[-1:]


def _open(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


# ---------------------------------------------------------------------------------------------- parsing


def parse_line(line: str) -> tuple[int, list[Optional[int]], list[str]]:
    """One line as `(label, 13 integers or None where empty, 26 hex strings, '' where empty)`.

    Raises:
        ValueError: not 40 tab-separated fields, a label other than 0/1, or a non-integer integer field.
    """
    fields = line.rstrip("\r\n").split("\t")
    if len(fields) != NUM_FIELDS:
        raise ValueError(f"{len(fields)} tab-separated fields, Criteo's lines have {NUM_FIELDS}")
    if fields[0] not in ("0", "1"):
        raise ValueError(f"label {fields[0]!r} is not 0 or 1")
    ints = [int(f) if f else None for f in fields[1:1 + NUM_INT]]
    return int(fields[0]), ints, fields[1 + NUM_INT:]


def format_line(label: int, ints: Sequence[Optional[int]], cats: Sequence[str]) -> str:
    """The line `parse_line` reads back (None and '' as empty fields), with its newline."""
    return "\t".join([str(int(label)), *("" if v is None else str(int(v)) for v in ints), *cats]) + "\n"


@dataclasses.dataclass(frozen=True)
class Split:
    """A split in memory, one entry per line: `labels` (int32 `[N]`), `ints` (the 13 integers, int64 `[N, 13]`, 0
    where empty) and `keys` (each categorical's bytes as a number, uint64 `[N, 26]`: `category_keys`)."""

    labels: np.ndarray
    ints: np.ndarray
    keys: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)


def read_split(paths: Sequence[str]) -> Split:
    """Reads every line of `paths` (in order) into a `Split`.

    Raises:
        TrainingFailed: a line that is not 40 tab-separated fields with a 0/1 label, an integer field that is not an
            integer, or a categorical longer than `KEY_BYTES` (each names the file and line).
    """
    parts = [_read_file(path) for path in paths]
    return Split(*(np.concatenate([part[i] for part in parts]) for i in range(3)))


def _read_file(path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    labels: list[bool] = []
    ints: list[list[bytes]] = []
    cats: list[list[bytes]] = []
    with _open(path) as f:
        for number, line in enumerate(f, start=1):
            fields = line.rstrip(b"\r\n").split(b"\t")
            if len(fields) != NUM_FIELDS or fields[0] not in (b"0", b"1"):
                raise TrainingFailed(f"{path}:{number}: not a Criteo line ({len(fields)} tab-separated fields, "
                                     f"label {fields[0][:10]!r}; want {NUM_FIELDS} and 0 or 1)")
            labels.append(fields[0] == b"1")
            ints.append(fields[1:1 + NUM_INT])
            cats.append(fields[1 + NUM_INT:])
    int_fields = np.array(ints, dtype=bytes).reshape(len(ints), NUM_INT)
    cat_fields = np.array(cats, dtype=bytes).reshape(len(cats), NUM_CAT)
    return np.asarray(labels, dtype=np.int32), _parse_ints(path, int_fields), _keys_of(path, cat_fields)


def _parse_ints(path: str, fields: np.ndarray) -> np.ndarray:
    try:
        return np.where(fields == b"", b"0", fields).astype(np.int64)
    except ValueError:
        for number, row in enumerate(fields, start=1):
            for column, value in enumerate(row, start=1):
                if value and not value.lstrip(b"-").isdigit():
                    raise TrainingFailed(f"{path}:{number}: integer field I{column} is {value[:20]!r}, not an "
                                         "integer") from None
        raise


def _keys_of(path: str, fields: np.ndarray) -> np.ndarray:
    if fields.dtype.itemsize > KEY_BYTES:
        lengths = np.char.str_len(fields)
        number, column = np.argwhere(lengths > KEY_BYTES)[0]
        raise TrainingFailed(f"{path}:{number + 1}: categorical C{column + 1} is {lengths[number, column]} bytes "
                             f"({fields[number, column][:20]!r}); Criteo's are 8 hex digits, at most {KEY_BYTES} "
                             "bytes are read")
    return category_keys(fields)


def category_keys(values: np.ndarray) -> np.ndarray:
    """Categorical values (a bytes array, each at most `KEY_BYTES`) -> uint64 keys of the same shape: the value's
    bytes zero-padded to 8 and read little-endian ('' is 0). `preprocess_fields` computes the same in the graph."""
    fixed = np.ascontiguousarray(np.asarray(values, dtype=f"S{KEY_BYTES}"))
    return fixed.view("<u8").reshape(fixed.shape)


def _mix(keys: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 `keys` (every input bit moves every output bit), wrapping like C."""
    z = keys + np.uint64(_GOLDEN)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2)
    return z ^ (z >> np.uint64(31))


def table_rows(keys: np.ndarray, buckets: Sequence[int]) -> np.ndarray:
    """uint64 keys `[..., 26]` -> each one's row in the fused table (int64): its column's offset plus
    `mix(key) % buckets[column]`."""
    with np.errstate(over="ignore"):
        hashed = _mix(np.asarray(keys, np.uint64)) % np.asarray(buckets, np.uint64)
    return hashed.astype(np.int64) + table_offsets(buckets)


@functools.lru_cache(maxsize=4)
def load_split(data_dir: str, held_out: bool) -> Split:
    """The training (or held-out) split of `data_dir`, read once per process (`read_split`)."""
    train, test = split_files(data_dir)
    return read_split(test if held_out else train)


def check_files(data_dir: Optional[str], need: int) -> int:
    """What a launcher checks before any task starts: the day files are there, the first line of each parses, and
    the training split's lines, counted up to `need` (a day of Criteo's is not read through for it).

    Raises:
        TrainingFailed: no data, or a file whose first line is not a Criteo line (names the file and what to do).
    """
    train, held_out = split_files(data_dir)
    count = 0
    for path in train + held_out:
        with _open(path) as f:
            for number, line in enumerate(f, start=1):
                if number == 1:
                    _first_line_parses(path, line)
                if path in held_out or count >= need:
                    break
                count += 1
    return count


def _first_line_parses(path: str, line: bytes) -> None:
    try:
        parse_line(line.decode("utf-8", errors="replace"))
    except ValueError as e:
        raise TrainingFailed(f"{path}:1: not a Criteo line ({e}): the day_N files hold Criteo's tab-separated lines; "
                             "`psworker data criteo-synthetic --data_dir D` writes a synthetic set") from None


def num_examples(data_dir: Optional[str], held_out: bool = False) -> int:
    """Lines in the training (or held-out) split."""
    split_files(data_dir)   # the clear error first
    return len(load_split(str(data_dir), held_out))


# ---------------------------------------------------------------------------------------------- graph


def table_offsets(buckets: Sequence[int]) -> np.ndarray:
    """The first row of each column's buckets in the fused table (int64 `[26]`)."""
    return np.concatenate([[0], np.cumsum(buckets)[:-1]]).astype(np.int64)


def preprocess_fields(fields, buckets: Sequence[int]):
    """Raw fields (string `[batch, 39]`) -> int64 `[batch, 39]`: the 13 integers (empty: 0), then each categorical's
    row in the fused table, as `table_rows(category_keys(value))` computes it in numpy (bit for bit).

    A categorical longer than `KEY_BYTES` fails the run of the graph with a message that says so."""
    import tensorflow as tf

    fields = tf.convert_to_tensor(fields, tf.string)
    ints = fields[:, :NUM_INT]
    ints = tf.strings.to_number(tf.where(tf.equal(ints, ""), "0", ints), tf.int64)
    cats = fields[:, NUM_INT:]
    fits = tf.debugging.assert_less_equal(
        tf.strings.length(cats), KEY_BYTES,
        message=f"a categorical field is longer than {KEY_BYTES} bytes (Criteo's are 8 hex digits)")
    with tf.control_dependencies([fits]):
        octets = tf.cast(tf.io.decode_raw(cats, tf.uint8, fixed_length=KEY_BYTES), tf.uint64)   # [batch, 26, 8]
    shifts = tf.constant(np.arange(0, 64, 8, dtype=np.uint64))
    keys = tf.reduce_sum(tf.bitwise.left_shift(octets, shifts), axis=2)   # disjoint bits: the sum is the OR
    hashed = tf.math.floormod(_graph_mix(keys), tf.constant(np.asarray(buckets, np.uint64)))
    rows = tf.cast(hashed, tf.int64) + tf.constant(table_offsets(buckets))[tf.newaxis, :]
    return tf.concat([ints, rows], axis=1, name="criteo_features")


def _graph_mix(keys):
    """`_mix` in graph ops on uint64 `keys`."""
    import tensorflow as tf

    def u64(v):
        return tf.constant(np.uint64(v))

    z = keys + u64(_GOLDEN)
    z = tf.bitwise.bitwise_xor(z, tf.bitwise.right_shift(z, u64(30))) * u64(_MIX1)
    z = tf.bitwise.bitwise_xor(z, tf.bitwise.right_shift(z, u64(27))) * u64(_MIX2)
    return tf.bitwise.bitwise_xor(z, tf.bitwise.right_shift(z, u64(31)))


def _batches(positions, data_dir: str, held_out: bool, buckets: Sequence[int]):
    """`positions` (a dataset of int64 batches of line numbers) -> `(features int64 [B, 39], labels int32 [B])`,
    preprocessed in numpy from the split in memory (no string reaches TensorFlow)."""
    import tensorflow as tf

    def gather(p):
        split = load_split(data_dir, held_out)
        return np.concatenate([split.ints[p], table_rows(split.keys[p], buckets)], axis=1), split.labels[p]

    def lookup(p):
        features, labels = tf.numpy_function(gather, [p], (tf.int64, tf.int32), stateful=False)
        features.set_shape([None, NUM_FEATURES])
        labels.set_shape([None])
        return features, labels

    # straight ops: AutoGraph would write a file into /tmp per process, left there by a task that is killed
    return positions.map(tf.autograph.experimental.do_not_convert(lookup), num_parallel_calls=1).prefetch(2)


def dealt_dataset(data_dir: str, positions, batch_size: int, buckets: Sequence[int]):
    """The training lines at `positions` (int64 line numbers), in order, in batches (the last may be smaller)."""
    load_split(str(data_dir), False)   # read (and checked) now, not in the first step
    return _batches(positions.batch(batch_size), str(data_dir), False, buckets)


def train_dataset(data_dir: str, batch_size: int, buckets: Sequence[int], shard_index: int = 0,
                  num_shards: int = 1, seed: Optional[int] = None):
    """Every `num_shards`-th training line from `shard_index`, shuffled, forever (static slices)."""
    import tensorflow as tf

    n = num_examples(data_dir)
    ds = tf.data.Dataset.range(n).shard(num_shards, shard_index)
    ds = ds.shuffle(min(n, 100_000), seed=seed, reshuffle_each_iteration=True).repeat()
    return _batches(ds.batch(batch_size, drop_remainder=True), str(data_dir), False, buckets)


def eval_dataset(data_dir: str, batch_size: int, buckets: Sequence[int]):
    """The whole held-out split once, in order, in batches."""
    import tensorflow as tf

    n = num_examples(data_dir, held_out=True)
    return _batches(tf.data.Dataset.range(n).batch(batch_size), str(data_dir), True, buckets)


__all__ = ["NUM_INT", "NUM_CAT", "NUM_FEATURES", "NUM_FIELDS", "CARDINALITIES", "day_files", "split_files",
           "parse_line", "format_line", "Split", "read_split", "load_split", "num_examples", "KEY_BYTES",
           "category_keys", "table_rows", "table_offsets", "preprocess_fields", "dealt_dataset", "train_dataset",
           "eval_dataset"]
