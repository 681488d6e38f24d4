"""Metrics benchmark: what `--metrics_port` costs the launcher, and how long a scrape of a big run takes.

1. The launcher's own CPU (user + system of its process, threads included; not its tasks') over a real `psworker
   local` run of 1 ps + 8 async MLP workers, with metrics off and on, interleaved (off, on, off, on, ...): with them
   on, this process scrapes /metrics every `--scrape_every` seconds (Prometheus' default is 15 s: 1 s is a busy
   scraper). The launcher runs in-process in a child (`psworker.cli.main`, `--network host`) that prints its own
   rusage at the end; the run's CPU is every process's (the launcher and its tasks: this process's children rusage).
   Figure: (median launcher CPU on - median off) / median run CPU. Goal: below 1% (printed OK/OVER, not asserted).
2. The time to scrape /metrics of a run of 4 ps + 24 workers: the launcher's collector over a real `Progress` fed
   step lines as the launcher feeds it, 2 restarts, 3 checkpoints on disk, served on loopback by `psworker.exporter`;
   median and worst of `--scrapes` GETs, the body's size and its series.

`--quick` (for the test that runs it): one pair, 20 scrapes, and `psworker run` of a script that prints 80 step
lines in 4 s instead of TensorFlow tasks (1 ps + 2 workers): the launcher's work per line and per scrape is the same,
the run's CPU is not, so its percentage is no figure to quote. Prints a table, a figure
line (`metrics: launcher CPU ...`), then as its LAST line one JSON object (keys: overhead_pct, launcher_cpu_off_s,
launcher_cpu_on_s, run_cpu_s, scrapes_during_runs, scrape_ms_median, scrape_ms_max, scrape_bytes, scrape_series,
workers, repeat, goal_ok).

    python benchmarks/metrics_overhead.py [--repeat 3] [--workers 8] [--max_steps 3000] [--scrape_every 1] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))   # run from a checkout without installing

from psworker import events, exporter  # noqa: E402
from psworker.launcher.metrics import RunCollector, RunFacts  # noqa: E402
from psworker.launcher.ports import pick_free_ports  # noqa: E402
from psworker.launcher.console.progress import Progress  # noqa: E402
from psworker.states import TaskState  # noqa: E402
from psworker.testing import write_spec  # noqa: E402

GOAL_PCT = 1.0
RUNNER = ("import json, resource, sys\n"
          "from psworker.cli import main\n"
          "code = main(sys.argv[1:])\n"
          "r = resource.getrusage(resource.RUSAGE_SELF)\n"
          "print('LAUNCHER_CPU ' + json.dumps({'code': code, 'cpu_s': r.ru_utime + r.ru_stime}), flush=True)\n")


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


STEPS_SCRIPT = ("import sys, time\n"
                "for i in range(80 if sys.argv[1] != 'ps' else 0):\n"       # a ps serves until stopped
                "    print(f'step {i * 10}, loss = 0.5 (100.0 examples/sec)', flush=True)\n"
                "    time.sleep(0.05)\n"
                "time.sleep(0 if sys.argv[1] != 'ps' else 60)\n")


def one_run(workdir: Path, workers: int, max_steps: int, metrics: bool, scrape_every: float, quick: bool) -> dict:
    """One `psworker local` run (`quick`: `psworker run` of `STEPS_SCRIPT`); returns the launcher's CPU, the run's,
    its wall time and the scrapes made."""
    workdir.mkdir(parents=True)
    spec = write_spec(workdir / "c.yaml", num_workers=workers, max_steps=max_steps, batch_size=32,
                      log_every_steps=100, train_dir=str(workdir / "train"))
    argv = [sys.executable, "-c", RUNNER, "run" if quick else "local", str(spec), "--network", "host", "--console", "plain"]
    after = ["--", sys.executable, "-c", STEPS_SCRIPT, "{job_name}"] if quick else []
    port = pick_free_ports(1)[0]
    if metrics:
        argv += ["--metrics_port", str(port), "--set", "metrics_linger_secs=0"]
    argv += after
    before, began = _children_cpu(), time.monotonic()
    proc = subprocess.Popen(argv, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    scrapes = [0]
    done = threading.Event()
    if metrics:
        threading.Thread(target=_scrape_until, args=(port, scrape_every, done, scrapes), daemon=True).start()
    out = proc.communicate()[0]
    done.set()
    wall, run_cpu = time.monotonic() - began, _children_cpu() - before
    line = [ln for ln in out.splitlines() if ln.startswith("LAUNCHER_CPU ")]
    if proc.returncode != 0 or not line or json.loads(line[-1][13:])["code"] != 0:
        raise SystemExit(f"the run failed (exit {proc.returncode}):\n{out[-3000:]}")
    return {"launcher_cpu_s": json.loads(line[-1][13:])["cpu_s"], "run_cpu_s": run_cpu, "wall_s": wall,
            "scrapes": scrapes[0]}


def _scrape_until(port: int, every: float, done: threading.Event, count: list) -> None:
    while not done.wait(every):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                r.read()
            count[0] += 1
        except OSError:
            pass            # not up yet, or already gone


class _Run:
    """What the collector reads of a supervisor, fed as the launcher feeds it."""

    def __init__(self, names: list[str]) -> None:
        self.progress = Progress(names)
        self._names = names

    def ended_attempts(self) -> dict:
        return {n: (((-9, "injected"),), None) if n in ("worker:3", "ps:1") else ((), None) for n in self._names}


def scrape_times(num_ps: int, num_workers: int, scrapes: int) -> dict:
    """Median and worst ms of GET /metrics of a synthetic run of that size, its bytes and series."""
    names = [f"ps:{i}" for i in range(num_ps)] + [f"worker:{i}" for i in range(num_workers)]
    run = _Run(names)
    for name in names:
        run.progress.started(name, 0)
        if name.startswith("worker"):
            run.progress.feed(name, events.Step(1200, 0.31, 5400.0, 0.006, 2.4, 5).render())
        else:
            run.progress.set_state(name, TaskState.RUNNING)
    with tempfile.TemporaryDirectory() as tmp:
        for step in (0, 1000, 2000):
            (Path(tmp) / f"model.ckpt-{step}.index").write_bytes(b"")
        collector = RunCollector(RunFacts(300.0, Path(tmp), 3000))
        collector.attach(run)
        from prometheus_client import CollectorRegistry
        registry = CollectorRegistry(auto_describe=False)
        registry.register(collector)
        endpoint = exporter.Endpoint(exporter.listen("127.0.0.1", 0), registry)
        times, body = [], b""
        try:
            for _ in range(scrapes):
                t = time.perf_counter()
                with urllib.request.urlopen(endpoint.url, timeout=10) as r:
                    body = r.read()
                times.append((time.perf_counter() - t) * 1000)
        finally:
            endpoint.close()
    series = [ln for ln in body.decode().splitlines() if ln and not ln.startswith("#")]
    return {"scrape_ms_median": statistics.median(times), "scrape_ms_max": max(times), "scrape_bytes": len(body),
            "scrape_series": len(series)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="off/on pairs, interleaved (default 3)")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--max_steps", type=int, default=3000)
    ap.add_argument("--scrape_every", type=float, default=1.0, help="seconds between scrapes with metrics on")
    ap.add_argument("--scrapes", type=int, default=200, help="GETs of the 4 ps + 24 worker /metrics")
    ap.add_argument("--quick", action="store_true", help="1 pair, 20 scrapes, a step-printing script for tasks")
    args = ap.parse_args()
    if args.quick:
        args.repeat, args.workers, args.scrapes = 1, 2, 20
    rows: dict[str, list[dict]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="psworker-metrics-bench-") as tmp:
        for i in range(args.repeat):
            for mode in ("off", "on"):
                r = one_run(Path(tmp) / f"{mode}-{i}", args.workers, args.max_steps, mode == "on", args.scrape_every,
                            args.quick)
                rows[mode].append(r)
                print(f"{mode:>3} #{i}: launcher CPU {r['launcher_cpu_s']:7.2f} s, run CPU {r['run_cpu_s']:7.1f} s, "
                      f"wall {r['wall_s']:6.1f} s, scrapes {r['scrapes']}", flush=True)
    med = {m: {k: statistics.median(r[k] for r in rows[m]) for k in rows[m][0]} for m in rows}
    run_cpu = statistics.median(r["run_cpu_s"] for m in rows for r in rows[m])
    overhead = (med["on"]["launcher_cpu_s"] - med["off"]["launcher_cpu_s"]) / run_cpu * 100
    scrape = scrape_times(4, 24, args.scrapes)
    ok = overhead < GOAL_PCT
    print(f"metrics: launcher CPU {med['off']['launcher_cpu_s']:.2f} s off, {med['on']['launcher_cpu_s']:.2f} s on "
          f"(scraped every {args.scrape_every:g} s): {overhead:+.2f}% of the run's {run_cpu:.1f} CPU-s "
          f"(1 ps + {args.workers} {'step-printing scripts' if args.quick else 'MLP workers'}, medians of "
          f"{args.repeat}; goal < {GOAL_PCT:g}%: "
          f"{'OK' if ok else 'OVER'}); scrape at 4 ps + 24 workers: {scrape['scrape_ms_median']:.1f} ms median, "
          f"{scrape['scrape_ms_max']:.1f} ms worst, {scrape['scrape_series']} series, {scrape['scrape_bytes']} bytes")
    print(json.dumps({"overhead_pct": round(overhead, 3), "launcher_cpu_off_s": med["off"]["launcher_cpu_s"],
                      "launcher_cpu_on_s": med["on"]["launcher_cpu_s"], "run_cpu_s": run_cpu,
                      "scrapes_during_runs": sum(r["scrapes"] for r in rows["on"]), **scrape,
                      "workers": args.workers, "repeat": args.repeat, "quick": args.quick, "goal_ok": ok}))


if __name__ == "__main__":
    main()
