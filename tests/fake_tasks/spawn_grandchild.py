"""Fake task: starts a grandchild that sleeps forever (optionally ignoring SIGTERM, optionally in its own
session), prints "grandchild <pid>" and "ready", then sleeps until killed."""
import argparse
import subprocess
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--ignore-term", action="store_true")
parser.add_argument("--setsid", action="store_true", help="grandchild leaves the task's process group")
args = parser.parse_args()
code = "import signal, time\n"
if args.ignore_term:
    code += "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
code += "while True: time.sleep(60)\n"
child = subprocess.Popen([sys.executable, "-c", code], start_new_session=args.setsid)
print(f"grandchild {child.pid}", flush=True)
print("ready", flush=True)
while True:
    time.sleep(60)
