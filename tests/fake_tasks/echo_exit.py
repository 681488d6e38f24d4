"""Fake task: prints LINES lines ("<tag> line i"), optionally sleeps or waits for a file, then exits with CODE.

--wait-for PATH is a handshake: the task exits only once the test has created PATH (the test decides the order
of exits instead of a sleep racing the other tasks' start-up); after --wait-secs without it, it exits 99.
"""
import argparse
import os
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("code", type=int)
parser.add_argument("--lines", type=int, default=3)
parser.add_argument("--tag", default="out")
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--wait-for", metavar="PATH", help="exit only once PATH exists")
parser.add_argument("--wait-secs", type=float, default=120.0)
parser.add_argument("--stderr", action="store_true", help="also print one line to stderr")
parser.add_argument("--print-env", metavar="NAME", help="also print NAME=<value of that variable>")
args = parser.parse_args()
if args.print_env:
    print(f"{args.print_env}={os.environ.get(args.print_env)}", flush=True)
for i in range(args.lines):
    print(f"{args.tag} line {i}", flush=True)
if args.stderr:
    print(f"{args.tag} to stderr", file=sys.stderr, flush=True)
time.sleep(args.sleep)
if args.wait_for:
    deadline = time.monotonic() + args.wait_secs
    while not os.path.exists(args.wait_for):
        if time.monotonic() > deadline:
            sys.exit(f"{args.tag}: {args.wait_for} did not appear within {args.wait_secs:g} s")   # exit code 1
        time.sleep(0.02)
sys.exit(args.code)
