"""The `train` section of a spec: `TrainConfig`, its field types and rules, and merging command-line overrides.

Every TrainConfig field is also a flag of the commands that train (`worker`, `local`, `ssh`, `slurm`, `k8s
manifest`), its help generated from the field's `SettingDoc`; a bad value is a `SpecError` naming the field.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

from psworker.errors import SpecError, SpecProblems, describe_value, unknown_key
from psworker.spec.fieldtypes import AUTO, PARSERS, TYPE_PARSERS
from psworker.models import registry as model_registry

MODES = ("async", "sync")
REPLICATIONS = ("between-graph", "in-graph")
TRANSFER_DTYPES = ("float32", "bfloat16")   # psworker.train.transfer.DTYPES (TF-free here)
DATA_DEALINGS = ("dealt", "static")
DEFAULT_SAVE_CHECKPOINT_SECS = 60.0       # when neither save_checkpoint_steps nor save_checkpoint_secs is set


@dataclass(frozen=True)
class SettingDoc:
    """What `--help` says about one TrainConfig field: its meaning, its choices, its default in words."""

    meaning: str
    default: str                                          # in words: "the model's", "every worker", "2000"
    choices: Optional[Callable[[], tuple[str, ...]]] = None   # read when needed: the model registry is live
    metavar: Optional[str] = None                         # None: from the type (INT, FLOAT, ...) or the choices
    flag: bool = True                                     # False: a spec setting (`--set NAME=VALUE` on a command)


def _setting(default: Any, meaning: str, words: Optional[str] = None, **doc: Any) -> Any:
    """A TrainConfig field with its `SettingDoc` (a None default must say in words what None means)."""
    if default is None and words is None:
        raise TypeError(f"{meaning!r}: a None default needs its meaning in words")
    shown = words if words is not None else _in_words(default)
    return field(default=default, metadata={"doc": SettingDoc(meaning, shown, **doc)})


def _in_words(value: Any) -> str:
    """A default as a spec would write it: `true`, `120`, `async`."""
    if isinstance(value, bool):
        return str(value).lower()
    return f"{value:g}" if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class TrainConfig:
    """Trainer settings: the spec's `train` section, overridden by command-line flags of the same names.

    Each field's `SettingDoc` (`setting_doc`) is the one description of it: `--help` is generated from it."""

    model: str = _setting("mlp", "the registered model to train", choices=model_registry.names)
    mode: str = _setting("async", "async: each worker applies its own gradients at once; sync: the gradients of "
                                  "replicas_to_aggregate workers are averaged once per global step",
                         choices=lambda: MODES)
    max_steps: int = _setting(2000, "train until the global step reaches this")
    batch_size: int = _setting(64, "examples per step of each tower; a worker's batch is this x num_devices")
    learning_rate: Optional[float] = _setting(None, "the base learning rate, before scale_learning_rate",
                                              "the model's")
    train_dir: Optional[str] = _setting(None, "checkpoints and summaries; a launcher's run dir also holds "
                                              "cluster.yaml and logs/",
                                        "a launcher's fresh runs/<spec>-<date>-<time>; worker 0 of `psworker "
                                        "worker` needs one", metavar="DIR")
    data_dir: Optional[str] = _setting(None, "where the model's data set lies", "none; the digits come with "
                                             "scikit-learn, cifar10 needs one", metavar="DIR")
    save_checkpoint_steps: Optional[int] = _setting(None, "write a checkpoint every this many global steps",
                                                    "off, time-based", flag=False)
    save_checkpoint_secs: Optional[float] = _setting(None, "write a checkpoint every this many seconds; not with "
                                                           "save_checkpoint_steps",
                                                     f"every {DEFAULT_SAVE_CHECKPOINT_SECS:g} s", flag=False)
    log_every_steps: int = _setting(100, "print a step line every this many global steps", flag=False)
    replicas_to_aggregate: Optional[int] = _setting(None, "sync: gradients averaged per global step; fewer than "
                                                          "the workers makes the others backup workers",
                                                    "every worker")
    startup_timeout_secs: float = _setting(120.0, "how long a worker waits for its ps tasks and the chief's model, "
                                                  "in seconds", flag=False)
    step_timeout_secs: float = _setting(300.0, "longest training step (sync: waiting for the other workers; a ps "
                                               "that does not answer) before the worker fails with exit 170, "
                                               "naming who did not answer, in seconds", flag=False)
    num_devices: Union[int, str] = _setting(1, "towers per worker, or auto: one per visible GPU, one CPU tower "
                                               "when there is none", metavar="{N,auto}")
    replication: str = _setting("between-graph", "between-graph: every worker builds its own graph; in-graph: "
                                                  "one client drives every worker",
                                choices=lambda: REPLICATIONS, flag=False)
    seed: Optional[int] = _setting(None, "random seed of the initial weights and the data order",
                                   "off, different each run")
    scale_learning_rate: bool = _setting(True, "scale the learning rate linearly with the global batch, for "
                                               "models with a reference batch", metavar="{true,false}", flag=False)
    staged_vars: bool = _setting(False, "async: pull the next step's variables while this step computes (a "
                                        "StagingArea per variable on the worker); under plain gradient descent "
                                        "the worker adds its own last update to them, so only the other workers' "
                                        "updates come a step later; other optimizers compute one update stale "
                                        "(then halve learning_rate); not in sync mode",
                                 metavar="{true,false}", flag=False)
    data_dealing: str = _setting("dealt", "dealt: shards of the training split dealt on demand from a cursor on the "
                                          "ps, kept in the checkpoint (fast workers read more, nothing is lost on "
                                          "restarts or scaling); static: each worker reads its own fixed slice, "
                                          "forever (in-graph: the client reads every worker's batch, dealt, or "
                                          "each worker its own slice)",
                                 choices=lambda: DATA_DEALINGS, flag=False)
    num_epochs: Optional[int] = _setting(None, "dealt: end training once every example was dealt this many times "
                                               "and trained (or at max_steps, whichever comes first; sync mode: at "
                                               "the global step that covers them)", "none: until max_steps")
    shard_examples: Optional[int] = _setting(None, "dealt: examples per shard (a worker takes its next shard when it "
                                                   "runs out); at least a worker's batch (less is refused)",
                                             "the smaller of 2048 and an eighth of the training split", flag=False)
    transfer_dtype: str = _setting("float32", "dtype of the pulled weights and pushed gradients on the wire (cast "
                                              "on the sending side; variables stay float32 on the ps)",
                                   choices=lambda: TRANSFER_DTYPES, flag=False)
    concurrent_steps: Union[int, str] = _setting(
        "auto", "async: steps a worker runs at once, each on its own batch (threads beside the step loop): more hide "
                "the round trips to the ps as more workers would, with their staleness; not in sync mode; auto: 1 "
                "(2 cost AUC at the same steps, issue 37; `psworker plan` says which and why)",
        metavar="{N,auto}", flag=False)
    pack_transfers: Union[bool, str] = _setting(
        "auto", "each ps's small variables (up to 1 MiB each) pulled as one tensor and their gradients pushed as one, "
                "and a sparse table's row ids sent once a step: fewer RPCs per step, for models of many small "
                "variables; variables from 16 KiB (not 256 KiB) are split over the ps tasks, evening out what each ps "
                "link carries; auto: on in between-graph runs, off in-graph",
        metavar="{true,false,auto}", flag=False)
    allow_fresh_start: bool = _setting(False, "the chief starts from scratch when train_dir holds checkpoint files "
                                              "but none is usable (by default it refuses: exit 3)",
                                       metavar="{true,false}")


TRAIN_FIELDS = tuple(f.name for f in dataclasses.fields(TrainConfig))


# Rules for TrainConfig fields beyond their types: minimums, strictly positive numbers, enumerations.
_MINIMUM = {"max_steps": 1, "batch_size": 1, "log_every_steps": 1, "concurrent_steps": 1,
            "save_checkpoint_steps": 1, "replicas_to_aggregate": 1, "seed": 0, "num_epochs": 1,
            "shard_examples": 1}
_POSITIVE = ("learning_rate", "save_checkpoint_secs", "startup_timeout_secs", "step_timeout_secs")
_NONEMPTY = ("train_dir", "data_dir")


def _train_types() -> dict[str, tuple[type, bool]]:
    """Maps each TrainConfig field to `(base type, optional)`, read from the dataclass annotations."""
    out = {}
    for name, hint in typing.get_type_hints(TrainConfig).items():
        args = typing.get_args(hint)
        if typing.get_origin(hint) is Union and type(None) in args:
            out[name] = (next(a for a in args if a is not type(None)), True)
        elif typing.get_origin(hint) is Union:   # e.g. num_devices: an int or "auto" (fieldtypes.PARSERS)
            out[name] = (args[0], False)
        else:
            out[name] = (hint, False)
    return out


TRAIN_TYPES = _train_types()


def setting_argv(name: str, value: Any) -> list[str]:
    """One setting as a command's arguments: its flag, or `--set NAME=VALUE` for a spec setting."""
    return [f"--{name}", str(value)] if setting_doc(name).flag else ["--set", f"{name}={value}"]


def setting_doc(name: str) -> SettingDoc:
    """The meaning, choices and default in words of the TrainConfig field `name`."""
    return TrainConfig.__dataclass_fields__[name].metadata["doc"]


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix and not prefix.endswith("-") else f"{prefix}{key}"


def _coerce(name: str, value: Any, path: str, source: str, from_strings: bool) -> Any:
    """Checks (and for flags, parses) one TrainConfig value against its declared type."""
    kind, optional = TRAIN_TYPES[name]
    if value is None:
        if optional:
            return None
        raise SpecError(source, path, f"must be set (expected {kind.__name__}), got null")
    parse = PARSERS.get(name) or TYPE_PARSERS.get(kind)
    if parse is not None:
        return parse(value, path, source)
    if from_strings and isinstance(value, str) and kind is not str:
        text = value.strip()
        try:
            value = int(text) if kind is int else float(text)
        except ValueError:
            noun = "an integer" if kind is int else "a number"
            raise SpecError(source, path, f"expected {noun}, got {value!r}") from None
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(source, path, f"expected an integer, got {describe_value(value)}")
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(source, path, f"expected a number, got {describe_value(value)}")
        value = float(value)
        if not math.isfinite(value):
            raise SpecError(source, path, f"expected a finite number, got {value}")
    elif kind is str:
        if not isinstance(value, str):
            raise SpecError(source, path, f"expected a string, got {describe_value(value)}")
    return value


def _check_value(name: str, value: Any, path: str, source: str) -> None:
    if value is None or (value == AUTO and name in PARSERS):
        return
    if name in _MINIMUM and value < _MINIMUM[name]:
        raise SpecError(source, path, f"must be >= {_MINIMUM[name]}, got {value}")
    if name in _POSITIVE and not value > 0:
        raise SpecError(source, path, f"must be > 0, got {value}")
    if name in _NONEMPTY and not value.strip():
        raise SpecError(source, path, f"must not be empty, got {value!r}")
    read = setting_doc(name).choices          # read now: the model registry is live (`models.register`)
    choices = read() if read is not None else ()
    if choices and value not in choices:
        close = difflib.get_close_matches(value, choices, n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise SpecError(source, path, f"{value!r} is not one of {', '.join(choices)}{hint}")


def parse_setting(name: str, text: str, source: str = "--flags") -> Any:
    """One flag's value, parsed and checked alone (rules between fields wait for `merge_train`).

    Raises:
        SpecError: a bad value, naming `--NAME`.
    """
    path = _join("--", name)
    value = _coerce(name, text, path, source, True)
    _check_value(name, value, path, source)
    return value


def check_train_rules(config: TrainConfig, source: str, prefix: str,
                       num_workers: Optional[int]) -> None:
    if config.save_checkpoint_steps is not None and config.save_checkpoint_secs is not None:
        raise SpecError(source, _join(prefix, "save_checkpoint_secs"),
                        f"set either save_checkpoint_steps ({config.save_checkpoint_steps}) or "
                        f"save_checkpoint_secs ({config.save_checkpoint_secs:g}), not both")
    _check_transfer_rules(config, source, prefix)
    if config.num_epochs is not None and config.data_dealing != "dealt":
        raise SpecError(source, _join(prefix, "num_epochs"), "epochs are counted with dealt shards only (data_dealing "
                        "dealt); drop num_epochs")
    r = config.replicas_to_aggregate
    if r is not None and num_workers is not None and not 1 <= r <= num_workers:
        raise SpecError(source, _join(prefix, "replicas_to_aggregate"),
                        f"{r} is not between 1 and the number of workers ({num_workers})")


def _check_transfer_rules(config: TrainConfig, source: str, prefix: str) -> None:
    """Staged variables and steps in flight: async between-graph only (not together); a transfer dtype and
    packing: between-graph only."""
    if config.staged_vars and config.mode == "sync":
        raise SpecError(source, _join(prefix, "staged_vars"),
                        "staged variables are for async mode only (a sync step must compute on the weights of the "
                        "step it belongs to); drop staged_vars or use mode async")
    steps = 1 if config.concurrent_steps == AUTO else config.concurrent_steps   # auto: `fast_path` decides
    if steps > 1 and config.mode == "sync":
        raise SpecError(source, _join(prefix, "concurrent_steps"),
                        "more than one step in flight is for async mode only (a sync step waits for the others'); "
                        "drop concurrent_steps or use mode async")
    if steps > 1 and config.staged_vars:
        raise SpecError(source, _join(prefix, "concurrent_steps"),
                        "staged variables hold one step's values, for one step in flight; drop staged_vars or "
                        "concurrent_steps")
    for name, on in (("staged_vars", config.staged_vars), ("transfer_dtype", config.transfer_dtype != "float32"),
                     ("pack_transfers", config.pack_transfers is True), ("concurrent_steps", steps > 1)):
        if on and config.replication == "in-graph":
            raise SpecError(source, _join(prefix, name), f"{name} is for between-graph replication only")


def train_from(base: TrainConfig, values: Mapping[str, Any], source: str, prefix: str,
                from_strings: bool, num_workers: Optional[int]) -> TrainConfig:
    """`base` with `values` (a spec's train section, or flags when `from_strings`) checked and applied."""
    problems = SpecProblems()       # every unknown key and bad value at once; the rules between fields after
    for key in values:
        if key not in TRAIN_FIELDS:
            problems.errors.append(unknown_key(key, TRAIN_FIELDS, source, _join(prefix, str(key))))
    changes = {}
    for key, value in values.items():
        path = _join(prefix, key)
        if key in TRAIN_FIELDS:
            with problems.check():
                value = _coerce(key, value, path, source, from_strings)
                _check_value(key, value, path, source)
                changes[key] = value
    problems.raise_any()
    config = dataclasses.replace(base, **changes)
    check_train_rules(config, source, prefix, num_workers)
    return config


def merge_train(base: TrainConfig, overrides: Mapping[str, Any], source: str = "--flags", *,
                num_workers: Optional[int] = None, path_prefix: str = "--") -> TrainConfig:
    """Returns `base` with the non-None values of `overrides` applied, validated.

    String values for numeric fields are parsed (command-line flags arrive as strings), with errors in
    the same wording as the spec file's. Setting one of save_checkpoint_steps/save_checkpoint_secs
    clears the other one inherited from `base`; setting both in `overrides` is an error.

    Args:
        base: the spec's train section.
        overrides: field name -> value; None values are ignored.
        source: where the overrides came from, for messages.
        num_workers: when given, replicas_to_aggregate must lie in 1..num_workers.
        path_prefix: prefix of field names in messages (`--max_steps`).

    Returns:
        The merged TrainConfig.

    Raises:
        SpecError: an unknown key, a bad value, or a cross-field rule broken.
    """
    given = {k: v for k, v in overrides.items() if v is not None}
    ckpt = ("save_checkpoint_steps", "save_checkpoint_secs")
    for mine, other in (ckpt, ckpt[::-1]):
        if mine in given and other not in given:
            base = dataclasses.replace(base, **{other: None})
    return train_from(base, given, source, path_prefix, True, num_workers)


__all__ = ["MODES", "REPLICATIONS", "TRANSFER_DTYPES", "DATA_DEALINGS", "DEFAULT_SAVE_CHECKPOINT_SECS", "SettingDoc",
           "setting_doc", "setting_argv", "parse_setting", "TrainConfig", "TRAIN_FIELDS", "TRAIN_TYPES", "merge_train",
           "check_train_rules", "train_from"]
