"""The linear scaling rule: the learning rate grows with the global batch, relative to the model's reference batch.

A model's `default_learning_rate` (or `--learning_rate`) is the rate for `Model.reference_batch_size` examples per
update (the CIFAR-10 tutorial's 0.1 at 128). With another global batch the rate is `base * global / reference`
(Goyal et al., 2017), unless `--scale_learning_rate false`. Models without a reference batch are not scaled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from psworker.models.base import Model
from psworker.spec import TrainConfig

OPT_OUT = "--set scale_learning_rate=false"


def global_batch(config: TrainConfig, num_workers: int) -> int:
    """Examples behind one update of the variables.

    `batch_size` x towers, times `replicas_to_aggregate` (default: every worker) in sync mode, times the number of
    workers in in-graph replication; in async mode each worker applies its own batch.

    Args:
        config: the settings, `num_devices` already a number (`devices.resolve`).
        num_workers: workers in the cluster.
    """
    per_worker = config.batch_size * int(config.num_devices)
    if config.replication == "in-graph":
        return per_worker * num_workers
    if config.mode == "sync":
        return per_worker * (config.replicas_to_aggregate or num_workers)
    return per_worker


@dataclass(frozen=True)
class LearningRate:
    """The rate a run trains with, and why."""

    base: float
    value: float
    global_batch: int
    reference_batch: Optional[int]   # None: the model has none
    scaled: bool

    def describe(self) -> str:
        """E.g. `learning rate 0.025 (0.1 x 32/128, linear scaling; --scale_learning_rate false to turn off)`."""
        if self.scaled:
            return (f"learning rate {self.value:g} ({self.base:g} x {self.global_batch}/{self.reference_batch}, "
                    f"linear scaling; {OPT_OUT} to turn off)")
        if self.reference_batch is None:
            return f"learning rate {self.value:g} (not scaled: the model has no reference batch size)"
        return (f"learning rate {self.value:g} (not scaled: {OPT_OUT}; global batch {self.global_batch}, "
                f"the model's reference {self.reference_batch})")


def learning_rate(model: Model, config: TrainConfig, num_workers: int) -> LearningRate:
    """The base rate (`config.learning_rate` or the model's default), scaled to the global batch when asked to."""
    base = config.learning_rate if config.learning_rate is not None else model.default_learning_rate
    batch = global_batch(config, num_workers)
    reference = model.reference_batch_size
    if reference is None or not config.scale_learning_rate:
        return LearningRate(base, base, batch, reference, False)
    return LearningRate(base, base * batch / reference, batch, reference, True)


__all__ = ["global_batch", "LearningRate", "learning_rate", "OPT_OUT"]
