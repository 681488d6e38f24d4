"""The `train` section of a spec: `TrainConfig`, its field types and rules, and merging command-line overrides.

Every TrainConfig field is also a flag of `psworker worker|local`; a bad value is a `SpecError` naming the field.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional, Union

from psworker.errors import SpecError, describe_value, unknown_key
from psworker.fieldtypes import PARSERS, TYPE_PARSERS
from psworker.models import registry as model_registry

MODES = ("async", "sync")
REPLICATIONS = ("between-graph", "in-graph")


@dataclass(frozen=True)
class TrainConfig:
    """Trainer settings: the spec's `train` section, overridden by command-line flags of the same names."""

    model: str = "mlp"
    mode: str = "async"                       # MODES
    max_steps: int = 2000
    batch_size: int = 64
    learning_rate: Optional[float] = None     # None: the model's default
    train_dir: Optional[str] = None           # None: the command decides (see cli)
    data_dir: Optional[str] = None            # None: the model's default (digits need none)
    save_checkpoint_steps: Optional[int] = None
    save_checkpoint_secs: Optional[float] = None   # both None: every 60 s
    log_every_steps: int = 100
    replicas_to_aggregate: Optional[int] = None    # sync only; None: number of workers
    startup_timeout_secs: float = 120.0
    step_timeout_secs: float = 300.0          # one training step (sync: waiting for the other workers) at most
    num_devices: Union[int, str] = 1          # towers per worker, or "auto": every visible GPU (CPU when none)
    replication: str = "between-graph"        # REPLICATIONS
    seed: Optional[int] = None
    scale_learning_rate: bool = True          # linear scaling with the global batch (models with a reference batch)


TRAIN_FIELDS = tuple(f.name for f in dataclasses.fields(TrainConfig))


# Rules for TrainConfig fields beyond their types: minimums, strictly positive numbers, enumerations.
_MINIMUM = {"max_steps": 1, "batch_size": 1, "log_every_steps": 1,
            "save_checkpoint_steps": 1, "replicas_to_aggregate": 1, "seed": 0}
_POSITIVE = ("learning_rate", "save_checkpoint_secs", "startup_timeout_secs", "step_timeout_secs")
# Enumerations, read when a value is checked: the model registry is live (`models.register` extends it).
_CHOICES = {"mode": lambda: MODES, "replication": lambda: REPLICATIONS, "model": model_registry.names}
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
    if value is None:
        return
    if name in _MINIMUM and value < _MINIMUM[name]:
        raise SpecError(source, path, f"must be >= {_MINIMUM[name]}, got {value}")
    if name in _POSITIVE and not value > 0:
        raise SpecError(source, path, f"must be > 0, got {value}")
    if name in _NONEMPTY and not value.strip():
        raise SpecError(source, path, f"must not be empty, got {value!r}")
    choices = _CHOICES[name]() if name in _CHOICES else ()
    if choices and value not in choices:
        close = difflib.get_close_matches(value, choices, n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise SpecError(source, path, f"{value!r} is not one of {', '.join(choices)}{hint}")


def check_train_rules(config: TrainConfig, source: str, prefix: str,
                       num_workers: Optional[int]) -> None:
    if config.save_checkpoint_steps is not None and config.save_checkpoint_secs is not None:
        raise SpecError(source, _join(prefix, "save_checkpoint_secs"),
                        f"set either save_checkpoint_steps ({config.save_checkpoint_steps}) or "
                        f"save_checkpoint_secs ({config.save_checkpoint_secs:g}), not both")
    r = config.replicas_to_aggregate
    if r is not None and num_workers is not None and not 1 <= r <= num_workers:
        raise SpecError(source, _join(prefix, "replicas_to_aggregate"),
                        f"{r} is not between 1 and the number of workers ({num_workers})")


def train_from(base: TrainConfig, values: Mapping[str, Any], source: str, prefix: str,
                from_strings: bool, num_workers: Optional[int]) -> TrainConfig:
    """`base` with `values` (a spec's train section, or flags when `from_strings`) checked and applied."""
    for key in values:
        if key not in TRAIN_FIELDS:
            raise unknown_key(key, TRAIN_FIELDS, source, _join(prefix, str(key)))
    changes = {}
    for key, value in values.items():
        path = _join(prefix, key)
        value = _coerce(key, value, path, source, from_strings)
        _check_value(key, value, path, source)
        changes[key] = value
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


__all__ = ["MODES", "REPLICATIONS", "TrainConfig", "TRAIN_FIELDS", "TRAIN_TYPES", "merge_train", "check_train_rules",
           "train_from"]
