"""A small launcher for signal tests: supervises fake tasks under `stop_on_signals`, like `run_local` does.

Usage: driver.py LOG_DIR [--grace S]. Tasks: ps:0 sleeps forever, worker:0 ignores SIGTERM, worker:1 has a
grandchild (ignoring SIGTERM), worker:2 has a grandchild in its own session. Prints "STOPPED a,b" and exits
128 + signal, like the launcher.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root: psworker
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/: fake_tasks

from fake_tasks.fakes import fake  # noqa: E402
from psworker.launcher.backends.local import LocalBackend  # noqa: E402
from psworker.launcher.launch import stop_on_signals  # noqa: E402
from psworker.launcher.console.report import exit_status  # noqa: E402
from psworker.launcher.supervise.supervisor import Supervisor  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("log_dir")
parser.add_argument("--grace", type=float, default=1.0)
args = parser.parse_args()

tasks = [
    fake("ps", 0, "sleep_forever"),
    fake("worker", 0, "ignore_term"),
    fake("worker", 1, "spawn_grandchild", "--ignore-term"),
    fake("worker", 2, "spawn_grandchild", "--setsid"),
]
sup = Supervisor(tasks, args.log_dir, backend=LocalBackend(), grace_period_secs=args.grace, ps_exit_grace_secs=1.0)
with stop_on_signals(sup) as caught, sup:
    print("DRIVER STARTED", flush=True)
    result = sup.wait(timeout=120)
stopped = [name for name, e in result.exits.items() if e.stopped]
print(f"STOPPED {','.join(stopped)}", flush=True)
if caught.signum:
    sys.exit(128 + caught.signum)
sys.exit(0 if result.ok else exit_status(result.failure.returncode))
