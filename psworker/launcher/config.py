"""`LaunchConfig`: everything one launch needs, built once by the CLI (or a library caller) and handed on."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from psworker.errors import UsageError
from psworker.launcher.backends.local import LocalOptions
from psworker.launcher.inject import Fault
from psworker.launcher.metrics import MetricsOptions
from psworker.launcher.policy import RestartPolicy, SuccessPolicy
from psworker.spec import ClusterSpec, CountSpec

__all__ = ["LaunchConfig", "COMMAND_PS_EXIT_GRACE_SECS", "PS_EXIT_GRACE_SECS", "default_stop_save_secs"]

PS_EXIT_GRACE_SECS = 15.0           # psworker's ps tasks: they end by themselves once the workers are done
COMMAND_PS_EXIT_GRACE_SECS = 1.0    # a user's ps serves until stopped (server.join())


@dataclass(frozen=True)
class LaunchConfig:
    """One launch: the cluster, the backend that runs it (its typed options name it), what every task runs,
    supervision and console."""

    spec: Union[ClusterSpec, CountSpec]      # a count spec: only a backend that lays tasks out (slurm)
    backend: Any = field(default_factory=LocalOptions)   # LocalOptions | SshOptions | SlurmOptions | ...
    run_dir: Optional[str] = None            # cluster.yaml and logs/; None: the spec's train_dir, else a fresh
                                             # runs/<spec>-<time> here
    command: tuple[str, ...] = ()            # `psworker run`: the user's command; empty: psworker's trainer
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    faults: tuple[Fault, ...] = ()           # `--inject`, parsed (`psworker.launcher.inject.parse_fault`)
    stall_timeout_secs: Optional[float] = None
    verbose: bool = False
    live: Optional[bool] = None              # live status view; None: when the console is a terminal, else
    status_every_secs: float = 15.0          # ... plain status lines this often; False: neither
    grace_period_secs: float = 10.0
    ps_exit_grace_secs: Optional[float] = None     # None: PS_EXIT_GRACE_SECS, COMMAND_PS_EXIT_GRACE_SECS for a command
    stop_save_secs: Optional[float] = None   # on SIGINT/SIGTERM, how long the workers get to stop (the chief to save)
                                             # before the ps go; None: `default_stop_save_secs`
    success: SuccessPolicy = field(default_factory=SuccessPolicy)     # TFJob's default: the chief, else worker 0
    python: str = sys.executable             # the interpreter of psworker's own tasks, where they run
    metrics: Optional[MetricsOptions] = None     # `--metrics_port`: the launcher's /metrics; None: off

    def __post_init__(self) -> None:
        """Checks the settings and the rules of a launch (an elastic job runs psworker's trainer only); resolves
        the ps grace.

        Raises:
            UsageError: an elastic spec with a command. ValueError, TypeError: a bad setting.
        """
        elastic = getattr(self.spec, "elastic", None)
        if self.command and elastic is not None:
            raise UsageError(
                f"{self.spec.source or 'the spec'}: cluster.worker: an elastic worker job ({elastic.describe()}) runs "
                "psworker's own trainer only: its workers tell the ps tasks when they join and leave, which a "
                "command after '--' does not; give the worker job a fixed list or count, or drop the command")
        if self.ps_exit_grace_secs is None:
            grace = COMMAND_PS_EXIT_GRACE_SECS if self.command else PS_EXIT_GRACE_SECS
            object.__setattr__(self, "ps_exit_grace_secs", grace)
        if self.stop_save_secs is None:
            object.__setattr__(self, "stop_save_secs", default_stop_save_secs(self.spec, self.command,
                                                                              self.grace_period_secs))
        if self.stall_timeout_secs is not None and self.stall_timeout_secs <= 0:
            raise ValueError(f"stall_timeout_secs must be > 0, got {self.stall_timeout_secs}")
        if self.stop_save_secs < 0:
            raise ValueError(f"stop_save_secs must be >= 0, got {self.stop_save_secs}")
        if self.grace_period_secs < 0:
            raise ValueError(f"grace_period_secs must be >= 0, got {self.grace_period_secs}")
        bad = [f for f in self.faults if not isinstance(f, Fault)]
        if bad:
            raise TypeError(f"faults must be parsed (psworker.launcher.inject.parse_fault), got {bad!r}")

    @property
    def done_jobs(self) -> frozenset[str]:
        """The jobs whose tasks must all exit 0 under `all-workers`, and that get the worker grace once the run has
        succeeded: the chief if any, else the workers (plus, for psworker's own trainer, every non-ps job)."""
        jobs = set(self.spec.jobs())
        if not self.command:
            return frozenset(jobs - {"ps"})
        return frozenset({"chief"} if "chief" in jobs else {"worker"})


def default_stop_save_secs(spec: Any, command: tuple[str, ...], grace_period_secs: float) -> float:
    """How long a stop by SIGINT/SIGTERM gives the workers before the ps tasks go: psworker's trainer, its running
    step (`step_timeout_secs`), the chief's wait for the others and its checkpoint (`task.stop.ps_wait_secs`, what
    a stopping ps waits for the chief); a user's command, `grace_period_secs`."""
    if command:
        return grace_period_secs
    from psworker.task.stop import ps_wait_secs

    return ps_wait_secs(spec.train.step_timeout_secs)
