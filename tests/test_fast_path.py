"""The fast path by default (issue 37): `auto` packs between-graph transfers and keeps 1 step in flight (2 cost AUC);
explicit values win; `psworker plan` says which and why."""

from __future__ import annotations

import subprocess
import sys

import pytest

from psworker.errors import SpecError
from psworker.spec.fast_path import fast_path, resolve
from psworker.spec import TrainConfig, merge_train
from tests.cluster_utils import REPO, task_env


@pytest.mark.parametrize("given, pack, steps", [
    ({}, True, 1),
    ({"mode": "sync"}, True, 1),
    ({"staged_vars": "true"}, True, 1),
    ({"replication": "in-graph"}, False, 1),
    ({"concurrent_steps": "1", "pack_transfers": "false"}, False, 1),
    ({"concurrent_steps": "3"}, True, 3),
])
def test_auto_follows_the_rule_and_explicit_values_win(given, pack, steps):
    config = merge_train(TrainConfig(), given)
    path = fast_path(config)
    assert (path.pack, path.steps_in_flight) == (pack, steps)
    resolved = resolve(config)
    assert (resolved.pack_transfers, resolved.concurrent_steps) == (pack, steps)
    assert resolve(resolved) == resolved


def test_auto_packs_nothing_in_one_process_without_servers_but_an_explicit_true_does():
    assert not fast_path(TrainConfig(), servers=False).pack
    assert "without servers" in fast_path(TrainConfig(), servers=False).pack_reason
    assert fast_path(TrainConfig(pack_transfers=True), servers=False).pack


def test_auto_is_a_value_of_both_flags_and_bad_values_are_refused():
    assert merge_train(TrainConfig(concurrent_steps=1), {"concurrent_steps": "AUTO"}).concurrent_steps == "auto"
    assert merge_train(TrainConfig(pack_transfers=True), {"pack_transfers": "auto"}).pack_transfers == "auto"
    with pytest.raises(SpecError, match=r"--concurrent_steps: expected an integer or 'auto'"):
        merge_train(TrainConfig(), {"concurrent_steps": "two"})
    with pytest.raises(SpecError, match=r"--pack_transfers: expected true, false or auto"):
        merge_train(TrainConfig(), {"pack_transfers": "maybe"})
    with pytest.raises(SpecError, match=r"--pack_transfers: pack_transfers is for between-graph"):
        merge_train(TrainConfig(replication="in-graph"), {"pack_transfers": "true"})


def test_plan_prints_the_transfer_path_and_the_steps_in_flight_with_why():
    for spec, steps, why in (("local.yaml", 1, "auto: async between-graph: 2 in flight cost"),
                             ("local-sync.yaml", 1, "auto: a sync step waits")):
        done = subprocess.run([sys.executable, "-m", "psworker", "plan", str(REPO / "cluster_specs" / spec)],
                              env=task_env(), capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        lines = done.stdout.splitlines()
        assert lines[1].startswith("transfers: packed (one pull and one push per ps"), lines[:3]
        assert lines[2].startswith(f"steps in flight per worker: {steps}: {why}"), lines[:3]
