"""A real one-node Slurm (munged + slurmctld + slurmd) in a temporary directory, for tests.

Everything it starts lives under one directory: munge's own key and socket, the Slurm config, state, spool
and logs, on free loopback ports, so it never touches the machine's own /etc/munge or /etc/slurm. It needs
root (slurmd runs jobs as their users) and Debian's `slurm-wlm` + `munge` (installed by `.ci/run`).
Settings that work in a container without systemd or cgroup v2 delegation: `proctrack/linuxproc`,
`task/none`, an empty cgroup.conf, and `OverSubscribe=FORCE` so that more tasks than CPUs fit.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence

import psutil
import yaml

from psworker.launcher.ports import pick_free_ports
from psworker.deadline import WaitTimeout, wait_for

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sinfo", "squeue", "sbatch", "srun", "scancel", "scontrol")
SBIN_DIRS = ("/usr/sbin", "/usr/local/sbin", "/sbin")
START_TIMEOUT_SECS = 30.0
STOP_TIMEOUT_SECS = 10.0


def _which(name: str) -> Optional[str]:
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(SBIN_DIRS))


def why_no_slurm() -> Optional[str]:
    """None when this machine can run the test Slurm, else the reason (for pytest.skip)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "a test Slurm needs root (slurmd starts jobs as their users); run the tests as root"
    missing = [n for n in DAEMONS + CLIENTS if _which(n) is None]
    if missing:
        return f"Slurm/munge not installed (missing {', '.join(missing)}); .ci/run installs slurm-wlm and munge"
    return None


def _node_hardware() -> str:
    """`CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1` as slurmd itself sees it."""
    out = subprocess.run([_which("slurmd"), "-C"], capture_output=True, text=True, timeout=30).stdout
    keys = ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore")
    found = dict(re.findall(r"(\w+)=(\S+)", out))
    if "CPUs" not in found:
        return f"CPUs={os.cpu_count() or 1}"
    return " ".join(f"{k}={found[k]}" for k in keys if k in found)


@dataclass
class SlurmCluster:
    """A running test Slurm. `env` is os.environ plus SLURM_CONF: pass it to every client command."""

    root: Path
    conf: Path
    node: str
    env: dict[str, str]
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    forced: list[str] = field(default_factory=list)   # after stopping: what did not end by itself (KILLed)

    def run(self, argv: Sequence[str], *, timeout: float = 60.0, check: bool = True,
            **kwargs) -> subprocess.CompletedProcess:
        """Runs a client command (`sbatch`, `srun`, ...) against this cluster and returns its result."""
        result = subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=timeout,
                                **kwargs)
        if check and result.returncode != 0:
            raise AssertionError(f"{list(argv)} exited {result.returncode}: {result.stderr.strip()}\n"
                                 f"{self.log_tail()}")
        return result

    def wait_until(self, predicate, timeout: float, what: str) -> None:
        """Polls `predicate()` every 0.2 s; raises TimeoutError naming `what` and the daemon logs after `timeout`."""
        try:
            wait_for(predicate, timeout, what, interval=0.2)
        except WaitTimeout as e:
            raise TimeoutError(f"test Slurm: {e}\n{self.log_tail()}") from None

    def jobs(self) -> list[str]:
        """Ids of the jobs in the queue (any state squeue still lists)."""
        return self.run(["squeue", "-h", "-o", "%i"], check=False).stdout.split()

    def node_state(self) -> str:
        r = self.run(["sinfo", "-h", "-N", "-o", "%t"], check=False, timeout=10)
        return r.stdout.strip() if r.returncode == 0 else f"sinfo failed: {r.stderr.strip()}"

    def job_processes(self) -> list[psutil.Process]:
        """Processes started for this cluster's jobs: their environment names our SLURM_CONF, or they are a
        slurmstepd of ours: serving our spool directory, or holding a file under our root open (slurmd's log). A
        stepd that is shutting down has already closed its spool socket but still logs (seen once in CI); its
        environment names no SLURM_CONF."""
        found = []
        spool = str(self.root / "spool")
        root = str(self.root) + os.sep
        for p in psutil.process_iter(["pid", "name"]):
            if p.pid == os.getpid() or p.info["name"] in DAEMONS:
                continue
            try:
                if p.status() == psutil.STATUS_ZOMBIE:   # exited; only waits for its (re)parent to reap it
                    continue
                if p.info["name"] == "slurmstepd":
                    if (any(str(c.laddr).startswith(spool) for c in p.net_connections(kind="unix"))
                            or any(f.path.startswith(root) for f in p.open_files())):
                        found.append(p)
                elif p.environ().get("SLURM_CONF") == str(self.conf) and "SLURM_JOB_ID" in p.environ():
                    found.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return found

    def log_tail(self, lines: int = 15) -> str:
        parts = []
        for path in sorted((self.root / "log").glob("*.log")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {path} (last {len(text)} lines)\n" + "\n".join(text))
        return "\n".join(parts)


def _start(name: str, argv: list[str], cluster: SlurmCluster) -> None:
    log = open(cluster.root / "log" / f"{name}.out", "ab")
    with log:
        cluster.procs[name] = subprocess.Popen(argv, env=cluster.env, stdin=subprocess.DEVNULL, stdout=log,
                                               stderr=subprocess.STDOUT, start_new_session=True)


def _stop(cluster: SlurmCluster) -> list[str]:
    """Cancels every job, stops the daemons (TERM, then KILL) and kills stray job processes; returns what
    had to be killed."""
    forced = []
    if "slurmctld" in cluster.procs and cluster.procs["slurmctld"].poll() is None:
        with contextlib.suppress(Exception):
            if cluster.jobs():
                cluster.run(["scancel", "--full", *cluster.jobs()], check=False, timeout=10)
                cluster.wait_until(lambda: not cluster.jobs(), STOP_TIMEOUT_SECS, "every job cancelled")
    for name in reversed(list(cluster.procs)):
        proc = cluster.procs[name]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(STOP_TIMEOUT_SECS)
            except subprocess.TimeoutExpired:
                forced.append(name)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(STOP_TIMEOUT_SECS)
    for p in cluster.job_processes():
        with contextlib.suppress(psutil.NoSuchProcess):
            forced.append(f"{p.name()}[{p.pid}]")
            p.kill()
    return forced


@contextlib.contextmanager
def running_slurm(root: Path, *, timeout: float = START_TIMEOUT_SECS) -> Iterator[SlurmCluster]:
    """Starts munged, slurmctld and slurmd under `root`, waits until the node is idle, yields the cluster,
    and stops everything at the end.

    Raises:
        TimeoutError: the node was not idle within `timeout` (the message holds the daemons' logs).
    """
    root = Path(root)
    for sub in ("munge", "state", "spool", "log"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    (root / "munge").chmod(0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(128))
    key.chmod(0o600)
    socket_path = root / "munge" / "munge.socket"
    node = socket.gethostname().split(".")[0]
    ctld_port, slurmd_port = pick_free_ports(2)
    conf = root / "slurm.conf"
    conf.write_text(f"""\
# A one-node test cluster written by tests/slurm_fixture.py.
ClusterName=psworkertest
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={socket_path}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
InactiveLimit=0
KillWait=5
MinJobAge=10
NodeName={node} NodeAddr=127.0.0.1 {_node_hardware()} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
""")
    (root / "cgroup.conf").write_text("")   # 22.05 has no CgroupPlugin=disabled; an empty file turns it off
    env = dict(os.environ, SLURM_CONF=str(conf))
    for k in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and k != "SLURM_CONF"]:
        del env[k]          # a test run inside a real Slurm job must not leak that job's settings
    cluster = SlurmCluster(root=root, conf=conf, node=node, env=env)
    try:
        _start("munged", [_which("munged"), "--foreground", "--force", f"--socket={socket_path}",
                          f"--key-file={key}", f"--pid-file={root}/munge/munged.pid",
                          f"--log-file={root}/log/munged.log", f"--seed-file={root}/munge/munged.seed"], cluster)
        cluster.wait_until(lambda: socket_path.exists(), timeout, f"munged listening on {socket_path}")
        _start("slurmctld", [_which("slurmctld"), "-D", "-i"], cluster)
        _start("slurmd", [_which("slurmd"), "-D", "-N", node], cluster)

        def idle() -> bool:
            for name, proc in cluster.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"test Slurm: {name} exited {proc.returncode} while starting\n"
                                       f"{(root / 'log' / (name + '.out')).read_text(errors='replace')[-2000:]}\n"
                                       f"{cluster.log_tail()}")
            return cluster.node_state() == "idle"

        cluster.wait_until(idle, timeout, f"node {node} idle in sinfo (last state: see logs)")
        yield cluster
    finally:
        cluster.forced = _stop(cluster)


# -- a psworker job in it ------------------------------------------------------------------------------------

JOB_TIMEOUT_SECS = 420        # TensorFlow's import in 3 tasks on a small, shared machine


def free_port_base(n: int = 3) -> int:
    """A port p with p .. p+n-1 free on every interface (the tasks listen on all of them)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        try:
            for port in range(base + 1, base + n):
                with socket.socket() as t:
                    t.bind(("", port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {n} consecutive free ports")


def counts_spec(tmp_path: Path, **train) -> Path:
    """`tmp_path/counts.yaml`: 1 ps and 2 workers by count, the MLP, and the given train settings."""
    path = tmp_path / "counts.yaml"
    path.write_text(yaml.safe_dump({"cluster": {"ps": 1, "worker": 2},
                                    "train": {"model": "mlp", "batch_size": 32, "log_every_steps": 10, **train}}))
    return path


def submit_counts(slurm, monkeypatch, capsys, tmp_path: Path, *extra: str, **train) -> tuple[str, Path]:
    """`psworker slurm submit` of `counts_spec` (1 ps, 2 workers) into `tmp_path/run`: (job id, run dir)."""
    from psworker.cli import main

    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    run_dir = tmp_path / "run"
    rc = main(["slurm", "submit", str(counts_spec(tmp_path, **train)), "--run_dir", str(run_dir), "--overcommit",
               "--time", "0:10:00", "--port_base", str(free_port_base()), *extra])
    out = capsys.readouterr().out
    assert rc == 0, out
    job_id = out.strip().splitlines()[-1]
    assert job_id.isdigit() and (run_dir / "slurm-job-id").read_text().strip() == job_id
    return job_id, run_dir


def wait_done(slurm, job_id: str, run_dir: Path) -> str:
    """Waits for a job `submit_counts` queued to leave the queue; its output file."""
    out = run_dir / f"slurm-{job_id}.out"
    slurm.wait_until(lambda: job_id not in slurm.jobs(), JOB_TIMEOUT_SECS, f"job {job_id} finished ({out})")
    return out.read_text(errors="replace")
