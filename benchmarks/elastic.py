"""Throughput of one elastic run per phase (issue 18): the MLP on digits, async, scaled 1 -> 2 -> 4 workers.

Not a test: run it by hand, e.g.

    python benchmarks/elastic.py --phase_secs 20 --repeat 3

Each repeat is one `psworker local` run of an elastic spec (1 ps; workers min 1, start 1, max 4) that is scaled
with `psworker scale` once the current phase has been measured. A phase starts when its last joining worker's
`psworker: worker:N joined at global step S` line appears on the console, plus --settle_secs, and lasts
--phase_secs; its rate is the rise of the largest global step seen in the workers' step lines (each timestamped as
read) between the window's first and last line, divided by the time between them. The run is then ended with
SIGINT. Printed: one table row per phase (median over the repeats, and each repeat's value), the speed-up against
1 worker, then a JSON line of every sample.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from psworker import events  # noqa: E402

PHASES = (1, 2, 4)
# quick: the position-logging model, whose step sleeps 20 ms (psworker/models/positions.py): the workers that train
# while a joiner imports TensorFlow cost little CPU (the MLP trains flat out, ~60 CPU-s on a loaded machine)
QUICK = {"repeat": 1, "phase_secs": 1.0, "settle_secs": 0.5, "log_every_steps": 10, "phases": (1, 2),
         "model": "positions"}
QUICK_ENV = {"PSWORKER_MODELS": "psworker.models.positions", "PSWORKER_POSITIONS_STEP_SECS": "0.02"}
JOINED = re.compile(r"^psworker: worker:(\d+) joined at global step \d+$")


def is_step(line: str) -> bool:
    """A worker's step line on the console."""
    found = events.parse_step(line)
    return found is not None and found.task is not None


class Console:
    """`psworker local`'s console, read in a thread: (time.monotonic(), line) pairs."""

    def __init__(self, argv: list[str], cwd: Path) -> None:
        self.proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def wait_for(self, pattern: re.Pattern | Callable[[str], bool], count: int, timeout: float) -> float:
        """The time of the `count`-th line matching `pattern` (a regex or a test); fails after `timeout` s or if the
        run ends."""
        found = pattern if callable(pattern) else pattern.search
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hits = [t for t, line in list(self.lines) if found(line)]
            if len(hits) >= count:
                return hits[count - 1]
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        tail = "\n".join(line for _, line in self.lines[-30:])
        raise SystemExit(f"no {count} x {getattr(pattern, 'pattern', 'step line')!r} within {timeout:g} s:\n{tail}")

    def steps_until(self, end: float) -> list[tuple[float, int]]:
        """(time, global step) of every step line read by `end`."""
        return [(t, r.step.step) for t, line in list(self.lines) if t <= end for r in [events.parse_step(line)]
                if r is not None and r.task is not None]

    def end(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._thread.join(10)


def write_spec(path: Path, args: argparse.Namespace) -> Path:
    doc = {"cluster": {"ps": ["127.0.0.1:auto"],
                       "worker": {"addresses": ["127.0.0.1:auto"] * max(args.phases), "min": 1,
                                  "start": args.phases[0]}},
           "train": {"model": args.model, "mode": "async", "batch_size": args.batch_size, "max_steps": 10 ** 9,
                     "log_every_steps": args.log_every_steps}}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def rate(samples: list[tuple[float, int]], start: float) -> Optional[float]:
    """Global steps per second from `start` to the last step line: the rise of the largest step seen (each worker's
    lines lag the global step by up to log_every_steps), between the first and the last line in the window."""
    best, inside = 0, []
    for t, step in samples:
        best = max(best, step)
        if t >= start:
            inside.append((t, best))
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return None
    return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


def phase_rate(run: Console, start: float, args: argparse.Namespace) -> float:
    """The rate from `start` over --phase_secs, or longer until two step lines fall in it (a loaded machine's
    workers may print fewer): a quick run's figure is never missing for want of lines."""
    time.sleep(max(0.0, start + args.phase_secs - time.monotonic()))
    end, deadline = start + args.phase_secs, start + args.timeout_secs
    while (found := rate(run.steps_until(end), start)) is None:
        if time.monotonic() > deadline or run.proc.poll() is not None:
            raise SystemExit(f"fewer than two step lines within {args.timeout_secs:g} s of the phase's start")
        time.sleep(0.1)
        end = time.monotonic()
    return found


def one_run(args: argparse.Namespace, workdir: Path) -> dict[int, float]:
    """One run scaled through PHASES; returns global steps/s per worker count."""
    train_dir = workdir / "train"
    run = Console([sys.executable, "-m", "psworker", "local", str(write_spec(workdir / "elastic.yaml", args)),
                   "--train_dir", str(train_dir)], workdir)
    rates: dict[int, float] = {}
    try:
        begin = run.wait_for(is_step, 1, args.timeout_secs)
        joined = 0
        for n, workers in enumerate(args.phases):
            if n:
                done = subprocess.run([sys.executable, "-m", "psworker", "scale", str(train_dir), "--workers",
                                       str(workers)], capture_output=True, text=True, timeout=120)
                print(f"  {done.stdout.strip() or done.stderr.strip()}", flush=True)
                joined += workers - args.phases[n - 1]
                begin = run.wait_for(JOINED, joined, args.timeout_secs)
            rates[workers] = phase_rate(run, begin + args.settle_secs, args)
            print(f"  {workers} worker(s): {rates[workers]:.1f} global steps/s", flush=True)
    finally:
        run.end()
    return rates


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--phase_secs", type=float, default=20.0)
    p.add_argument("--settle_secs", type=float, default=3.0, help="after a phase's last join, before measuring")
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--log_every_steps", type=int, default=50)
    p.add_argument("--timeout_secs", type=float, default=300.0)
    p.add_argument("--model", default="mlp")
    p.add_argument("--quick", action="store_true", help=f"seconds, for tests/test_benchmarks.py: {QUICK}")
    args = p.parse_args()
    args.phases = PHASES
    if args.quick:
        vars(args).update(QUICK)
        os.environ.update(QUICK_ENV)
    samples: dict[int, list[float]] = {w: [] for w in args.phases}
    for r in range(args.repeat):
        print(f"repeat {r + 1}/{args.repeat}", flush=True)
        with tempfile.TemporaryDirectory(prefix="psworker-elastic-") as tmp:
            for workers, value in one_run(args, Path(tmp)).items():
                if value is not None:
                    samples[workers].append(value)
    base = statistics.median(samples[1]) if samples[1] else None
    print(f"\n| workers | global steps/s (median of {args.repeat}) | x 1 worker | each repeat |")
    print("|---|---|---|---|")
    for workers in args.phases:
        values = samples[workers]
        med = statistics.median(values) if values else None
        print(f"| {workers} | {med or 0:.1f} | {med / base if med and base else 0:.2f} | "
              f"{', '.join(f'{v:.1f}' for v in values)} |")
    print(json.dumps({"samples": samples, "phase_secs": args.phase_secs, "batch_size": args.batch_size}))


if __name__ == "__main__":
    main()
