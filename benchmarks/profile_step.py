"""Where one psworker worker step's time goes, in a 1 ps + 1 worker cluster on this machine.

The ps is a `tf.distribute.Server` subprocess (benchmarks/pss_peer.py's `serve`); this process is worker 0, as a
psworker worker is: an in-process `tf.compat.v1.train.Server`, the training graph of
`psworker.train.graph.build_train_graph` and the session config of `psworker.task.server.session_config`. For each
variant of the graph (CNN with the moving averages as shipped, i.e. computed on each variable's ps; computed on the
worker as before issue #9, `ema@worker`, see `use_worker_averages`; without them; MLP) it measures, alternating in
rounds:
  - wall time per step of `sess.run(train_op)` on a bare session;
  - the same with the loss and global step fetched (what psworker's progress hook fetched every step before #9);
  - `MonitoredSession` without hooks; with psworker's hooks before issue #9 (StopAtStepHook, NanTensorHook, a
    progress hook fetching loss and global step, the chief's checkpoint and summary hooks); and with today's one
    `TrainLoopHook` gating the chief's hooks, as `psworker.task.runner` runs it;
  - CPU seconds per step of this process (worker + client) and of the ps process;
then traces --trace_steps steps (`RunOptions(trace_level=FULL_TRACE)`) and splits each step's `step_stats` into:
reads of the ps's variables as the worker receives them (`_Recv` from /job:ps), worker compute by op type, sends to
the ps, the apply on the ps, the moving-average update on the ps, other ps ops. Times are the union of the ops'
intervals (ms of wall time during which at least one such op ran) and, for compute, the sum of op times.

    python benchmarks/profile_step.py --models cnn,mlp --steps 100 --trace_steps 10 [--data_dir D] [--timeline_dir T]
    python benchmarks/profile_step.py --models criteo --batch_size 256 [--criteo_dir D]     # a sparse step

criteo (psworker/models/criteo.py, its table whole on the one ps) adds the table's categories: the row gather on
the ps (`ResourceGather`), the sparse Adagrad apply of the touched rows, and the worker's input (`IteratorGetNext`:
the lines gathered by position and hashed to table rows in numpy, `data.criteo`).

Prints a table per variant and last a JSON line with every number. Noisy on a shared machine: compare ratios.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

import pss_peer  # noqa: E402  (free ports, server subprocesses)
from psworker.models.criteo import TABLE_NAME  # noqa: E402
from psworker.tf_import import import_tensorflow  # noqa: E402  (without Keras and scikit-learn, as a task)

EMA_MARKERS = ("ExponentialMovingAverage", "moving_avg")
RECV_TYPES = ("RecvTensor", "_Recv", "_HostRecv")
APPLY_TYPES = ("ResourceApplyGradientDescent", "ApplyGradientDescent", "AssignAddVariableOp", "AssignAdd",
               "ResourceApplyAdagrad", "ApplyAdagrad", "ResourceApplyAdagradV2")
SPARSE_APPLY_TYPES = ("ResourceSparseApplyAdagrad", "SparseApplyAdagrad", "ResourceSparseApplyAdagradV2")
GATHER_TYPES = ("ResourceGather", "GatherV2", "Gather")
SPARSE_UPDATE_SCOPE = f"/update_{TABLE_NAME}"   # psworker's update of criteo's table rows: gathers, scatters, lock
INPUT_TYPES = ("IteratorGetNext", "IteratorGetNextSync")


def _union_ms(intervals: list[tuple[int, int]]) -> float:
    total, end = 0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total / 1000.0


def _op_type(graph, node_name: str, label: str) -> str:
    try:
        return graph.get_operation_by_name(node_name.split(":")[0]).type
    except (KeyError, ValueError):
        pass
    if " = " in label:   # "name = Type(inputs)"
        return label.split(" = ", 1)[1].split("(", 1)[0]
    return node_name.split(":")[0] or "?"


def breakdown(step_stats, graph) -> dict:
    """One traced step's times (ms) by category; see the module docstring."""
    cats: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)
    compute_by_type: dict[str, float] = collections.Counter()
    ps_by_type: dict[str, float] = collections.Counter()
    starts: dict[str, list[int]] = collections.defaultdict(list)
    ends: dict[str, list[int]] = collections.defaultdict(list)
    for dev in step_stats.dev_stats:
        side = "ps" if "/job:ps" in dev.device else "worker"
        for ns in dev.node_stats:
            if ns.node_name in ("_SOURCE", "_SINK"):
                continue
            start = ns.all_start_micros
            end = start + max(ns.all_end_rel_micros, 0)
            starts[side].append(start)
            ends[side].append(end)
            kind = _op_type(graph, ns.node_name, ns.timeline_label or "")
            iv = (start, end)
            # In TF's gRPC runtime the receiver pulls: the worker's RecvTensor reads the ps's variables, the ps's
            # RecvTensor fetches the gradients (and the learning rate) from the worker.
            if side == "ps":
                ps_by_type[kind] += (end - start) / 1000.0
                if any(m in ns.node_name for m in EMA_MARKERS):
                    cats["ps: moving-average update"].append(iv)
                elif kind in APPLY_TYPES:
                    cats["ps: apply (dense + global step)"].append(iv)
                elif kind in SPARSE_APPLY_TYPES or SPARSE_UPDATE_SCOPE in ns.node_name:
                    cats["ps: sparse apply (table rows)"].append(iv)
                elif kind in GATHER_TYPES:
                    cats["ps: gather (table rows)"].append(iv)
                elif kind in RECV_TYPES:
                    cats["ps: pull gradients from worker (RecvTensor)"].append(iv)
                else:
                    cats["ps: other (variable reads, ...)"].append(iv)
                cats["ps: any op"].append(iv)
            else:
                if any(m in ns.node_name for m in EMA_MARKERS) and kind not in RECV_TYPES:
                    cats["worker: moving-average arithmetic"].append(iv)
                elif kind in RECV_TYPES:
                    cats["worker: pull variables from ps (RecvTensor)"].append(iv)
                elif kind in ("_Send", "_HostSend"):
                    cats["worker: send"].append(iv)
                elif kind in INPUT_TYPES:
                    cats["worker: input (IteratorGetNext)"].append(iv)
                else:
                    cats["worker: compute"].append(iv)
                    compute_by_type[kind] += (end - start) / 1000.0
                    ends["compute"].append(end)
                cats["worker: any op"].append(iv)
    out = {k: _union_ms(v) for k, v in cats.items()}
    first = min(min(v) for v in starts.values())
    last = max(max(v) for v in ends.values())
    out["step span (first op start to last op end)"] = (last - first) / 1000.0
    if starts["ps"] and starts["worker"]:
        out["ps partition starts after the worker's (RunGraph dispatch)"] = \
            (min(starts["ps"]) - min(starts["worker"])) / 1000.0
    if ends["compute"]:
        out["tail: worker's last model op to step end (apply, EMA)"] = (last - max(ends["compute"])) / 1000.0
    return {"union_ms": out, "compute_sum_ms_by_type": dict(compute_by_type),
            "ps_sum_ms_by_type": dict(ps_by_type)}


def _mean_dicts(ds: list[dict]) -> dict:
    keys = sorted({k for d in ds for k in d})
    return {k: statistics.mean(d.get(k, 0.0) for d in ds) for k in keys}


_SHIPPED: dict = {}


def FetchEveryStep(fetches):   # noqa: N802 - a class built on demand (TensorFlow is imported late)
    """psworker's progress hook before issue #9, for comparison: fetches the loss and the global step every step."""
    tf = import_tensorflow()
    class _Hook(tf.compat.v1.train.SessionRunHook):
        def before_run(self, run_context):
            return tf.compat.v1.train.SessionRunArgs(fetches)

        def after_run(self, run_context, run_values):
            loss, step = run_values.results
            int(step), float(loss)

    return _Hook()


def use_worker_averages(on: bool) -> None:
    """Benchmark-only: `True` builds the moving averages as before issue #9 (one `ema.apply` under the worker's
    device setter, so the arithmetic runs on the worker); `False` restores psworker's own (on the ps)."""
    from psworker.train import graph

    cls = graph.ColocatedAverages
    _SHIPPED.setdefault("apply", cls.__dict__["apply"])
    cls.apply = (lambda self, var_list: self._ema.apply(var_list)) if on else _SHIPPED["apply"]


class InProcess:
    """The same model's training graph in this process without servers (`build_train_graph(cluster=None)`): the
    CPU per step a cluster step can at best get down to, measured in the same rounds as the cluster modes (its ps
    CPU column reads the idle ps)."""

    def __init__(self, model, config):
        tf = import_tensorflow()
        from psworker.train.graph import build_train_graph

        self._graph = tf.Graph()
        with self._graph.as_default():
            self._train_op = build_train_graph(model, config, cluster=None, task_index=0).train_op
            init = [tf.compat.v1.global_variables_initializer(), tf.compat.v1.local_variables_initializer()]
        self._sess = tf.compat.v1.Session(graph=self._graph)
        self._sess.run(init)

    def run(self):
        self._sess.run(self._train_op)

    def close(self):
        self._sess.close()


def profile_variant(variant: str, server, cluster: dict, ps_proc, args) -> dict:
    """Builds `variant`'s training graph as worker 0 and measures it (see the module docstring)."""
    import psutil
    tf = import_tensorflow()
    from psworker import models
    from psworker.spec import TrainConfig
    from psworker.task.session_setup import chief_hooks
    from psworker.task.server import session_config
    from psworker.train.graph import build_train_graph
    from psworker.train.hooks import TrainLoopHook
    from psworker.train.session import FastSessionCreator

    v1 = tf.compat.v1
    base, _, extra = variant.partition("+")   # "criteo+packed": with --pack_transfers
    name = {"cnn": "cifar10", "mlp": "mlp", "criteo": "criteo"}[base.split()[0]]
    model = models.get(name)
    if variant == "cnn -ema":
        model.moving_average_decay = None   # this instance only: the graph without the moving averages
    if variant == "cnn ema@worker":
        use_worker_averages(True)   # restored below
    train_dir = tempfile.mkdtemp(prefix=f"profile-{variant}-")
    config = TrainConfig(model=name, batch_size=args.batch_size, learning_rate=0.1, max_steps=10 ** 9,
                         log_every_steps=100, data_dir={"cifar10": args.data_dir, "criteo": args.criteo_dir}.get(name),
                         train_dir=train_dir, pack_transfers=extra == "packed")
    ps = psutil.Process(ps_proc.pid)   # this process (worker and client): time.process_time(), finer than ticks
    graph = tf.Graph()
    with graph.as_default():
        try:
            tg = build_train_graph(model, config, cluster=cluster, task_index=0)
        finally:
            use_worker_averages(False)
        scaffold = v1.train.Scaffold(saver=v1.train.Saver(sharded=True, max_to_keep=5, save_relative_paths=True))
        # psworker's hooks before issue #9 (StopAtStepHook, NanTensorHook, a progress hook fetching the loss and the
        # global step, the chief's savers: five hooks, each step) and now (one TrainLoopHook gating the savers). The
        # workers' summary hook is left out of both.
        old_hooks = [v1.train.StopAtStepHook(last_step=config.max_steps), v1.train.NanTensorHook(tg.loss),
                     FetchEveryStep([tg.loss, tg.global_step])]
        old_hooks += chief_hooks(config, scaffold, "worker:0")
        new_config = dataclasses.replace(config, train_dir=train_dir + "-new")
        new_hooks = [TrainLoopHook(tg.loss, tg.global_step, last_step=config.max_steps,
                                   every_steps=config.log_every_steps, examples_per_step=config.batch_size,
                                   gated=chief_hooks(new_config, scaffold, "worker:0"),
                                   align_steps=(config.log_every_steps,), stride=1, emit=lambda *a, **k: None,
                                   name="worker:0")]
        init = [v1.global_variables_initializer(), v1.local_variables_initializer()]
        sconf = session_config("worker", 0)
        bare = v1.Session(server.target, graph=graph, config=sconf)
        bare.run(init)
        creator = FastSessionCreator(scaffold, master=server.target, config=sconf, is_chief=True,
                                     checkpoint_dir=train_dir, max_wait_secs=60, name="worker:0")
        monitored = v1.train.MonitoredSession(session_creator=creator, hooks=old_hooks, stop_grace_period_secs=0)
        creator_new = FastSessionCreator(scaffold, master=server.target, config=sconf, is_chief=True,
                                         checkpoint_dir=train_dir, max_wait_secs=60, name="worker:0")
        looped = v1.train.MonitoredSession(session_creator=creator_new, hooks=new_hooks, stop_grace_period_secs=0)
        plain = v1.train.MonitoredSession(session_creator=FastSessionCreator(
            scaffold, master=server.target, config=sconf, is_chief=True, checkpoint_dir=train_dir, max_wait_secs=60,
            name="worker:0"), hooks=[], stop_grace_period_secs=0)
        modes = {
            "MonitoredSession, no hooks": lambda: plain.run(tg.train_op),
            "bare sess.run(train_op)": lambda: bare.run(tg.train_op),
            "bare + loss, global step fetched": lambda: bare.run([tg.train_op, tg.loss, tg.global_step]),
            "MonitoredSession + hooks before #9": lambda: monitored.run(tg.train_op),
            "MonitoredSession + TrainLoopHook": lambda: looped.run(tg.train_op),
        }
        in_process = InProcess(model, config)
        modes["in-process, no servers (the bound)"] = in_process.run
        for run in modes.values():
            for _ in range(args.warmup):
                run()
        wall: dict[str, list[float]] = {k: [] for k in modes}
        cpu_me: dict[str, list[float]] = {k: [] for k in modes}
        cpu_ps: dict[str, list[float]] = {k: [] for k in modes}
        steps = args.steps * {"mlp": args.mlp_factor, "criteo": args.criteo_factor}.get(name, 1)
        per_round = max(1, steps // args.rounds)
        for _ in range(args.rounds):
            for key, run in modes.items():
                c0, p0, t0 = time.process_time(), sum(ps.cpu_times()[:2]), time.perf_counter()
                for _ in range(per_round):
                    run()
                t1, c1, p1 = time.perf_counter(), time.process_time(), sum(ps.cpu_times()[:2])
                wall[key].append((t1 - t0) / per_round * 1000)
                cpu_me[key].append((c1 - c0) / per_round * 1000)
                cpu_ps[key].append((p1 - p0) / per_round * 1000)
        traces, traced_wall = [], []
        options = v1.RunOptions(trace_level=v1.RunOptions.FULL_TRACE)
        for i in range(args.trace_steps):
            meta = v1.RunMetadata()
            t0 = time.perf_counter()
            bare.run(tg.train_op, options=options, run_metadata=meta)
            traced_wall.append((time.perf_counter() - t0) * 1000)
            traces.append(breakdown(meta.step_stats, graph))
            if args.timeline_dir and i == args.trace_steps - 1:
                from tensorflow.python.client import timeline   # not public API; only for the optional trace file

                os.makedirs(args.timeline_dir, exist_ok=True)
                path = os.path.join(args.timeline_dir, f"{variant.replace(' ', '_')}.trace.json")
                Path(path).write_text(timeline.Timeline(meta.step_stats).generate_chrome_trace_format())
        creator.abandon_on_close()
        creator_new.abandon_on_close()   # as psworker's trainer does; the process leaves through os._exit
        in_process.close()
    return {
        "wall_ms_per_step": {k: statistics.median(v) for k, v in wall.items()},
        "worker_cpu_ms_per_step": {k: statistics.median(v) for k, v in cpu_me.items()},
        "ps_cpu_ms_per_step": {k: statistics.median(v) for k, v in cpu_ps.items()},
        "traced_wall_ms": statistics.median(traced_wall),
        "trace_union_ms": _mean_dicts([t["union_ms"] for t in traces]),
        "compute_sum_ms_by_type": _mean_dicts([t["compute_sum_ms_by_type"] for t in traces]),
        "ps_sum_ms_by_type": _mean_dicts([t["ps_sum_ms_by_type"] for t in traces]),
    }


def print_variant(variant: str, r: dict, batch_size: int) -> None:
    print(f"\n== {variant}: 1 ps + 1 worker, batch {batch_size}")
    print(f"{'untraced, median over rounds':<44}{'wall ms/step':>13}{'worker CPU ms':>15}{'ps CPU ms':>11}")
    for k, v in r["wall_ms_per_step"].items():
        print(f"  {k:<42}{v:>13.2f}{r['worker_cpu_ms_per_step'][k]:>15.2f}{r['ps_cpu_ms_per_step'][k]:>11.2f}")
    bound = "in-process, no servers (the bound)"
    cpu = {k: r["worker_cpu_ms_per_step"][k] + r["ps_cpu_ms_per_step"][k] for k in r["wall_ms_per_step"]}
    cluster = "MonitoredSession + TrainLoopHook"
    print(f"CPU per step, worker + ps, against in-process: {cpu[cluster]:.1f} / {cpu[bound]:.1f} ms = "
          f"{cpu[cluster] / cpu[bound]:.2f}x; where CPU is the limit (ps and worker sharing {os.cpu_count()} cores), "
          f"a cluster step reaches at most {cpu[bound] / cpu[cluster]:.2f}x of in-process examples/s "
          f"(wall here: {r['wall_ms_per_step'][bound] / r['wall_ms_per_step'][cluster]:.2f}x)")
    print(f"traced step (FULL_TRACE, bare session): wall {r['traced_wall_ms']:.2f} ms; union of op intervals (ms):")
    for k, v in sorted(r["trace_union_ms"].items()):
        print(f"  {k:<50}{v:>9.2f}")
    top = sorted(r["compute_sum_ms_by_type"].items(), key=lambda kv: -kv[1])[:8]
    print("  worker compute by op type (sum ms): " + ", ".join(f"{k} {v:.2f}" for k, v in top))
    top = sorted(r["ps_sum_ms_by_type"].items(), key=lambda kv: -kv[1])[:6]
    print("  ps ops by type (sum ms): " + ", ".join(f"{k} {v:.2f}" for k, v in top))


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="cnn,mlp", help="comma-separated: cnn, mlp, criteo (cnn runs with and "
                                                        "without EMA); `+packed` after one: with --pack_transfers")
    p.add_argument("--steps", type=int, default=100, help="CNN: timed steps per mode (split into rounds)")
    p.add_argument("--mlp_factor", type=int, default=10, help="the MLP runs --steps times this")
    p.add_argument("--criteo_factor", type=int, default=5, help="criteo runs --steps times this")
    p.add_argument("--criteo_dir", help="Criteo day files (default: `criteo-synthetic --rows_per_day 50000`, "
                                        "in a temporary folder)")
    p.add_argument("--rounds", type=int, default=4, help="the modes alternate this many times")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--trace_steps", type=int, default=10)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--data_dir", help="CIFAR-10 records (default: synthetic, in a temporary folder)")
    p.add_argument("--timeline_dir", help="also write the last traced step of each variant as a Chrome trace")
    p.add_argument("--quick", action="store_true", help="the MLP, a round of 20 steps, 2 traced (tests)")
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.steps, args.mlp_factor, args.rounds, args.warmup, args.trace_steps = "mlp", 10, 2, 1, 2, 2
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    models = [m for m in args.models.split(",") if m]
    variants = [v for m in models for v in (("cnn", "cnn ema@worker", "cnn -ema") if m == "cnn" else (m,))]
    models = [m.partition("+")[0] for m in models]
    if args.data_dir is None and "cnn" in models:
        from psworker.data.cifar10_files import write_synthetic

        args.data_dir = tempfile.mkdtemp(prefix="profile-cifar-")
        write_synthetic(args.data_dir)
    if args.criteo_dir is None and "criteo" in models:
        from psworker.data.criteo_synthetic import write_synthetic as write_criteo

        args.criteo_dir = tempfile.mkdtemp(prefix="profile-criteo-")
        write_criteo(args.criteo_dir, days=3, rows_per_day=50_000)

    tf = import_tensorflow()
    tf.compat.v1.disable_eager_execution()
    ports = pss_peer.free_ports(2)
    cluster = {"ps": [f"localhost:{ports[0]}"], "worker": [f"localhost:{ports[1]}"]}
    env = dict(os.environ)
    ps_proc = pss_peer.subprocess.Popen(
        [sys.executable, str(HERE / "pss_peer.py"), "serve", "--cluster", json.dumps(cluster), "--job", "ps",
         "--index", "0"], env=env, stdout=pss_peer.subprocess.DEVNULL)
    code = 1
    try:
        pss_peer.wait_listening(ports[0], pss_peer.SERVER_START_TIMEOUT_S)
        server = tf.compat.v1.train.Server(tf.train.ClusterSpec(cluster), job_name="worker", task_index=0,
                                           start=True)
        results = {}
        for variant in variants:
            results[variant] = profile_variant(variant, server, cluster, ps_proc, args)
            print_variant(variant, results[variant], args.batch_size)
        print("\nNOTE: measured on a shared machine; absolute numbers are noisy, compare within one run.")
        print(json.dumps({"batch_size": args.batch_size, "steps": args.steps, "cpus": os.cpu_count(),
                          "results": results}, sort_keys=True))
        code = 0
    except Exception:  # noqa: BLE001 - reported, then the prompt exit below
        import traceback

        traceback.print_exc()
    finally:
        pss_peer.stop_servers([ps_proc])
        sys.stdout.flush()
        sys.stderr.flush()
        # This process's own tf.train.Server cannot be stopped; leave without waiting for its threads.
        os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
