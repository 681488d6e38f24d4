"""A ps memory model, measured (issue 37): each ps's memory against its variables' bytes, fitted as base + k x bytes.

For each table size (`--sizes`: the criteo variant's `max_buckets`, 16 columns, as README's "Tables larger than one
ps") and each ps count (`--ps`), two `psworker local --ps_memory_limit` runs in one train dir: the first trains
`--steps` steps with a checkpoint every `--save_every` steps (the sparse updates, then the saves), the second restores
that checkpoint and trains `--restore_steps` more (the restore, and one save after it). Every ps's memory cgroup is
sampled every 0.05 s: anonymous memory (`memory.stat` rss: the variables, their copies, the runtime), page cache
(`cache`: the checkpoint shards it wrote), and the ps process's resident set (/proc: shared libraries included). Each
ps is a point (its variables and optimizer slots, as the trainer places them: `memory_plan`; its peak anonymous memory
over both runs); a least-squares line through the points is the model:

    PYTHONPATH=$PWD python benchmarks/ps_memory_model.py --sizes 150000,300000 --ps 1,2,4
    PYTHONPATH=$PWD python benchmarks/ps_memory_model.py --quick      # one small size pair, 1 ps (a test runs it)

One line per ps, then `fit: peak anonymous memory = 244 MiB + 1.27 x variable bytes`, then a JSON line (`--out`: the
samples too). Needs root and the cgroup v1 memory controller (`--ps_memory_limit`'s own needs). The causes, one at a
time: `--saver plain` (TensorFlow's own saver: the memory before `psworker.train.saving`), `--env MALLOC_ARENA_MAX=2`,
`--workers 2` (the second worker's pushes go on while the chief saves), `--ref_variables` (TF 1's ref variables).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from psworker.launcher.cgroups import own_memory_cgroup, unavailable  # noqa: E402
from psworker.testing import write_spec  # noqa: E402

MiB = 2 ** 20
SAMPLE_SECS = 0.05
RUN_TIMEOUT_SECS = 900
LIMIT = "16GiB"           # a cap no ps reaches: the cgroup is there to be measured
MODULE = "psw_memory_model"
PLUGIN = """
import os
from psworker.models import register
from psworker.models.criteo import CriteoModel

if os.environ.get("PSW_REF_VARIABLES") == "1":
    import tensorflow as tf
    tf.compat.v1.disable_resource_variables()
for size in {sizes}:
    register(f"memmodel_{{size}}", lambda size=size: CriteoModel(max_buckets=size, embedding_dim=16,
                                                                 name=f"memmodel_{{size}}"))
"""


@dataclass
class Peaks:
    """One ps's peaks over a run (bytes), and its samples `(seconds, anonymous, page cache, resident)`."""

    anon: int = 0
    cache: int = 0
    rss: int = 0
    samples: list = field(default_factory=list)


def _stat(cgroup: Path) -> dict[str, int]:
    try:
        return {k: int(v) for k, v in (line.split() for line in (cgroup / "memory.stat").read_text().splitlines())}
    except (OSError, ValueError):
        return {}


def _resident(cgroup: Path) -> int:
    """The resident set (VmRSS) of the processes in `cgroup`, summed."""
    total = 0
    try:
        pids = (cgroup / "cgroup.procs").read_text().split()
    except OSError:
        return 0
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        total += next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    return total


def sample(launcher: subprocess.Popen, done: threading.Event, peaks: dict[int, Peaks]) -> None:
    """Until `done`: every ps cgroup of `launcher`, its memory.stat and its process's resident set."""
    parent, start = own_memory_cgroup(), time.monotonic()
    while not done.wait(SAMPLE_SECS):
        for cgroup in parent.glob(f"psworker-{launcher.pid}-*-ps-*"):
            stat = _stat(cgroup)
            if not stat:
                continue
            p = peaks.setdefault(int(cgroup.name.rsplit("-", 1)[1]), Peaks())
            anon, cache, rss = stat.get("rss", 0), stat.get("cache", 0), _resident(cgroup)
            p.anon, p.cache, p.rss = max(p.anon, anon), max(p.cache, cache), max(p.rss, rss)
            p.samples.append((round(time.monotonic() - start, 2), anon, cache, rss))


def run_measured(argv: list[str], env: dict[str, str], log: Path) -> dict[int, Peaks]:
    """`psworker local ARGV` with every ps sampled; its peaks per ps index.

    Raises:
        SystemExit: the run failed or outlasted RUN_TIMEOUT_SECS (its output's tail is in `log`).
    """
    peaks: dict[int, Peaks] = {}
    with log.open("a") as out:
        launcher = subprocess.Popen([sys.executable, "-m", "psworker", "local", *argv], env=env, stdout=out,
                                    stderr=subprocess.STDOUT, cwd=log.parent)
        done = threading.Event()
        sampler = threading.Thread(target=sample, args=(launcher, done, peaks), daemon=True)
        sampler.start()
        try:
            rc = launcher.wait(timeout=RUN_TIMEOUT_SECS)
        except subprocess.TimeoutExpired:
            launcher.kill()
            launcher.wait()
            rc = "timeout"
        finally:
            done.set()
            sampler.join(timeout=5)
    if rc != 0:
        tail = log.read_text(errors="replace")[-3000:]
        sys.exit(f"ps_memory_model.py: psworker local {' '.join(argv)} ended with {rc}:\n{tail}")
    return peaks


def placed_bytes(model: str, num_ps: int) -> tuple[int, ...]:
    """Each ps's variables and optimizer slots as the trainer places them (`memory_plan`)."""
    import logging

    logging.getLogger("tensorflow").setLevel(logging.ERROR)
    from psworker.train import memory_plan

    return memory_plan._placed(model, num_ps)[0]


@dataclass(frozen=True)
class Case:
    size: int
    num_ps: int


def measure(case: Case, args, work: Path, env: dict[str, str]) -> tuple[dict[int, Peaks], dict[int, Peaks]]:
    """The two runs of one case: (train and save, restore and save), each ps's peaks."""
    folder = work / f"{case.size}-{case.num_ps}ps"
    folder.mkdir()
    spec = write_spec(folder / "spec.yaml", num_ps=case.num_ps, num_workers=args.workers,
                      model=f"memmodel_{case.size}", batch_size=args.batch_size)
    common = [str(spec), "--train_dir", str(folder / "train"), "--data_dir", str(work / "data"),
              "--ps_memory_limit", LIMIT, "--checkpoint_every", f"{args.save_every}steps", "--set", "log_every_steps=5"]
    saved = run_measured([*common, "--max_steps", str(args.steps)], env, folder / "launcher.log")
    restored = run_measured([*common, "--max_steps", str(args.steps + args.restore_steps)], env,
                            folder / "launcher.log")
    return saved, restored


def points_of(case: Case, saved: dict[int, Peaks], restored: dict[int, Peaks]) -> list[dict]:
    """One point per ps of `case`: its variables' bytes and its peaks."""
    points = []
    for i, nbytes in enumerate(placed_bytes(f"memmodel_{case.size}", case.num_ps)):
        a, b = saved.get(i, Peaks()), restored.get(i, Peaks())
        points.append({"size": case.size, "num_ps": case.num_ps, "ps": i, "bytes": nbytes,
                       "anon": max(a.anon, b.anon), "anon_save": a.anon, "anon_restore": b.anon,
                       "cache": max(a.cache, b.cache), "rss": max(a.rss, b.rss),
                       "samples": {"save": a.samples, "restore": b.samples}})
    return points


def fit(points: list[dict]) -> tuple[float, float]:
    """(base, k) of the least-squares line peak anonymous memory = base + k x variable bytes."""
    xs, ys = [p["bytes"] for p in points], [p["anon"] for p in points]
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if n < 2 or sxx == 0:
        raise SystemExit("ps_memory_model.py: the points need at least two different variable sizes to fit a line")
    k = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - k * mx, k


def point_line(p: dict) -> str:
    return (f"table {p['size']:,} buckets, {p['num_ps']} ps, ps:{p['ps']}: variables {p['bytes'] / MiB:,.0f} MiB; "
            f"peak anonymous {p['anon'] / MiB:,.0f} MiB (training and saves {p['anon_save'] / MiB:,.0f}, restore "
            f"{p['anon_restore'] / MiB:,.0f}), page cache {p['cache'] / MiB:,.0f} MiB, resident {p['rss'] / MiB:,.0f} "
            f"MiB = {p['anon'] / max(p['bytes'], 1):.2f} x variables (anonymous)")


def setup(work: Path, sizes: list[int], args) -> dict[str, str]:
    """The plugin module and the data in `work`; the environment of every run."""
    (work / f"{MODULE}.py").write_text(PLUGIN.format(sizes=sizes))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(work)]), "PSWORKER_MODELS": MODULE}
    env.update(kv.split("=", 1) for kv in args.env)
    if args.saver == "plain":
        env["PSWORKER_SAVER"] = "plain"
    if args.ref_variables:
        env["PSW_REF_VARIABLES"] = "1"
    data = subprocess.run([sys.executable, "-m", "psworker", "data", "criteo-synthetic", "--data_dir",
                           str(work / "data"), "--days", "2", "--rows_per_day", str(args.rows_per_day)], env=env,
                          capture_output=True, text=True, timeout=300)
    if data.returncode != 0:
        sys.exit(f"ps_memory_model.py: making the data failed:\n{data.stderr[-3000:]}")
    sys.path.insert(0, str(work))
    os.environ.update({"PSWORKER_MODELS": MODULE, "PSW_REF_VARIABLES": env.get("PSW_REF_VARIABLES", "0"),
                       "TF_CPP_MIN_LOG_LEVEL": "2"})   # this process's placement (`placed_bytes`): no log noise
    return env


def parse(argv: list[str]):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="150000,300000", help="the criteo variant's max_buckets, comma-separated")
    p.add_argument("--ps", default="1,2,4", help="ps counts, comma-separated")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save_every", type=int, default=10)
    p.add_argument("--restore_steps", type=int, default=5)
    p.add_argument("--batch_size", type=int, default=256)
    p.add_argument("--rows_per_day", type=int, default=2000)
    p.add_argument("--saver", choices=("sequenced", "plain"), default="sequenced")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="for every task, repeatable")
    p.add_argument("--ref_variables", action="store_true", help="TF 1's ref variables instead of resource ones")
    p.add_argument("--parallel", action="store_true", help="run the cases at once (each ps has its own cgroup)")
    p.add_argument("--quick", action="store_true", help="--sizes 20000,60000 --ps 1 --steps 6 --save_every 3, "
                                                       "the two sizes at once")
    p.add_argument("--out", type=Path, help="write the points and their samples here (JSON)")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.ps, args.steps, args.save_every, args.restore_steps = "20000,60000", "1", 6, 3, 2
        args.rows_per_day, args.batch_size, args.parallel = 500, 64, True
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    why = unavailable()
    if why is not None:
        sys.exit(f"ps_memory_model.py: --ps_memory_limit cannot measure here: {why}")
    sizes, counts = [int(s) for s in args.sizes.split(",")], [int(n) for n in args.ps.split(",")]
    cases = [Case(size, num_ps) for size in sizes for num_ps in counts]
    with tempfile.TemporaryDirectory(prefix="ps-memory-model-") as tmp:
        work = Path(tmp)
        env = setup(work, sizes, args)
        with ThreadPoolExecutor(max_workers=len(cases) if args.parallel else 1) as pool:
            runs = list(pool.map(lambda case: measure(case, args, work, env), cases))
        points = []      # placed here: the plugin module lives in `work`
        for case, (saved, restored) in zip(cases, runs):
            for p in points_of(case, saved, restored):
                print(point_line(p), flush=True)
                points.append(p)
    base, k = fit(points)
    print(f"fit: peak anonymous memory = {base / MiB:.0f} MiB + {k:.2f} x variable bytes ({len(points)} ps; saver "
          f"{args.saver}, {args.workers} worker(s){''.join(', ' + e for e in args.env)}"
          f"{', ref variables' if args.ref_variables else ''})")
    if args.out:
        args.out.write_text(json.dumps(points))
    print(json.dumps({"base_mib": round(base / MiB, 1), "k": round(k, 3),
                      "points": [{k2: v for k2, v in p.items() if k2 != "samples"} for p in points]}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
