"""`LaunchConfig`: everything one launch needs, built once by the CLI (or a library caller) and handed on."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from psworker.launcher.backends.local import LocalOptions
from psworker.launcher.inject import Fault
from psworker.launcher.policy import RestartPolicy, SuccessPolicy
from psworker.spec import ClusterSpec, CountSpec

__all__ = ["LaunchConfig"]


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
    ps_exit_grace_secs: float = 15.0
    success: SuccessPolicy = field(default_factory=SuccessPolicy)     # TFJob's default: the chief, else worker 0
    python: str = sys.executable             # the interpreter of psworker's own tasks, where they run

    def __post_init__(self) -> None:
        if self.stall_timeout_secs is not None and self.stall_timeout_secs <= 0:
            raise ValueError(f"stall_timeout_secs must be > 0, got {self.stall_timeout_secs}")
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
