"""Fake task of a large cluster: prints the start-up lines every task prints, each with its own name, address and
pid, then a step line (the same in every task, as in sync training), and exits 0.

--ready DIR and --go PATH are a barrier: the task writes DIR/<job>-<index> and prints only once the test has
created PATH (so that every task prints at the same moment). --hold PATH: after printing, exit only once PATH
exists. A wait that ends without its file exits 1 after --wait-secs.
"""
import argparse
import os
import sys
import time
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("job")
parser.add_argument("index", type=int)
parser.add_argument("address")
parser.add_argument("--ready", metavar="DIR")
parser.add_argument("--go", metavar="PATH")
parser.add_argument("--hold", metavar="PATH")
parser.add_argument("--wait-secs", type=float, default=120.0)
args = parser.parse_args()
name = f"{args.job}:{args.index}"


def wait_for(path: str) -> None:
    deadline = time.monotonic() + args.wait_secs
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            sys.exit(f"{name}: {path} did not appear within {args.wait_secs:g} s")
        time.sleep(0.01)


if args.ready:
    Path(args.ready, f"{args.job}-{args.index}").write_text("")
if args.go:
    wait_for(args.go)
print("towers: 1 on /cpu:0 (no GPU visible)\n"
      f"{name} serving at grpc://{args.address} (pid {os.getpid()})\n"
      f"variables of /job:{args.job}/replica:0/task:{args.index} on /job:ps/replica:0/task:0\n"
      "waiting for the chief's model on the ps tasks\n"
      "step 100, loss = 0.50 (100.0 examples/sec; 0.010 sec/batch)", flush=True)
if args.hold:
    wait_for(args.hold)
