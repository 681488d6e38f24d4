"""`psworker scale RUN_DIR --workers N`: changes the number of running workers of a running elastic job, through
the run dir (`psworker.launcher.elastic.scale_inbox`)."""

from __future__ import annotations

import argparse

from psworker.cli.flags import positive_float

__all__ = ["cmd_scale", "scale_flags"]


def cmd_scale(args: argparse.Namespace) -> int:
    """Sends the request, waits for the launcher's answer and prints it."""
    from psworker.launcher.elastic.scale_inbox import request_scale

    print(f"psworker: {request_scale(args.run_dir, args.workers, args.timeout_secs)}", flush=True)
    return 0


def scale_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR",
                   help="the run's train_dir, or the run dir its launcher printed (holds cluster.yaml)")
    p.add_argument("--workers", type=int, required=True, metavar="N",
                   help="how many workers should run, within the spec's elastic range (min..max)")
    p.add_argument("--timeout_secs", type=positive_float, default=60.0, metavar="SECS",
                   help="how long to wait for the launcher's answer (default 60)")
