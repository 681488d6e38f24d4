"""Fake worker: prints `step N, loss = ...` lines every STEP steps up to --to, then exits 0.

--state FILE keeps the last step so that a restarted attempt resumes from it; --hang-at K stops printing at step
K (once per state file) and sleeps until killed: a stalled worker, or one that an injected fault due at step K
is sure to find running. --pause-at K waits after step K for a SIGCONT (the launcher resuming an injected stop),
prints "resumed after step K" and goes on.
"""
import argparse
import os
import signal
import sys
import time
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--to", type=int, default=100)
parser.add_argument("--step", type=int, default=10)
parser.add_argument("--every", type=float, default=0.05)
parser.add_argument("--state")
parser.add_argument("--hang-at", type=int)
parser.add_argument("--pause-at", type=int)
args = parser.parse_args()
continued = []
signal.signal(signal.SIGCONT, lambda *_: continued.append(True))
state = Path(args.state) if args.state else None
step = int(state.read_text()) if state and state.exists() else 0


def wait_for_sigcont(secs: float = 120.0) -> None:
    deadline = time.monotonic() + secs
    while not continued:
        if time.monotonic() > deadline:
            sys.exit(f"no SIGCONT within {secs:g} s after step {step}")
        time.sleep(0.02)
    print(f"resumed after step {step}", flush=True)


while step <= args.to:
    print(f"step {step}, loss = 1.50 (640.0 examples/sec; 0.050 sec/batch)", flush=True)
    if state:                      # atomically: the launcher may SIGKILL this process at any moment
        state.with_suffix(".tmp").write_text(str(step))
        os.replace(state.with_suffix(".tmp"), state)
    hung = state.with_suffix(".hung") if state else None
    if args.hang_at is not None and step >= args.hang_at and hung and not hung.exists():
        hung.write_text("")
        time.sleep(3600)
    if args.pause_at is not None and step == args.pause_at:
        wait_for_sigcont()
    step += args.step
    time.sleep(args.every)
