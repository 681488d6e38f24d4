"""SSH pieces against a real sshd (psworker/testing_sshd.py): quoted remote commands, the reachability check, and a
remote task that dies with its connection."""

from __future__ import annotations

import subprocess
import time

import psutil
import pytest

from psworker.errors import UnreachableHosts, UsageError
from psworker.launcher.backends.ssh.hosts import check_reachable, require_reachable
from psworker.launcher.backends.ssh.remote import remote_command, ssh_argv
from psworker.deadline import wait_for

AWKWARD = "it's \"$HOME\" `id` ; rm -rf / \\ *"


def test_remote_command_quotes_every_part():
    cmd = remote_command(["python3", "-c", "print(1)", AWKWARD], env={"PSWORKER_X": "a b", "TF_CONFIG": '{"a": 1}'},
                         cwd="/srv/run 1")
    assert cmd == ("cd '/srv/run 1' && exec env 'PSWORKER_X=a b' 'TF_CONFIG={\"a\": 1}' python3 -c 'print(1)' "
                   "'it'\"'\"'s \"$HOME\" `id` ; rm -rf / \\ *'")
    for bad_env in ({"A B": "1"}, {"-i": "1"}, {"": "1"}):
        with pytest.raises(UsageError, match="not a shell identifier"):
            remote_command(["true"], env=bad_env)
    with pytest.raises(UsageError, match="contains '='"):
        remote_command(["A=1", "true"])
    with pytest.raises(UsageError, match="empty"):
        remote_command([])


def test_ssh_argv_forces_a_terminal_and_never_prompts():
    argv = ssh_argv("user@node1", ["sleep", "1"], ssh_config="/c f")
    assert argv == ["ssh", "-F", "/c f", "-tt", "-o", "BatchMode=yes", "-o", "ServerAliveInterval=5", "-o",
                    "ServerAliveCountMax=3", "--", "user@node1", "exec env sleep 1"]
    for bad in ("-oProxyCommand=x", "", "a b"):
        with pytest.raises(UsageError, match="ssh host"):
            ssh_argv(bad, ["true"])


def test_remote_command_reaches_the_remote_program_unchanged(sshd):
    program = "import os, sys; print(repr(sys.argv[1:]), os.environ['PSWORKER_X'])"
    argv = ssh_argv("127.0.0.2", ["python3", "-c", program, AWKWARD, "a b"], env={"PSWORKER_X": "x y'z"}, cwd="/tmp",
                    ssh_config=sshd.client_config)
    result = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.replace("\r\n", "\n") == f"{[AWKWARD, 'a b']!r} x y'z\n"   # a terminal may write \r\n


@pytest.mark.parametrize("remote,status", [("exit 3", 3), ("kill -TERM $$", 255), ("kill -KILL $$", 255)])
def test_ssh_exit_status_is_the_remote_status_or_255_for_a_signal(sshd, remote, status):
    argv = ssh_argv("127.0.0.3", ["sh", "-c", remote], ssh_config=sshd.client_config)
    assert subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=30).returncode == status


def test_ssh_to_each_fixture_host_and_a_dead_one(sshd):
    for host in sshd.hosts:
        result = sshd.ssh(host, "true")
        assert result.returncode == 0, f"{host}: {result.stderr}\n{sshd.log_tail()}"
    result = sshd.ssh("127.0.0.4", "true")      # how long a refusal takes: benchmarks/response_times.py
    assert result.returncode == 255
    assert f"127.0.0.4 port {sshd.port}: Connection refused" in result.stderr


def test_reachability_check_names_each_failing_host(sshd):
    """Refused hosts fail at once; the timeout is only there for a host that never answers, so it is far above what
    a live host takes on a loaded machine (4 parallel ssh handshakes took 4.8-5.8 s at load 24)."""
    cfg = sshd.client_config
    assert check_reachable(list(sshd.hosts), ssh_config=cfg, timeout=60) == {}
    require_reachable(list(sshd.hosts) * 2, ssh_config=cfg, timeout=60)
    with pytest.raises(UnreachableHosts) as info:
        require_reachable(["127.0.0.1", "127.0.0.4", "127.0.0.3", "127.0.0.5"], ssh_config=cfg,
                          timeout=60)
    assert set(info.value.failures) == {"127.0.0.4", "127.0.0.5"}
    assert "Connection refused" in info.value.failures["127.0.0.4"]
    assert "127.0.0.5" in str(info.value) and "nothing was started" in str(info.value)


def test_reachability_check_times_out_on_a_host_that_never_answers(sshd, tmp_path):
    """A listener that accepts but never speaks SSH: the check gives up after its timeout and says so (how soon
    after it: benchmarks/response_times.py)."""
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.3", 0))
        silent.listen()
        port = silent.getsockname()[1]
        started = time.monotonic()
        failures = check_reachable(["127.0.0.3"], ssh_config=sshd.client_config, timeout=2, options=("-p", str(port)))
        assert time.monotonic() - started >= 1.0      # it waited for an answer (a lower bound: load cannot break it)
    assert list(failures) == ["127.0.0.3"]
    assert "timed out" in failures["127.0.0.3"] or "no answer within 2 s" in failures["127.0.0.3"]


def _remote_sleeps(seconds: str) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", seconds]]


@pytest.mark.parametrize("signal_name", ["kill", "terminate"])
def test_remote_task_dies_with_its_connection(sshd, signal_name):
    local = subprocess.Popen(ssh_argv("127.0.0.2", ["sleep", "301"], ssh_config=sshd.client_config),
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        remote = wait_for(lambda: _remote_sleeps("301"), 15, "remote sleep 301 started")
    finally:
        getattr(local, signal_name)()
        local.wait(10)
    gone, alive = psutil.wait_procs(remote, timeout=10)
    assert not alive, f"remote task survived its ssh connection: {alive}\n{sshd.log_tail()}"


def test_without_a_terminal_the_remote_task_would_survive(sshd):
    """Why ssh_argv uses -tt: the same command without it outlives its connection."""
    argv = ssh_argv("127.0.0.3", ["sleep", "302"], ssh_config=sshd.client_config, tty=False)
    local = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    remote = []
    try:
        remote = wait_for(lambda: _remote_sleeps("302"), 15, "remote sleep 302 started")
        local.kill()
        local.wait(10)
        _, alive = psutil.wait_procs(remote, timeout=2)
        assert alive, "without -tt the remote sleep ended too: the -tt rationale in psworker/launcher/backends/ssh/remote.py is stale"
    finally:
        if local.poll() is None:
            local.kill()
            local.wait(10)
        for p in remote:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
