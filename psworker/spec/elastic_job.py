"""An elastic worker job in a cluster spec (`worker: {addresses: [...], min: 1, start: 2}`): its range (`Elastic`),
read from the raw mapping, its defaults, and its rules against the train section."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

from psworker.errors import SpecError, describe_value, unknown_key
from psworker.spec.train_config import TrainConfig

__all__ = ["ELASTIC_KEYS", "Elastic", "check_elastic", "elastic_range", "elastic_worker"]

ELASTIC_KEYS = ("addresses", "max", "min", "start")   # an elastic worker job (a mapping instead of a list)


@dataclass(frozen=True)
class Elastic:
    """An elastic worker job: between `min` and `max` workers run, `start` of them at launch. Every address up to
    `max` is reserved from the start (every server's ClusterSpec holds them); worker 0, the chief, always runs."""

    min: int
    start: int
    max: int

    def describe(self) -> str:
        """`min 1, start 2, max 4`."""
        return f"min {self.min}, start {self.start}, max {self.max}"


def elastic_worker(cluster: Mapping[str, Any], source: str) -> tuple[Mapping[str, Any], Optional[dict]]:
    """An elastic worker job (`worker: {addresses: [...], min: 1, start: 2}` or `{max: 8, min: 2, start: 4}`):
    the cluster with `worker` as its addresses or its `max` count, and the range's raw numbers. A plain list or
    count is a fixed job (None)."""
    worker = cluster.get("worker")
    if not isinstance(worker, Mapping):
        return cluster, None
    for key in worker:
        if key not in ELASTIC_KEYS:
            raise unknown_key(key, ELASTIC_KEYS, source, f"cluster.worker.{key}")
    numbers = {key: worker.get(key) for key in ("max", "min", "start")}
    for key, value in numbers.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise SpecError(source, f"cluster.worker.{key}", f"expected a number of workers, got "
                                                             f"{describe_value(value)}")
    addresses = worker.get("addresses")
    if addresses is None and numbers["max"] is None:
        raise SpecError(source, "cluster.worker", "an elastic worker job needs `addresses` (every address up to "
                                                  "its max, `host:auto` locally) or, with task counts, `max`")
    if addresses is not None and numbers["max"] is not None:
        raise SpecError(source, "cluster.worker.max", "give either `addresses` (max is their number) or `max` "
                                                      "(a count spec), not both")
    return {**cluster, "worker": addresses if addresses is not None else numbers["max"]}, numbers


def elastic_range(numbers: dict, max_workers: int) -> Elastic:
    """The Elastic range from `elastic_worker`'s numbers: min defaults to 1, start to max."""
    return Elastic(min=1 if numbers["min"] is None else numbers["min"],
                   start=max_workers if numbers["start"] is None else numbers["start"], max=max_workers)


def check_elastic(elastic: Optional[Elastic], train: TrainConfig, source: str, max_workers: int) -> None:
    """The elastic range's rules: 1 <= min <= start <= max; between-graph replication only; in sync mode every
    step's gradients must come from at most `min` workers (the others are backups).

    Raises:
        SpecError: naming `cluster.worker.<field>`.
    """
    if elastic is None:
        return
    path = "cluster.worker"
    if elastic.max != max_workers:
        raise SpecError(source, f"{path}.max", f"is {elastic.max}, but the job has {max_workers} worker addresses")
    for name, value in (("min", elastic.min), ("start", elastic.start)):
        if not 1 <= value <= elastic.max:
            raise SpecError(source, f"{path}.{name}", f"{value} is not between 1 (worker 0, the chief, always runs) "
                                                      f"and max ({elastic.max})")
    if elastic.start < elastic.min:
        raise SpecError(source, f"{path}.start", f"{elastic.start} is below min ({elastic.min})")
    if train.replication == "in-graph":
        raise SpecError(source, path, "an elastic worker job needs between-graph replication (train.replication): "
                                      "the in-graph client drives a fixed set of workers")
    r = train.replicas_to_aggregate
    if train.mode == "sync" and (r or elastic.max) > elastic.min:
        raise SpecError(source, f"{path}.min", (
            f"in sync mode min ({elastic.min}) must be at least train.replicas_to_aggregate ({r}): each step needs "
            f"that many workers' gradients" if r else
            f"in sync mode an elastic job needs train.replicas_to_aggregate <= min ({elastic.min}); unset, every one "
            f"of the {elastic.max} workers must push a gradient for each step"))
