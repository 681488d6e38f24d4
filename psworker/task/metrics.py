"""`psworker ps|worker --metrics_port P`: one task's own /metrics, where no launcher runs (start scripts, pods, srun
steps). It listens on the host of the task's own address (where its TensorFlow server is named: the same safety
rule, `--allow_public_bind`), from before TensorFlow's import until the task exits.

Nothing on the training path changes: the task's own lines feed the gauges (`Watcher.line`): what it prints (step
lines go to stdout, `events.Step`) through a stdout wrapper, and its log records through a logging handler (the end
lines, a ps's done tokens). Memory is read at each scrape. Names, types and labels: `METRICS`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, TextIO

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from psworker import events, exporter

__all__ = ["METRICS", "Watcher", "memory_limit", "serving"]

log = logging.getLogger(__name__)

# name -> (type, labels, meaning): docs/operations.md's table is this (tests/test_metrics.py checks both against a
# scrape).
_TASK = ("job", "task")
METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "psworker_worker_step": ("gauge", _TASK, "the global step of the worker's last step line"),
    "psworker_worker_examples_per_second": ("gauge", _TASK, "the worker's examples/s, from its last step line"),
    "psworker_worker_loss": ("gauge", _TASK, "the loss of its last step line"),
    "psworker_worker_step_seconds": ("gauge", _TASK, "seconds per local step, over the steps since its step line "
                                                     "before (sec/batch)"),
    "psworker_worker_done": ("gauge", _TASK, "1 once the worker has finished training (or found it complete)"),
    "psworker_worker_leaving": ("gauge", _TASK, "1 once an elastic job's worker was asked to leave (scaled away "
                                                "or preempted)"),
    "psworker_ps_members": ("gauge", _TASK, "the workers whose done token the ps waits for"),
    "psworker_ps_done_tokens_total": ("counter", _TASK, "the done tokens the ps has taken (one per worker that "
                                                        "finished)"),
    "psworker_task_resident_memory_bytes": ("gauge", _TASK, "the task's resident memory (RSS)"),
    "psworker_task_memory_limit_bytes": ("gauge", _TASK, "the memory limit of the task's cgroup, when it has one "
                                                         "(v1 memory.limit_in_bytes, v2 memory.max)"),
}

# the ps's lines about its done tokens (task/shutdown.py: serve_until_done, _PsWait.on_member)
_DONE = re.compile(r"\bworker:\d+ is done \((\d+) of (\d+)\)")
_MEMBERS = re.compile(r"\(members now: ([^)]*)\)")
_LEAVING = re.compile(r"; leaving the job\b")       # task/leave.py, on SIGUSR2 or SIGTERM


class Watcher(Collector):
    """One task's gauges, fed its lines (`line`), collected at each scrape."""

    def __init__(self, job: str, index: int, members: int) -> None:
        self._labels = [job, str(index)]
        self._job = job
        self._lock = threading.Lock()
        self._step: Optional[events.Step] = None
        self._done = self._leaving = False
        self._members, self._tokens = members, 0

    def line(self, text: str) -> None:
        """Records one line the task wrote, if it tells something."""
        event = events.parse_line(text)
        with self._lock:
            if isinstance(event, events.Step):
                self._step = event
            elif isinstance(event, (events.WorkerDone, events.FoundComplete)):
                self._done = True
            elif self._job == "ps" and (m := _DONE.search(text)):
                self._tokens += 1
                self._members = int(m.group(2))
            elif self._job == "ps" and (m := _MEMBERS.search(text)):
                self._members = len([w for w in m.group(1).split(",") if w.strip()])
            elif _LEAVING.search(text):
                self._leaving = True

    def collect(self) -> Iterator[Any]:
        with self._lock:
            step, done, leaving, members, tokens = self._step, self._done, self._leaving, self._members, self._tokens
        if self._job == "ps":
            yield self._one("psworker_ps_members", members)
            yield self._one("psworker_ps_done_tokens_total", tokens)
        else:
            if step is not None:
                yield self._one("psworker_worker_step", step.step)
                for name, value in (("psworker_worker_examples_per_second", step.examples_per_sec),
                                    ("psworker_worker_loss", step.loss),
                                    ("psworker_worker_step_seconds", step.sec_per_batch)):
                    if value is not None:
                        yield self._one(name, value)
            yield self._one("psworker_worker_done", float(done))
            yield self._one("psworker_worker_leaving", float(leaving))
        rss = _resident_bytes()
        if rss is not None:
            yield self._one("psworker_task_resident_memory_bytes", rss)
        limit = memory_limit()
        if limit is not None:
            yield self._one("psworker_task_memory_limit_bytes", limit)

    def _one(self, name: str, value: float) -> Any:
        kind, labels, meaning = METRICS[name]
        family = (CounterMetricFamily(name.removesuffix("_total"), meaning, labels=labels) if kind == "counter"
                  else GaugeMetricFamily(name, meaning, labels=labels))
        family.add_metric(self._labels, value)
        return family


def _resident_bytes() -> Optional[int]:
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


_NO_LIMIT = 1 << 60       # cgroup v1 writes "no limit" as a huge page-rounded number


def memory_limit(proc: Path = Path("/proc/self")) -> Optional[int]:
    """The memory limit of this process's cgroup (v1 `memory.limit_in_bytes`, v2 `memory.max`), where it is visible
    at the usual mounts (/sys/fs/cgroup/memory, /sys/fs/cgroup); None when unlimited or unknown."""
    try:
        lines = (proc / "cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            candidates = [Path("/sys/fs/cgroup/memory") / path.lstrip("/") / "memory.limit_in_bytes"]
        elif controllers == "":
            candidates = [Path("/sys/fs/cgroup") / path.lstrip("/") / "memory.max"]
        else:
            continue
        for file in candidates:
            try:
                text = file.read_text().strip()
            except OSError:
                continue
            if text != "max" and text.isdigit() and int(text) < _NO_LIMIT:
                return int(text)
    return None


class _Lines:
    """A text stream that copies to `stream` and hands each whole line to `on_line`."""

    def __init__(self, stream: TextIO, on_line: Callable[[str], None]) -> None:
        self._stream, self._on_line, self._part = stream, on_line, ""

    def write(self, text: str) -> int:
        written = self._stream.write(text)
        *whole, self._part = (self._part + text).split("\n")
        for line in whole:
            with contextlib.suppress(Exception):    # a metric never breaks the task's output
                self._on_line(line)
        return written

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _Records(logging.Handler):
    def __init__(self, on_line: Callable[[str], None]) -> None:
        super().__init__(logging.INFO)
        self._on_line = on_line

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            self._on_line(record.getMessage())


@contextlib.contextmanager
def serving(job: str, index: int, host: str, port: Optional[int], members: int) -> Iterator[None]:
    """While inside: with `port` (0: a free one), the task's /metrics on `host` (its own address's, already vetted
    by `task.server.check_bind_safety`), fed its stdout lines and log records; None: nothing."""
    if port is None:
        yield
        return
    watcher = Watcher(job, index, members)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(watcher)
    endpoint = exporter.Endpoint(exporter.listen(host, port), registry)
    records, stdout = _Records(watcher.line), sys.stdout
    logging.getLogger().addHandler(records)
    sys.stdout = _Lines(stdout, watcher.line)       # type: ignore[assignment]
    log.info("%s:%d: metrics for Prometheus at %s", job, index, endpoint.url)
    try:
        yield
    finally:
        sys.stdout = stdout
        logging.getLogger().removeHandler(records)
        endpoint.close()
