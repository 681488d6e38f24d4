"""Local backend tests: address rewriting, cluster.yaml, and run_local over fake tasks (no TF)."""

from __future__ import annotations

import dataclasses
import io
import os
import signal
import socket
import threading
from pathlib import Path

import psutil
import pytest

from tests.fake_tasks.fakes import kill_quietly, wait_for, wait_gone
from psworker.launcher import backends
from psworker.launcher.console.lines import by_task
from psworker.launcher.backends.base import Backend
from psworker.launcher.backends.local import LocalBackend, resolve_local_spec
from psworker.launcher.launch import run_local
from psworker.launcher.rundir import fresh_run_dir
from psworker.errors import SpecError
from psworker.launcher.ports import pick_free_ports
from psworker.spec import Address, TrainConfig, build_cluster, load_spec


def make_spec(ps=("ps.example:auto",), worker=("w0.example:auto", "w1.example:auto"), train_dir=None,
              source="specs/mycluster.yaml"):
    return build_cluster(list(ps), list(worker), source, train=TrainConfig(max_steps=7, train_dir=train_dir))


# -- pure parts ---------------------------------------------------------------------------------------------

def test_pick_free_ports_are_distinct_and_bindable():
    ports = pick_free_ports(5)
    assert len(set(ports)) == 5 and all(0 < p < 65536 for p in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))
    assert pick_free_ports(0) == []
    with pytest.raises(ValueError):
        pick_free_ports(-1)


def test_resolve_local_spec_rewrites_hosts_and_fills_ports_and_train_dir(tmp_path):
    spec = make_spec(ps=("ps.example:2222",), worker=("w0.example:auto", "w1.example:auto", "10.0.0.9:2300"))
    resolved = resolve_local_spec(spec, tmp_path / "train")

    addresses = resolved.ps + resolved.worker
    assert all(a.host == "127.0.0.1" for a in addresses)
    assert resolved.ps[0].port == 2222 and resolved.worker[2].port == 2300
    auto = [resolved.worker[0].port, resolved.worker[1].port]
    assert 0 not in auto and len({a.port for a in addresses}) == 4
    assert resolved.train == dataclasses.replace(spec.train, train_dir=str(tmp_path / "train"))
    assert resolved.source == spec.source
    assert spec.worker[0] == Address("w0.example", 0)        # the input is untouched


def test_resolve_local_spec_rejects_ports_that_clash_on_localhost(tmp_path):
    spec = make_spec(ps=("a.example:2222",), worker=("b.example:2222",))
    with pytest.raises(SpecError, match=r"cluster\.worker\[0\]: port 2222 is also used by cluster\.ps\[0\]"):
        resolve_local_spec(spec, tmp_path)


def test_fresh_run_dir_is_fresh_and_named_after_the_spec(tmp_path):
    spec = make_spec()
    first, second = fresh_run_dir(spec, tmp_path), fresh_run_dir(spec, tmp_path)
    assert first != second and first.is_dir() and second.is_dir()
    assert first.parent == tmp_path / "runs" and first.name.startswith("mycluster-")


def test_backend_registry_has_local():
    assert "local" in backends.names() and backends.get("local") is LocalBackend
    with pytest.raises(KeyError, match="local"):
        backends.get("nope")


def test_every_registered_backend_loads_under_its_own_name():
    """Each registry line names a Backend whose options carry the same name (a module or a scheduler's package)."""
    assert backends.names() == ("local", "slurm", "ssh")
    for name in backends.names():
        cls = backends.get(name)
        assert issubclass(cls, Backend) and cls.Options.BACKEND == name


# -- run_local over fake tasks ------------------------------------------------------------------------------

def test_run_local_success_writes_cluster_yaml_and_logs(tmp_path, fake_python, monkeypatch):
    monkeypatch.setenv("PSWORKER_FAKE_PS_SECS", "60")
    train_dir = tmp_path / "train"
    train_dir.mkdir()
    (train_dir / "checkpoint").write_text("keep me")
    console = io.StringIO()
    before = signal.getsignal(signal.SIGINT)

    rc = run_local(make_spec(train_dir=str(train_dir)), console=console, python=fake_python,
                   grace_period_secs=2.0, ps_exit_grace_secs=0.2)

    assert rc == 0, console.getvalue()
    assert signal.getsignal(signal.SIGINT) is before
    assert (train_dir / "checkpoint").read_text() == "keep me"
    written = load_spec(train_dir / "cluster.yaml")
    assert all(a.host == "127.0.0.1" and a.port for a in written.ps + written.worker)
    assert written.train.train_dir == str(train_dir) and written.train.max_steps == 7
    log = (train_dir / "logs" / "worker-1.log").read_text()
    assert f"worker:1 address {written.worker[1]}" in log       # every task got the resolved spec
    assert f"worker:1 train_dir {train_dir}" in log and "worker:1 step 24" in log
    out = console.getvalue()
    shown = by_task(out)    # what several tasks print at once is shown once: `[ps:0, worker:0-1] <task> address ...`
    assert {f"ps:0 address {written.ps[0]}", "<task> address <address>"} & set(shown["ps:0"]), out
    assert {"worker:0 step 0", "<task> step 0"} & set(shown["worker:0"]), out
    assert "all 2 workers finished" in out


def test_run_local_failure_returns_the_exit_code_and_reports(tmp_path, fake_python, monkeypatch, capsys):
    monkeypatch.setenv("PSWORKER_FAKE_EXIT", "worker:1=3")
    monkeypatch.setenv("PSWORKER_FAKE_WORKER_SECS", "0")
    rc = run_local(make_spec(train_dir=str(tmp_path / "t")), console=io.StringIO(), python=fake_python,
                   grace_period_secs=2.0)
    assert rc == 3
    err = capsys.readouterr().err
    assert "run failed: worker:1 exited with exit code 3" in err
    assert "worker:1 step 24" in err and str(tmp_path / "t" / "logs" / "worker-1.log") in err


def test_run_local_picks_a_fresh_train_dir_under_runs(tmp_path, fake_python, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PSWORKER_FAKE_PS_SECS", "60")      # serves until the launcher stops it, after the workers
    console = io.StringIO()
    assert run_local(make_spec(), console=console, python=fake_python, grace_period_secs=2.0,
                     ps_exit_grace_secs=0.2) == 0, console.getvalue()
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert run_dir.name.startswith("mycluster-") and (run_dir / "cluster.yaml").exists()
    assert f"train_dir is {Path('runs') / run_dir.name}" in console.getvalue()


def test_sigint_to_run_local_stops_every_task_and_returns_130(tmp_path, fake_python, monkeypatch, capsys):
    monkeypatch.setenv("PSWORKER_FAKE_WORKER_SECS", "60")
    train_dir = tmp_path / "train"
    seen: list[int] = []
    returned = threading.Event()
    # processes of earlier tests' session fixtures (a test sshd, Slurm) are no tasks of this run
    before = {p.pid for p in psutil.Process().children(recursive=True)}

    def interrupt() -> None:
        logs = [train_dir / "logs" / f"{n}.log" for n in ("ps-0", "worker-0", "worker-1")]
        ready = lambda: all(p.exists() and "ready" in p.read_text() for p in logs)  # noqa: E731
        try:
            wait_for(lambda: returned.is_set() or ready(), 30, "tasks ready")
            seen.extend(p.pid for p in psutil.Process().children(recursive=True) if p.pid not in before)
        finally:
            if not returned.is_set():           # also on timeout, so that run_local returns
                os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=interrupt)
    thread.start()
    try:
        rc = run_local(make_spec(train_dir=str(train_dir)), console=io.StringIO(), python=fake_python,
                       grace_period_secs=2.0)
    finally:
        returned.set()
        thread.join(40)
    try:
        assert rc == 130
        assert len(seen) == 3
        wait_gone(seen, 5)
        assert "stopped ps:0, worker:0, worker:1" in capsys.readouterr().err
    finally:
        kill_quietly(seen)
