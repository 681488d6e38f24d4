"""Fake elastic worker: prints `step N, ...` lines every --every s up to --to, then exits 0. As psworker's
workers in an elastic job: SIGUSR2 (scaled away) ends it with exit 0 after its current step, SIGTERM (preempted)
with 171. --go FILE: it waits for FILE before its steps past --hold; --until FILE: it is done once FILE exists (a
test then decides when the run finishes).
"""
import argparse
import signal
import sys
import time
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--to", type=int, default=100)
parser.add_argument("--every", type=float, default=0.05)
parser.add_argument("--go")
parser.add_argument("--hold", type=int, default=0)
parser.add_argument("--until")
args = parser.parse_args()
asked = []
signal.signal(signal.SIGUSR2, lambda *_: asked.append(0))
signal.signal(signal.SIGTERM, lambda *_: asked.append(171))
step = 0
while step <= args.to:
    if asked:
        print(f"leaving after step {step} (exit {asked[0]})", flush=True)
        sys.exit(asked[0])
    if args.until and Path(args.until).exists():
        break
    if args.go and step >= args.hold and not Path(args.go).exists():
        time.sleep(0.02)
        continue
    print(f"step {step}, loss = 1.50 (640.0 examples/sec; 0.050 sec/batch)", flush=True)
    step += 1
    time.sleep(args.every)
print(f"done at global step {step}", flush=True)
