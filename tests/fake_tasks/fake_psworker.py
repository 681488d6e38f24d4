"""Fake `python -m psworker ps|worker --spec PATH --task_index N` for local-backend tests.

Reads the spec it is given and prints its address and train_dir, then "ready". A ps prints its memory cgroup
(`ps:0 memory cgroup PATH`), holds PSWORKER_FAKE_PS_ALLOC_MB MiB (every page written: charged to that cgroup),
touches PSWORKER_FAKE_PS_TOUCH/ps-<index> (if set) and serves until stopped (or exits after PSWORKER_FAKE_PS_SECS
seconds); a worker prints a few steps and exits with the code given in PSWORKER_FAKE_EXIT (e.g. "worker:1=3"), 0 by
default, after PSWORKER_FAKE_WORKER_SECS seconds and, with PSWORKER_FAKE_WORKER_WAIT_FOR=PATH[:PATH...], once
they exist (a test's handshake; exit 1 after 120 s without them).
"""
import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root: psworker

from psworker.spec import load_spec  # noqa: E402

argv = sys.argv[1:]
if argv[:2] != ["-m", "psworker"]:
    sys.exit(f"fake_psworker: expected '-m psworker ...', got {argv}")
parser = argparse.ArgumentParser()
parser.add_argument("job", choices=["ps", "worker"])
parser.add_argument("--spec", required=True)
parser.add_argument("--task_index", type=int, required=True)
args = parser.parse_args(argv[2:])

spec = load_spec(args.spec)
name = f"{args.job}:{args.task_index}"
print(f"{name} address {spec.addresses(args.job)[args.task_index]}")
print(f"{name} train_dir {spec.train.train_dir}")
print("ready", flush=True)
if args.job == "ps":
    cgroups = Path("/proc/self/cgroup").read_text().splitlines() if Path("/proc/self/cgroup").exists() else []
    memory = [line.split(":", 2)[2] for line in cgroups if "memory" in line.split(":", 2)[1].split(",")]
    print(f"{name} memory cgroup {memory[0] if memory else '?'}", flush=True)
    held = bytearray(int(float(os.environ.get("PSWORKER_FAKE_PS_ALLOC_MB", "0")) * 2 ** 20))
    held[::4096] = b"\x01" * len(range(0, len(held), 4096))
    print(f"{name} holds {len(held)} bytes", flush=True)
    if os.environ.get("PSWORKER_FAKE_PS_TOUCH"):       # a handshake: the workers may go on
        (Path(os.environ["PSWORKER_FAKE_PS_TOUCH"]) / f"ps-{args.task_index}").touch()
    deadline = time.monotonic() + float(os.environ.get("PSWORKER_FAKE_PS_SECS", "inf"))
    while time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit(0)
time.sleep(float(os.environ.get("PSWORKER_FAKE_WORKER_SECS", "0")))
wait_for = [p for p in os.environ.get("PSWORKER_FAKE_WORKER_WAIT_FOR", "").split(os.pathsep) if p]
deadline = time.monotonic() + 120
while wait_for and not all(os.path.exists(p) for p in wait_for):
    if time.monotonic() > deadline:
        sys.exit(f"{name}: {wait_for} did not appear within 120 s")
    time.sleep(0.02)
for step in range(25):
    print(f"{name} step {step}")
codes = dict(item.split("=") for item in os.environ.get("PSWORKER_FAKE_EXIT", "").split(",") if item)
sys.exit(int(codes.get(name, 0)))
