"""Training flags are merged into the spec in one place (`plan.with_train`, issue 26 §4): every command that takes
them (the launchers, a task, Kubernetes manifests, a Slurm submission) applies and refuses them alike, before
anything starts. In-process `psworker` commands that stop at the merge."""

from __future__ import annotations

import pytest

from psworker import cli
from psworker.errors import SpecError
from psworker.spec.plan import with_train
from psworker.spec import CountSpec, parse_spec

FIXED = 'cluster:\n  ps: ["127.0.0.1:2221"]\n  worker: ["127.0.0.1:2222", "127.0.0.1:2223"]\n'
ELASTIC = ('cluster:\n  ps: ["127.0.0.1:2221"]\n  worker: {addresses: ["127.0.0.1:2222", "127.0.0.1:2223", '
           '"127.0.0.1:2224"], min: 1, start: 2}\n')


def _commands(spec: str, run_dir: str) -> dict[str, list[str]]:
    return {"local": ["local", spec], "ssh": ["ssh", spec], "slurm launch": ["slurm", "launch", spec],
            "slurm submit": ["slurm", "submit", spec, "--dry_run", "--run_dir", run_dir],
            "k8s manifest": ["k8s", "manifest", spec, "--image", "psworker:test"],
            "worker": ["worker", "--spec", spec, "--task_index", "1"]}


@pytest.mark.parametrize("spec_text, flags, error", [
    (FIXED, ["--mode", "sync", "--replicas_to_aggregate", "3"],
     "psworker: error: --flags: --replicas_to_aggregate: 3 is not between 1 and the number of workers (2)"),
    (ELASTIC, ["--mode", "sync"],
     "psworker: error: --flags: cluster.worker.min: in sync mode"),
], ids=["replicas-over-workers", "elastic-sync"])
def test_every_command_refuses_the_same_flags_with_the_same_error(tmp_path, capsys, spec_text, flags, error):
    spec = tmp_path / "c.yaml"
    spec.write_text(spec_text)
    said = {}
    for name, argv in _commands(str(spec), str(tmp_path / "run")).items():
        assert cli.main([*argv, *flags]) == 2, name
        out = capsys.readouterr()
        said[name] = [line for line in (out.err + out.out).splitlines() if line.startswith("psworker: error:")]
    assert len({tuple(lines) for lines in said.values()}) == 1, said
    assert said["worker"][0].startswith(error), said
    assert not (tmp_path / "run" / "psworker.sbatch").exists()      # refused before anything is written


def test_flags_reach_both_kinds_of_spec_and_a_count_spec_counts_its_workers():
    fixed = parse_spec(FIXED, "c.yaml")
    merged = with_train(fixed, {"max_steps": "7", "mode": "sync", "replicas_to_aggregate": "2", "model": None})
    assert (merged.train.max_steps, merged.train.mode, merged.train.replicas_to_aggregate) == (7, "sync", 2)
    assert merged.worker == fixed.worker and merged.train.model == fixed.train.model
    counts = parse_spec("cluster: {ps: 1, worker: 3}\n", "n.yaml", allow_counts=True)
    assert isinstance(counts, CountSpec)
    assert with_train(counts, {"mode": "sync", "replicas_to_aggregate": "3"}).train.replicas_to_aggregate == 3
    with pytest.raises(SpecError, match="replicas_to_aggregate"):
        with_train(counts, {"mode": "sync", "replicas_to_aggregate": "4"})
