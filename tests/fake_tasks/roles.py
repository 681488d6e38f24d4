"""Fake task of a `psworker run` script, by role (`roles.py JOB INDEX`): the ps serves until stopped (a classic
`server.join()`); worker 0 (the chief) prints a step line and exits 0; every other worker never ends (a classic
non-chief stuck creating its session) or, with --others-wait-for PATH, exits 0 once PATH exists (a test's
handshake; 99 after --wait-secs without it).
"""
import argparse
import os
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("job")
parser.add_argument("index", type=int)
parser.add_argument("--others-wait-for", metavar="PATH")
parser.add_argument("--wait-secs", type=float, default=120.0)
args = parser.parse_args()
name = f"{args.job}:{args.index}"
print(f"{name} started", flush=True)
if args.job == "worker" and args.index == 0:
    print("step 10, loss = 0.50", flush=True)
    print(f"{name} done", flush=True)
    sys.exit(0)
if args.job == "ps" or not args.others_wait_for:
    while True:
        time.sleep(1)
deadline = time.monotonic() + args.wait_secs
while not os.path.exists(args.others_wait_for):
    if time.monotonic() > deadline:
        print(f"{name}: {args.others_wait_for} did not appear within {args.wait_secs:g} s", flush=True)
        sys.exit(99)
    time.sleep(0.02)
print(f"{name} done", flush=True)
