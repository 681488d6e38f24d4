"""A straggler's examples, static slices against dealt shards: 1 ps + 2 async workers, worker:1 held to about a
third of worker:0's speed by a SIGSTOP/SIGCONT duty cycle from this script (running `--run_secs` of every
`--period_secs`), on the position-logging model (`psworker.models.positions`). Each run logs every position each
worker trained on; the figure is the max/min ratio of the per-example update counts (issue 25: dealt <= 1.1; static
about the speed ratio, since each worker loops over its own half).

Both runs train the same examples in all: `--epochs` passes over `PSWORKER_POSITIONS_EXAMPLES` (300) positions,
as `num_epochs` (dealt) or as the matching `max_steps` (static slices have no epochs). Prints one line per run,
then as its LAST line one JSON object: per setting the ratio, each worker's steps and the speed ratio seen, and the
load average before and after.

    python benchmarks/dealt_straggler.py [--epochs 10] [--batch_size 10] [--step_secs 0.02] [--rounds 1]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from psworker.models import positions  # noqa: E402
from psworker.testing import LocalCluster  # noqa: E402

SETTINGS = ("static", "dealt")
SLOW = "worker:1"


class DutyCycle:
    """Holds task `name` of `cluster` stopped for all but `run_secs` of every `period_secs`, in a thread, until
    `stop()` (which leaves it running)."""

    def __init__(self, cluster: LocalCluster, name: str, run_secs: float, period_secs: float):
        self._cluster, self._name = cluster, name
        self._run, self._period = run_secs, period_secs
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="duty-cycle", daemon=True)

    def start(self) -> "DutyCycle":
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._done.wait(self._run) and self._signal(signal.SIGSTOP):
            self._done.wait(self._period - self._run)
            self._signal(signal.SIGCONT)

    def _signal(self, sig: int) -> bool:
        """Sends `sig`; False once the task has exited (it ends by itself when training does)."""
        try:
            self._cluster.send_signal(self._name, sig)
            return True
        except RuntimeError:   # "kill_task: worker:1 is not running"
            return False

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=10)
        self._signal(signal.SIGCONT)


def wait_until(check, timeout: float, what: str, cluster: LocalCluster) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} after {timeout:g} s\n{cluster.tails()}")
        time.sleep(0.02)


def one_run(workdir: Path, setting: str, args) -> dict:
    """Trains `args.epochs` passes' worth with `setting`, worker:1 held to a duty cycle from its first step; the
    per-example update counts' max/min, and each worker's steps."""
    folder = workdir / "positions"
    folder.mkdir(parents=True)
    os.environ[positions.POSITIONS_DIR_ENV] = str(folder)
    n = positions.NUM_EXAMPLES
    train = {"model": "positions", "batch_size": args.batch_size, "log_every_steps": 50, "learning_rate": 0.1,
             "data_dealing": setting, "save_checkpoint_secs": 600.0}
    if setting == "dealt":
        train.update(num_epochs=args.epochs, max_steps=10 ** 9, shard_examples=args.shard_examples)
    else:
        train.update(max_steps=args.epochs * n // args.batch_size)
    with LocalCluster(workdir, num_ps=1, num_workers=2, train=train) as cluster:
        wait_until(lambda: any(folder.glob("worker1-*.txt")), args.timeout, "step of worker:1", cluster)
        cycle = DutyCycle(cluster, SLOW, args.run_secs, args.period_secs).start()
        try:
            codes = cluster.wait_exits(args.timeout, ["worker:0"])
        finally:
            cycle.stop()
        codes.update(cluster.wait_exits(args.timeout))
        if set(codes.values()) != {0}:
            raise RuntimeError(f"{setting}: exit codes {codes}\n{cluster.tails()}")
    read = collections.Counter()
    steps = {}
    for task, batches in positions.read_positions(folder).items():
        steps[task] = len(batches)
        for batch in batches:
            read.update(batch)
    counts = [read.get(p, 0) for p in range(n)]
    return {"ratio": max(counts) / max(min(counts), 1e-9), "min": min(counts), "max": max(counts),
            "steps": steps, "speed_ratio": steps.get("worker0", 0) / max(steps.get("worker1", 0), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch_size", type=int, default=10)
    parser.add_argument("--shard_examples", type=int, default=30)
    parser.add_argument("--step_secs", type=float, default=0.02, help="a step's sleep (the model's compute)")
    parser.add_argument("--run_secs", type=float, default=0.1, help="the straggler runs this long ...")
    parser.add_argument("--period_secs", type=float, default=0.3, help="... of every this many seconds")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated: static, dealt")
    parser.add_argument("--quick", action="store_true", help="2 epochs, dealt only (for tests/test_benchmarks.py)")
    args = parser.parse_args()
    if args.quick:
        args.epochs, args.rounds, args.settings = 2, 1, "dealt"
    settings = tuple(s for s in SETTINGS if s in args.settings.split(","))
    os.environ.update({"PSWORKER_MODELS": positions.__name__, positions.STEP_SECS_ENV: str(args.step_secs),
                       "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    load = [os.getloadavg()]
    runs: dict[str, list[dict]] = {s: [] for s in settings}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for setting in settings if r % 2 == 0 else settings[::-1]:
                got = one_run(Path(tmp) / f"{setting}{r}", setting, args)
                runs[setting].append(got)
                print(f"round {r} {setting}: max/min updates per example {got['ratio']:.2f} ({got['max']} / "
                      f"{got['min']}), steps {got['steps']}, speed ratio {got['speed_ratio']:.2f}", flush=True)
    load.append(os.getloadavg())
    print(json.dumps({"max_over_min": {s: statistics.median(g["ratio"] for g in v) for s, v in runs.items()},
                      "runs": runs, "load_average": load}))


if __name__ == "__main__":
    main()
