"""Which devices a worker's towers run on: `--num_devices N|auto` resolved against the GPUs this process sees.

`auto` means every visible GPU, one tower on each (`/gpu:0`, `/gpu:1`, ...), or one tower on `/cpu:0` when there is
none. Variables stay on the ps (the `replica_device_setter`); the ps tasks keep their GPUs out of it entirely.
GPU memory is allocated as needed (`allow_growth`), so several tasks can share a host's GPUs.

TensorFlow's thread pools spin a while waiting for work before they sleep (its default, kept here).
`PSWORKER_TF_THREAD_SPINNING` in the tasks' environment turns that off: `ps-off` on the ps tasks (which mostly wait
on RPCs), `off` on every task, `on` (the default) nowhere. Opt-in: on this 2-core host `ps-off` took ~10% off the
ps's CPU in most interleaved runs, ~1% of a run's, below the run-to-run noise (docs/performance.md, "Unshaped").
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Mapping, Optional, Union

from psworker.environment import SPINNING_ENV, spinning_setting
from psworker.errors import UsageError
from psworker.spec.fieldtypes import AUTO
from psworker.spec import TrainConfig

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


def server_config(num_towers: int, num_gpus: int):
    """A worker server's `ConfigProto`: GPU memory grown on demand; `num_towers` CPU devices for CPU towers; thread
    spinning as `thread_spinning("worker")` says."""
    import tensorflow as tf

    from psworker.train import towers

    config = tf.compat.v1.ConfigProto()
    if num_gpus:
        config.gpu_options.allow_growth = True
    elif num_towers > 1:
        config = towers.session_config_for_towers(num_towers)
    return with_spinning(config, "worker")


def ps_server_config():
    """A ps server's `ConfigProto`: no GPU devices (variables live in host memory; the GPUs are the workers'); thread
    spinning as `thread_spinning("ps")` says."""
    import tensorflow as tf

    return with_spinning(tf.compat.v1.ConfigProto(device_count={"GPU": 0}), "ps")


def for_worker(config: TrainConfig, name: str):
    """Resolves `config.num_devices` in this worker process and logs the towers.

    Returns:
        `(config with an int num_devices, the worker server's ConfigProto)`.
    """
    gpus = visible_gpus()
    config = resolve(config, gpus)
    log.info("%s: %s", name, describe(config.num_devices, gpus))
    return config, server_config(config.num_devices, gpus)


__all__ = ["visible_gpus", "resolve_num_devices", "device_names", "describe", "resolve", "thread_spinning",
           "with_spinning", "server_config", "ps_server_config", "for_worker", "SPINNING_ENV"]
