"""Stack-dump benchmark: what asking the tasks for their Python stacks adds to a teardown.

Measures, each `--repeat` times (median and worst printed), over N fake tasks (tests/fake_tasks/stuck.py: a
faulthandler on SIGUSR1, blocked in a function; no TensorFlow):
- `Supervisor.stop` of N live tasks that are asked first (SIGUSR1, then the wait for each dump in its log);
- the same stop without asking (the baseline);
- the same stop of N tasks that have all exited (nothing to ask, nothing to wait for).

Goal (printed as OK/OVER, never asserted by the tests): asking adds at most 1 s to the teardown of live tasks.
Prints a table, then as its LAST line one JSON object (keys: the measurement names, each {median_s, max_s}).

    python benchmarks/stacks.py [--repeat 5] [--tasks 3]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))   # run from a checkout without installing

from psworker.launcher.backends.local import LocalBackend  # noqa: E402
from psworker.launcher.supervise.stacks import StackAsker  # noqa: E402
from psworker.launcher.supervise.supervisor import Supervisor  # noqa: E402
from psworker.testing import ProgramTask, drive_until  # noqa: E402

FAKE_TASKS = REPO / "tests" / "fake_tasks"       # the programs only: benchmarks import nothing of tests/

GOAL_EXTRA_S = 1.0


def stop_time(n: int, asker, exited: bool) -> float:
    """Seconds `Supervisor.stop` takes over `n` tasks, once each is ready (or, `exited`, once all have exited)."""
    program = (str(FAKE_TASKS / "echo_exit.py"), "0") if exited else (str(FAKE_TASKS / "stuck.py"),)
    tasks = [ProgramTask("worker", i, (sys.executable, *program)) for i in range(n)]
    with tempfile.TemporaryDirectory() as logs:
        sup = Supervisor(tasks, logs, backend=LocalBackend(), console=io.StringIO(), stacks=asker,
                         grace_period_secs=5.0)
        sup.start()
        try:
            if exited:
                while sup.pids():
                    sup.wait_task(next(iter(sup.pids())), 60)
            else:
                drive_until(sup, lambda: all("ready" in sup.log_path(t.name).read_text() for t in tasks), 60,
                           "every task ready")
            started = time.monotonic()
            sup.stop("benchmark")
            return time.monotonic() - started
        finally:
            sup.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--tasks", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one repeat of 2 tasks (for tests/test_benchmarks.py)")
    args = parser.parse_args()
    if args.quick:
        args.repeat, args.tasks = 1, 2
    cases = {f"stop {args.tasks} live tasks, asked": (StackAsker(by_signal=True), False),
             f"stop {args.tasks} live tasks, not asked": (None, False),
             f"stop {args.tasks} exited tasks, asked": (StackAsker(by_signal=True), True)}
    figures = {}
    for name, (asker, exited) in cases.items():
        times = [stop_time(args.tasks, asker, exited) for _ in range(args.repeat)]
        figures[name] = {"median_s": statistics.median(times), "max_s": max(times)}
    for name, f in figures.items():
        print(f"{name:<40} median {f['median_s'] * 1000:7.0f} ms   max {f['max_s'] * 1000:7.0f} ms")
    asked, base = (figures[n]["median_s"] for n in list(cases)[:2])
    print(f"asking adds {1000 * (asked - base):.0f} ms (median): {'OK' if asked - base <= GOAL_EXTRA_S else 'OVER'} "
          f"(goal <= {GOAL_EXTRA_S:g} s)")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
