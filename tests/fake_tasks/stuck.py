"""Fake task stuck in `wait_for_the_ps` (called from `train`), with a helper thread: dumps its stacks on SIGUSR1
as psworker's tasks do (unless --no-handler: a user's program), prints `step 0` and "ready", then blocks until
killed. --steps N prints N step lines first (a worker that trained, then stalled)."""
import argparse
import sys
import threading

from psworker import stackdump

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=1)
parser.add_argument("--no-handler", action="store_true")
args = parser.parse_args()
if not args.no_handler:
    stackdump.dump_on_signal(sys.stderr)
never = threading.Event()


def heartbeat() -> None:
    never.wait()


def wait_for_the_ps() -> None:
    never.wait()


def train() -> None:
    for step in range(args.steps):
        print(f"step {step}, loss = 1.00", flush=True)
    print("ready", flush=True)
    wait_for_the_ps()


threading.Thread(target=heartbeat, name="heartbeat", daemon=True).start()
train()
