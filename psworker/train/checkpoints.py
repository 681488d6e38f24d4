"""The chief's checkpoints: found on disk, checked before a restore, the newest usable one chosen (never a silent
step back), and new ones written under the global step they hold and rotated only once a newer one is checked.

A checkpoint is *usable* when its `.index` opens, every `.data-*` shard it needs is there, the shards hold at least
the bytes its tensors take, it has every variable of the graph with the graph's shape and dtype, and (before a
restore) every tensor reads back with a matching checksum. The train dir is the chief's and its ps tasks' (one host,
or shared storage): the chief checks, renames and deletes files the ps tasks wrote.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Mapping, Optional

from psworker.errors import TrainingFailed

log = logging.getLogger(__name__)

PREFIX = "model.ckpt"                    # TF's CheckpointSaverHook writes <train_dir>/model.ckpt-<step>
PARTIAL = f"{PREFIX}-partial"            # where a checkpoint is written before it is checked and named
STATE_FILE = "checkpoint"                # TF's list of the checkpoints (`tf.train.latest_checkpoint` reads it)
_FILE = re.compile(r"^model\.ckpt-(\d+)\.(index|meta|data-(\d{5})-of-(\d{5}))$")
_SHARD = re.compile(r"\.data-(\d{5})-of-(\d{5})$")
_MAX_PROBLEMS = 3                        # variables named in one reason, at most

Expected = Mapping[str, tuple]           # checkpoint key -> (full shape as a tuple, tf.DType)


@dataclass(frozen=True)
class Found:
    """One checkpoint's files in the train dir (`files`: basenames present; `listed`: named by the state file)."""

    step: int
    prefix: str
    files: tuple[str, ...]
    listed: bool

    @property
    def name(self) -> str:
        return os.path.basename(self.prefix)


@dataclass(frozen=True)
class Choice:
    """What to restore: the newest usable checkpoint (`path`, None: none is), those given up on the way as
    `(name, step, why)` newest first, and the usable one with the older ones, oldest first (the rotation's list)."""

    path: Optional[str]
    step: Optional[int]
    rejected: tuple[tuple[str, int, str], ...]
    kept: tuple[str, ...]

    @property
    def refused(self) -> bool:
        """Checkpoint files are there, but none is usable."""
        return self.path is None and bool(self.rejected)


def find(train_dir: str, *, listed_only: bool = False) -> list[Found]:
    """Every `model.ckpt-N` of `train_dir`, newest first: those on disk and those the state file names (TF's
    `latest_checkpoint` sees only the latter, and nothing when the newest's `.index` is gone). `listed_only`: those
    the state file names (a reader beside a running chief: the files of one being named are not there yet)."""
    names: dict[int, list[str]] = {}
    try:
        entries = os.listdir(train_dir)
    except FileNotFoundError:
        return []
    for entry in entries:
        match = _FILE.match(entry)
        if match:
            names.setdefault(int(match.group(1)), []).append(entry)
    listed = set()
    for path in listed_paths(train_dir):
        match = re.match(r"^model\.ckpt-(\d+)$", os.path.basename(path))
        if match:
            listed.add(int(match.group(1)))
            names.setdefault(int(match.group(1)), [])
    return [Found(step, os.path.join(train_dir, f"{PREFIX}-{step}"), tuple(sorted(names[step])), step in listed)
            for step in sorted(names, reverse=True) if step in listed or not listed_only]


def listed_paths(train_dir: str) -> list[str]:
    """The checkpoints the state file names, oldest first (none when it is missing or unreadable)."""
    import tensorflow as tf

    try:
        state = tf.train.get_checkpoint_state(train_dir)
    except Exception as exc:   # noqa: BLE001 - a corrupt state file is rewritten at the next save
        log.warning("%s: unreadable (%s); looking for checkpoint files instead",
                    os.path.join(train_dir, STATE_FILE), str(exc).splitlines()[0])
        return []
    if state is None:
        return []
    paths = list(state.all_model_checkpoint_paths)
    if state.model_checkpoint_path and state.model_checkpoint_path not in paths:
        paths.append(state.model_checkpoint_path)
    return paths


OPTIONAL_SCOPE = "psworker_data/"   # train.dealer.SCOPE: the data position, which old checkpoints lack


def expected_variables(var_list=None) -> dict:
    """The checkpoint keys a `Saver` of `var_list` (default: every global variable and saveable object of the
    default graph) writes and reads, each with its full shape and dtype (a split variable's shards as one)."""
    import tensorflow as tf
    from tensorflow.python.training.saving import saveable_object_util

    v1 = tf.compat.v1
    if var_list is None:
        var_list = v1.global_variables() + v1.get_collection(v1.GraphKeys.SAVEABLE_OBJECTS)
    out = {}
    for saveable in saveable_object_util.validate_and_slice_inputs(saveable_object_util.op_list_to_dict(var_list)):
        for spec in saveable.specs:
            if spec.slice_spec:
                shape = tuple(int(n) for n in spec.slice_spec.split()[:-1])
            else:
                shape = tuple(spec.tensor.shape.as_list()) if hasattr(spec.tensor, "shape") else None
            out[spec.name] = (shape, spec.dtype.base_dtype)
    return out


def problem(found: Found, expected: Optional[Expected] = None, *, read_tensors: bool = True) -> Optional[str]:
    """Why the checkpoint `found` cannot be restored, or None when it can.

    Args:
        expected: the graph's variables (`expected_variables`); None: any variables.
        read_tensors: read every tensor back (TF checks each one's CRC32C): the whole checkpoint is read once more,
            before the restore reads it again (CIFAR-10's 4.3 MB: see docs/architecture.md). False: the cheap
            checks only (files, sizes, variables).
    """
    import tensorflow as tf

    index = f"{found.name}.index"
    if index not in found.files:
        return ".index missing"
    shards = [f for f in found.files if _SHARD.search(f)]
    if not shards:
        return ".data files missing"
    total = int(_SHARD.search(shards[0]).group(2))
    missing = [f"{found.name}.data-{i:05d}-of-{total:05d}" for i in range(total)
               if f"{found.name}.data-{i:05d}-of-{total:05d}" not in shards]
    if missing:
        return f"{', '.join(missing)} missing"
    try:
        reader = tf.train.load_checkpoint(found.prefix)
        shapes, dtypes = reader.get_variable_to_shape_map(), reader.get_variable_to_dtype_map()
    except Exception as exc:   # noqa: BLE001 - any failure to open makes it unusable; say which
        return f".index unreadable: {_first_line(exc)}"
    why = _variables_differ(shapes, dtypes, expected) if expected is not None else None
    if why or not read_tensors:
        return why or _too_short(found, shapes, dtypes, total)
    for key in sorted(shapes):
        try:
            reader.get_tensor(key)
        except Exception as exc:   # noqa: BLE001
            short = _too_short(found, shapes, dtypes, total)
            return f"variable {key} unreadable{f' ({short})' if short else ''}: {_first_line(exc)}"
    return None


def _variables_differ(shapes: Mapping, dtypes: Mapping, expected: Expected) -> Optional[str]:
    problems = []
    # a checkpoint written before dealt shards holds no data position: it restores, and the position starts fresh
    # (train.dealer.restore); one holding part of it does not
    old = not any(key.startswith(OPTIONAL_SCOPE) for key in shapes)
    for key, (shape, dtype) in sorted(expected.items()):
        if key not in shapes and old and key.startswith(OPTIONAL_SCOPE):
            continue
        if key not in shapes:
            problems.append(f"variable {key} missing")
        elif shape is not None and tuple(shapes[key]) != tuple(shape):
            problems.append(f"variable {key} has shape {list(shapes[key])}, the graph's is {list(shape)}")
        elif dtypes[key].base_dtype != dtype:
            problems.append(f"variable {key} is {dtypes[key].name}, the graph's is {dtype.name}")
    if not problems:
        return None
    more = f" (and {len(problems) - _MAX_PROBLEMS} more)" if len(problems) > _MAX_PROBLEMS else ""
    return "; ".join(problems[:_MAX_PROBLEMS]) + more


def _too_short(found: Found, shapes: Mapping, dtypes: Mapping, total: int) -> Optional[str]:
    """The shards hold fewer bytes than the index's tensors take (numeric tensors take exactly their bytes)."""
    import numpy as np

    if any(dtypes[k].base_dtype.name == "string" for k in dtypes):
        return None
    need = sum(int(np.prod(shapes[k], dtype=np.int64)) * dtypes[k].size for k in shapes)
    have = sum(os.path.getsize(f"{found.prefix}.data-{i:05d}-of-{total:05d}") for i in range(total))
    if have < need:
        return f".data holds {have} bytes, its index lists {need}"
    return None


def _first_line(exc: BaseException) -> str:
    text = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    return text.strip().splitlines()[0]


def choose(train_dir: str, expected: Optional[Expected] = None, *, listed_only: bool = False) -> Choice:
    """The newest usable checkpoint of `train_dir`, and every newer one given up with the reason (`listed_only`:
    see `find`)."""
    found = find(train_dir, listed_only=listed_only)
    rejected = []
    for i, candidate in enumerate(found):
        why = problem(candidate, expected)
        if why is None:
            kept = tuple(f.prefix for f in reversed(found[i:]) if f"{f.name}.index" in f.files)
            return Choice(candidate.prefix, candidate.step, tuple(rejected), kept)
        rejected.append((candidate.name, candidate.step, why))
    return Choice(None, None, tuple(rejected), ())


def describe_rejected(rejected: tuple[tuple[str, int, str], ...]) -> str:
    """`model.ckpt-600: .index missing; model.ckpt-500, model.ckpt-400: variable w unreadable (...)`: the
    checkpoints given up, newest first, those with the same reason together."""
    reasons: dict[str, list[str]] = {}
    for name, _, why in rejected:
        reasons.setdefault(why, []).append(name)
    return "; ".join(f"{', '.join(names)}: {why}" for why, names in reasons.items())


def fallback_message(choice: Choice) -> str:
    """`model.ckpt-600: .index missing; restoring model.ckpt-407 instead (193 steps given up)`."""
    bad = describe_rejected(choice.rejected)
    given_up = choice.rejected[0][1] - choice.step
    return (f"{bad}; restoring {os.path.basename(choice.path)} instead "
            f"({given_up} step{'s' if given_up != 1 else ''} given up)")


def refusal(train_dir: str, choice: Choice, flag: str = "--allow_fresh_start true") -> TrainingFailed:
    """The error (exit 3) of a train dir that holds checkpoint files, none of them usable."""
    bad = describe_rejected(choice.rejected)
    return TrainingFailed(
        f"no usable checkpoint in {train_dir} ({bad}); refusing to start from scratch, which would give up "
        f"{choice.rejected[0][1]} steps: repair or move those files away, or pass {flag} to start afresh")


def write_state(train_dir: str, kept: tuple[str, ...]) -> None:
    """Points TF's state file at `kept` (oldest first; the last is the latest), so TF's own tools agree."""
    from tensorflow.python.checkpoint import checkpoint_management

    checkpoint_management.update_checkpoint_state_internal(
        save_dir=train_dir, model_checkpoint_path=kept[-1], all_model_checkpoint_paths=list(kept),
        save_relative_paths=True)


class CheckpointKeeper:
    """Writes the chief's checkpoints: first as `model.ckpt-partial`, then checked (the cheap checks of `problem`)
    and renamed after the global step the files hold (`model.ckpt-N`, the `.index` last), then listed in the state
    file; only then is the oldest beyond `keep` deleted. So the rotation never deletes a usable checkpoint for one
    that is not proven, and a half-written checkpoint never bears a step's name.

    Args:
        train_dir: the checkpoint directory.
        keep: how many checkpoints to keep (the newest); 0 or None: every one.
        kept: those already there, oldest first (`Choice.kept`): they rotate away as new ones come.
        step_key: the checkpoint key of the global step.
    """

    def __init__(self, train_dir: str, *, keep: Optional[int], kept: tuple[str, ...] = (),
                 step_key: str = "global_step"):
        self._dir = train_dir
        self._keep = keep   # 0 or None: keep every one (as TF's max_to_keep)
        self._kept = list(kept)
        self._step_key = step_key

    @property
    def kept(self) -> tuple[str, ...]:
        return tuple(self._kept)

    def save(self, session, saver, *, write_meta_graph: bool = False) -> Optional[tuple[str, int]]:
        """Saves, checks and names a checkpoint; returns `(path, global step it holds)`, or None when the files
        written fail the check (a warning says why; the older checkpoints stay)."""
        import tensorflow as tf

        partial = os.path.join(self._dir, PARTIAL)
        _remove(partial)
        saver.save(session, partial, write_meta_graph=write_meta_graph, write_state=False)
        written = Found(-1, partial, _files_of(partial), False)
        why = problem(written, None, read_tensors=False)
        step = None
        if why is None:
            try:
                step = int(tf.train.load_checkpoint(partial).get_tensor(self._step_key))
            except Exception as exc:   # noqa: BLE001
                why = f"{self._step_key} unreadable: {_first_line(exc)}"
        if why is not None:
            log.warning("the checkpoint just written is unusable (%s: %s); the older ones are kept", PARTIAL, why)
            return None
        final = os.path.join(self._dir, f"{PREFIX}-{step}")
        if final in self._kept:   # the same step again (a chief that restored it): the older copy stays
            _remove(partial)
            return final, step
        _remove(final)            # an unusable checkpoint of this step, given up at the restore
        _rename(partial, final, written.files)
        self._kept.append(final)
        going = self._kept[:-self._keep] if self._keep else []
        del self._kept[:len(going)]
        write_state(self._dir, tuple(self._kept))   # first: the state file never lists a deleted checkpoint
        for prefix in going:
            _remove(prefix)
        return final, step


def _files_of(prefix: str) -> tuple[str, ...]:
    """The basenames of `prefix`'s files (`.index`, `.data-*`, `.meta`)."""
    directory, name = os.path.split(prefix)
    try:
        return tuple(sorted(f for f in os.listdir(directory) if f.startswith(name + ".")))
    except FileNotFoundError:
        return ()


def _remove(prefix: str) -> None:
    directory = os.path.dirname(prefix)
    for name in _files_of(prefix):
        try:
            os.remove(os.path.join(directory, name))
        except FileNotFoundError:
            pass


def _rename(old: str, new: str, files: tuple[str, ...]) -> None:
    """Renames `old`'s files to `new`'s, the `.index` last: until it is there, `new` is not a checkpoint."""
    directory, old_name = os.path.split(old)
    new_name = os.path.basename(new)
    for name in sorted(files, key=lambda f: f.endswith(".index")):
        os.replace(os.path.join(directory, name), os.path.join(directory, new_name + name[len(old_name):]))


__all__ = ["PREFIX", "PARTIAL", "STATE_FILE", "Found", "Choice", "find", "listed_paths",
           "expected_variables", "problem", "choose", "describe_rejected", "fallback_message", "refusal", "write_state",
           "CheckpointKeeper"]
