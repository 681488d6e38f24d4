"""`--metrics_port`: the launcher's `/metrics` for Prometheus, made at each scrape from what the launcher already
knows (the supervisor's progress and exits, the train dir's checkpoints, the ps links' tc counters): nothing is
counted on the run's path, so a run nobody scrapes pays nothing. Names, types and labels: `METRICS`
(docs/operations.md's table is checked against what a scrape shows). The endpoint itself is `psworker.exporter`'s.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, TextIO

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from psworker import exporter
from psworker.errors import EXIT_PEER_GONE, EXIT_PREEMPTED
from psworker.launcher.console.progress import TaskProgress
from psworker.states import RunState, TaskState
from psworker.launcher.supervise.watch import STALL_JOBS

__all__ = ["DEFAULT_STALL_SECS", "EXIT_CLASSES", "METRICS", "RUN_STATES", "Endpoint", "RunCollector", "exit_class",
           "MetricsOptions", "RunFacts", "newest_checkpoint", "serving", "state_label"]

logger = logging.getLogger(__name__)

DEFAULT_STALL_SECS = 300.0      # `psworker_task_stalled` without --metrics_stall_secs or --stall_timeout_secs
EXIT_CLASSES = ("ok", "error", "signal", "peer_gone", "preempted", "stalled", "memory_limit")
RUN_STATES = tuple(RunState)
_CHECKPOINT = re.compile(r"-(\d+)\.index$")     # TF's `<prefix>-<step>.index`, written last (train/checkpoints.py)

# name -> (type, labels, meaning): docs/operations.md's table is this (tests/test_metrics.py checks both against a
# scrape).
METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "psworker_run_state": ("gauge", ("state",), "1 for the run's state (starting, running, succeeded, failed, "
                                                "stopped), 0 for the others"),
    "psworker_global_step": ("gauge", (), "the largest global step any task reported or the newest checkpoint holds"),
    "psworker_max_steps": ("gauge", (), "the run's max_steps (psworker's trainer)"),
    "psworker_examples_per_second": ("gauge", (), "the training workers' examples/s, summed"),
    "psworker_elastic_workers": ("gauge", ("kind",), "an elastic job's workers: `running` and `target`"),
    "psworker_checkpoint_step": ("gauge", (), "the global step of the newest checkpoint in the train dir"),
    "psworker_checkpoint_age_seconds": ("gauge", (), "seconds since the newest checkpoint was written"),
    "psworker_ps_link_bytes_total": ("counter", ("task", "direction"), "`--ps_link_rate`: bytes through ps TASK's "
                                                                       "link, `to_ps` or `from_ps`"),
    "psworker_data_epoch": ("gauge", (), "dealt shards: the furthest epoch position a worker showed "
                                         "(examples trained / examples per epoch)"),
    "psworker_data_epochs": ("gauge", (), "dealt shards: the epochs to train (num_epochs)"),
    "psworker_task_state": ("gauge", ("job", "task", "state"), "1 for the task's state (one series per launcher "
                                                               "state, `state_label`), 0 for the others"),
    "psworker_task_restarts_total": ("counter", ("job", "task", "exit_class"), "restarts of the task, by the class "
                                                                               "of the exit that preceded each"),
    "psworker_task_last_exit_code": ("gauge", ("job", "task"), "the exit status of the task's last ended attempt "
                                                               "(128+N: killed by signal N)"),
    "psworker_task_step": ("gauge", ("job", "task"), "the last global step the task reported"),
    "psworker_task_examples_per_second": ("gauge", ("job", "task"), "a training task's examples/s, from its last "
                                                                    "step line"),
    "psworker_task_seconds_since_step": ("gauge", ("job", "task"), "a live worker's seconds since its step last "
                                                                   "moved (since its start before its first step)"),
    "psworker_task_stalled": ("gauge", ("job", "task"), "1 while a live worker's step has not moved for the stall "
                                                        "threshold"),
}


def state_label(state: TaskState) -> str:
    """The `state` label of a launcher task state: its enum name in lower case (`paused`: an injected stop)."""
    return state.name.lower()


def exit_class(returncode: int, cause: Optional[str]) -> str:
    """The class of an ended attempt (`EXIT_CLASSES`): the launcher's own reason first (it killed the task as
    stalled, the kernel killed it over its memory cap), then the code (errors.py: 170 a peer gone, 171 a preempted
    elastic worker; a signal, or 128+N; any other non-zero code an error)."""
    if cause and cause.startswith("stalled"):
        return "stalled"
    if cause and "over its memory limit" in cause:
        return "memory_limit"
    if returncode == 0:
        return "ok"
    if returncode in (EXIT_PEER_GONE, EXIT_PREEMPTED):
        return "peer_gone" if returncode == EXIT_PEER_GONE else "preempted"
    return "signal" if returncode < 0 or returncode >= 128 else "error"


def newest_checkpoint(train_dir: Optional[Path]) -> Optional[tuple[int, float]]:
    """(step, mtime) of the newest complete checkpoint in `train_dir` (its `.index`, written last), or None."""
    if train_dir is None:
        return None
    best: Optional[tuple[int, float]] = None
    try:
        for entry in train_dir.iterdir():
            m = _CHECKPOINT.search(entry.name)
            if m and (best is None or int(m.group(1)) > best[0]):
                best = (int(m.group(1)), entry.stat().st_mtime)
    except OSError:      # not (yet) there, not readable here, or a file removed while listed
        return best
    return best


@dataclass(frozen=True)
class MetricsOptions:
    """`--metrics_port` and its companions: where the launcher serves /metrics, and what it calls stalled."""

    port: int = 0                           # 0: a free port (the banner names it)
    host: str = exporter.DEFAULT_HOST
    allow_public: bool = False              # a public or every-interface host (refused otherwise)
    stall_secs: Optional[float] = None      # None: --stall_timeout_secs, else DEFAULT_STALL_SECS
    linger_secs: float = 30.0               # after the run, serve until the next scrape, at most this long

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"metrics port must be 0-65535, got {self.port}")
        if self.stall_secs is not None and self.stall_secs <= 0:
            raise ValueError(f"metrics stall_secs must be > 0, got {self.stall_secs}")
        if self.linger_secs < 0:
            raise ValueError(f"metrics linger_secs must be >= 0, got {self.linger_secs}")


@dataclass(frozen=True)
class RunFacts:
    """What the collector reads besides the supervisor: fixed for the run."""

    stall_secs: float
    train_dir: Optional[Path] = None
    max_steps: Optional[int] = None
    link_bytes: Optional[Callable[[], Optional[Sequence[Any]]]] = None   # `shaping.PortBytes` per ps, or None


class RunCollector(Collector):
    """The launcher's metrics, made at each scrape from the attached `Supervisor` (`attach`), read without its lock
    (a scrape never waits on the run loop)."""

    def __init__(self, facts: RunFacts) -> None:
        self._facts = facts
        self._sup: Any = None
        self._ended: Optional[str] = None

    def attach(self, sup: Any) -> None:
        self._sup = sup

    def ended(self, state: str) -> None:
        """The run's end (`succeeded`, `failed`, `stopped`), for the scrapes after it."""
        self._ended = state

    def collect(self) -> Iterator[Any]:
        now = time.time()
        sup = self._sup
        state = self._ended or ("starting" if sup is None else "running")
        family = _family("psworker_run_state")
        for choice in RUN_STATES:
            family.add_metric([choice], 1.0 if choice == state else 0.0)
        yield family
        if sup is None:
            return
        tasks = sup.progress.snapshot()
        yield from self._run(sup, tasks, now)
        yield from _tasks(tasks, sup.ended_attempts(), self._facts.stall_secs, now)

    def _run(self, sup: Any, tasks: dict[str, TaskProgress], now: float) -> Iterator[Any]:
        newest = newest_checkpoint(self._facts.train_dir)
        step = max(sup.progress.global_step(), newest[0] if newest is not None else 0)  # a save can be newer
        yield _gauge("psworker_global_step", step)
        if self._facts.max_steps:
            yield _gauge("psworker_max_steps", self._facts.max_steps)
        rates = [t.examples_per_sec for t in tasks.values() if t.examples_per_sec and t.state == TaskState.TRAINING]
        yield _gauge("psworker_examples_per_second", sum(rates))
        workers = sup.progress.workers()
        if workers is not None:
            family = _family("psworker_elastic_workers")
            family.add_metric(["running"], workers[0])
            family.add_metric(["target"], workers[1])
            yield family
        if newest is not None:
            yield _gauge("psworker_checkpoint_step", newest[0])
            yield _gauge("psworker_checkpoint_age_seconds", max(0.0, now - newest[1]))
        epochs = [(t.epoch, t.num_epochs) for t in tasks.values() if t.epoch is not None]
        if epochs:
            epoch, of = max(epochs, key=lambda e: e[0])
            yield _gauge("psworker_data_epoch", epoch)
            if of is not None:
                yield _gauge("psworker_data_epochs", of)
        yield from self._links()

    def _links(self) -> Iterator[Any]:
        if self._facts.link_bytes is None:
            return
        try:
            links = self._facts.link_bytes()
        except Exception as err:    # tc gone or failing: the other metrics still go out
            logger.debug("--ps_link_rate: no tc counters for /metrics: %s", err)
            return
        if links:
            family = _family("psworker_ps_link_bytes_total")
            for i, b in enumerate(links):
                family.add_metric([str(i), "to_ps"], b.to_ps)
                family.add_metric([str(i), "from_ps"], b.from_ps)
            yield family


Exit = tuple[int, Optional[str]]     # an ended attempt's (return code, cause)


# GONE is `psworker status`'s word for a task whose launcher died, JOINED the elastic membership's for a started
# worker: a live launcher never shows either as a task's state
LAUNCHER_STATES = tuple(s for s in TaskState if s not in (TaskState.GONE, TaskState.JOINED))


def _tasks(tasks: dict[str, TaskProgress], ended: dict[str, tuple[Sequence[Exit], Optional[Exit]]],
           stall_secs: float, now: float) -> Iterator[Any]:
    """The per-task families: every task in each, labelled `job` and `task` (its index). `ended`: per task, the
    exits that were restarted and the current attempt's exit (None: running)."""
    families = {name: _family(name) for name in METRICS if name.startswith("psworker_task_")}
    live = (TaskState.STARTING, TaskState.RUNNING, TaskState.TRAINING, TaskState.PAUSED)
    for name, t in tasks.items():
        job, _, index = name.rpartition(":")
        labels = [job, index]
        for s in LAUNCHER_STATES:
            families["psworker_task_state"].add_metric([*labels, state_label(s)], 1.0 if s == t.state else 0.0)
        restarted, current = ended.get(name, ((), None))
        classes = [exit_class(code, cause) for code, cause in restarted]
        for cls in EXIT_CLASSES:
            families["psworker_task_restarts_total"].add_metric([*labels, cls], classes.count(cls))
        last = current or (restarted[-1] if restarted else None)
        if last is not None:
            code = last[0]
            families["psworker_task_last_exit_code"].add_metric(labels, 128 - code if code < 0 else code)
        if t.step is not None:
            families["psworker_task_step"].add_metric(labels, t.step)
        if t.examples_per_sec is not None and t.state == TaskState.TRAINING:     # not a rate from before a restart
            families["psworker_task_examples_per_second"].add_metric(labels, t.examples_per_sec)
        if job in STALL_JOBS and t.state in live:
            quiet = max(0.0, now - t.step_moved_at)
            families["psworker_task_seconds_since_step"].add_metric(labels, quiet)
            families["psworker_task_stalled"].add_metric(labels, 1.0 if quiet >= stall_secs else 0.0)
    yield from families.values()


def _family(name: str) -> Any:
    kind, labels, meaning = METRICS[name]
    if kind == "counter":
        return CounterMetricFamily(name.removesuffix("_total"), meaning, labels=labels)
    return GaugeMetricFamily(name, meaning, labels=labels)


def _gauge(name: str, value: float) -> Any:
    family = _family(name)
    family.add_metric([], value)
    return family


class Endpoint:
    """The launcher's endpoint: its socket bound when made (before the backend's session: on this host's network,
    before any re-exec into a namespace, which `inherit` lets it keep), served once the run is set up (`serve`)."""

    def __init__(self, host: str, port: int) -> None:
        self._sock = exporter.inherited() or exporter.listen(host, port)
        self.collector: Optional[RunCollector] = None
        self._endpoint: Optional[exporter.Endpoint] = None

    def inherit(self) -> None:
        exporter.inherit(self._sock)

    def serve(self, facts: RunFacts) -> str:
        """Starts serving the run's metrics; returns the banner line."""
        self.collector = RunCollector(facts)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self.collector)
        os.environ.pop(exporter.INHERIT_ENV, None)      # settled here: no task gets it
        os.set_inheritable(self._sock.fileno(), False)
        self._endpoint = exporter.Endpoint(self._sock, registry)
        return f"metrics for Prometheus at {self._endpoint.url}"

    def finish(self, state: str, linger_secs: float, console: TextIO) -> None:
        """The run's end for the scrapes to come; if anyone has scraped, serves until the next scrape (at most
        `linger_secs`), so that the end and the last checkpoint reach Prometheus."""
        if self.collector is not None:
            self.collector.ended(state)
        begun = self._endpoint.scrapes if self._endpoint is not None else 0     # a scrape in flight may predate the end
        if begun and linger_secs > 0:
            print(f"psworker: metrics: serving the run's end until the next scrape (at most {linger_secs:g} s, "
                  "--set metrics_linger_secs=SECS)", file=console, flush=True)
            self._endpoint.wait_scrape(begun, linger_secs)

    def close(self) -> None:
        if self._endpoint is not None:
            self._endpoint.close()
        else:
            self._sock.close()


@contextlib.contextmanager
def serving(options: Optional[MetricsOptions]) -> Iterator[Optional[Endpoint]]:
    """While inside: the bound endpoint of `options` (None: metrics off), refused on a public host unless allowed;
    its socket is handed across a re-exec (exec keeps it, `exporter.inherit`)."""
    if options is None:
        yield None
        return
    exporter.check_host(options.host, allow_public=options.allow_public, flag="--set metrics_allow_public_bind=true")
    endpoint = Endpoint(options.host, options.port)
    endpoint.inherit()
    try:
        yield endpoint
    finally:
        endpoint.close()
