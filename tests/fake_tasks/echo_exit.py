"""Fake task: prints LINES lines ("<tag> line i"), optionally sleeps, then exits with CODE."""
import argparse
import os
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("code", type=int)
parser.add_argument("--lines", type=int, default=3)
parser.add_argument("--tag", default="out")
parser.add_argument("--sleep", type=float, default=0.0)
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
sys.exit(args.code)
