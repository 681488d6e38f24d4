"""What keeps TensorFlow's unauthenticated servers off public networks: a task refuses a public or every-interface
address unless `--allow_public_bind` (then it really listens on every interface), and `psworker local --network
isolated` fails rather than run without a private network namespace. Real `psworker` processes; the isolated run
itself is in tests/test_real_launcher.py."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

from psworker.testing import assert_processes_gone, port_listening
from tests.cluster_utils import REPO, task_env


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _psworker(*args: str, env=None, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "psworker", *args], capture_output=True, text=True,
                          env=env or task_env(), timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("job,host,says", [
    ("ps", "0.0.0.0", "0.0.0.0 names every interface of this host"),
    ("worker", "0.0.0.0", "0.0.0.0 names every interface of this host"),
    ("ps", "1.1.1.1", "1.1.1.1 resolves to the public address 1.1.1.1"),
    ("worker", "1.1.1.1", "1.1.1.1 resolves to the public address 1.1.1.1"),
])
def test_a_task_refuses_a_public_or_every_interface_address(tmp_path, job, host, says):
    """Exit 2 (a usage error: never retried) with one line naming the address and the way out, before serving."""
    own, other = f"{host}:{_free_port()}", f"127.0.0.1:{_free_port()}"
    hosts = {"ps": own, "worker": other} if job == "ps" else {"ps": other, "worker": own}
    extra = ["--train_dir", str(tmp_path / "t"), "--max_steps", "10"] if job == "worker" else []
    done = _psworker(job, "--ps_hosts", hosts["ps"], "--worker_hosts", hosts["worker"], "--task_index", "0", *extra)
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"psworker: error: refusing to serve {own}: {says}." in done.stderr, done.stderr[-3000:]
    assert "--allow_public_bind" in done.stderr
    assert "serving at" not in done.stderr + done.stdout
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_allow_public_bind_serves_on_every_interface(tmp_path):
    """With --allow_public_bind a ps at 0.0.0.0 starts, and answers on loopback and on this host's other addresses."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "psworker", "ps", "--ps_hosts", f"0.0.0.0:{port}", "--worker_hosts",
                             f"127.0.0.1:{_free_port()}", "--task_index", "0", "--allow_public_bind",
                             "--workers_gone_timeout_secs", "600"],
                            env=task_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 180
        while not any(f"ps:0 serving at grpc://0.0.0.0:{port}" in line for line in lines):
            assert proc.poll() is None, f"the ps exited ({proc.returncode}):\n{''.join(lines[-40:])}"
            assert time.monotonic() < deadline, "the ps did not serve within 180 s:\n" + "".join(lines[-40:])
            time.sleep(0.1)
        addresses = ["127.0.0.1", *_other_ipv4_addresses()]
        answered = [a for a in addresses if port_listening(port, a)]
        assert answered == addresses, f"answered on {answered} of {addresses}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
            reader.join(10)
    assert_processes_gone([proc.pid])


def test_network_isolated_fails_where_no_namespace_can_be_made(tmp_path):
    """No `unshare` on PATH: `--network isolated` is a usage error, and no task starts."""
    train_dir = tmp_path / "t"
    done = _psworker("local", str(REPO / "cluster_specs" / "local.yaml"), "--train_dir", str(train_dir),
                     "--network", "isolated", env=task_env(PATH=str(tmp_path / "empty")))
    assert done.returncode == 2, done.stderr[-3000:]
    assert "psworker: error: --network isolated: cannot create a network namespace here" in done.stderr, done.stderr
    assert not (train_dir / "logs").exists()
    assert "starting" not in done.stdout + done.stderr


def _other_ipv4_addresses() -> list[str]:
    return sorted({a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                   if a.family == socket.AF_INET and not a.address.startswith("127.")})
