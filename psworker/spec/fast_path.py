"""The fast path a run takes by default (issue 37): packed transfers and steps in flight where they are correct.

`pack_transfers` and `concurrent_steps` default to `auto`; `fast_path` turns `auto` into a value by a rule, and an
explicit value (spec or flag) always wins. The rule, from measurements (issue 37, its closing note):

- packed transfers: between-graph replication with servers (in-graph has no per-worker pull to pack, one process
  without servers no transfer). Only the transport changes, not the update (the same bytes in fewer tensors).
- steps in flight: 1 (`AUTO_STEPS_IN_FLIGHT`). 2 in flight are correct in async between-graph runs without staged
  variables (each step claims its global step, `train.step_claim`: a run ends exactly at max_steps, dealt data
  stays exactly-once) and were ~1.3x the steps/s on criteo 1 ps + 1 worker, but cost 0.005-0.007 AUC at 400 steps
  (interleaved pairs, seed 1), and the issue asks for no AUC loss at a fixed step count: `--set concurrent_steps=2`.

Pure: no TensorFlow, no I/O.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from psworker.spec.fieldtypes import AUTO

AUTO_STEPS_IN_FLIGHT = 1   # 2 measured faster but lower AUC at the same steps (issue 37)


@dataclass(frozen=True)
class FastPath:
    """What a run uses: packed transfers or not, the steps in flight per worker, and why (one phrase each)."""

    pack: bool
    steps_in_flight: int
    pack_reason: str
    steps_reason: str

    def lines(self) -> tuple[str, str]:
        """The two lines `psworker plan` prints."""
        path = "packed (one pull and one push per ps for the small variables and the table rows)" if self.pack else \
            "one transfer per variable (unpacked)"
        return (f"transfers: {path}: {self.pack_reason}",
                f"steps in flight per worker: {self.steps_in_flight}: {self.steps_reason}")


def _pack(config, servers: bool) -> tuple[bool, str]:
    if config.pack_transfers != AUTO:
        return bool(config.pack_transfers), f"pack_transfers {str(bool(config.pack_transfers)).lower()} was given"
    if config.replication == "in-graph":
        return False, "auto: in-graph replication pulls no per-worker copy to pack"
    if not servers:
        return False, "auto: one process without servers has no transfer to pack"
    return True, "auto: between-graph replication (--set pack_transfers=false turns it off)"


def _steps(config) -> tuple[int, str]:
    if config.concurrent_steps != AUTO:
        return int(config.concurrent_steps), f"concurrent_steps {config.concurrent_steps} was given"
    if config.replication == "in-graph":
        return 1, "auto: in-graph replication runs one step at a time"
    if config.mode == "sync":
        return 1, "auto: a sync step waits for the other workers' gradients"
    if config.staged_vars:
        return 1, "auto: staged variables hold one step's values"
    return AUTO_STEPS_IN_FLIGHT, ("auto: async between-graph: 2 in flight cost 0.006 AUC on criteo at 400 steps "
                                  "(issue 37); --set concurrent_steps=2 for ~1.3x the steps/s, ending exactly at "
                                  "max_steps")


def fast_path(config, servers: bool = True) -> FastPath:
    """The transfer path and steps in flight of `config` (a `TrainConfig`), each with its reason; `servers`: False
    for a graph built in one process without a cluster (`build_train_graph(cluster=None)`)."""
    pack, pack_reason = _pack(config, servers)
    steps, steps_reason = _steps(config)
    return FastPath(pack, steps, pack_reason, steps_reason)


def resolve(config):
    """`config` with `pack_transfers` and `concurrent_steps` values, `auto` decided by `fast_path`."""
    if AUTO not in (config.pack_transfers, config.concurrent_steps):
        return config
    path = fast_path(config)
    return dataclasses.replace(config, pack_transfers=path.pack, concurrent_steps=path.steps_in_flight)


__all__ = ["FastPath", "fast_path", "resolve", "AUTO_STEPS_IN_FLIGHT"]
