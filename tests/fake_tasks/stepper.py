"""Fake worker: prints `step N, loss = ...` lines every STEP steps up to --to, then exits 0.

--state FILE keeps the last step so that a restarted attempt resumes from it; --hang-at K stops printing at step
K (once per state file) and sleeps forever: a stalled worker.
"""
import argparse
import os
import time
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--to", type=int, default=100)
parser.add_argument("--step", type=int, default=10)
parser.add_argument("--every", type=float, default=0.05)
parser.add_argument("--state")
parser.add_argument("--hang-at", type=int)
args = parser.parse_args()
state = Path(args.state) if args.state else None
step = int(state.read_text()) if state and state.exists() else 0
while step <= args.to:
    print(f"step {step}, loss = 1.50 (640.0 examples/sec; 0.050 sec/batch)", flush=True)
    if state:                      # atomically: the launcher may SIGKILL this process at any moment
        state.with_suffix(".tmp").write_text(str(step))
        os.replace(state.with_suffix(".tmp"), state)
    hung = state.with_suffix(".hung") if state else None
    if args.hang_at is not None and step >= args.hang_at and hung and not hung.exists():
        hung.write_text("")
        time.sleep(3600)
    step += args.step
    time.sleep(args.every)
