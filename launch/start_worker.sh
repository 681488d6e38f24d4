#!/usr/bin/env bash
# Starts one worker task of a psworker cluster on this host; every argument is passed through:
#   launch/start_worker.sh --spec cluster.yaml --task_index N [--train_dir D --max_steps N ...]
# The cluster may also come from $PSWORKER_SPEC (a spec path), $TF_CONFIG, or --ps_hosts/--worker_hosts.
# $PSWORKER_PYTHON picks the interpreter (default: python3). --metrics_port P serves the task's /metrics for
# Prometheus on its own address's host (docs/operations.md: Metrics for Prometheus).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "${PSWORKER_PYTHON:-python3}" -m psworker worker "$@"
