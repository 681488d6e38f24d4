"""The local backend: every task of a spec runs as a subprocess on this machine, bound to 127.0.0.1, in its own
process group, dying with the launcher; optionally in a private network namespace (`--network`) and with
TensorBoard on the run dir (`--tensorboard`), and each ps in a memory cgroup of its own (`--ps_memory_limit`,
`psworker.launcher.cgroups`)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, ClassVar, Iterator, Mapping, Optional, Sequence, TextIO

import psutil

from psworker.errors import SpecError, UsageError
from psworker.states import RunState
from psworker.launcher.backends.base import Backend, popen_task
from psworker.launcher.ports import pick_free_ports, ports_in_use
from psworker.spec.plan import Task
from psworker.spec import Address, ClusterSpec, format_address, with_addresses

if TYPE_CHECKING:
    from psworker.launcher.cgroups import MemoryCgroup
    from psworker.launcher.shaping import LinkShaping

__all__ = ["LOCAL_HOST", "LocalBackend", "LocalOptions", "NETWORK_MODES", "memory_cap_possible", "resolve_local_spec"]

logger = logging.getLogger(__name__)

LOCAL_HOST = "127.0.0.1"
NETWORK_MODES = ("auto", "isolated", "host")
TENSORBOARD_PID_ENV = "PSWORKER_TENSORBOARD_PID"   # `--tensorboard`: the server a re-executed launcher must stop
TENSORBOARD_URL_ENV = "PSWORKER_TENSORBOARD_URL"   # ... and where it serves


@dataclass(frozen=True)
class LocalOptions:
    """How the local backend runs a cluster."""

    BACKEND: ClassVar[str] = "local"

    network: str = "auto"                        # auto | isolated | host (see `isolate_network`)
    reexec_argv: Optional[tuple[str, ...]] = None   # the psworker command line, to re-execute in a namespace;
                                                    # None: called in-process (never re-executed)
    tensorboard_port: Optional[int] = None       # serve the run dir on 127.0.0.1 (0: a free port); None: no
    ps_link_rate_bps: Optional[int] = None       # shape each ps port's link to this, per direction (shaping.py)
    ps_memory_limit_bytes: Optional[int] = None  # cap each ps's memory (a cgroup v1 each, cgroups.py); None: no cap

    def __post_init__(self) -> None:
        if self.network not in NETWORK_MODES:
            raise ValueError(f"network must be one of {', '.join(NETWORK_MODES)}, got {self.network!r}")
        if self.ps_link_rate_bps is not None and self.network == "host":
            raise UsageError("--ps_link_rate shapes the links inside the run's private network namespace; it "
                             "cannot be used with --network host")


def resolve_local_spec(spec: ClusterSpec, train_dir: str | os.PathLike) -> ClusterSpec:
    """The spec as a local run starts it: every host 127.0.0.1, automatic ports chosen, train_dir filled in.

    Fixed ports are kept; automatic ones (port 0) come from `pick_free_ports`, avoiding the fixed ones.

    Raises:
        SpecError: two tasks would share a port on 127.0.0.1 (e.g. `a:2222` and `b:2222`).
        UsageError: a fixed port is in use on this machine (in the run's network namespace, where it has one).
    """
    fixed: dict[int, tuple[str, int]] = {}
    for job in spec.jobs():
        for i, a in enumerate(spec.addresses(job)):
            if a.port == 0:
                continue
            if a.port in fixed:
                raise SpecError(spec.source or "spec", f"cluster.{job}[{i}]", f"port {a.port} is also used by "
                                f"cluster.{fixed[a.port][0]}[{fixed[a.port][1]}]; a local run binds every task to "
                                f"{LOCAL_HOST}, so ports must differ")
            fixed[a.port] = (job, i)
    busy = ports_in_use(fixed)
    if busy:
        named = ", ".join(f"port {p} ({fixed[p][0]}:{fixed[p][1]})" for p in busy)
        raise UsageError(f"{spec.source or 'the spec'}: {named} {'is' if len(busy) == 1 else 'are'} in use on this "
                         "machine: stop what listens there, or give the spec free ports ('auto')")
    n_auto = sum(a.port == 0 for job in spec.jobs() for a in spec.addresses(job))
    auto = iter([p for p in pick_free_ports(n_auto + len(fixed), LOCAL_HOST) if p not in fixed][:n_auto])
    new = {job: [Address(LOCAL_HOST, a.port or next(auto)) for a in spec.addresses(job)] for job in spec.jobs()}
    resolved = with_addresses(spec, **new)
    for job in spec.jobs():
        for i, (old, a) in enumerate(zip(spec.addresses(job), resolved.addresses(job))):
            logger.debug("local address: %s:%d %s -> %s", job, i, format_address(old), a)
    return dataclasses.replace(resolved, train=dataclasses.replace(spec.train, train_dir=str(train_dir)))


def memory_cap_possible() -> None:
    """`--ps_memory_limit` needs a cgroup v1 memory controller this process may use: refuses (exit 2) naming why
    not."""
    from psworker.launcher.cgroups import unavailable

    why = unavailable()
    if why is not None:
        raise UsageError(f"--ps_memory_limit: cannot cap the ps memory here: {why}")


def _check_shaping_possible(argv: Optional[Sequence[str]]) -> None:
    """`--ps_link_rate` needs tc and a private network namespace (where this process is root): refuses (exit 2)
    naming what is missing."""
    from psworker.launcher import netns, shaping

    missing = shaping.missing_tool()
    if missing is None and not (netns.inside() and netns.interfaces() == ["lo"]):
        if argv is None:
            missing = "a private network namespace (psworker.cli.main called in-process cannot re-execute in one)"
        elif not netns.available():
            missing = ("a private network namespace (needs Linux, util-linux 'unshare' and unprivileged user "
                       "namespaces)")
    if missing is not None:
        raise UsageError(f"--ps_link_rate: cannot shape the ps links here: missing {missing}")


def _stopped(run_dir: Path) -> bool:
    """Whether the run in `run_dir` was stopped by a signal (Ctrl-C): then TensorBoard stops with it."""
    from psworker.launcher.rundir import read_end

    end = read_end(run_dir)
    return end is None or end.outcome == RunState.STOPPED


@contextlib.contextmanager
def _tensorboard(port: Optional[int], run_dir: Path, console: TextIO) -> Iterator[None]:
    """`--tensorboard_port`: TensorBoard on the run dir while inside (a re-executed launcher finds the pid its first
    self started in the environment); after a run that was not stopped, on a terminal, it serves on until Ctrl-C."""
    from psworker.launcher import tensorboard

    pid = os.environ.get(TENSORBOARD_PID_ENV)
    if port is not None and pid is None:
        started, url = tensorboard.start_detached(str(run_dir), port)
        pid = os.environ[TENSORBOARD_PID_ENV] = str(started)
        os.environ[TENSORBOARD_URL_ENV] = url
        after = "and after it until Ctrl-C" if tensorboard.keeps_serving(console) else "for as long as it lasts"
        print(f"psworker: TensorBoard at {url} (127.0.0.1 only) shows the run from its first step, {after}",
              file=console, flush=True)
    if pid is None:
        yield
        return
    try:
        yield
    finally:
        if tensorboard.keeps_serving(console) and sys.exc_info()[0] is None and not _stopped(run_dir):
            print(f"psworker: TensorBoard at {os.environ.get(TENSORBOARD_URL_ENV, '?')} serves the run until Ctrl-C",
                  file=console, flush=True)
            tensorboard.serve_until_interrupted(int(pid))
        tensorboard.stop_pid(int(pid))
        print(f"psworker: TensorBoard stopped with the run; psworker tensorboard --logdir {run_dir} serves it again",
              file=console, flush=True)


def isolate_network(mode: str, argv: Optional[Sequence[str]], shaped: bool = False) -> None:
    """`--network`: runs the local cluster in a private network namespace (loopback only) where possible, by
    re-executing `psworker ARGV` there (this process is replaced); else warns, or refuses under `isolated` or
    when `shaped` (`--ps_link_rate`, which needs the namespace and tc)."""
    from psworker.launcher import netns

    if shaped:
        _check_shaping_possible(argv)
    if netns.inside() and netns.interfaces() == ["lo"]:
        netns.bring_up_loopback()
        logger.info("network: private namespace, interfaces %s: the cluster's ports are unreachable from outside",
                    ", ".join(netns.interfaces()))
        return
    if mode == "host":
        logger.warning("network: host; TensorFlow's unauthenticated servers listen on every interface of this host")
        return
    if argv is None:   # called as a library: replacing the caller's process is not ours to do
        if mode == "isolated":
            raise UsageError("--network isolated needs the psworker command itself (it re-executes in a namespace)")
        logger.warning("network: not isolated (psworker.cli.main called in-process)")
        return
    if netns.available():
        netns.reexec_isolated(argv)
    if mode == "isolated":
        raise UsageError("--network isolated: cannot create a network namespace here (needs Linux, util-linux "
                         "'unshare' and user namespaces); use --network host on a firewalled machine")
    logger.warning("network: no private namespace available (unshare not permitted); TensorFlow's unauthenticated "
                   "servers listen on every interface of this host: firewall their ports")


def _live_group_members(pgids: set[int]) -> dict[int, list[int]]:
    """The non-zombie processes in each of the process groups `pgids`."""
    live = set()
    for pgid in pgids:
        try:
            os.killpg(pgid, 0)
            live.add(pgid)
        except ProcessLookupError:
            pass
        except PermissionError:
            live.add(pgid)
    found: dict[int, list[int]] = {}
    for proc in psutil.process_iter() if live else ():
        try:
            pgid = os.getpgid(proc.pid)
            if pgid in live and proc.status() != psutil.STATUS_ZOMBIE:
                found.setdefault(pgid, []).append(proc.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return found


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class LocalBackend(Backend):
    """Runs each task as a subprocess of this launcher, in its own session (process group == pid); a signal goes
    to the whole group, and the teardown also ends what a task started outside it (setsid)."""

    Options = LocalOptions
    LOCAL_PIDS = True

    def __init__(self, options: Optional[LocalOptions] = None, *, python: str = sys.executable,
                 popen: Callable[..., subprocess.Popen] = subprocess.Popen) -> None:
        """Args:
            options, python: as `Backend`.
            popen: starts a process, with subprocess.Popen's signature (injected so tests may swap it).
        """
        super().__init__(options, python=python)
        self._popen = popen
        self._strays: list[psutil.Process] = []    # what the tasks had started when the teardown began
        self._shaping: Optional["LinkShaping"] = None   # `--ps_link_rate`, once installed
        self._cgroups: dict[int, "MemoryCgroup"] = {}   # `--ps_memory_limit`: ps index -> its cgroup, once made
        self._capped: dict[int, tuple["MemoryCgroup", Optional[int]]] = {}   # pid -> (its cgroup, OOM kills before)
        self._run_dir: Optional[Path] = None

    def place(self, spec: ClusterSpec, run_dir: Path) -> ClusterSpec:
        return resolve_local_spec(spec, run_dir)

    @contextlib.contextmanager
    def session(self, run_dir: Path, console: TextIO) -> Iterator[None]:
        """The run's surroundings, each a context manager on one stack: TensorBoard on the run dir (started on
        this host's network, before the launcher moves into its private namespace), the namespace (`--network`),
        and at the end each ps's memory peak (`--ps_memory_limit`, its cgroups removed) and each ps link's bytes.
        The cgroup controller is probed once, by the CLI (`check_memory_plan`); `prepare` makes the cgroups."""
        self._run_dir = run_dir
        with contextlib.ExitStack() as stack:
            stack.callback(self._report_link_bytes, console)
            stack.enter_context(_tensorboard(self.options.tensorboard_port, run_dir, console))
            stack.callback(self._end_memory_caps, console)
            argv = self.options.reexec_argv   # the re-executed launcher takes the run dir chosen here
            isolate_network(self.options.network,
                            None if argv is None else [*argv[:1], "--train_dir", str(run_dir), *argv[1:]],
                            self.options.ps_link_rate_bps is not None)
            yield

    def prepare(self, spec: ClusterSpec, text: str) -> None:
        """`--ps_link_rate`: a shaped link per ps port on `lo` (we are root in the run's own namespace here);
        `--ps_memory_limit`: a memory cgroup per ps."""
        from psworker.launcher import shaping

        self._make_memory_caps(len(spec.addresses("ps")))
        if self.options.ps_link_rate_bps is None:
            return
        link = shaping.LinkShaping(self.options.ps_link_rate_bps, tuple(a.port for a in spec.addresses("ps")),
                                   tuple(a.port for job in spec.jobs() if job != "ps" for a in spec.addresses(job)))
        try:
            shaping.install(link)
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
            raise UsageError(f"--ps_link_rate: cannot shape the ps links: {e}") from None
        self._shaping = link

    def link_bytes(self) -> Optional[list]:
        """`--ps_link_rate`: per ps, the bytes its link has carried so far (`shaping.PortBytes`); None unshaped."""
        from psworker.launcher import shaping

        return None if self._shaping is None else shaping.class_bytes(self._shaping)

    def _report_link_bytes(self, console: TextIO) -> None:
        """The bytes each ps link carried, from the tc class counters (after the run's report)."""
        from psworker.launcher import shaping

        if self._shaping is None:
            return
        try:
            counters = shaping.read_counters(self._shaping.dev)
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
            logger.warning("--ps_link_rate: could not read the tc counters: %s", e)
            return
        for line in shaping.report_lines(self._shaping, counters):
            print(f"psworker: {line}", file=console, flush=True)

    def banner(self, tasks: Sequence[Task], log_dir: Path) -> str:
        where = ", ".join(f"{t.name}={t.address}" for t in tasks)
        shaped = f"; {self._shaping.describe()}" if self._shaping is not None else ""
        return f"starting {len(tasks)} tasks on {LOCAL_HOST} ({where}){shaped}; logs in {log_dir}"

    def start(self, task: Task, env: Mapping[str, str]) -> subprocess.Popen:
        cgroup = self._cgroups.get(task.index) if task.job == "ps" else None
        if cgroup is None:
            return popen_task(self._popen, task.argv, env)
        cgroup.reset()
        kills = cgroup.oom_kills()          # before it starts: a kill at once still counts as its own
        proc = popen_task(self._popen, task.argv, env, before_exec=cgroup.joiner())
        self._capped[proc.pid] = (cgroup, kills)
        return proc

    def exit_cause(self, proc: subprocess.Popen, returncode: int) -> Optional[str]:
        """A capped ps that the kernel's OOM killer ended: `killed by the kernel: over its memory limit (...)`."""
        from psworker.launcher.cgroups import killed_over_limit

        cgroup, kills_before = self._capped.get(proc.pid, (None, None))
        return None if cgroup is None else killed_over_limit(cgroup, returncode, kills_before)

    def _make_memory_caps(self, num_ps: int) -> None:
        """`--ps_memory_limit`: one capped cgroup per ps, in the launcher's own (refuses, exit 2, if one cannot be
        made: nothing has started yet)."""
        from psworker.launcher import cgroups

        limit = self.options.ps_memory_limit_bytes
        if limit is None or self._cgroups:
            return
        parent, token = cgroups.own_memory_cgroup(), secrets.token_hex(4)
        if parent is None:
            raise UsageError("--ps_memory_limit: no cgroup v1 memory controller is mounted")
        cgroups.remove_stale(parent)
        try:
            for i in range(num_ps):
                self._cgroups[i] = cgroups.create(parent, cgroups.new_name(i, token), limit)
        except OSError as e:
            self._remove_memory_caps()
            raise UsageError(f"--ps_memory_limit: cannot make a memory cgroup in {parent}: {e}") from None
        logger.info("--ps_memory_limit: each ps in a memory cgroup of its own, capped at %d bytes: %s", limit,
                    ", ".join(str(c.path) for c in self._cgroups.values()))

    def _end_memory_caps(self, console: TextIO) -> None:
        """After the run's report: each ps's peak memory, then its cgroup removed."""
        from psworker.launcher.cgroups import peak_line

        try:
            if self._cgroups:
                print(f"psworker: {peak_line(self._cgroups, self._run_dir)}", file=console, flush=True)
        finally:
            self._remove_memory_caps()

    def _remove_memory_caps(self) -> None:
        for cgroup in self._cgroups.values():
            cgroup.remove()
        self._cgroups.clear()

    def signal(self, proc: subprocess.Popen, sig: int) -> None:
        _signal_group(proc.pid, sig)

    def terminate(self, procs: Sequence[subprocess.Popen]) -> None:
        """SIGTERM and SIGCONT to every task's group (an exited task may have left members), and SIGTERM to what
        the running ones started outside it."""
        self._strays = []
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(psutil.Error):
                    self._strays += psutil.Process(p.pid).children(recursive=True)
        for pgid in _live_group_members({p.pid for p in procs}):
            _signal_group(pgid, signal.SIGTERM)
            _signal_group(pgid, signal.SIGCONT)
        for proc in self._strays:
            with contextlib.suppress(psutil.Error):
                proc.terminate()

    def alive(self, procs: Sequence[subprocess.Popen]) -> list[str]:
        members = _live_group_members({p.pid for p in procs})
        pids = {pid for group in members.values() for pid in group} | {p.pid for p in self._strays if _alive(p)}
        pids |= {p.pid for p in procs if p.poll() is None}
        return [f"pid {pid}" for pid in sorted(pids)]

    def kill(self, procs: Sequence[subprocess.Popen]) -> None:
        for pgid in _live_group_members({p.pid for p in procs}):
            _signal_group(pgid, signal.SIGKILL)
        for proc in self._strays:
            with contextlib.suppress(psutil.Error):
                proc.kill()
