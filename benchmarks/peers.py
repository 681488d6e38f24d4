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

Shapes are worker counts (1 ps each; 0: in-process) or PSxW (`2x2`: 2 ps + 2 workers; PSS then gets a
MinSizePartitioner). `--ps_link_rate 100mbit,1gbit` runs every shape once per rate, each ps port shaped per
direction on both sides (`psworker local --ps_link_rate`; pss_peer.py --ps_link_rate, the same tc classes in its own
namespace); `none` in the list is unshaped. Besides examples/s it reports CPU-seconds per 1,000 examples: the user +
system time of every process of the run (launcher or coordinator, ps, workers: all reaped, so
getrusage(RUSAGE_CHILDREN) holds them), start-up included, over every example the run trained (warm-up included).

    python benchmarks/peers.py --models cnn --variants psworker,pss --shapes 1x1,1x2,2x2 \
        --ps_link_rate 100mbit,1gbit --steps 120 --repeat 3                           # issue 19's table

criteo (psworker/models/criteo.py; pss_peer.py's CtrNet, the fair sparse peer its docstring describes) runs
`--steps` x `--criteo_factor` global steps on Criteo day files (`--criteo_dir`, default synthetic). psworker's
criteo runs also report the held-out AUC (the chief's final eval; the in-process run trains exactly as many
examples, saves and is scored by `evaluate_checkpoint`), and the table prints each cluster's AUC minus the
in-process one. An in-process run is unshaped, so with `--ps_link_rate none,...` it runs once and serves every rate.

    python benchmarks/peers.py --models criteo --variants psworker,pss --shapes 0,1x1,2x2,4x4 \
        --ps_link_rate none,100mbit --batch_size 256 --steps 120 --repeat 3                  # issue 28's table

`--variants "psworker,psworker staged,pss"` adds psworker with `--set staged_vars=true` (opt-in; the in-process column
runs it unstaged); likewise "psworker unpacked" (`--set pack_transfers=false`: packing is on by default, issue 37),
"psworker packed" (`--set pack_transfers=true`), "psworker 2 in flight" (`--set concurrent_steps=2`), "psworker 2 in
flight packed" (both), "psworker 2 in flight packed nospin" (both, and `PSWORKER_TF_THREAD_SPINNING=off`) and
"psworker tf threads" (`PSWORKER_TF_THREADS=tf`: TensorFlow's own thread pools, one thread per CPU per task, instead
of the host's CPUs divided among its tasks). Runs are interleaved (each repeat runs every variant once), and the
median over --repeat is reported. Prints a table (examples/s; each side vs its own in-process; psworker vs pss;
CPU-s per 1,000 examples) and last a JSON line with every number.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import resource
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

REPO = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO))

from psworker import events  # noqa: E402  (this checkout's step-line parser, whichever checkout a run is of)

LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")
FIRST_STEP = re.compile(r"^.*first step done at global step (\d+)$", re.MULTILINE)
LAST_STEP = re.compile(r"^.*last step done.*$", re.MULTILINE)
DONE = re.compile(r"done at global step (\d+) after \d+ local steps")
STOP_GRACE_S = 30.0
# quick: both sides in one process each (2 TensorFlow processes, not 5); their cluster runs are the quick runs of
# compare.py (psworker_run) and pss_peer.py (the script pss_run starts)
QUICK = {"models": "mlp", "shapes": "0", "variants": "psworker,pss", "steps": 10, "mlp_factor": 3, "intervals": 3}
PSWORKER_MODEL = {"cnn": "cifar10", "mlp": "mlp", "criteo": "criteo"}
AUC_LINE = re.compile(r"auc = ([0-9.]+), logloss = ([0-9.]+)")
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
    before = _children_cpu()
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
    done.cpu_s = _children_cpu() - before   # the whole tree: every process of the run was reaped by its parent
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed with exit code {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}")
    return done


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def parse_shape(token: str) -> tuple[int, int]:
    """`0` (in-process), `2` (1 ps + 2 workers) or `2x4` (2 ps + 4 workers) -> (ps, workers)."""
    ps, _, workers = token.strip().rpartition("x")
    shape = (int(ps) if ps else (1 if int(workers) else 0), int(workers))
    if shape[1] < 0 or (shape[1] and shape[0] < 1):
        raise ValueError(f"bad shape {token!r}")
    return shape


def shape_name(shape: tuple[int, int]) -> str:
    return "in-process" if shape[1] == 0 else f"{shape[0]}ps+{shape[1]}w"


LINK_LINE = re.compile(r"^psworker: ps:(\d+) link \(\S+ each way\): ([0-9.]+) (MB|kB) to it, ([0-9.]+) (MB|kB) from it",
                       re.MULTILINE)
POOLED_LINE = re.compile(r"^psworker: ps links \(.*pooled\): ([0-9.]+) (MB|kB) of gradients", re.MULTILINE)


def link_bytes(stdout: str) -> dict:
    """The bytes each shaped ps link carried, from `psworker local --ps_link_rate`'s report."""
    scale = {"MB": 1e6, "kB": 1e3}
    links = [[float(m[2]) * scale[m[3]], float(m[4]) * scale[m[5]]] for m in LINK_LINE.finditer(stdout)]
    pooled = POOLED_LINE.search(stdout)
    return {"link_bytes": links, "pulled_bytes": float(pooled[1]) * scale[pooled[2]] if pooled else 0} if links else {}


# --------------------------------------------------------------------------------------------- psworker side

def psworker_in_process(model: str, steps: int, batch_size: int, data_dir: str, learning_rate: float) -> None:
    """The `_psworker_in_process` subcommand: psworker's own graph and MonitoredSession, no servers. A model with
    an AUC (criteo) trains `steps` in all (warm-up included, as many examples as a cluster run's global steps),
    saves a checkpoint and reports the held-out AUC as `psworker eval` computes it."""
    from psworker.tf_import import import_tensorflow
    tf = import_tensorflow()   # without Keras and scikit-learn, as a task

    from psworker import models
    from psworker.spec import TrainConfig
    from psworker.train.graph import WARMUP_STEPS, train_in_process

    tf.compat.v1.disable_eager_execution()
    name = PSWORKER_MODEL[model]
    scored = models.get(name).eval_metric == "auc"
    config = TrainConfig(model=name, batch_size=batch_size, learning_rate=learning_rate,
                         data_dir=data_dir if model != "mlp" else None)
    with tempfile.TemporaryDirectory(prefix="psworker-inprocess-") as tmp:
        seconds, n = train_in_process(models.get(name), config, steps=steps - WARMUP_STEPS if scored else steps,
                                      checkpoint_dir=tmp if scored else None)
        extra = {}
        if scored:
            from psworker.train.evaluate import evaluate_checkpoint

            got = evaluate_checkpoint(models.get(name), tf.train.latest_checkpoint(tmp), data_dir=data_dir)
            extra = {"auc": got.auc, "logloss": got.logloss, "global_step": got.global_step}
    print(json.dumps({"examples_per_sec": n * batch_size / seconds, "seconds": seconds,
                      "ema": bool(models.get(name).moving_average_decay), **extra}), flush=True)


def model_steps(model: str, args) -> int:
    """Global steps of a cluster run of `model` (`--steps`, times `--mlp_factor` or `--criteo_factor`)."""
    return args.steps * {"cnn": 1, "mlp": args.mlp_factor, "criteo": args.criteo_factor}[model]


def data_dir(model: str, args) -> Optional[str]:
    return {"cnn": args.data_dir, "criteo": args.criteo_dir}.get(model)


def psworker_run(model: str, workers: int, *, ema: str, args, workdir: Path, site_dir: Path, tag: str,
                 mode: str = "async", env: Optional[dict] = None, num_ps: int = 1, rate: Optional[str] = None,
                 flags: Sequence[str] = ()) -> dict:
    """One run; `examples_per_sec` counts one batch per global step (sync: times the workers aggregated).
    `env` replaces the environment `ema` selects (benchmarks/compare.py runs other checkouts); `rate`: each ps
    link shaped (`--ps_link_rate`)."""
    env = _env(ema, site_dir) if env is None else env
    what = f"psworker {model} {num_ps}ps+{workers}w ema={ema} {mode}{f' at {rate}' if rate else ''}"
    if workers == 0:
        steps = model_steps(model, args) * (1 if model == "criteo" else args.inprocess_factor)
        done = _run([sys.executable, str(Path(__file__).resolve()), "_psworker_in_process", "--model", model,
                     "--steps", str(steps), "--batch_size", str(args.batch_size), "--data_dir",
                     data_dir(model, args) or "", "--learning_rate", str(args.learning_rate)], env, args.timeout, what)
        result = _last_json(done.stdout, what)
        if model == "cnn" and result["ema"] == (ema == "off"):
            raise RuntimeError(f"{what}: the moving-average switch did not take effect")
        return {"examples_per_sec": result["examples_per_sec"],
                "cpu_s_per_1000": 1000 * done.cpu_s / (steps * args.batch_size),
                **({"auc": result["auc"]} if "auc" in result else {})}
    import yaml

    steps = model_steps(model, args)
    log_every = max(1, steps // (args.intervals * workers))   # lines count each worker's local steps
    spec = workdir / f"{tag}.yaml"
    spec.write_text(yaml.safe_dump({
        "cluster": {"ps": ["localhost:auto"] * num_ps, "worker": ["localhost:auto"] * workers},
        "train": {"model": PSWORKER_MODEL[model], "mode": mode, "max_steps": steps,
                  "batch_size": args.batch_size, "learning_rate": args.learning_rate, "log_every_steps": log_every,
                  "data_dir": data_dir(model, args)},
    }, sort_keys=False))
    started = time.monotonic()
    done = _run([sys.executable, "-m", "psworker", "local", str(spec), "--train_dir", str(workdir / tag), *flags]
                + (["--ps_link_rate", rate] if rate else []), env, args.timeout, what, cwd=workdir)
    steady = {w: r for w, r in events.steady_rates(events.step_records(done.stdout)).items() if w is not None}
    warmup = warmup_steps(steps)
    auc = AUC_LINE.search(done.stdout)
    return {**({"auc": float(auc[1])} if auc else {}),
            "examples_per_sec": steady_rate(workdir / tag, workers, warmup, what) * args.batch_size,
            "from_first_step": global_rate(workdir / tag / "logs", workers, what) * args.batch_size,
            "progress_lines_sum": sum(steady.values()), "wall_s": time.monotonic() - started,
            "cpu_s_per_1000": 1000 * done.cpu_s / (steps * args.batch_size), **link_bytes(done.stdout)}


def warmup_steps(steps: int) -> int:
    """Global steps left out at the start of a run, on both sides (pss_peer.py --warmup)."""
    return max(5, steps // 10)


def summary_points(folder: Path) -> list[tuple[float, int]]:
    """(wall time, global step) of every summary in `folder`'s event files, read without TensorFlow (its import
    costs seconds of CPU): TFRecord framing (length, its CRC, the record, its CRC) around TensorBoard's Event."""
    from tensorboard.compat.proto import event_pb2

    points = []
    for path in sorted(folder.glob("events.out.tfevents*")):
        data, at = path.read_bytes(), 0
        while at + 12 <= len(data):
            (size,) = struct.unpack_from("<Q", data, at)
            if at + 12 + size + 4 > len(data):
                break   # a record still being written
            event = event_pb2.Event.FromString(data[at + 12:at + 12 + size])
            at += 12 + size + 4
            if event.summary.value:
                points.append((event.wall_time, event.step))
    return points


def steady_rate(train_dir: Path, workers: int, warmup: int, what: str) -> float:
    """Global steps/s after the warm-up, from the workers' own summaries (global step and wall time, written every
    `log_every_steps`): from the first one at a global step >= `warmup` written once every worker trains, to the
    last one. The first steps of a run (graph setup, the input pipeline's first shuffle buffer, autotuning) are
    up to 20% slower than the rest; PSS and the in-process runs leave theirs out too."""
    points, firsts = [], []
    for i in range(workers):
        mine = summary_points(train_dir / f"worker_{i}")
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

def pss_run(model: str, workers: int, *, ema: bool, args, num_ps: int = 1, rate: Optional[str] = None) -> dict:
    what = f"pss {model} {num_ps}ps+{workers}w{' +ema' if ema else ''}{f' at {rate}' if rate else ''}"
    steps = model_steps(model, args)
    if workers == 0:
        steps *= args.inprocess_factor
    argv = [sys.executable, str(HERE / "pss_peer.py"), "--model", model, "--workers", str(workers), "--ps",
            str(num_ps), "--steps", str(steps), "--batch_size", str(args.batch_size), "--learning_rate",
            str(args.learning_rate), "--warmup", str(warmup_steps(steps)), "--data_dir", data_dir(model, args) or ""]
    argv += (["--ema"] if ema else []) + (["--ps_link_rate", rate] if rate else [])
    done = _run(argv, dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"), args.timeout, what)
    result = _last_json(done.stdout, what)
    examples = (steps + warmup_steps(steps)) * args.batch_size
    return {"examples_per_sec": result["examples_per_sec"], "cpu_s_per_1000": 1000 * done.cpu_s / examples,
            **{k: result[k] for k in ("link_bytes", "pulled_bytes") if k in result}}


# --------------------------------------------------------------------------------------------- table

_IN_FLIGHT_PACKED = ["--set", "concurrent_steps=2", "--set", "pack_transfers=true"]
# psworker with flags, run only when named in --variants (the in-process column runs psworker without them)
OPT_IN = {
    "psworker staged": ["--set", "staged_vars=true"],
    "psworker unpacked": ["--set", "pack_transfers=false"],   # the default before issue 37
    "psworker packed": ["--set", "pack_transfers=true"],
    "psworker 2 in flight": ["--set", "concurrent_steps=2"],
    "psworker 2 in flight packed": _IN_FLIGHT_PACKED,
    "psworker 2 in flight packed nospin": _IN_FLIGHT_PACKED,   # with OPT_IN_ENV's
    "psworker tf threads": [],                                  # likewise
}
# and their environment, where it differs (`PSWORKER_TF_THREAD_SPINNING`, `PSWORKER_TF_THREADS`: train/devices.py)
OPT_IN_ENV = {
    "psworker 2 in flight packed nospin": {"PSWORKER_TF_THREAD_SPINNING": "off"},
    "psworker tf threads": {"PSWORKER_TF_THREADS": "tf"},   # the default before issue 37's thread budget
}


def variants(models: list[str], pss_ema: bool, only: Optional[list[str]] = None) -> list[tuple[str, str, dict]]:
    """(model, variant name, options) in table order; `only`: just these names."""
    out = []
    for m in models:
        out.append((m, "psworker", {"side": "psworker", "ema": "shipped"}))
        if m == "cnn":
            out.append((m, "psworker ema@worker", {"side": "psworker", "ema": "worker"}))
            out.append((m, "psworker -ema", {"side": "psworker", "ema": "off"}))
        for name, flags in OPT_IN.items():   # opt-in: `--variants psworker,"psworker staged",pss`
            if only is not None and name in only:
                out.append((m, name, {"side": "psworker", "ema": "shipped", "flags": flags,
                                      "env": OPT_IN_ENV.get(name, {})}))
        out.append((m, "pss", {"side": "pss", "ema": False}))
        if m == "cnn" and pss_ema:
            out.append((m, "pss +ema", {"side": "pss", "ema": True}))
    return [v for v in out if only is None or v[1] in only]


def _ratio_rows(model: str, args) -> list[tuple[str, str]]:
    pairs = [("psworker", "pss")] + [(name, "pss") for name in OPT_IN] + [(name, "psworker") for name in OPT_IN]
    if model == "cnn":
        pairs += [("psworker ema@worker", "pss"), ("psworker -ema", "pss"), ("psworker", "psworker ema@worker")]
    if model == "cnn" and args.pss_ema:
        pairs += [("psworker", "pss +ema"), ("psworker ema@worker", "pss +ema")]
    names = [name for m, name, _ in variants([model], args.pss_ema, args.variants)]
    return [(a, b) for a, b in pairs if a in names and b in names]


def print_table(results: dict, cpu: dict, models: list[str], columns: list[tuple], args) -> dict:
    """`columns`: (rate or None, shape); cells: examples/s (x own in-process, where it ran at that rate)."""
    label = {c: (f"{c[0]} " if c[0] else "") + shape_name(c[1]) for c in columns}
    ratios: dict = {}
    print(f"\npsworker vs TF2 ParameterServerStrategy: batch {args.batch_size} per worker, async, "
          f"{os.cpu_count()} CPUs, median of {args.repeat}; examples/s (x own in-process); rate: each ps link, "
          "each way")
    print("NOTE: all processes share this machine's CPUs; absolute numbers are noisy, compare ratios.")
    print(f"{'model':<5} {'side':<26}" + "".join(f"{label[c]:>22}" for c in columns))
    for model, name, _ in variants(models, args.pss_ema, args.variants):
        row, cells = results[model][name], []
        for c in columns:
            v, base = row[c], in_process(row, c[0])
            cells.append(f"{v:.0f}" + (f" ({v / base:.2f}x)" if base and c[1][1] else ""))
            if base and c[1][1] and v == v:
                ratios[f"{model}/{name}/{label[c]}/vs_in_process"] = v / base
        print(f"{model:<5} {name:<26}" + "".join(f"{x:>22}" for x in cells))
    for model in models:
        for a, b in _ratio_rows(model, args):
            cells = []
            for c in columns:
                r = results[model][a][c] / results[model][b][c]
                ratios[f"{model}/{a} over {b}/{label[c]}"] = r
                cells.append(f"{r:.2f}x")
            print(f"{model:<5} {(a + ' / ' + b):<26}" + "".join(f"{x:>22}" for x in cells))
    print("CPU-seconds per 1,000 examples, every process of the run (start-up included):")
    for model, name, _ in variants(models, args.pss_ema, args.variants):
        print(f"{model:<5} {name:<26}" + "".join(f"{cpu[model][name][c]:>22.1f}" for c in columns))
    return ratios


def in_process(row: dict, rate: Optional[str]) -> Optional[float]:
    """`row`'s in-process cell at `rate`, else its unshaped one (in-process runs have no link to shape)."""
    return row.get((rate, (0, 0)), row.get((None, (0, 0))))


def print_aucs(aucs: dict, models: list[str], columns: list[tuple]) -> dict:
    """psworker's held-out AUC per column (models with one), and each cluster's difference from its in-process
    run at the same rate: the same examples trained in one process should score the same."""
    out = {}
    for model in [m for m in models if "psworker" in aucs[m] and any(v == v for v in aucs[m]["psworker"].values())]:
        row = aucs[model]["psworker"]
        print(f"held-out AUC, psworker, after the same examples:\n{model:<5} {'psworker':<26}"
              + "".join(f"{row[c]:>22.4f}" for c in columns))
        cells = []
        for c in columns:
            base = in_process(row, c[0]) or float("nan")
            out[f"{model}/psworker/{(c[0] or '')} {shape_name(c[1])}/auc_minus_in_process"] = row[c] - base
            cells.append(f"{row[c] - base:+.4f}")
        print(f"{model:<5} {'cluster - in-process':<26}" + "".join(f"{x:>22}" for x in cells))
    return out


def run_one(model: str, column: tuple, name: str, opt: dict, args, workdir: Path, site_dir: Path, tag: str
            ) -> dict:
    rate, (num_ps, workers) = column
    if opt["side"] == "psworker":
        env = dict(_env(opt["ema"], site_dir), **opt.get("env", {}))
        return psworker_run(model, workers, ema=opt["ema"], args=args, workdir=workdir, site_dir=site_dir, tag=tag,
                            num_ps=num_ps, rate=rate, flags=opt.get("flags", []), env=env)
    return pss_run(model, workers, ema=opt["ema"], args=args, num_ps=num_ps, rate=rate)


def measure(models: list[str], columns: list[tuple], args, workdir: Path, site_dir: Path
            ) -> tuple[dict, list[str]]:
    """Every (model, column, variant) --repeat times, interleaved: samples[model][variant][column] = [results]."""
    samples: dict = {m: {name: {c: [] for c in columns} for mm, name, _ in variants(models, args.pss_ema,
                                                                                   args.variants) if mm == m}
                     for m in models}
    n, errors = 0, []
    for r in range(args.repeat):
        for model in models:
            for column in columns:
                for mm, name, opt in variants([model], args.pss_ema, args.variants):
                    n += 1
                    tag = f"r{r}-{model}-{column[0] or 'free'}-{shape_name(column[1])}-{re.sub(r'[^A-Za-z0-9]', '', name)}-{n}"
                    try:
                        out = run_one(model, column, name, opt, args, workdir, site_dir, tag)
                    except RuntimeError as exc:   # one failed run must not lose the others' numbers
                        errors.append(f"{tag}: {exc}")
                        print(f"[{time.strftime('%H:%M:%S')}] FAILED {tag}: {str(exc)[:2000]}", flush=True)
                        continue
                    samples[model][name][column].append(out)
                    links = " ".join(f"{a / 1e6:.0f}/{b / 1e6:.0f}" for a, b in out.get("link_bytes", []))
                    print(f"[{time.strftime('%H:%M:%S')}] {model} {name} {column[0] or ''} {shape_name(column[1])}: "
                          f"{out['examples_per_sec']:.0f} examples/s, {out['cpu_s_per_1000']:.1f} CPU-s/1000"
                          + (f", MB to/from each ps {links} + pulled {out['pulled_bytes'] / 1e6:.0f}"
                             if links else ""), flush=True)
    return samples, errors


def _parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="cnn,mlp", help="comma-separated: cnn, mlp, criteo")
    p.add_argument("--shapes", default="0,1,2",
                   help="comma-separated: workers with 1 ps (0 = in-process), or PSxW, e.g. 0,1x1,2x2")
    p.add_argument("--variants", default=None, help="only these sides, comma-separated (e.g. psworker,pss)")
    p.add_argument("--ps_link_rate", default="none",
                   help="comma-separated rates per ps link and direction (tc units, none: unshaped), e.g. "
                        "100mbit,1gbit; every shape runs at each")
    p.add_argument("--steps", type=int, default=200, help="CNN global steps per cluster run")
    p.add_argument("--mlp_factor", type=int, default=10, help="MLP runs --steps times this")
    p.add_argument("--criteo_factor", type=int, default=5, help="criteo runs --steps times this")
    p.add_argument("--inprocess_factor", type=int, default=1, help="in-process runs this many times more steps")
    p.add_argument("--intervals", type=int, default=5, help="psworker progress lines per worker and run")
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--learning_rate", type=float, default=0.1)
    p.add_argument("--repeat", type=int, default=1, help="runs of every variant (interleaved); median reported")
    p.add_argument("--pss_ema", action="store_true", help="also run the PSS CNN with moving averages")
    p.add_argument("--data_dir", help="CIFAR-10 records (default: synthetic, in a temporary folder)")
    p.add_argument("--criteo_dir", help="Criteo day files (default: `psworker data criteo-synthetic "
                                        "--rows_per_day 50000` in a temporary folder)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    p.add_argument("--quick", action="store_true", help=f"seconds, for tests/test_benchmarks.py: {QUICK}")
    args = p.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    args.models_list = [m for m in args.models.split(",") if m]
    try:
        args.shapes_list = [parse_shape(t) for t in args.shapes.split(",") if t]
    except ValueError:
        p.error(f"--shapes: {args.shapes!r}: worker counts or PSxW, e.g. 0,1,2x2")
    args.rates = [None if r == "none" else r for r in args.ps_link_rate.split(",") if r]
    args.variants = None if args.variants is None else [v.strip() for v in args.variants.split(",")]
    if set(args.models_list) - set(PSWORKER_MODEL):
        p.error("--models takes cnn,mlp,criteo")
    return args


def write_data(models: list[str], args, workdir: Path, site_dir: Path) -> None:
    """Synthetic CIFAR-10 (cnn) and Criteo (criteo) in `workdir` where no --data_dir / --criteo_dir names them."""
    if "cnn" in models and args.data_dir is None:
        args.data_dir = str(workdir / "data")
        _run([sys.executable, "-m", "psworker", "data", "cifar10-synthetic", "--data_dir", args.data_dir],
             _env("shipped", site_dir), 300, "writing synthetic CIFAR-10")
    if "criteo" in models and args.criteo_dir is None:
        args.criteo_dir = str(workdir / "criteo")
        _run([sys.executable, "-m", "psworker", "data", "criteo-synthetic", "--data_dir", args.criteo_dir,
              "--rows_per_day", "50000"], _env("shipped", site_dir), 300, "writing synthetic Criteo")
    args.data_dir, args.criteo_dir = (os.path.abspath(d) if d else d for d in (args.data_dir, args.criteo_dir))


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
    args = _parse_args(argv)
    models = args.models_list
    columns = [(rate, shape) for rate in args.rates for shape in args.shapes_list
               if not (rate and shape == (0, 0) and None in args.rates)]   # one in-process run serves every rate
    with tempfile.TemporaryDirectory(prefix="psworker-peers-") as tmp:
        workdir = Path(tmp)
        site_dir = workdir / "site"
        site_dir.mkdir()
        (site_dir / "sitecustomize.py").write_text(SITECUSTOMIZE)
        write_data(models, args, workdir, site_dir)
        samples, errors = measure(models, columns, args, workdir, site_dir)
    nan = float("nan")

    def med(key: str) -> dict:
        return {m: {name: {c: statistics.median([o[key] for o in v if key in o]) if any(key in o for o in v)
                           else nan for c, v in row.items()}
                    for name, row in rows.items()} for m, rows in samples.items()}

    results, cpu, aucs = med("examples_per_sec"), med("cpu_s_per_1000"), med("auc")
    ratios = print_table(results, cpu, models, columns, args)
    ratios.update(print_aucs(aucs, models, columns))
    key = {c: f"{c[0] or 'unshaped'} {shape_name(c[1])}" for c in columns}
    flat = {m: {name: {key[c]: v for c, v in row.items()} for name, row in rows.items()} for m, rows in samples.items()}
    print(json.dumps({"batch_size": args.batch_size, "steps": args.steps, "mlp_factor": args.mlp_factor,
                      "repeat": args.repeat, "cpus": os.cpu_count(), "samples": flat,
                      "median": {m: {n: {key[c]: v for c, v in r.items()} for n, r in rows.items()}
                                 for m, rows in results.items()},
                      "cpu_s_per_1000": {m: {n: {key[c]: v for c, v in r.items()} for n, r in rows.items()}
                                         for m, rows in cpu.items()},
                      "ratios": ratios, "errors": errors}, sort_keys=True))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
