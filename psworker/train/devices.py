"""Which devices a worker's towers run on: `--num_devices N|auto` resolved against the GPUs this process sees.

`auto` means every visible GPU, one tower on each (`/gpu:0`, `/gpu:1`, ...), or one tower on `/cpu:0` when there is
none. Variables stay on the ps (the `replica_device_setter`); the ps tasks keep their GPUs out of it entirely.
GPU memory is allocated as needed (`allow_growth`), so several tasks can share a host's GPUs.

TensorFlow's thread pools spin a while waiting for work before they sleep (its default, kept here).
`PSWORKER_TF_THREAD_SPINNING` in the tasks' environment turns that off: `ps-off` on the ps tasks (which mostly wait
on RPCs), `off` on every task, `on` (the default) nowhere. Opt-in: on this 2-core host `ps-off` took ~10% off the
ps's CPU in most interleaved runs, ~1% of a run's, below the run-to-run noise (docs/performance.md, "Unshaped").

TensorFlow gives each process two pools (inter-op and intra-op) of one thread per CPU. Where several of the spec's
tasks share a host (`psworker local`: all of them), that oversubscribes it: their threads take turns on the same
CPUs, and a step's hand-offs between gRPC's and the pools' threads become context switches. So the pools are sized
by the tasks that compete for the host's CPUs (at least 1 thread; `thread_budget`), as torchrun sets
`OMP_NUM_THREADS=1` for several processes per node: a worker's by the workers on its host (a worker's step is the
compute; its ps mostly waits on RPCs), a ps's by every task there. `PSWORKER_TF_THREADS=tf` keeps TensorFlow's
own, a number sets it; `TF_NUM_INTEROP_THREADS` / `TF_NUM_INTRAOP_THREADS` in the environment win over both.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
from typing import Mapping, Optional, Union

from psworker.environment import SPINNING_ENV, THREADS_ENV, spinning_setting, threads_setting
from psworker.errors import UsageError
from psworker.spec.fieldtypes import AUTO
from psworker.spec import ClusterSpec, TrainConfig

log = logging.getLogger(__name__)


def visible_gpus() -> int:
    """How many GPUs TensorFlow sees in this process (no memory is allocated on them)."""
    import tensorflow as tf

    return len(tf.config.list_physical_devices("GPU"))


def resolve_num_devices(num_devices: Union[int, str], num_gpus: int) -> int:
    """The number of towers: `num_devices` itself, or for `auto` the number of GPUs (1, a CPU tower, when 0).

    Raises:
        UsageError: more towers asked for than there are GPUs (when there are GPUs at all).
    """
    if num_devices == AUTO:
        return max(1, num_gpus)
    if num_gpus and num_devices > num_gpus:
        raise UsageError(f"--num_devices {num_devices}: requested {num_devices} towers, only {num_gpus} GPUs visible "
                         f"(use --num_devices auto for all of them)")
    return int(num_devices)


def device_names(num_towers: int, num_gpus: int) -> list[str]:
    """`["/gpu:0", ...]` when there are GPUs, else `["/cpu:0", ...]` (CPU towers need `server_config`)."""
    kind = "gpu" if num_gpus else "cpu"
    return [f"/{kind}:{i}" for i in range(num_towers)]


def describe(num_towers: int, num_gpus: int) -> str:
    """The log line: `towers: 2 on /gpu:0, /gpu:1` or `towers: 1 on /cpu:0 (no GPU visible)`."""
    line = f"towers: {num_towers} on {', '.join(device_names(num_towers, num_gpus))}"
    return line if num_gpus else line + " (no GPU visible)"


def resolve(config: TrainConfig, num_gpus: int) -> TrainConfig:
    """`config` with `num_devices` a number of towers (see `resolve_num_devices`)."""
    return dataclasses.replace(config, num_devices=resolve_num_devices(config.num_devices, num_gpus))


def thread_spinning(job: str, env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether the thread pools of a `job` task spin waiting for work (`PSWORKER_TF_THREAD_SPINNING` in `env`,
    default `os.environ`; see the module's docstring).

    Raises:
        UsageError: the variable holds something else than `on`, `ps-off` or `off`.
    """
    value = spinning_setting(env)
    return value == "on" or (value == "ps-off" and job != "ps")


def with_spinning(config, job: str):
    """`config` (a `ConfigProto`, changed in place) with `experimental.disable_thread_spinning` set for `job`."""
    config.experimental.disable_thread_spinning = not thread_spinning(job)
    return config


TF_THREAD_ENVS = ("TF_NUM_INTEROP_THREADS", "TF_NUM_INTRAOP_THREADS")


def _host_key(host: str) -> str:
    """The host an address names, loopback ones (`localhost`, 127.x, ::1) all this one; no DNS."""
    host = host.strip("[]").lower()
    try:
        return "loopback" if host == "localhost" or ipaddress.ip_address(host).is_loopback else host
    except ValueError:
        return host


def tasks_on_host(spec: ClusterSpec, job: str, index: int, jobs: tuple[str, ...] = ("ps", "worker")) -> int:
    """How many of the spec's tasks of `jobs` name this task's host (this one included, if of `jobs`)."""
    mine = _host_key(spec.addresses(job)[index].host)
    return sum(_host_key(a.host) == mine for j in jobs for a in spec.addresses(j))


def thread_budget(spec: ClusterSpec, job: str, index: int, *, cpus: Optional[int] = None,
                  env: Optional[Mapping[str, str]] = None) -> tuple[Optional[int], str]:
    """`(threads per TensorFlow pool, why)` for one task; None: TensorFlow's own count (see the module docstring).

    Raises:
        UsageError: `PSWORKER_TF_THREADS` holds a bad value.
    """
    env = os.environ if env is None else env
    setting = threads_setting(env)
    if any(env.get(name) for name in TF_THREAD_ENVS):
        return None, "TensorFlow's, from " + " and ".join(n for n in TF_THREAD_ENVS if env.get(n))
    if setting == "tf":
        return None, "TensorFlow's own (PSWORKER_TF_THREADS=tf)"
    if setting != "auto":
        return int(setting), "PSWORKER_TF_THREADS"
    cpus = cpus or len(os.sched_getaffinity(0))
    if tasks_on_host(spec, job, index) <= 1:
        return None, "TensorFlow's own: no other task of the spec on this host"
    jobs = ("ps", "worker") if job == "ps" else ("worker",)
    sharing = tasks_on_host(spec, job, index, jobs)
    if sharing <= 1:
        return None, "TensorFlow's own: the only worker on this host"
    return max(1, cpus // sharing), f"{cpus} CPUs shared by the spec's {sharing} {' and '.join(jobs)} tasks here"


def budget_line(spec: ClusterSpec, *, cpus: Optional[int] = None, env: Optional[Mapping[str, str]] = None) -> str:
    """`plan`'s line: the threads per pool of this machine's tasks (loopback addresses), and the rule elsewhere."""
    env = os.environ if env is None else env
    head = "TensorFlow threads per pool: "
    if threads_setting(env) != "auto" or any(env.get(name) for name in TF_THREAD_ENVS):
        threads, why = thread_budget(spec, "ps", 0, cpus=cpus, env=env)
        return head + f"{'one per CPU' if threads is None else threads}: {why}"
    cpus = cpus or len(os.sched_getaffinity(0))
    here: dict[str, Optional[int]] = {}
    shared_elsewhere = False
    for job in ("ps", "worker"):
        for i, address in enumerate(spec.addresses(job)):
            if _host_key(address.host) == "loopback":
                here.setdefault(job, thread_budget(spec, job, i, cpus=cpus, env=env)[0])
            else:
                shared_elsewhere = shared_elsewhere or tasks_on_host(spec, job, i) > 1
    parts = [f"{'one per CPU' if here[job] is None else here[job]} per {job}" for job in here]
    line = f"on this machine ({cpus} CPUs) " + ", ".join(parts) if any(t is not None for t in here.values()) else ""
    if shared_elsewhere:
        line += ("; " if line else "") + "on a host several tasks share, its CPUs over its workers (a ps: over all)"
    if not line:
        return head + "one per CPU (no two tasks share a host)"
    return head + line + "; PSWORKER_TF_THREADS=tf keeps one per CPU"


def with_threads(config, threads: Optional[int]):
    """`config` (a `ConfigProto`, changed in place) with both pools at `threads` (None: left to TensorFlow)."""
    if threads is not None:
        config.inter_op_parallelism_threads = threads
        config.intra_op_parallelism_threads = threads
    return config


def server_config(num_towers: int, num_gpus: int, threads: Optional[int] = None):
    """A worker server's `ConfigProto`: GPU memory grown on demand; `num_towers` CPU devices for CPU towers; thread
    spinning as `thread_spinning("worker")` says; `threads` per pool (`with_threads`)."""
    import tensorflow as tf

    from psworker.train import towers

    config = tf.compat.v1.ConfigProto()
    if num_gpus:
        config.gpu_options.allow_growth = True
    elif num_towers > 1:
        config = towers.session_config_for_towers(num_towers)
    return with_threads(with_spinning(config, "worker"), threads)


def ps_server_config(threads: Optional[int] = None):
    """A ps server's `ConfigProto`: no GPU devices (variables live in host memory; the GPUs are the workers'); thread
    spinning as `thread_spinning("ps")` says; `threads` per pool (`with_threads`)."""
    import tensorflow as tf

    return with_threads(with_spinning(tf.compat.v1.ConfigProto(device_count={"GPU": 0}), "ps"), threads)


def for_worker(config: TrainConfig, name: str, threads: Optional[int] = None):
    """Resolves `config.num_devices` in this worker process and logs the towers.

    Returns:
        `(config with an int num_devices, the worker server's ConfigProto)`.
    """
    gpus = visible_gpus()
    config = resolve(config, gpus)
    log.info("%s: %s", name, describe(config.num_devices, gpus))
    return config, server_config(config.num_devices, gpus, threads)


def log_threads(name: str, budget: tuple[Optional[int], str]) -> Optional[int]:
    """Logs a task's thread budget (`thread_budget`'s pair); returns the count."""
    threads, why = budget
    log.info("%s: TensorFlow threads per pool: %s (%s)", name, "one per CPU" if threads is None else threads, why)
    return threads


__all__ = ["visible_gpus", "resolve_num_devices", "device_names", "describe", "resolve", "thread_spinning",
           "with_spinning", "TF_THREAD_ENVS", "tasks_on_host", "thread_budget", "budget_line", "with_threads",
           "server_config", "ps_server_config", "for_worker", "log_threads", "SPINNING_ENV", "THREADS_ENV"]
