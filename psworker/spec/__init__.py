"""Cluster specs: the YAML file, its frozen dataclasses, loading and validation.

Loading fills defaults, then checks each field, then checks rules across fields; every failure is a
`SpecError` naming the source, the field path and the bad value. Nothing here imports TensorFlow.
Addresses are parsed in `spec/addresses.py`, the train section in `spec/train_config.py`, an elastic worker job's
range in `spec/elastic_job.py`; their public names are re-exported here.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import yaml

from psworker.spec.addresses import (AUTO_PORT, Address, check_duplicates, format_address, parse_address,
                                parse_address_list)
from psworker.spec.elastic_job import Elastic, check_elastic, elastic_range, elastic_worker
from psworker.errors import SpecError, SpecProblems, describe_value, unknown_key
from psworker.spec.train_config import (MODES, REPLICATIONS, TRAIN_FIELDS, TRAIN_TYPES, TrainConfig, check_train_rules,
                                   merge_train, train_from)

JOBS = ("ps", "worker")                      # psworker's own trainer
SCRIPT_JOBS = ("chief", "evaluator")         # TF2 ParameterServerStrategy roles, for `psworker run` scripts
ALL_JOBS = ("chief", "ps", "worker", "evaluator")
DEFAULT_PORT_BASE = 2222      # `cluster.port` of a count spec: the first port on each host
TOP_KEYS = ("cluster", "train")
PORT_KEY = "port"


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
    elastic: Optional[Elastic] = None          # None: a fixed worker job (every worker runs)

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
    elastic: Optional[Elastic] = None         # the worker count is then `elastic.max`

    def count(self, job: str) -> int:
        """The number of tasks of `job` (0 when the spec has no such job)."""
        return dict(self.counts).get(job, 0)


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


def build_cluster(ps: Any, worker: Any, source: str, *, train: Optional[TrainConfig] = None,
                  ps_path: str = "cluster.ps", worker_path: str = "cluster.worker", chief: Any = None,
                  evaluator: Any = None, elastic: Optional[Elastic] = None) -> ClusterSpec:
    """Builds and validates a ClusterSpec from raw address lists (strings or Addresses).

    Args:
        ps: list of `host:port` strings (or Address objects) for the ps job.
        worker: the same for the worker job; worker 0 is the chief.
        source: where the lists came from, for messages.
        train: trainer defaults; `TrainConfig()` when None.
        ps_path: field path of the ps list in messages (`--ps_hosts` for flags).
        worker_path: field path of the worker list in messages.
        chief, evaluator: optional one-address lists (`psworker run` scripts only).
        elastic: the worker job's range (its `max` is the number of worker addresses); None: a fixed job.

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
    check_duplicates([(ps_path, ps_addrs), (worker_path, worker_addrs)]
                      + [(f"cluster.{j}", a) for j, a in extra.items()], source)
    spec = ClusterSpec(ps=ps_addrs, worker=worker_addrs, train=train or TrainConfig(), source=source,
                       elastic=elastic, **extra)
    check_cross_fields(spec)
    return spec


def _addresses_from(items: Any, path: str, source: str) -> tuple[Address, ...]:
    if isinstance(items, (list, tuple)) and items and all(isinstance(a, Address) for a in items):
        return tuple(items)
    if isinstance(items, (list, tuple)):
        items = [format_address(a) if isinstance(a, Address) else a for a in items]
    return parse_address_list(items, path, source)


def check_cross_fields(spec: ClusterSpec) -> None:
    """Checks the rules that span sections (replicas_to_aggregate vs. the number of workers, the elastic range).

    Raises:
        SpecError: a rule is broken.
    """
    check_train_rules(spec.train, spec.source or "spec", "train", len(spec.worker))
    check_elastic(spec.elastic, spec.train, spec.source or "spec", len(spec.worker))


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
                                    f"'train'), got {describe_value(data)}")
    problems = SpecProblems()    # every problem of every section, reported together
    problems.errors += [unknown_key(key, TOP_KEYS, source, str(key)) for key in data if key not in TOP_KEYS]
    cluster = data.get("cluster")
    with problems.check():
        _check_cluster_keys(cluster, source)
    keys_known = not problems.errors
    train = data.get("train")
    if train is None:
        train = {}
    config = TrainConfig()
    with problems.check():
        if not isinstance(train, Mapping):
            raise SpecError(source, "train", f"expected a mapping of trainer settings, got {describe_value(train)}")
        config = train_from(TrainConfig(), train, source, "train", False, None)
    spec = None
    if keys_known:        # the addresses too (with the defaults where the train section has errors)
        with problems.check():
            spec = _cluster_spec(cluster, config, source, allow_counts)
    problems.raise_any()
    return spec


def _check_cluster_keys(cluster: Any, source: str) -> None:
    """The cluster section is a mapping of known jobs (and a base port with task counts)."""
    if cluster is None:
        raise SpecError(source, "cluster", "missing; the spec needs a 'cluster' section with "
                                           "'ps' and 'worker' address lists")
    if not isinstance(cluster, Mapping):
        raise SpecError(source, "cluster", f"expected a mapping with 'ps' and 'worker', "
                                           f"got {describe_value(cluster)}")
    counted = _counted_jobs(cluster)
    problems = SpecProblems()
    for key in cluster:
        if key not in ALL_JOBS and not (counted and key == PORT_KEY):
            if key == PORT_KEY:
                problems.errors.append(SpecError(source, "cluster.port", "a base port applies only to task counts "
                                                 "(`ps: 2`); address lists carry their own ports"))
            else:
                problems.errors.append(unknown_key(key, ALL_JOBS + ((PORT_KEY,) if counted else ()), source,
                                                   f"cluster.{key}"))
    problems.raise_any()


def _cluster_spec(cluster: Mapping[str, Any], config: TrainConfig, source: str, allow_counts: bool) -> Any:
    """The ClusterSpec (or CountSpec) of a cluster section whose keys are known, with its train section."""
    cluster, elastic = elastic_worker(cluster, source)
    if _counted_jobs(cluster):
        return _count_spec(cluster, config, source, allow_counts, elastic)
    workers = cluster.get("worker")
    return build_cluster(cluster.get("ps"), workers, source, train=config, chief=cluster.get("chief"),
                         evaluator=cluster.get("evaluator"),
                         worker_path="cluster.worker.addresses" if elastic else "cluster.worker",
                         elastic=elastic_range(elastic, len(workers)) if elastic and isinstance(workers, list)
                         else None)


def _counted_jobs(cluster: Mapping[str, Any]) -> list[str]:
    """The jobs given as a number rather than an address list."""
    return [job for job in JOBS if isinstance(cluster.get(job), int) and not isinstance(cluster.get(job), bool)]


def _count_spec(cluster: Mapping[str, Any], config: TrainConfig, source: str, allow: bool,
                elastic: Optional[dict] = None) -> CountSpec:
    """Validates a cluster section of task counts (every job a count, optional base port)."""
    counted = _counted_jobs(cluster)
    if not allow:
        raise SpecError(source, f"cluster.{counted[0]}",
                        f"a task count ({cluster[counted[0]]}) needs hosts from a scheduler; this command needs "
                        f"'host:port' address lists (see `psworker plan SPEC --hosts ...`, `psworker k8s manifest`)")
    counts = []
    for job in ALL_JOBS:
        value, path = cluster.get(job), f"cluster.{job}"
        if value is None and job not in JOBS:   # chief, evaluator: optional (TF2 ParameterServerStrategy)
            continue
        if value is None:
            raise SpecError(source, path, "missing; give a number of tasks like the other jobs")
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(source, path, f"expected a number of tasks like {counted[0]!r} has, got "
                                          f"{describe_value(value)}; give every job as a count or every job as "
                                          f"an address list, not both")
        if value < 1:
            raise SpecError(source, path, f"must be >= 1, got {value}")
        if job not in JOBS and value > 1:
            raise SpecError(source, path, f"TensorFlow runs at most one {job} task, got {value}")
        counts.append((job, value))
    port = cluster.get(PORT_KEY, DEFAULT_PORT_BASE)
    if isinstance(port, bool) or not isinstance(port, int):
        raise SpecError(source, "cluster.port", f"expected a fixed port number (1-65535; a scheduled task "
                                                f"cannot pick its own), got {describe_value(port)}")
    if not 1 <= port <= 65535:
        raise SpecError(source, "cluster.port", f"port {port} is out of range 1-65535")
    workers = dict(counts)["worker"]
    check_train_rules(config, source, "train", workers)
    limits = elastic_range(elastic, workers) if elastic is not None else None
    check_elastic(limits, config, source, workers)
    return CountSpec(tuple(counts), port, config, source, limits)


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
    cluster: dict[str, Any] = {j: [format_address(a) for a in spec.addresses(j)] for j in spec.jobs()}
    if spec.elastic is not None:
        cluster["worker"] = {"addresses": cluster["worker"], "min": spec.elastic.min, "start": spec.elastic.start}
    data = {"cluster": cluster, "train": train}
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
    new = build_cluster(list(ps), list(worker), spec.source or "spec", train=spec.train, elastic=spec.elastic,
                        **jobs)
    return dataclasses.replace(new, source=spec.source)


def has_auto_ports(spec: ClusterSpec) -> bool:
    """True when any task's port is automatic (0 / `auto`): the launcher must pick it."""
    return any(a.port == AUTO_PORT for j in spec.jobs() for a in spec.addresses(j))


__all__ = [
    "JOBS", "SCRIPT_JOBS", "ALL_JOBS", "MODES", "REPLICATIONS", "TRAIN_FIELDS", "TRAIN_TYPES", "AUTO_PORT",
    "DEFAULT_PORT_BASE",
    "Address", "TrainConfig", "ClusterSpec", "CountSpec", "Elastic", "check_elastic",
    "load_spec", "parse_spec", "parse_address", "format_address", "build_cluster", "merge_train",
    "check_cross_fields", "dump_spec", "with_addresses", "has_auto_ports",
]
