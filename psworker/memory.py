"""Memory and disk sizes for people (`--ps_memory_limit 1.5GB`, `800MiB`), and the rule that says whether a ps fits
under a cap: the fitted ps memory model, what a bare ps holds (`PS_BASELINE_BYTES`) plus `BYTES_FACTOR` times its
variables' bytes (optimizer slots included). Pure: the bytes come from `train.memory_plan` (the trainer's own
placement), the cap is enforced by `launcher.cgroups`."""

from __future__ import annotations

import math
import re
from typing import Sequence

__all__ = ["BYTES_FACTOR", "MIN_LIMIT_BYTES", "PS_BASELINE_BYTES", "fits", "format_mib", "format_size", "needs",
           "parse_size", "ps_lower_bound"]

# The ps memory model (issue 37): a ps's peak anonymous memory across training, checkpoint saves and a restore, fitted
# by least squares over 1, 2 and 4 ps and two table sizes (`benchmarks/ps_memory_model.py`, docs/performance.md "A
# ps's memory"): 233 MiB + 1.15 x variable bytes (2026-12-07; 1.52 x before `train.slots` filled the accumulators at
# run time, 2.53 x before `train.saving`). The plan keeps a margin over both: a bare ps's base (the interpreter,
# TensorFlow's runtime, the server, as its memory cgroup charges it) and the bytes' factor (the variables, and what a
# checkpoint's read or a restore copies of the largest one).
PS_BASELINE_BYTES = 320 * 2 ** 20
BYTES_FACTOR = 1.5
MIN_LIMIT_BYTES = 2 ** 20           # a cap under 1 MiB is a typo (a bare number is bytes)

_UNITS = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*")


def parse_size(text: str) -> int:
    """Bytes of a size written `1.5GB`, `800MiB`, `2 GiB` or `1073741824` (a bare number is bytes): decimal units
    kB MB GB TB, binary KiB MiB GiB TiB, any case.

    Raises:
        ValueError: not a number and one of those units, or under 1 MiB.
    """
    m = _SIZE.fullmatch(text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size: a number and a unit, e.g. 1.5GB or 800MiB (units: B, kB, MB, GB, "
                         f"TB, KiB, MiB, GiB, TiB)")
    n = int(float(m.group(1)) * _UNITS[unit])
    if n < MIN_LIMIT_BYTES:
        raise ValueError(f"{text!r} is {n} bytes; a memory limit must be at least 1 MiB")
    return n


def format_size(n: float) -> str:
    """`1.5 GiB`, `612 MiB`, `48 KiB`, `512 B`: binary units, as the kernel counts pages."""
    for unit, scale in (("TiB", 2 ** 40), ("GiB", 2 ** 30)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    for unit, scale in (("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= scale:
            return f"{n / scale:.0f} {unit}"
    return f"{int(n)} B"


def format_mib(n: float) -> str:
    """`2,454 MiB`: one unit for figures read side by side (each ps's peak)."""
    return f"{n / 2 ** 20:,.0f} MiB"


def needs(variable_bytes: int, baseline: int = PS_BASELINE_BYTES) -> int:
    """What one ps needs under a cap: the bare ps's baseline and `BYTES_FACTOR` times its variables' bytes (optimizer
    slots included)."""
    return baseline + math.ceil(BYTES_FACTOR * variable_bytes)


def ps_lower_bound(total_variable_bytes: int, limit: int, baseline: int = PS_BASELINE_BYTES) -> int:
    """The fewest ps tasks that could hold the variables under `limit` each, were the bytes split evenly (0 when no
    number can: the baseline alone reaches the limit)."""
    room = limit - baseline
    return 0 if room <= 0 else max(1, math.ceil(BYTES_FACTOR * total_variable_bytes / room))


def fits(bytes_per_ps: Sequence[int], limit: int, baseline: int = PS_BASELINE_BYTES) -> bool:
    """Whether every ps's need (`needs`) is within `limit`."""
    return all(needs(b, baseline) <= limit for b in bytes_per_ps)
