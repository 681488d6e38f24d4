"""What a launcher command checks of the training before any task starts, so that a mistake in the data or the batch
is one line and exit 2 rather than tasks that fail (or wait for a batch that never fills) after start-up: the
model's data (`Model.check_data`: the files there, their format's first line) and a worker's batch against the
training split (`train.shard_plan.batch_refusal`). It reads the model's data code, so it runs here, in the CLI (the
launcher never imports `train/` or the models' inputs), once: not again in a re-executed launcher.

Where the data is: `local` reads it on this machine, so it is always checked. `ssh`, `slurm submit` and `slurm
launch` run the tasks on other hosts: a `--data_dir` that is not a directory here may be theirs, and is then left to the
tasks (which fail with exit 3 naming it); one visible here (a shared file system) is checked as `local`'s is. A model
that needs
a `--data_dir` and has none is refused by every launcher.
"""

from __future__ import annotations

import os
from typing import Union

from psworker.errors import PsworkerError, UsageError
from psworker.spec import ClusterSpec, CountSpec, TrainConfig

__all__ = ["check_training", "reader_batch"]


def reader_batch(train: TrainConfig, num_workers: int) -> int:
    """The examples one reader takes a step: `batch_size` x towers (`auto`: at least one), x the workers for the
    in-graph client that reads every worker's batch from dealt shards."""
    towers = train.num_devices if isinstance(train.num_devices, int) else 1
    readers = num_workers if train.replication == "in-graph" and train.data_dealing == "dealt" else 1
    return train.batch_size * towers * readers


def check_training(spec: Union[ClusterSpec, CountSpec], *, data_here: bool) -> None:
    """Refuses (exit 2), before any task starts, a run whose data cannot be read or whose batch does not fit it.

    Args:
        spec: the run's spec with its training flags applied.
        data_here: the tasks read their data on this machine (`local`); False: only a data_dir visible here is read.

    Raises:
        UsageError: no data_dir where the model needs one, data missing or not in the model's format, a worker's
            batch larger than the training split, or `shard_examples` below it.
    """
    from psworker.launcher import netns
    from psworker.models import Model, registry
    from psworker.train import shard_plan

    if netns.inside():
        return
    train = spec.train
    model = registry.get(train.model)
    if not isinstance(model, Model):      # a registered factory of something else: nothing here to ask
        return
    data_dir = train.data_dir
    if data_dir and not data_here and not os.path.isdir(os.path.expanduser(data_dir)):
        return                        # the hosts' data_dir: their tasks say what is wrong with it
    workers = spec.count("worker") if isinstance(spec, CountSpec) else len(spec.worker)
    batch = reader_batch(train, workers)
    try:
        examples = model.check_data(data_dir, batch)
    except UsageError:
        raise
    except (PsworkerError, OSError) as e:   # the tasks' data error (exit 3), found before they start: usage here
        raise UsageError(str(e)) from None
    split = f"model {model.name}'s training split" + (f" in {data_dir}" if data_dir and model.needs_data_dir else "")
    refusal = shard_plan.batch_refusal(examples, batch, train.batch_size,
                                       train.shard_examples if train.data_dealing == "dealt" else None, split)
    if refusal is not None:
        raise UsageError(refusal)
