"""Straggler benchmark: sync training with one backup worker (3 workers, 2 gradients per step), with and without
one worker frozen by `--inject stop:worker:2@step=S,for=SECS` (SIGSTOP, then SIGCONT).

Training time is measured from the launcher's console: from the first step line to the last one (start-up and
shutdown are the same in both runs and left out). The straggler's share is 1/3 of the workers, so a backup worker
doing its job keeps the ratio (with / without the straggler) at or below 1 / (1 - 1/3) = 1.5.

Prints one line per run, then as its LAST line one JSON object (keys: baseline_s, straggler_s, ratio, bound).

    python benchmarks/straggler.py [--max_steps 1000] [--stop_at 200] [--stop_secs 10] [--workers 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from psworker import events  # noqa: E402
from psworker.testing import write_spec  # noqa: E402



def _task_env() -> dict[str, str]:
    """This checkout first on PYTHONPATH, unbuffered output."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env

def training_secs(spec: Path, train_dir: Path, inject: list[str], timeout: float) -> tuple[float, int]:
    """Runs `psworker local` and returns (seconds from the first step line to the last, last step seen)."""
    argv = [sys.executable, "-m", "psworker", "local", str(spec), "--train_dir", str(train_dir), "--console", "plain",
            *[a for fault in inject for a in ("--inject", fault)]]
    proc = subprocess.Popen(argv, env=_task_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    first = last = None
    step = 0
    deadline = time.monotonic() + timeout
    try:
        for line in proc.stdout:
            m = events.parse_step(line)
            if m is not None and m.task is not None:
                now = time.monotonic()
                first = first or now
                last, step = now, max(step, m.step.step)
            if time.monotonic() > deadline:
                raise TimeoutError(f"straggler run not done after {timeout} s")
        if proc.wait(timeout=60) != 0:
            raise RuntimeError(f"psworker local exited {proc.returncode}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    if first is None:
        raise RuntimeError("no step lines")
    return last - first, step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max_steps", type=int, default=1000)
    parser.add_argument("--stop_at", type=int, default=200)
    parser.add_argument("--stop_secs", type=float, default=10.0)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--log_every_steps", type=int, default=20)
    parser.add_argument("--workers", type=int, default=3, help="sync workers; each step aggregates all but one")
    parser.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                        help="also the run without the straggler (default: yes)")
    parser.add_argument("--quick", action="store_true", help="2 workers (1 backup), 40 steps, worker:1 stopped 1 s "
                                                             "at step 10, no baseline (tests/test_benchmarks.py)")
    args = parser.parse_args()
    if args.quick:
        args.workers, args.max_steps, args.stop_at, args.stop_secs, args.log_every_steps = 2, 40, 10, 1.0, 5
        args.baseline = False
    with tempfile.TemporaryDirectory() as tmp:
        spec = write_spec(Path(tmp) / "cluster.yaml", num_workers=args.workers, mode="sync",
                          replicas_to_aggregate=args.workers - 1,
                          max_steps=args.max_steps, batch_size=32,
                          log_every_steps=args.log_every_steps, save_checkpoint_steps=100000)
        base = None
        if args.baseline:
            base, base_step = training_secs(spec, Path(tmp) / "base", [], args.timeout)
            print(f"baseline: {base:.1f} s of training to step {base_step}", flush=True)
        fault = f"stop:worker:{args.workers - 1}@step={args.stop_at},for={args.stop_secs:g}"
        slow, slow_step = training_secs(spec, Path(tmp) / "straggler", [fault], args.timeout)
        print(f"with {fault}: {slow:.1f} s of training to step {slow_step}", flush=True)
    print(json.dumps({"baseline_s": base and round(base, 2), "straggler_s": round(slow, 2),
                      "ratio": base and round(slow / base, 3), "bound": round(args.workers / (args.workers - 1), 3),
                      "fault": fault}))

if __name__ == "__main__":
    main()
