"""`psworker ps` and `psworker worker`: one task of a cluster, in this process."""

from __future__ import annotations

import argparse
import contextlib
import os
from typing import ContextManager

from psworker.cli.flags import train_config
from psworker.errors import UsageError
from psworker.spec import ClusterSpec

__all__ = ["cmd_ps", "cmd_worker", "ps_flags"]


def _resolve(job: str, args: argparse.Namespace) -> tuple[ClusterSpec, int]:
    from psworker.spec.interop import resolve_cluster
    return resolve_cluster(job, spec_path=args.spec_path, ps_hosts=args.ps_hosts,
                           worker_hosts=args.worker_hosts, job_name=args.job_name,
                           task_index=args.task_index, environ=os.environ)


def cmd_ps(args: argparse.Namespace) -> int:
    """`psworker ps ...`: runs one parameter server."""
    spec, index = _resolve("ps", args)
    if args.workers_gone_timeout_secs <= 0:
        raise UsageError(f"--workers_gone_timeout_secs must be > 0, got {args.workers_gone_timeout_secs:g}")
    if args.rejoin_grace_secs is not None and args.rejoin_grace_secs < 0:
        raise UsageError(f"--rejoin_grace_secs must be >= 0, got {args.rejoin_grace_secs:g}")
    from psworker.task import main
    with _metrics(spec, "ps", index, args):
        return main.run_ps(spec, index, keep_running=args.keep_ps_running,
                           workers_gone_timeout_secs=args.workers_gone_timeout_secs,
                           rejoin_grace_secs=args.rejoin_grace_secs,
                           allow_public_bind=args.allow_public_bind)


def cmd_worker(args: argparse.Namespace) -> int:
    """`psworker worker ...`: runs one training worker (worker 0 is the chief)."""
    spec, index = _resolve("worker", args)
    config = train_config(spec, args)
    from psworker.task import main
    with _metrics(spec, "worker", index, args):
        return main.run_worker(spec, index, config, allow_public_bind=args.allow_public_bind)


def _metrics(spec: ClusterSpec, job: str, index: int, args: argparse.Namespace) -> ContextManager[None]:
    """`--metrics_port`: the task's /metrics while it runs, on its own address's host (vetted as its server's)."""
    from psworker.task import metrics, server

    if args.metrics_port is None:
        return contextlib.nullcontext()
    address = spec.addresses(job)[index]
    server.check_bind_safety(address, allow_public=args.allow_public_bind)
    members = 1 if spec.elastic is not None else len(spec.worker)    # an elastic job's ps waits for the chief first
    return metrics.serving(job, index, address.host, args.metrics_port, members)


def ps_flags(p: argparse.ArgumentParser) -> None:
    """The ps's own flags (besides the cluster's)."""
    p.add_argument("--keep_ps_running", action="store_true",
                   help="keep serving after the workers finish (default: exit once every worker is done)")
    p.add_argument("--rejoin_grace_secs", type=float, default=None, metavar="FLOAT",
                   help="once some worker is done, how long a non-chief worker that went away without saying so "
                        "may take to come back before it counts as done (default 30: a restart by hand, by a pod's "
                        "controller or by Slurm; the launcher passes its longest backoff plus 60). The chief never "
                        "counts as done until it says so: its final checkpoint is outstanding")
    p.add_argument("--workers_gone_timeout_secs", type=float, default=300.0, metavar="FLOAT",
                   help="when every worker has gone away without saying it is done (crashed), or the others are "
                        "done and the chief has, exit with an error (170) after this long instead of serving forever "
                        "(default 300); workers never seen get at least the spec's startup_timeout_secs, and if the "
                        "spec's train_dir shows training complete (a ps restarted after the end) the ps exits 0")
