"""Response-time benchmark: how soon psworker's probes and checks answer or give up. The tests check only what they
answer (a time bound in a test races the machine's load); the figures and goals live here.

Measures, each `--repeat` times (median and worst printed):
- gRPC readiness probe (`psworker.task.server.is_reachable`): the first probe of a new TF server; 5 probes of
  another, the first of them right after a refused probe of the same address (gRPC's shared subchannel of a
  refused address backs off for 1 s; psworker's probes use their own); a refused port; a listener that speaks no
  gRPC (0.3 s timeout); one `grpc.channel_ready_future` of the live server for comparison;
- `FastSessionCreator`: a non-chief waiting for a model that never comes (max_wait 1.5 s) until it gives up;
- SSH, against the test sshd (psworker/testing_sshd.py; skipped where it cannot run): `ssh` to a refused host, the
  reachability check of 4 hosts with 2 refused (timeout 10 s), the check of a listener that never speaks SSH
  (timeout 2 s), and `psworker ssh` with a refused host until it exits.

Goals (printed as OK/OVER, never asserted by the tests) are the bounds the tests used to assert.
Prints a table, then as its LAST line one JSON object (keys: the measurement names, each {median_s, max_s}).

    python benchmarks/response_times.py [--repeat 3] [--no_ssh]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))   # run from a checkout without installing

GOALS_S = {                      # the upper bounds the tests asserted before issue 20
    "grpc: 5 probes of a live server": 0.9,
    "session: give up after max_wait 1.5 s": 10.0,
    "ssh: refused host": 5.0,
    "ssh: check 4 hosts, 2 refused": 10.0,
    "ssh: check a silent listener, timeout 2 s": 6.0,
    "psworker ssh: refused host, until exit": 30.0,
}


def timed(fn: Callable[[], object]) -> float:
    began = time.monotonic()
    fn()
    return time.monotonic() - began


def grpc_probes() -> dict[str, float]:
    """One round of the gRPC probe measurements (a fresh address and TF server each time)."""
    import grpc
    from psworker.tf_import import import_tensorflow
    tf = import_tensorflow()   # without Keras and scikit-learn, as a task

    from psworker.launcher.ports import pick_free_ports
    from psworker.task.server import is_reachable

    fresh, address = (f"127.0.0.1:{port}" for port in pick_free_ports(2))
    tf.distribute.Server({"ps": [fresh]}, job_name="ps", task_index=0, protocol="grpc", start=True)
    out = {"grpc: first probe of a server (none refused)": timed(lambda: is_reachable(fresh, timeout=10)),
           "grpc: refused probe": timed(lambda: is_reachable(address, timeout=10))}
    tf.distribute.Server({"ps": [address]}, job_name="ps", task_index=0, protocol="grpc", start=True)
    out["grpc: first probe after a refused one"] = timed(lambda: is_reachable(address, timeout=10))
    out["grpc: 5 probes of a live server"] = out["grpc: first probe after a refused one"] + timed(
        lambda: [is_reachable(address, timeout=10) for _ in range(4)])
    with socket.socket() as plain:
        plain.bind(("127.0.0.1", 0))
        plain.listen()
        out["grpc: non-gRPC listener (timeout 0.3 s)"] = timed(
            lambda: is_reachable(f"127.0.0.1:{plain.getsockname()[1]}", timeout=0.3))
    with grpc.insecure_channel(address) as channel:
        out["grpc: one channel_ready_future"] = timed(lambda: grpc.channel_ready_future(channel).result(timeout=10))
    return out


def session_give_up() -> dict[str, float]:
    from psworker.tf_import import import_tensorflow
    tf = import_tensorflow()   # without Keras and scikit-learn, as a task

    from psworker.train.session import FastSessionCreator

    server = tf.compat.v1.train.Server.create_local_server()
    with tf.Graph().as_default():
        tf.compat.v1.train.get_or_create_global_step()
        tf.compat.v1.get_variable("weights", initializer=tf.constant([1.0, 2.0]))
        creator = FastSessionCreator(tf.compat.v1.train.Scaffold(), master=server.target, config=None,
                                     is_chief=False, checkpoint_dir=None, max_wait_secs=1.5, name="worker:1")

        def wait() -> None:
            try:
                creator.create_session()
            except tf.errors.DeadlineExceededError:
                return
            raise AssertionError("the session creator did not give up")

        return {"session: give up after max_wait 1.5 s": timed(wait)}


def ssh_checks(sshd, workdir: Path) -> dict[str, float]:
    """One round of the SSH measurements against a running test sshd."""
    from psworker.errors import UnreachableHosts
    from psworker.launcher.backends.ssh.hosts import check_reachable, require_reachable

    cfg = sshd.client_config
    out = {"ssh: refused host": timed(lambda: sshd.ssh("127.0.0.4", "true"))}

    def check_four() -> None:
        try:
            require_reachable(["127.0.0.1", "127.0.0.4", "127.0.0.3", "127.0.0.5"], ssh_config=cfg, timeout=10)
        except UnreachableHosts:
            return
        raise AssertionError("require_reachable passed with two refused hosts")

    out["ssh: check 4 hosts, 2 refused"] = timed(check_four)
    with socket.socket() as silent:
        silent.bind(("127.0.0.3", 0))
        silent.listen()
        port = str(silent.getsockname()[1])
        out["ssh: check a silent listener, timeout 2 s"] = timed(
            lambda: check_reachable(["127.0.0.3"], ssh_config=cfg, timeout=2, options=("-p", port)))
    out["psworker ssh: refused host, until exit"] = launch_refused(cfg, workdir)
    return out


def launch_refused(ssh_config: Path, workdir: Path) -> float:
    """Seconds from `psworker ssh SPEC` (one of 3 hosts refuses) to its exit."""
    import yaml

    from psworker.launcher.ports import pick_free_ports

    workdir.mkdir(parents=True, exist_ok=True)
    ps, w0, w1 = (f"{h}:{p}" for h, p in zip(("127.0.0.1", "127.0.0.4", "127.0.0.2"), pick_free_ports(3)))
    spec = workdir / "hosts.yaml"
    spec.write_text(yaml.safe_dump({"cluster": {"ps": [ps], "worker": [w0, w1]},
                                    "train": {"max_steps": 200, "train_dir": str(workdir / "train")}}))
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    began = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "psworker", "ssh", str(spec), "--ssh_config", str(ssh_config),
                          "--console", "plain"], cwd=workdir, env=env, capture_output=True, text=True, timeout=300)
    took = time.monotonic() - began
    if out.returncode == 0 or "127.0.0.4" not in out.stderr + out.stdout:
        raise AssertionError(f"psworker ssh did not refuse 127.0.0.4 (exit {out.returncode}):\n{out.stderr[-2000:]}")
    return took


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no_ssh", action="store_true", help="leave out the SSH measurements")
    parser.add_argument("--quick", action="store_true", help="one round (for tests/test_benchmarks.py)")
    args = parser.parse_args()
    if args.quick:
        args.repeat = 1
    rounds: list[dict[str, float]] = []
    for _ in range(args.repeat):
        rounds.append({**grpc_probes(), **session_give_up()})
    if not args.no_ssh:
        rounds = ssh_rounds(rounds, args.repeat)
    report(rounds, args.repeat)
    return 0


def ssh_rounds(rounds: list[dict[str, float]], repeat: int) -> list[dict[str, float]]:
    from psworker.testing_sshd import running_sshd, why_no_sshd

    reason = why_no_sshd()
    if reason:
        print(f"ssh measurements skipped: {reason}")
        return rounds
    with tempfile.TemporaryDirectory(prefix="psworker-response-times-") as tmp, \
            running_sshd(Path(tmp) / "sshd") as sshd:
        for i in range(repeat):
            rounds[i].update(ssh_checks(sshd, Path(tmp) / f"launch-{i}"))
    return rounds


def report(rounds: list[dict[str, float]], repeat: int) -> None:
    print(f"psworker response times: {repeat} rounds on {os.cpu_count()} cores (load average "
          f"{os.getloadavg()[0]:.1f})")
    print(f"{'':<46}{'median (s)':>12}{'max (s)':>10}  goal")
    summary = {}
    for name in rounds[0]:
        values = [r[name] for r in rounds if name in r]
        median, worst = statistics.median(values), max(values)
        goal = GOALS_S.get(name)
        verdict = "" if goal is None else f"<= {goal:g} s {'OK' if worst <= goal else 'OVER'}"
        print(f"{name:<46}{median:>12.3f}{worst:>10.3f}  {verdict}")
        summary[name] = {"median_s": round(median, 4), "max_s": round(worst, 4)}
    print(json.dumps(summary, sort_keys=True))


if __name__ == "__main__":
    raise SystemExit(main())
