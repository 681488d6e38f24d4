"""Sync throughput with one backup worker (3 workers, 2 gradients per step, dealt shards): this checkout against
another (`--base`, e.g. `git archive <commit> | tar -x -C /tmp/base`), runs interleaved, medians compared.

Training time is from the launcher's first step line to its last (`straggler.training_secs`: start-up and shutdown
left out). Prints one line per run, then as its LAST line one JSON object (keys: base_s, new_s, ratio, runs).

    python benchmarks/sync_backup.py --base /tmp/base [--runs 5] [--max_steps 600] [--model mlp]
    python benchmarks/sync_backup.py --quick     # one run each of 40 steps, this checkout against itself (a test)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import straggler  # noqa: E402
from psworker.testing import write_spec  # noqa: E402


def run_secs(repo: Path, spec: Path, train_dir: Path, timeout: float) -> tuple[float, int]:
    """`psworker local` of `repo`'s code on `spec`: seconds from the first step line to the last, and the last
    global step seen."""
    saved = straggler.REPO
    straggler.REPO = repo   # `_task_env` puts it first on PYTHONPATH
    try:
        return straggler.training_secs(spec, train_dir, [], timeout)
    finally:
        straggler.REPO = saved


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", type=Path, help="the other checkout (default: this one, a self-check)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--max_steps", type=int, default=600)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--quick", action="store_true", help="1 run each of 40 steps (the suite's check)")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.max_steps = 1, 40
    base_repo = (args.base or REPO).resolve()
    times: dict[str, list[float]] = {"base": [], "new": []}
    with tempfile.TemporaryDirectory() as tmp:
        spec = write_spec(Path(tmp) / "cluster.yaml", num_workers=3, mode="sync", replicas_to_aggregate=2,
                          model=args.model, max_steps=args.max_steps, batch_size=32,
                          log_every_steps=5 if args.quick else 20,
                          save_checkpoint_steps=100000)
        for i in range(args.runs):
            for name, repo in (("base", base_repo), ("new", REPO)) if i % 2 == 0 else \
                    (("new", REPO), ("base", base_repo)):
                secs, step = run_secs(repo, spec, Path(tmp) / f"{name}{i}", args.timeout)
                times[name].append(secs)
                rate = f"{args.max_steps / secs:.1f} steps/s" if secs > 0 else "steps/s unmeasured: one burst of lines"
                print(f"run {i} {name}: {secs:.2f} s of training to step {step} ({rate})", flush=True)
    base, new = statistics.median(times["base"]), statistics.median(times["new"])
    print(json.dumps({"base_s": round(base, 2), "new_s": round(new, 2), "ratio": round(new / base, 3) if base > 0 else None,
                      "runs": times, "cpus": os.cpu_count()}))


if __name__ == "__main__":
    main()
