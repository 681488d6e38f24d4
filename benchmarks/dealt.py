"""Dealt shards against static slices: global steps/s of 1 ps + 2 workers (async), the two interleaved round by
round so that the machine's load falls on both alike (issue 25: dealing costs a side-session call per shard and two
scalar updates on the ps per step).

Steps/s is measured from the launcher's console: the global steps between the first and the last step line over
the seconds between them (start-up and shutdown left out). Prints one line per run, then as its LAST line one JSON
object: per setting the median steps/s, and dealt / static.

    python benchmarks/dealt.py [--model mlp|cifar10] [--data_dir D | --synthetic_cifar PER_CLASS]
                               [--max_steps 1500] [--rounds 3]

`--synthetic_cifar 5000` writes a synthetic CIFAR-10 of the official size (50,000 training records in the real
binary format, `psworker.data.cifar10_files.write_synthetic`) into a temporary folder and trains on it. The load
average (`os.getloadavg`) before and after is printed and kept in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from psworker import events  # noqa: E402
from psworker.testing import write_spec  # noqa: E402
SETTINGS = ("static", "dealt")


def _task_env() -> dict[str, str]:
    """This checkout first on PYTHONPATH, unbuffered output."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _cpu_seconds(launcher: psutil.Process) -> dict[str, float]:
    """CPU seconds (user + system) so far of each task process under `launcher`, by its job and index."""
    out = {}
    for proc in launcher.children(recursive=True):
        try:
            argv, times = proc.cmdline(), proc.cpu_times()
        except psutil.Error:
            continue
        job = next((a for a in argv if a in ("ps", "worker")), None)
        if job and "--task_index" in argv:
            out[f"{job}:{argv[argv.index('--task_index') + 1]}"] = times.user + times.system
    return out


def steps_per_sec(spec: Path, train_dir: Path, dealing: str, timeout: float) -> tuple[float, dict[str, float]]:
    """Runs `psworker local` with `--set data_dealing=DEALING`: global steps per second between the step lines, and
    each task's CPU milliseconds per global step over the same stretch."""
    argv = [sys.executable, "-m", "psworker", "local", str(spec), "--train_dir", str(train_dir), "--console", "plain",
            "--set", f"data_dealing={dealing}"]
    proc = subprocess.Popen(argv, env=_task_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    launcher = psutil.Process(proc.pid)
    seen: list[tuple[float, int, dict]] = []
    deadline = time.monotonic() + timeout
    try:
        for line in proc.stdout:
            m = events.parse_step(line)
            if m is not None and m.task is not None:
                seen.append((time.monotonic(), m.step.step, _cpu_seconds(launcher)))
            if time.monotonic() > deadline:
                raise TimeoutError(f"run not done after {timeout} s")
        if proc.wait(timeout=60) != 0:
            raise RuntimeError(f"psworker local exited {proc.returncode}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    (t0, s0, c0), (t1, s1, c1) = min(seen, key=lambda x: x[:2]), max(seen, key=lambda x: x[:2])
    cpu = {task: round(1000 * (c1[task] - c0[task]) / (s1 - s0), 1) for task in c0 if task in c1}
    return (s1 - s0) / (t1 - t0), cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--data_dir")
    parser.add_argument("--synthetic_cifar", type=int, metavar="PER_CLASS",
                        help="write a synthetic CIFAR-10 with this many training images per class and use it")
    parser.add_argument("--max_steps", type=int, default=1500)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--log_every_steps", type=int, default=50)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="one round of 40 steps, 1 ps + 1 worker (for "
                                                             "tests/test_benchmarks.py)")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.max_steps, args.log_every_steps, args.workers = 1, 40, 5, 1
    results: dict[str, list[float]] = {s: [] for s in SETTINGS}
    cpu: dict[str, list[dict]] = {s: [] for s in SETTINGS}
    load = [os.getloadavg()]
    with tempfile.TemporaryDirectory() as tmp:
        train = {"model": args.model, "max_steps": args.max_steps, "batch_size": args.batch_size,
                 "log_every_steps": args.log_every_steps, "save_checkpoint_secs": 600.0}
        if args.synthetic_cifar:
            from psworker.data.cifar10_files import write_synthetic

            write_synthetic(str(Path(tmp) / "cifar10"), train_per_class=args.synthetic_cifar, test_per_class=10)
            train["data_dir"] = str(Path(tmp) / "cifar10")
        elif args.data_dir:
            train["data_dir"] = args.data_dir
        print(f"load average before: {' '.join(f'{x:.2f}' for x in load[0])}", flush=True)
        for r in range(args.rounds):
            for setting in SETTINGS if r % 2 == 0 else SETTINGS[::-1]:
                spec = write_spec(Path(tmp) / f"{setting}{r}.yaml", num_ps=1, num_workers=args.workers, **train)
                rate, used = steps_per_sec(spec, Path(tmp) / f"train-{setting}{r}", setting, args.timeout)
                results[setting].append(rate)
                cpu[setting].append(used)
                print(f"round {r} {setting}: {rate:.1f} global steps/s; CPU ms per global step: "
                      f"{', '.join(f'{t} {ms}' for t, ms in sorted(used.items()))}", flush=True)
    load.append(os.getloadavg())
    print(f"load average after: {' '.join(f'{x:.2f}' for x in load[1])}", flush=True)
    medians = {s: statistics.median(v) for s, v in results.items()}
    print(json.dumps({"model": args.model, "steps_per_sec": medians, "runs": results, "cpu_ms_per_step": cpu,
                      "dealt_over_static": medians["dealt"] / medians["static"], "load_average": load}))


if __name__ == "__main__":
    main()
