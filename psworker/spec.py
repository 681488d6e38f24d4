"""Cluster specs: the YAML file, its frozen dataclasses, loading and validation.

Loading fills defaults, then checks each field, then checks rules across fields; every failure is a
`SpecError` naming the source, the field path and the bad value. Nothing here imports TensorFlow.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import math
import re
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import yaml

from psworker.errors import SpecError
from psworker.fieldtypes import PARSERS, TYPE_PARSERS
from psworker.models import registry as model_registry

JOBS = ("ps", "worker")                      # psworker's own trainer
SCRIPT_JOBS = ("chief", "evaluator")         # TF2 ParameterServerStrategy roles, for `psworker run` scripts
ALL_JOBS = ("chief", "ps", "worker", "evaluator")
MODES = ("async", "sync")
REPLICATIONS = ("between-graph", "in-graph")
DEFAULT_PORT_BASE = 2222      # `cluster.port` of a count spec: the first port on each host


@dataclass(frozen=True)
class Address:
    """One task's `host:port`. `port == 0` means "pick a free port" (local runs only)."""

    host: str
    port: int

    def __str__(self) -> str:  # IPv6 literals are bracketed: [::1]:2222
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


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


@dataclass(frozen=True)
class ClusterSpec:
    """A whole cluster: ps and worker addresses plus trainer defaults. Worker 0 is psworker's chief; the
    optional `chief` and `evaluator` jobs (one task each) are for scripts under `psworker run` (TF2's
    ParameterServerStrategy topology) and are refused by psworker's own trainer."""

    ps: tuple[Address, ...]
    worker: tuple[Address, ...]
    train: TrainConfig = field(default_factory=TrainConfig)
    # the file it came from, for messages; not part of equality (a dumped and reloaded spec is equal)
    source: Optional[str] = field(default=None, compare=False)
    chief: tuple[Address, ...] = ()
    evaluator: tuple[Address, ...] = ()

    def addresses(self, job: str) -> tuple[Address, ...]:
        return {"ps": self.ps, "worker": self.worker, "chief": self.chief, "evaluator": self.evaluator}[job]

    def jobs(self) -> tuple[str, ...]:
        """The jobs with tasks, in `ALL_JOBS` order."""
        return tuple(j for j in ALL_JOBS if self.addresses(j))

    def as_dict(self) -> dict[str, list[str]]:
        """`{"ps": ["h:p", ...], "worker": [...]}` (plus chief/evaluator when present): what
        tf.train.ClusterSpec and TF_CONFIG take."""
        return {j: [str(a) for a in self.addresses(j)] for j in self.jobs()}


@dataclass(frozen=True)
class CountSpec:
    """A cluster given as task counts (`ps: 2`, `worker: 8`): a scheduler assigns the hosts (`plan.layout`)."""

    counts: tuple[tuple[str, int], ...]       # (job, number of tasks), in JOBS order
    port: int = DEFAULT_PORT_BASE             # first port on each host, +1 per further task there
    train: TrainConfig = field(default_factory=TrainConfig)
    source: Optional[str] = field(default=None, compare=False)

    def count(self, job: str) -> int:
        """The number of tasks of `job` (0 when the spec has no such job)."""
        return dict(self.counts).get(job, 0)


AUTO_PORT = 0
TOP_KEYS = ("cluster", "train")
PORT_KEY = "port"
_PORT_RE = re.compile(r"-?[0-9]+", re.ASCII)
_HOST_RE = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?", re.ASCII)
_SHELL_META = set(";&|$`'\"\\<>(){}*?!#~^=,%@")

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


# --------------------------------------------------------------------------------------------- helpers

def _describe(value: Any) -> str:
    """`bool true`, `int 5`, `str 'x'`, `list [...]`: the bad value and its type, for messages."""
    if isinstance(value, bool):
        return f"bool {str(value).lower()}"
    if value is None:
        return "null"
    kind = {dict: "mapping", list: "list"}.get(type(value), type(value).__name__)
    return f"{kind} {value!r}"


def _unknown_key(key: Any, valid: Iterable[str], source: str, path: str) -> SpecError:
    valid = list(valid)
    close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return SpecError(source, path, f"unknown key {key!r}{hint} (valid keys: {', '.join(valid)})")


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix and not prefix.endswith("-") else f"{prefix}{key}"


class _StrictLoader(yaml.SafeLoader):
    """A safe YAML loader that rejects duplicate mapping keys instead of keeping the last one."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        if isinstance(key, typing.Hashable) and key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first at line {seen[key]})", key_node.start_mark)
        if isinstance(key, typing.Hashable):
            seen[key] = line
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _load_yaml(text: str, source: str) -> Any:
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        problem = getattr(e, "problem", None) or str(e)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise SpecError(source, "", f"invalid YAML{where}: {problem}") from None


# ------------------------------------------------------------------------------------------- addresses

def parse_address(s: Any, field_path: str, source: str) -> Address:
    """Parses one `host:port` entry.

    Accepts DNS names, IPv4, bracketed IPv6 (`[::1]:2222`) and `localhost`; port `0` or `auto` means
    "pick a free port at launch" (`Address.port == 0`).

    Args:
        s: the entry as written (anything; non-strings are reported).
        field_path: where it sits, e.g. `cluster.worker[1]`, for messages.
        source: the file path, `TF_CONFIG` or `--flags`, for messages.

    Returns:
        The parsed Address.

    Raises:
        SpecError: not a string, no port, bad host, non-numeric or out-of-range port.
    """
    if isinstance(s, dict) and len(s) == 1:
        (k, v), = s.items()
        raise SpecError(source, field_path, f"expected a 'host:port' string, got {_describe(s)}; "
                                            f"write it as '{k}:{v}' (no space after the colon)")
    if not isinstance(s, str):
        raise SpecError(source, field_path, f"expected a 'host:port' string, got {_describe(s)}")
    text = s.strip()
    if not text:
        raise SpecError(source, field_path, "empty address; expected 'host:port'")
    if text.startswith("["):
        end = text.find("]")
        if end < 0 or not text[end + 1:].startswith(":"):
            raise SpecError(source, field_path, f"{s!r} is not '[ipv6]:port' (e.g. '[::1]:2222')")
        host, port_text = text[1:end], text[end + 2:]
        _check_ipv6(host, s, field_path, source)
    else:
        if ":" not in text:
            raise SpecError(source, field_path, f"{s!r} has no port; expected 'host:port'")
        host, port_text = text.rsplit(":", 1)
        if ":" in host:
            raise SpecError(source, field_path,
                            f"{s!r}: IPv6 addresses must be in brackets, e.g. '[::1]:2222'")
        _check_host(host, s, field_path, source)
    return Address(host, _parse_port(port_text, s, field_path, source))


def _check_host(host: str, entry: str, field_path: str, source: str) -> None:
    if not host:
        raise SpecError(source, field_path, f"{entry!r} has an empty host")
    bad = next((c for c in host if c.isspace() or c in _SHELL_META), None)
    if bad is not None:
        raise SpecError(source, field_path, f"host {host!r} contains {bad!r}; whitespace and shell "
                                            f"metacharacters are not allowed in host names")
    if not _HOST_RE.fullmatch(host) or ".." in host:
        raise SpecError(source, field_path, f"host {host!r} is not a valid host name or IP address")


def _check_ipv6(host: str, entry: str, field_path: str, source: str) -> None:
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        raise SpecError(source, field_path, f"{host!r} in {entry!r} is not a valid IPv6 address") from None


def _parse_port(text: str, entry: str, field_path: str, source: str) -> int:
    if text.lower() == "auto":
        return AUTO_PORT
    if not text:
        raise SpecError(source, field_path, f"{entry!r} has an empty port")
    if not _PORT_RE.fullmatch(text):
        raise SpecError(source, field_path, f"port {text!r} is not a number (use 1-65535, or 'auto')")
    port = int(text)
    if port == AUTO_PORT and text.isdigit():   # "0", not "-0"
        return AUTO_PORT
    if not 1 <= port <= 65535:
        raise SpecError(source, field_path, f"port {port} is out of range 1-65535")
    return port


def format_address(address: Address) -> str:
    """`str(address)`, except that an automatic port shows as `host:auto` (what a spec file says)."""
    return str(address) if address.port != AUTO_PORT else str(address)[:-1] + "auto"


def _parse_address_list(items: Any, path: str, source: str) -> tuple[Address, ...]:
    if items is None:
        raise SpecError(source, path, "missing; need a list of at least one 'host:port' address")
    if isinstance(items, str) or not isinstance(items, (list, tuple)):
        raise SpecError(source, path, f"expected a list of 'host:port' strings, got {_describe(items)}")
    if not items:
        raise SpecError(source, path, "empty; need at least one 'host:port' address")
    return tuple(parse_address(item, f"{path}[{i}]", source) for i, item in enumerate(items))


def _check_duplicates(jobs: Iterable[tuple[str, tuple[Address, ...]]], source: str) -> None:
    seen: dict[tuple[str, int], str] = {}
    for path, addresses in jobs:
        for i, a in enumerate(addresses):
            if a.port == AUTO_PORT:
                continue
            key = (a.host.lower(), a.port)
            here = f"{path}[{i}]"
            if key in seen:
                raise SpecError(source, here, f"duplicate address {a} (also at {seen[key]})")
            seen[key] = here


def build_cluster(ps: Any, worker: Any, source: str, *, train: Optional[TrainConfig] = None,
                  ps_path: str = "cluster.ps", worker_path: str = "cluster.worker", chief: Any = None,
                  evaluator: Any = None) -> ClusterSpec:
    """Builds and validates a ClusterSpec from raw address lists (strings or Addresses).

    Args:
        ps: list of `host:port` strings (or Address objects) for the ps job.
        worker: the same for the worker job; worker 0 is the chief.
        source: where the lists came from, for messages.
        train: trainer defaults; `TrainConfig()` when None.
        ps_path: field path of the ps list in messages (`--ps_hosts` for flags).
        worker_path: field path of the worker list in messages.
        chief, evaluator: optional one-address lists (`psworker run` scripts only).

    Returns:
        The validated, frozen ClusterSpec.

    Raises:
        SpecError: any address or cross-field problem.
    """
    ps_addrs = _addresses_from(ps, ps_path, source)
    worker_addrs = _addresses_from(worker, worker_path, source)
    extra = {}
    for job, items in (("chief", chief), ("evaluator", evaluator)):
        if items is not None:
            extra[job] = _addresses_from(items, f"cluster.{job}", source)
            if len(extra[job]) > 1:
                raise SpecError(source, f"cluster.{job}", f"has {len(extra[job])} addresses; TensorFlow allows "
                                                          f"one {job} task")
    _check_duplicates([(ps_path, ps_addrs), (worker_path, worker_addrs)]
                      + [(f"cluster.{j}", a) for j, a in extra.items()], source)
    spec = ClusterSpec(ps=ps_addrs, worker=worker_addrs, train=train or TrainConfig(), source=source, **extra)
    check_cross_fields(spec)
    return spec


def _addresses_from(items: Any, path: str, source: str) -> tuple[Address, ...]:
    if isinstance(items, (list, tuple)) and items and all(isinstance(a, Address) for a in items):
        return tuple(items)
    if isinstance(items, (list, tuple)):
        items = [format_address(a) if isinstance(a, Address) else a for a in items]
    return _parse_address_list(items, path, source)


# ---------------------------------------------------------------------------------------------- train

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
            raise SpecError(source, path, f"expected an integer, got {_describe(value)}")
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(source, path, f"expected a number, got {_describe(value)}")
        value = float(value)
        if not math.isfinite(value):
            raise SpecError(source, path, f"expected a finite number, got {value}")
    elif kind is str:
        if not isinstance(value, str):
            raise SpecError(source, path, f"expected a string, got {_describe(value)}")
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


def _check_train_rules(config: TrainConfig, source: str, prefix: str,
                       num_workers: Optional[int]) -> None:
    if config.save_checkpoint_steps is not None and config.save_checkpoint_secs is not None:
        raise SpecError(source, _join(prefix, "save_checkpoint_secs"),
                        f"set either save_checkpoint_steps ({config.save_checkpoint_steps}) or "
                        f"save_checkpoint_secs ({config.save_checkpoint_secs:g}), not both")
    r = config.replicas_to_aggregate
    if r is not None and num_workers is not None and not 1 <= r <= num_workers:
        raise SpecError(source, _join(prefix, "replicas_to_aggregate"),
                        f"{r} is not between 1 and the number of workers ({num_workers})")


def _train_from(base: TrainConfig, values: Mapping[str, Any], source: str, prefix: str,
                from_strings: bool, num_workers: Optional[int]) -> TrainConfig:
    for key in values:
        if key not in TRAIN_FIELDS:
            raise _unknown_key(key, TRAIN_FIELDS, source, _join(prefix, str(key)))
    changes = {}
    for key, value in values.items():
        path = _join(prefix, key)
        value = _coerce(key, value, path, source, from_strings)
        _check_value(key, value, path, source)
        changes[key] = value
    config = dataclasses.replace(base, **changes)
    _check_train_rules(config, source, prefix, num_workers)
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
    return _train_from(base, given, source, path_prefix, True, num_workers)


# ----------------------------------------------------------------------------------------------- spec

def check_cross_fields(spec: ClusterSpec) -> None:
    """Checks the rules that span sections (replicas_to_aggregate vs. the number of workers).

    Raises:
        SpecError: a rule is broken.
    """
    _check_train_rules(spec.train, spec.source or "spec", "train", len(spec.worker))


def parse_spec(text_or_mapping: Union[str, bytes, Mapping[str, Any], None], source: str, *,
               allow_counts: bool = False) -> Any:
    """Parses and validates a cluster spec from YAML text or an already-loaded mapping.

    Args:
        text_or_mapping: YAML text, or the mapping it loads to.
        source: a file path (or other label) used in every error message.
        allow_counts: accept task counts (`ps: 2`) and return a CountSpec for them; otherwise they are an
            error naming the field.

    Returns:
        The validated ClusterSpec (or CountSpec, with `allow_counts`), with `source` set.

    Raises:
        SpecError: YAML syntax, structure, address, train value or cross-field problems.
    """
    data = text_or_mapping
    if isinstance(data, bytes):
        data = data.decode("utf-8", errors="replace")
    if isinstance(data, str):
        data = _load_yaml(data, source)
    if data is None:
        raise SpecError(source, "", "the spec is empty; expected a mapping with a 'cluster' section "
                                    "(ps and worker address lists)")
    if not isinstance(data, Mapping):
        raise SpecError(source, "", f"the top level must be a mapping with 'cluster' (and optional "
                                    f"'train'), got {_describe(data)}")
    for key in data:
        if key not in TOP_KEYS:
            raise _unknown_key(key, TOP_KEYS, source, str(key))
    cluster = data.get("cluster")
    if cluster is None:
        raise SpecError(source, "cluster", "missing; the spec needs a 'cluster' section with "
                                           "'ps' and 'worker' address lists")
    if not isinstance(cluster, Mapping):
        raise SpecError(source, "cluster", f"expected a mapping with 'ps' and 'worker', "
                                           f"got {_describe(cluster)}")
    counted = _counted_jobs(cluster)
    for key in cluster:
        if key not in ALL_JOBS and not (counted and key == PORT_KEY):
            if key == PORT_KEY:
                raise SpecError(source, "cluster.port", "a base port applies only to task counts "
                                                        "(`ps: 2`); address lists carry their own ports")
            raise _unknown_key(key, ALL_JOBS + ((PORT_KEY,) if counted else ()), source, f"cluster.{key}")
    train = data.get("train")
    if train is None:
        train = {}
    if not isinstance(train, Mapping):
        raise SpecError(source, "train", f"expected a mapping of trainer settings, got {_describe(train)}")
    config = _train_from(TrainConfig(), train, source, "train", False, None)
    if counted:
        return _count_spec(cluster, config, source, allow_counts)
    return build_cluster(cluster.get("ps"), cluster.get("worker"), source, train=config,
                         chief=cluster.get("chief"), evaluator=cluster.get("evaluator"))


def _counted_jobs(cluster: Mapping[str, Any]) -> list[str]:
    """The jobs given as a number rather than an address list."""
    return [job for job in JOBS if isinstance(cluster.get(job), int) and not isinstance(cluster.get(job), bool)]


def _count_spec(cluster: Mapping[str, Any], config: TrainConfig, source: str, allow: bool) -> CountSpec:
    """Validates a cluster section of task counts (every job a count, optional base port)."""
    counted = _counted_jobs(cluster)
    if not allow:
        raise SpecError(source, f"cluster.{counted[0]}",
                        f"a task count ({cluster[counted[0]]}) needs hosts from a scheduler; this command needs "
                        f"'host:port' address lists (see `psworker plan SPEC --hosts ...`, `psworker k8s manifest`)")
    counts = []
    for job in JOBS:
        value, path = cluster.get(job), f"cluster.{job}"
        if value is None:
            raise SpecError(source, path, "missing; give a number of tasks like the other jobs")
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(source, path, f"expected a number of tasks like {counted[0]!r} has, got "
                                          f"{_describe(value)}; give every job as a count or every job as "
                                          f"an address list, not both")
        if value < 1:
            raise SpecError(source, path, f"must be >= 1, got {value}")
        counts.append((job, value))
    port = cluster.get(PORT_KEY, DEFAULT_PORT_BASE)
    if isinstance(port, bool) or not isinstance(port, int):
        raise SpecError(source, "cluster.port", f"expected a fixed port number (1-65535; a scheduled task "
                                                f"cannot pick its own), got {_describe(port)}")
    if not 1 <= port <= 65535:
        raise SpecError(source, "cluster.port", f"port {port} is out of range 1-65535")
    _check_train_rules(config, source, "train", dict(counts)["worker"])
    return CountSpec(tuple(counts), port, config, source)


def load_spec(path: Any, *, allow_counts: bool = False) -> Any:
    """Reads and validates a cluster spec YAML file.

    Args:
        path: the file (str or path-like).
        allow_counts: accept task counts and return a CountSpec for them (see `parse_spec`).

    Returns:
        The validated ClusterSpec (or CountSpec) with `source` set to the path.

    Raises:
        SpecError: the file cannot be read or is invalid.
    """
    source = str(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise SpecError(source, "", "no such file") from None
    except IsADirectoryError:
        raise SpecError(source, "", "is a directory, not a spec file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(source, "", f"cannot read: {e}") from None
    return parse_spec(text, source, allow_counts=allow_counts)


def dump_spec(spec: ClusterSpec) -> str:
    """Renders a spec as YAML that `load_spec` reads back to an equal spec.

    Args:
        spec: the spec to write.

    Returns:
        YAML text; automatic ports are written as `host:auto`, unset (None) train fields are omitted.
    """
    train = {k: v for k, v in dataclasses.asdict(spec.train).items() if v is not None}
    data = {"cluster": {j: [format_address(a) for a in spec.addresses(j)] for j in spec.jobs()},
            "train": train}
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


def with_addresses(spec: ClusterSpec, ps: Iterable[Any], worker: Iterable[Any], **extra: Iterable[Any]
                   ) -> ClusterSpec:
    """Returns `spec` with new ps and worker addresses (e.g. once automatic ports are chosen).

    Args:
        spec: the original spec; its train section and source are kept.
        ps: new ps addresses, as Address objects or `host:port` strings.
        worker: new worker addresses, likewise.
        **extra: new `chief` / `evaluator` addresses (default: the spec's own).

    Returns:
        A new validated ClusterSpec.

    Raises:
        SpecError: a new address is invalid or duplicated.
    """
    jobs = {j: list(extra.get(j, spec.addresses(j))) or None for j in SCRIPT_JOBS}
    new = build_cluster(list(ps), list(worker), spec.source or "spec", train=spec.train, **jobs)
    return dataclasses.replace(new, source=spec.source)


def has_auto_ports(spec: ClusterSpec) -> bool:
    """True when any task's port is automatic (0 / `auto`): the launcher must pick it."""
    return any(a.port == AUTO_PORT for j in spec.jobs() for a in spec.addresses(j))


__all__ = [
    "JOBS", "SCRIPT_JOBS", "ALL_JOBS", "MODES", "REPLICATIONS", "TRAIN_FIELDS", "AUTO_PORT", "DEFAULT_PORT_BASE",
    "Address", "TrainConfig", "ClusterSpec", "CountSpec",
    "load_spec", "parse_spec", "parse_address", "format_address", "build_cluster", "merge_train",
    "check_cross_fields", "dump_spec", "with_addresses", "has_auto_ports",
]
