"""psworker against TF2 ParameterServerStrategy (benchmarks/pss_peer.py), side by side in one run.

For each model (cnn: the CIFAR-10 tutorial CNN; mlp: the digits MLP) and each shape (in-process, 1 ps + 1 worker,
1 ps + 2 workers, async) it measures examples/s of
  - psworker: `python -m psworker local SPEC`; global steps/s after the warm-up (the first 10% of the steps, as
    on the PSS side), from the workers' own summaries (global step and wall time every `log_every_steps`); kept
    in the JSON as second opinions: from every worker's first step (as benchmarks/lifecycle.py measures, warm-up
    included) and the sum of the workers' progress-line rates; in-process:
    `psworker.train.graph.train_in_process` in a subprocess;
  - pss: benchmarks/pss_peer.py (ClusterCoordinator, one step per closure; warm-up steps left out).
Same model, data pipeline (CIFAR-10 records with the tutorial's distortions / standardised digits), batch per
worker, plain SGD at the same learning rate. The training ops differ in one way: psworker's CNN keeps moving
averages of its weights, updated after every apply (on each variable's ps). psworker has no switch for them, so
the psworker CNN runs three ways, switched in every task process by a `sitecustomize.py` on PYTHONPATH
(benchmark-only patches): as shipped ("psworker"), with the moving-average update computed on the worker as before
issue #9 ("psworker ema@worker"), and without moving averages (`Cifar10Model.moving_average_decay = None`,
"psworker -ema", the same training op as "pss"). `--pss_ema` adds the PSS side with the same averages.

    python benchmarks/peers.py                               # everything, defaults
    python benchmarks/peers.py --models mlp --shapes 0,1 --steps 300 --repeat 1   # a smoke test

Runs are interleaved (each repeat runs every variant once), and the median over --repeat is reported. Prints a
table (examples/s; each side vs its own in-process; psworker vs pss) and last a JSON line with every number.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
RATE_LINE = re.compile(r"^\[(worker:\d+)\] step \d+, loss = [0-9.naif]+ \(([0-9.]+) examples/sec;", re.MULTILINE)
LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")
FIRST_STEP = re.compile(r"^.*first step done at global step (\d+)$", re.MULTILINE)
LAST_STEP = re.compile(r"^.*last step done.*$", re.MULTILINE)
DONE = re.compile(r"done at global step (\d+) after \d+ local steps")
STOP_GRACE_S = 30.0
PSWORKER_MODEL = {"cnn": "cifar10", "mlp": "mlp"}
SITECUSTOMIZE = '''\
"""Benchmark-only switches for psworker's moving averages (written by benchmarks/peers.py)."""
import os

if os.environ.get("PSWORKER_BENCH_EMA") == "off":
    from psworker.models.cifar10 import Cifar10Model

    Cifar10Model.moving_average_decay = None
elif os.environ.get("PSWORKER_BENCH_EMA") == "worker":   # as before issue #9: the arithmetic on the worker
    from psworker.train import graph

    graph.ColocatedAverages.apply = lambda self, var_list: self._ema.apply(var_list)
'''


def _env(ema: str, site_dir: Path) -> dict:
    """Environment of psworker processes; `ema`: "shipped", "off" or "worker" (see SITECUSTOMIZE)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PSWORKER_BENCH_EMA=ema)
    paths = [str(REPO), str(HERE)] + ([str(site_dir)] if ema != "shipped" else [])
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return env


def _last_json(stdout: str, what: str) -> dict:
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"{what}: no JSON result line in its output:\n{stdout[-2000:]}")


def _run(argv: list[str], env: dict, timeout: float, what: str, cwd: Optional[Path] = None
         ) -> subprocess.CompletedProcess:
    """Runs `argv` in its own session; on timeout: SIGTERM, STOP_GRACE_S, then SIGKILL to its whole group."""
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()   # psworker local stops its tasks; pss_peer.py stops its servers
        try:
            proc.communicate(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=STOP_GRACE_S)
        raise RuntimeError(f"{what}: no result within {timeout:.0f} s (--timeout); it was stopped") from None
    done = subprocess.CompletedProcess(argv, proc.returncode, out, err)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed with exit code {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}")
    return done


# --------------------------------------------------------------------------------------------- psworker side

def psworker_in_process(model: str, steps: int, batch_size: int, data_dir: str, learning_rate: float) -> None:
    """The `_psworker_in_process` subcommand: psworker's own graph and MonitoredSession, no servers."""
    import tensorflow as tf

    from psworker import models
    from psworker.spec import TrainConfig
    from psworker.train.graph import train_in_process

    tf.compat.v1.disable_eager_execution()
    name = PSWORKER_MODEL[model]
    config = TrainConfig(model=name, batch_size=batch_size, learning_rate=learning_rate,
                         data_dir=data_dir if model == "cnn" else None)
    seconds, n = train_in_process(models.get(name), config, steps=steps)
    print(json.dumps({"examples_per_sec": n * batch_size / seconds, "seconds": seconds,
                      "ema": bool(models.get(name).moving_average_decay)}), flush=True)


def psworker_run(model: str, workers: int, *, ema: str, args, workdir: Path, site_dir: Path, tag: str,
                 mode: str = "async", env: Optional[dict] = None) -> dict:
    """One run; `examples_per_sec` counts one batch per global step (sync: times the workers aggregated).
    `env` replaces the environment `ema` selects (benchmarks/compare.py runs other checkouts)."""
    env = _env(ema, site_dir) if env is None else env
    what = f"psworker {model} {workers}w ema={ema} {mode}"
    if workers == 0:
        steps = args.steps * args.inprocess_factor
        done = _run([sys.executable, str(Path(__file__).resolve()), "_psworker_in_process", "--model", model,
                     "--steps", str(steps), "--batch_size", str(args.batch_size), "--data_dir", args.data_dir,
                     "--learning_rate", str(args.learning_rate)], env, args.timeout, what)
        result = _last_json(done.stdout, what)
        if model == "cnn" and result["ema"] == (ema == "off"):
            raise RuntimeError(f"{what}: the moving-average switch did not take effect")
        return {"examples_per_sec": result["examples_per_sec"]}
    import yaml

    steps = args.steps if model == "cnn" else args.steps * args.mlp_factor
    log_every = max(1, steps // (args.intervals * workers))   # lines count each worker's local steps
    spec = workdir / f"{tag}.yaml"
    spec.write_text(yaml.safe_dump({
        "cluster": {"ps": ["localhost:auto"], "worker": ["localhost:auto"] * workers},
        "train": {"model": PSWORKER_MODEL[model], "mode": mode, "max_steps": steps,
                  "batch_size": args.batch_size, "learning_rate": args.learning_rate, "log_every_steps": log_every,
                  "data_dir": args.data_dir if model == "cnn" else None},
    }, sort_keys=False))
    started = time.monotonic()
    done = _run([sys.executable, "-m", "psworker", "local", str(spec), "--train_dir", str(workdir / tag)],
                env, args.timeout, what, cwd=workdir)
    per_worker: dict[str, list[float]] = {}
    for worker, rate in RATE_LINE.findall(done.stdout):
        per_worker.setdefault(worker, []).append(float(rate))
    steady = {w: statistics.mean(r[1:]) for w, r in per_worker.items() if len(r) > 1}
    warmup = warmup_steps(steps)
    return {"examples_per_sec": steady_rate(workdir / tag, workers, warmup, what) * args.batch_size,
            "from_first_step": global_rate(workdir / tag / "logs", workers, what) * args.batch_size,
            "progress_lines_sum": sum(steady.values()), "wall_s": time.monotonic() - started}


def warmup_steps(steps: int) -> int:
    """Global steps left out at the start of a run, on both sides (pss_peer.py --warmup)."""
    return max(5, steps // 10)


def steady_rate(train_dir: Path, workers: int, warmup: int, what: str) -> float:
    """Global steps/s after the warm-up, from the workers' own summaries (global step and wall time, written every
    `log_every_steps`): from the first one at a global step >= `warmup` written once every worker trains, to the
    last one. The first steps of a run (graph setup, the input pipeline's first shuffle buffer, autotuning) are
    up to 20% slower than the rest; PSS and the in-process runs leave theirs out too."""
    import tensorflow as tf

    points, firsts = [], []
    for i in range(workers):
        files = sorted((train_dir / f"worker_{i}").glob("events.out.tfevents*"))
        mine = [(e.wall_time, e.step) for f in files for e in tf.compat.v1.train.summary_iterator(str(f))
                if e.summary.value]
        if not mine:
            raise RuntimeError(f"{what}: worker:{i} wrote no summaries under {train_dir}")
        firsts.append(min(mine)[0])
        points += mine
    window = sorted(p for p in points if p[0] >= max(firsts) and p[1] >= warmup)
    if len(window) < 2 or window[-1][0] <= window[0][0]:
        raise RuntimeError(f"{what}: fewer than two summaries after the warm-up ({warmup} steps): raise --steps or "
                           "--intervals")
    (t0, s0), (t1, s1) = window[0], window[-1]
    return (s1 - s0) / (t1 - t0)


def _stamp(line: str) -> float:
    m = LOG_TIME.match(line)
    if not m:
        raise RuntimeError(f"no timestamp in {line!r}")
    return datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp() + int(m.group(2)) / 1000.0


def global_rate(log_dir: Path, workers: int, what: str) -> float:
    """Global steps/s once every worker trains: from the later worker's first step (and the global step it saw)
    to the last worker's last step (as benchmarks/lifecycle.py measures)."""
    firsts, lasts, finals = [], [], []
    for i in range(workers):
        log = (log_dir / f"worker-{i}.log").read_text(errors="replace")
        first, last, final = FIRST_STEP.search(log), LAST_STEP.search(log), DONE.search(log)
        if not (first and last and final):
            raise RuntimeError(f"{what}: worker:{i}'s log lacks its first/last step lines:\n{log[-2000:]}")
        firsts.append((_stamp(first.group(0)), int(first.group(1))))
        lasts.append(_stamp(last.group(0)))
        finals.append(int(final.group(1)))
    start_at, start_step = max(firsts)
    return (max(finals) - start_step) / max(max(lasts) - start_at, 1e-9)


# --------------------------------------------------------------------------------------------- pss side

def pss_run(model: str, workers: int, *, ema: bool, args) -> dict:
    what = f"pss {model} {workers}w{' +ema' if ema else ''}"
    steps = args.steps if model == "cnn" else args.steps * args.mlp_factor
    if workers == 0:
        steps *= args.inprocess_factor
    argv = [sys.executable, str(HERE / "pss_peer.py"), "--model", model, "--workers", str(workers),
            "--steps", str(steps), "--batch_size", str(args.batch_size), "--learning_rate", str(args.learning_rate),
            "--warmup", str(warmup_steps(steps)), "--data_dir", args.data_dir] + (["--ema"] if ema else [])
    done = _run(argv, dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"), args.timeout, what)
    return {"examples_per_sec": _last_json(done.stdout, what)["examples_per_sec"]}


# --------------------------------------------------------------------------------------------- table

def variants(models: list[str], pss_ema: bool) -> list[tuple[str, str, dict]]:
    """(model, variant name, options) in table order."""
    out = []
    for m in models:
        out.append((m, "psworker", {"side": "psworker", "ema": "shipped"}))
        if m == "cnn":
            out.append((m, "psworker ema@worker", {"side": "psworker", "ema": "worker"}))
            out.append((m, "psworker -ema", {"side": "psworker", "ema": "off"}))
        out.append((m, "pss", {"side": "pss", "ema": False}))
        if m == "cnn" and pss_ema:
            out.append((m, "pss +ema", {"side": "pss", "ema": True}))
    return out


def print_table(results: dict, models: list[str], shapes: list[int], args) -> dict:
    shape_name = {0: "in-process", 1: "1ps+1w", 2: "1ps+2w"}
    ratios: dict = {}
    print(f"\npsworker vs TF2 ParameterServerStrategy: batch {args.batch_size} per worker, async, "
          f"{os.cpu_count()} CPUs, median of {args.repeat}; examples/s (x own in-process)")
    print("NOTE: all processes share this machine's CPUs; absolute numbers are noisy, compare ratios.")
    head = f"{'model':<5} {'side':<26}" + "".join(f"{shape_name[s]:>20}" for s in shapes)
    print(head)
    for model, name, _ in variants(models, args.pss_ema):
        row = results[model][name]
        base = row.get(0)
        cells = []
        for s in shapes:
            v = row[s]
            cells.append(f"{v:.0f}" + (f" ({v / base:.2f}x)" if base and s else ""))
            if base and s and v == v:
                ratios[f"{model}/{name}/{shape_name[s]}/vs_in_process"] = v / base
        print(f"{model:<5} {name:<26}" + "".join(f"{c:>20}" for c in cells))
    for model in models:
        pairs = [("psworker", "pss")] + ([("psworker ema@worker", "pss"), ("psworker -ema", "pss"),
                                          ("psworker", "psworker ema@worker")]
                                          if model == "cnn" else [])
        if model == "cnn" and args.pss_ema:
            pairs += [("psworker", "pss +ema"), ("psworker ema@worker", "pss +ema")]
        for a, b in pairs:
            cells = []
            for s in shapes:
                r = results[model][a][s] / results[model][b][s]
                ratios[f"{model}/{a} over {b}/{shape_name[s]}"] = r
                cells.append(f"{r:.2f}x")
            print(f"{model:<5} {(a + ' / ' + b):<26}" + "".join(f"{c:>20}" for c in cells))
    return ratios


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_psworker_in_process"]:
        p = argparse.ArgumentParser(prog="peers.py _psworker_in_process")
        p.add_argument("--model", required=True)
        p.add_argument("--steps", type=int, required=True)
        p.add_argument("--batch_size", type=int, required=True)
        p.add_argument("--data_dir", required=True)
        p.add_argument("--learning_rate", type=float, required=True)
        a = p.parse_args(argv[1:])
        psworker_in_process(a.model, a.steps, a.batch_size, a.data_dir, a.learning_rate)
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="cnn,mlp", help="comma-separated: cnn, mlp")
    p.add_argument("--shapes", default="0,1,2", help="workers per cluster, comma-separated; 0 = in-process")
    p.add_argument("--steps", type=int, default=200, help="CNN global steps per cluster run")
    p.add_argument("--mlp_factor", type=int, default=10, help="MLP runs --steps times this")
    p.add_argument("--inprocess_factor", type=int, default=1, help="in-process runs this many times more steps")
    p.add_argument("--intervals", type=int, default=5, help="psworker progress lines per worker and run")
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--learning_rate", type=float, default=0.1)
    p.add_argument("--repeat", type=int, default=1, help="runs of every variant (interleaved); median reported")
    p.add_argument("--pss_ema", action="store_true", help="also run the PSS CNN with moving averages")
    p.add_argument("--data_dir", help="CIFAR-10 records (default: synthetic, in a temporary folder)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    args = p.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    shapes = [int(s) for s in args.shapes.split(",") if s]
    if set(models) - {"cnn", "mlp"} or set(shapes) - {0, 1, 2}:
        p.error("--models takes cnn,mlp; --shapes takes 0,1,2")

    with tempfile.TemporaryDirectory(prefix="psworker-peers-") as tmp:
        workdir = Path(tmp)
        site_dir = workdir / "site"
        site_dir.mkdir()
        (site_dir / "sitecustomize.py").write_text(SITECUSTOMIZE)
        if args.data_dir is None:
            args.data_dir = str(workdir / "data")
            _run([sys.executable, "-m", "psworker", "data", "cifar10-synthetic", "--data_dir", args.data_dir],
                 _env("shipped", site_dir), 300, "writing synthetic CIFAR-10")
        args.data_dir = os.path.abspath(args.data_dir)
        samples: dict = {m: {name: {s: [] for s in shapes} for mm, name, _ in variants(models, args.pss_ema)
                             if mm == m} for m in models}
        n = 0
        errors: list[str] = []
        for r in range(args.repeat):
            for model in models:
                for s in shapes:
                    for mm, name, opt in variants(models, args.pss_ema):
                        if mm != model:
                            continue
                        n += 1
                        tag = f"r{r}-{model}-{s}-{name.replace(' ', '')}-{n}"
                        try:
                            if opt["side"] == "psworker":
                                out = psworker_run(model, s, ema=opt["ema"], args=args, workdir=workdir,
                                                   site_dir=site_dir, tag=tag)
                            else:
                                out = pss_run(model, s, ema=opt["ema"], args=args)
                        except RuntimeError as exc:   # one failed run must not lose the others' numbers
                            errors.append(f"{tag}: {exc}")
                            print(f"[{time.strftime('%H:%M:%S')}] FAILED {tag}: {str(exc)[:2000]}", flush=True)
                            continue
                        samples[model][name][s].append(out["examples_per_sec"])
                        print(f"[{time.strftime('%H:%M:%S')}] {model} {name} {s}w: "
                              f"{out['examples_per_sec']:.0f} examples/s"
                              + (f" (from the first step: {out['from_first_step']:.0f})"
                                 if "from_first_step" in out else ""), flush=True)
    nan = float("nan")
    results = {m: {name: {s: statistics.median(v) if v else nan for s, v in row.items()}
                   for name, row in rows.items()} for m, rows in samples.items()}
    ratios = print_table(results, models, shapes, args)
    print(json.dumps({"batch_size": args.batch_size, "steps": args.steps, "mlp_factor": args.mlp_factor,
                      "repeat": args.repeat, "cpus": os.cpu_count(), "samples": samples, "median": results,
                      "ratios": ratios, "errors": errors}, sort_keys=True))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
