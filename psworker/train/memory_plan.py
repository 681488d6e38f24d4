"""`--ps_memory_limit` against a model, before anything starts (`psworker plan`, `psworker local`): each ps needs what
the fitted ps memory model says (`memory.needs`: a bare ps's `PS_BASELINE_BYTES` plus `BYTES_FACTOR` times its
bytes) for the variables and optimizer slots that the trainer's own placement gives it (`plan_report.placement_report`:
the training graph built without servers or data, tables split by rows over the ps, `GreedyByteStrategy`); and, where
that is over the cap, how many ps the model needs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from psworker import memory
from psworker.errors import UsageError

__all__ = ["MemoryFit", "check", "describe", "placed_bytes", "refusal", "require"]

SEARCH = 16          # ps counts tried past the even-split bound before giving up on naming a number


@dataclass(frozen=True)
class MemoryFit:
    """Each ps's variable bytes (and of them, its sparse tables' shards and slots) on `num_ps` ps under `limit`;
    `needed`: the fewest ps that fit (None: the spec's count fits, so none was searched for; 0: none fits, the
    baseline alone reaches the limit; -1: none up to `searched`)."""

    model: str
    limit: int
    baseline: int
    bytes_per_ps: tuple[int, ...]
    table_bytes_per_ps: tuple[int, ...]
    needed: Optional[int] = None
    searched: int = 0

    @property
    def num_ps(self) -> int:
        return len(self.bytes_per_ps)

    @property
    def needs_per_ps(self) -> tuple[int, ...]:
        return tuple(memory.needs(b, self.baseline) for b in self.bytes_per_ps)

    @property
    def fits(self) -> bool:
        return max(self.needs_per_ps) <= self.limit


def placed_bytes(report) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(bytes per ps, of them the sparse tables' shards and their slots per ps) of a `plan_report.PlacementReport`."""
    tables = [0] * report.num_ps
    for v in report.variables:
        if any(v.checkpoint_name == t or v.checkpoint_name.startswith(t + "/") for t in report.tables):
            tables[v.ps] += v.nbytes
    return tuple(report.bytes_per_ps), tuple(tables)


def _placed(model: str, num_ps: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    from psworker.train.plan_report import placement_report

    return placed_bytes(placement_report(model, num_ps))


def check(model: str, num_ps: int, limit: int, *, baseline: int = memory.PS_BASELINE_BYTES,
          placed: Optional[tuple[tuple[int, ...], tuple[int, ...]]] = None) -> MemoryFit:
    """Whether `model`'s variables on `num_ps` ps fit under `limit` each; if not, the fewest ps that do (each count
    placed as the trainer would place it: a table splits into as many shards as there are ps).

    Args:
        placed: `placed_bytes` of the placement on `num_ps` ps, where the caller has it already.
    """
    loads, tables = placed if placed is not None else _placed(model, num_ps)
    fit = MemoryFit(model, limit, baseline, loads, tables)
    if fit.fits:
        return fit
    lower = memory.ps_lower_bound(sum(loads), limit, baseline)
    if lower == 0:
        return MemoryFit(model, limit, baseline, loads, tables, needed=0)
    first = max(num_ps + 1, lower)
    for n in range(first, first + SEARCH):
        if memory.fits(_placed(model, n)[0], limit, baseline):
            return MemoryFit(model, limit, baseline, loads, tables, needed=n)
    return MemoryFit(model, limit, baseline, loads, tables, needed=-1, searched=first + SEARCH - 1)


def _parts(fit: MemoryFit, i: int) -> str:
    """`320 MiB for a bare ps + 1.5 x 316 MiB of variables and optimizer slots (of them 316 MiB of table shards)`."""
    size = memory.format_size
    tables = f" (of them {size(fit.table_bytes_per_ps[i])} of table shards)" if fit.table_bytes_per_ps[i] else ""
    return (f"{size(fit.baseline)} for a bare ps + {memory.BYTES_FACTOR:g} x {size(fit.bytes_per_ps[i])} of variables "
            f"and optimizer slots{tables}")


def describe(fit: MemoryFit) -> list[str]:
    """`psworker plan`'s lines: each ps's need against the limit, and whether it fits."""
    size = memory.format_size
    lines = [f"memory per ps under --ps_memory_limit {size(fit.limit)}: the fitted ps memory model, "
             f"{size(fit.baseline)} + {memory.BYTES_FACTOR:g} x its variables and optimizer slots as placed above "
             "(a ps's peak across training, a checkpoint save and a restore, with a margin; measured by "
             "benchmarks/ps_memory_model.py)"]
    for i, need in enumerate(fit.needs_per_ps):
        verdict = (f"fits ({size(fit.limit - need)} to spare)" if need <= fit.limit
                   else f"over by {size(need - fit.limit)}")
        lines.append(f"  ps:{i} {size(need)} ({_parts(fit, i)}): {verdict}")
    if not fit.fits:
        lines.append(refusal(fit))
    return lines


def refusal(fit: MemoryFit) -> str:
    """The one line that refuses a spec whose ps do not fit, naming how many ps the model needs."""
    worst = max(range(fit.num_ps), key=lambda i: fit.needs_per_ps[i])
    held = f"ps:{worst} would need {memory.format_size(fit.needs_per_ps[worst])} ({_parts(fit, worst)})"
    if fit.needed == 0:
        how = f"no number of ps fits: a bare ps needs {memory.format_size(fit.baseline)} before any variable"
    elif fit.needed == -1:
        how = f"model {fit.model} needs more than {fit.searched} ps at this limit"
    else:
        how = f"model {fit.model} needs at least {fit.needed} ps at this limit"
    return f"--ps_memory_limit {memory.format_size(fit.limit)}: {held}; {how} (the spec has {fit.num_ps})"


def require(model: str, num_ps: int, limit: int) -> MemoryFit:
    """`psworker local --ps_memory_limit`'s check before anything starts.

    Raises:
        UsageError: a ps would not fit (`refusal`'s line).
    """
    fit = check(model, num_ps, limit)
    if not fit.fits:
        raise UsageError(refusal(fit))
    return fit
