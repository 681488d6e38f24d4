"""Cluster specs: the YAML file, its frozen dataclasses, and validation.

CONTRACT (written first so that every layer codes against the same shapes). The helper that owns this
file fills in loading and validation; the dataclass fields and names below are relied on elsewhere.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

JOBS = ("ps", "worker")
MODES = ("async", "sync")
REPLICATIONS = ("between-graph", "in-graph")


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
    num_devices: int = 1                      # towers per worker
    replication: str = "between-graph"        # REPLICATIONS
    seed: Optional[int] = None


TRAIN_FIELDS = tuple(f.name for f in dataclasses.fields(TrainConfig))


@dataclass(frozen=True)
class ClusterSpec:
    """A whole cluster: ps and worker addresses plus trainer defaults. Worker 0 is the chief."""

    ps: tuple[Address, ...]
    worker: tuple[Address, ...]
    train: TrainConfig = field(default_factory=TrainConfig)
    source: Optional[str] = None              # the file it came from, for messages

    def addresses(self, job: str) -> tuple[Address, ...]:
        return {"ps": self.ps, "worker": self.worker}[job]

    def as_dict(self) -> dict[str, list[str]]:
        """`{"ps": ["h:p", ...], "worker": [...]}`: what tf.train.ClusterSpec and TF_CONFIG take."""
        return {"ps": [str(a) for a in self.ps], "worker": [str(a) for a in self.worker]}
