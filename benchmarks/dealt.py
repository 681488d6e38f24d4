"""Dealt shards against static slices: global steps/s of 1 ps + 2 workers (async), the two interleaved round by
round so that the machine's load falls on both alike (issue 25: dealing costs a side-session call per shard and two
scalar updates on the ps per step).

Steps/s is measured from the launcher's console: the global steps between the first and the last step line over
the seconds between them (start-up and shutdown left out). Prints one line per run, then as its LAST line one JSON
object: per setting the median steps/s, and dealt / static.

    python benchmarks/dealt.py [--model mlp|cifar10] [--data_dir D] [--max_steps 1500] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from psworker.testing import write_spec  # noqa: E402

STEP = re.compile(r"^\[worker:\d+\] step (\d+), loss")
SETTINGS = ("static", "dealt")


def _task_env() -> dict[str, str]:
    """This checkout first on PYTHONPATH, unbuffered output."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def steps_per_sec(spec: Path, train_dir: Path, dealing: str, timeout: float) -> float:
    """Runs `psworker local` with `--data_dealing dealing`; global steps per second between the step lines."""
    argv = [sys.executable, "-m", "psworker", "local", str(spec), "--train_dir", str(train_dir), "--no_live",
            "--data_dealing", dealing]
    proc = subprocess.Popen(argv, env=_task_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    seen: list[tuple[float, int]] = []
    deadline = time.monotonic() + timeout
    try:
        for line in proc.stdout:
            m = STEP.match(line)
            if m:
                seen.append((time.monotonic(), int(m.group(1))))
            if time.monotonic() > deadline:
                raise TimeoutError(f"run not done after {timeout} s")
        if proc.wait(timeout=60) != 0:
            raise RuntimeError(f"psworker local exited {proc.returncode}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    (t0, s0), (t1, s1) = min(seen), max(seen)
    return (s1 - s0) / (t1 - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--data_dir")
    parser.add_argument("--max_steps", type=int, default=1500)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    results: dict[str, list[float]] = {s: [] for s in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        train = {"model": args.model, "max_steps": args.max_steps, "batch_size": args.batch_size,
                 "log_every_steps": 50, "save_checkpoint_secs": 600.0}
        if args.data_dir:
            train["data_dir"] = args.data_dir
        for r in range(args.rounds):
            for setting in SETTINGS if r % 2 == 0 else SETTINGS[::-1]:
                spec = write_spec(Path(tmp) / f"{setting}{r}.yaml", num_ps=1, num_workers=2, **train)
                rate = steps_per_sec(spec, Path(tmp) / f"train-{setting}{r}", setting, args.timeout)
                results[setting].append(rate)
                print(f"round {r} {setting}: {rate:.1f} global steps/s", flush=True)
    medians = {s: statistics.median(v) for s, v in results.items()}
    print(json.dumps({"model": args.model, "steps_per_sec": medians, "runs": results,
                      "dealt_over_static": medians["dealt"] / medians["static"]}))


if __name__ == "__main__":
    main()
