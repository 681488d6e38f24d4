"""Memory and disk sizes for people (`--ps_memory_limit 1.5GB`, `800MiB`), and the rule that says whether a ps fits
under a cap: its variables' bytes, twice more its sparse tables' (`TABLE_COPIES`), plus what a bare ps holds before it
has any (`PS_BASELINE_BYTES`). Pure: the bytes come from `train.memory_plan` (the trainer's own placement), the cap is
enforced by `launcher.cgroups`."""

from __future__ import annotations

import math
import re
from typing import Sequence

__all__ = ["MIN_LIMIT_BYTES", "PS_BASELINE_BYTES", "TABLE_COPIES", "fits", "format_mib", "format_size", "needs", "parse_size",
           "ps_lower_bound"]

# What a bare ps holds before its first variable: the Python interpreter, TensorFlow's runtime and the started
# tf.train.Server, as its memory cgroup charges it (anonymous memory: TensorFlow's shared libraries are file pages,
# already cached by the other tasks). Measured on TF 2.21 (docs/performance.md, ps memory): 291 MiB.
PS_BASELINE_BYTES = 320 * 2 ** 20
# A sparse table's shards and their optimizer slots are held up to this many times more at a ps's peak. Measured
# (docs/performance.md, ps memory): a ps's anonymous memory grows by 1.6x (2.85 GB on 4 ps) to 1.77x (316 MiB on
# 4 ps) its table bytes over its first steps and the checkpoint after them. Why, as far as we read it: the table is a
# resource variable read by rows, which TensorFlow keeps in copy-on-read mode, so a read of it for a checkpoint copies
# it whole.
TABLE_COPIES = 2
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


def needs(variable_bytes: int, table_bytes: int = 0, baseline: int = PS_BASELINE_BYTES) -> int:
    """What one ps needs under a cap: its variables (optimizer slots included), `TABLE_COPIES` more of the sparse
    tables' shards and slots among them (`table_bytes`), and the bare ps's baseline."""
    return variable_bytes + TABLE_COPIES * table_bytes + baseline


def ps_lower_bound(total_variable_bytes: int, total_table_bytes: int, limit: int,
                   baseline: int = PS_BASELINE_BYTES) -> int:
    """The fewest ps tasks that could hold the variables under `limit` each, were the bytes split evenly (0 when no
    number can: the baseline alone reaches the limit)."""
    room = limit - baseline
    need = total_variable_bytes + TABLE_COPIES * total_table_bytes
    return 0 if room <= 0 else max(1, math.ceil(need / room))


def fits(bytes_per_ps: Sequence[int], table_bytes_per_ps: Sequence[int], limit: int,
         baseline: int = PS_BASELINE_BYTES) -> bool:
    """Whether every ps's need (`needs`) is within `limit`."""
    return all(needs(b, t, baseline) <= limit for b, t in zip(bytes_per_ps, table_bytes_per_ps))
