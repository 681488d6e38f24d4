"""The pure half of dealt shards (`psworker.train.dealer`): how the split is cut (`ShardPlan`: shards of a per-epoch
permutation of the example positions, `make_plan`), and what a read of the dealer's state says (a worker's lease,
its untrained examples, the run's account at the end). No TensorFlow."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from psworker.errors import UsageError

__all__ = ["DEFAULT_MAX_SHARD", "NO_LIMIT", "RING", "ShardPlan", "batch_refusal", "default_shard_examples",
           "lease_entries", "make_plan", "permutation", "remaining", "report", "sync_inexact"]

RING = 8                          # lease entries per worker: shards read ahead of training, at least a batch each
DEFAULT_MAX_SHARD = 2048          # the default shard: the smaller of this and an eighth of the split (8 batches+)
NO_LIMIT = np.iinfo(np.int64).max


@dataclass(frozen=True)
class ShardPlan:
    """How the split is cut: `num_examples` positions, shards of `shard_examples`, `num_epochs` passes (None:
    dealing never ends). Every shard and its positions are pure functions of this and the run's seed."""

    num_examples: int
    shard_examples: int
    num_epochs: Optional[int] = None

    @property
    def shards_per_epoch(self) -> int:
        return -(-self.num_examples // self.shard_examples)

    @property
    def limit(self) -> int:
        """Shards dealt in all (`NO_LIMIT` without epochs)."""
        return NO_LIMIT if self.num_epochs is None else self.shards_per_epoch * self.num_epochs

    def length(self, shard: int) -> int:
        """Examples in `shard` (an epoch's last shard may be shorter)."""
        j = shard % self.shards_per_epoch
        return min(self.shard_examples, self.num_examples - j * self.shard_examples)

    def end(self, shard: int, end: int = 0) -> int:
        """Where a piece of `shard` ends: `end`, or the shard's end when 0 (a whole shard's rest)."""
        return int(end) or self.length(shard)

    def positions(self, seed: int, shard: int, start: int = 0, end: int = 0) -> np.ndarray:
        """The example positions of `shard` from offset `start` to `end` (0: the shard's end): int64, in reading
        order."""
        epoch, j = divmod(shard, self.shards_per_epoch)
        first = j * self.shard_examples
        return permutation(self.num_examples, seed, epoch)[first + start:first + self.end(shard, end)]


def permutation(num_examples: int, seed: int, epoch: int) -> np.ndarray:
    """Epoch `epoch`'s order of the positions `0..num_examples-1`, a pure function of `seed` and `epoch`."""
    return np.random.default_rng([seed, epoch]).permutation(num_examples).astype(np.int64)


def default_shard_examples(num_examples: int, batch: int) -> int:
    """The smaller of `DEFAULT_MAX_SHARD` and an eighth of the split, but 8 batches at least (a take per shard)."""
    return max(1, min(DEFAULT_MAX_SHARD, max(-(-num_examples // 8), 8 * batch)))


def batch_refusal(num_examples: int, batch: int, batch_size: int, shard_examples: Optional[int] = None,
                  split: str = "the training split") -> Optional[str]:
    """Why a reader of `batch` examples a step (`batch_size` x towers, x workers for the in-graph client) cannot
    train on `num_examples` (`split` names them), in one line that says what to do; None when it can. A batch larger
    than the data never fills (every worker would wait for it until `--step_timeout_secs`); a shard holds one batch
    at least (the lease ring covers the read-ahead)."""
    per = "" if batch == batch_size else f" (--batch_size {batch_size} x {batch // batch_size})"
    if batch > num_examples:
        fits = max(1, num_examples * batch_size // batch)
        return (f"--batch_size {batch_size}: a worker reads {batch:,} examples a step{per}, more than the "
                f"{num_examples:,} of {split}; give --batch_size {fits} or less")
    if shard_examples is not None and shard_examples < batch:
        return (f"shard_examples {shard_examples} is below a worker's batch of {batch:,} examples{per}: a shard "
                f"holds one batch at least; give --set shard_examples={batch} or more, or leave it out (default: the "
                f"smaller of {DEFAULT_MAX_SHARD} and an eighth of the split, 8 batches at least)")
    return None


def make_plan(num_examples: int, shard_examples: Optional[int], num_epochs: Optional[int],
              batch: int, batch_size: Optional[int] = None) -> ShardPlan:
    """The plan for a worker reading `batch` examples per step (`batch_size` of them per tower; default `batch`).

    Raises:
        UsageError: the batch is larger than the split, or `shard_examples` below it (`batch_refusal`; exit 2, not
            retried: the launchers refuse it before any task starts, a task started by hand here).
    """
    refusal = batch_refusal(num_examples, batch, batch_size or batch, shard_examples)
    if refusal is not None:
        raise UsageError(refusal)
    size = shard_examples or default_shard_examples(num_examples, batch)
    return ShardPlan(num_examples, min(size, num_examples), num_epochs)


def remaining(plan: ShardPlan, state: dict, index: int) -> int:
    """Examples of worker `index`'s lease not trained yet, from a read of the state."""
    entries = lease_entries(state, index, trained=False)
    total = sum(plan.end(shard, end) - start for shard, start, end in entries)
    return max(0, total - int(state["trained"][index]))


def lease_entries(state: dict, index: int, trained: bool = True) -> list[tuple[int, int, int]]:
    """Worker `index`'s lease, in reading order: `[(shard, start, end)]` (end 0: the shard's end), the first start
    moved past what it trained (unless `trained` is False)."""
    count, head = int(state["ring_count"][index]), int(state["ring_head"][index])
    at = [(head + k) % RING for k in range(count)]
    ends = state.get("ring_end", np.zeros_like(state["ring_start"]))
    entries = [(int(state["ring_shard"][index][a]), int(state["ring_start"][index][a]), int(ends[index][a]))
               for a in at]
    if entries and trained:
        entries[0] = (entries[0][0], entries[0][1] + int(state["trained"][index]), entries[0][2])
    return entries


def report(plan: ShardPlan, state: dict) -> tuple[int, int, float]:
    """`(examples trained, examples trained again, epochs)` from a read of the state at the end: trained again are
    those beyond the positions dealt (each shard read once, the untrained rest of leases and pool not counted)."""
    trained = int(state["examples_trained"])
    dealt = sum(plan.length(k) for k in range(min(int(state["next_shard"]), plan.limit)))
    untrained = sum(remaining(plan, state, j) for j in range(len(state["trained"])))
    ends = state.get("pool_end", np.zeros_like(state["pool_start"]))
    pooled = sum(plan.end(int(s), int(e)) - int(st)
                 for s, st, e in zip(state["pool_shard"], state["pool_start"], ends) if s >= 0)
    read = dealt - untrained - pooled
    return trained, max(0, trained - read), trained / plan.num_examples


def sync_inexact(plan: ShardPlan, batch: int, aggregate: int, elastic: bool) -> Optional[str]:
    """Why a sync job's epochs cannot end exactly with every example applied `num_epochs` times (None: they can).

    Exact takes whole batches everywhere (shards and the split a multiple of the batch: no worker's last batch is
    partial) that fill every step (the epochs a multiple of `aggregate` batches),
    and a token per replica per step (an elastic job's tokens on demand give a worker left alone at the end one
    push per step, not the `aggregate` the last steps need)."""
    if elastic:
        return "an elastic job hands out its sync tokens on demand"
    if plan.shard_examples % batch or plan.num_examples % batch:
        return (f"shards of {plan.shard_examples} and {plan.num_examples} examples are not whole batches of "
                f"{batch}")
    if plan.num_epochs is not None and plan.num_epochs * plan.num_examples % (aggregate * batch):
        return (f"{plan.num_epochs} epochs of {plan.num_examples} examples do not fill whole steps of {aggregate} "
                f"batches of {batch}")
    return None
