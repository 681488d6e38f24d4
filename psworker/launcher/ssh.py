"""The SSH backend: each task runs on the host its address names, over OpenSSH (`psworker.schedulers.ssh`: BatchMode,
`-tt` so the remote task dies with its connection, one `shlex.quote`d remote command).

`SshProcessBackend` is the `ProcessBackend`: start runs `ssh -tt HOST 'exec env K=V ... sh -c ... ARGV'` locally
(its own session, dying with the launcher); poll is local ssh's exit status (the task's, or 255 when ssh failed
or the task was killed by a signal); output is ssh's stdout with the terminal's `\\r` removed. SIGKILL ends the
local ssh (the remote task gets SIGHUP); other signals go through `ssh HOST kill -SIG PID`, the pid being the
first line the remote wrapper prints (not copied to the log). The module is a backend of `psworker.launcher`'s
registry (`prepare`, `processes`, `report_success`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, TextIO

from psworker import events
from psworker.errors import PsworkerError, SpecError, UsageError
from psworker.launcher.launch import PYTHON, SPEC, LaunchConfig
from psworker.launcher.policy import with_rejoin_grace
from psworker.launcher.process import die_with_parent
from psworker.launcher.report import RunResult
from psworker.plan import plan
from psworker.schedulers.ssh import require_reachable, run_on_hosts, ssh_argv
from psworker.spec import dump_spec

__all__ = ["SshProcessBackend", "prepare", "processes", "report_success"]

logger = logging.getLogger(__name__)

SPEC_FILE = "cluster.yaml"
LOG_SUBDIR = "logs"
SSH_COMMAND_TIMEOUT_SECS = 30.0
_REAP_TIMEOUT_SECS = 10.0
# Prints the remote pid (== the task's: `exec` keeps it), then becomes the task.
_PID_WRAPPER = ("sh", "-c", f'{events.RemotePid.shell_echo()}; exec "$@"', "sh")
# Variables shipped to every task besides those the launcher set for it (its env minus the launcher's own).
SHIPPED_ALWAYS = ("PYTHONUNBUFFERED",)


def _options(config: LaunchConfig) -> dict[str, Any]:
    opts = dict(config.backend_options)
    return {"ssh_config": opts.get("ssh_config"), "options": tuple(opts.get("ssh_options", ())),
            "remote_dir": opts.get("remote_dir")}


def _check_hosts(config: LaunchConfig) -> list[str]:
    spec = config.spec
    for job in spec.jobs():
        for i, a in enumerate(spec.addresses(job)):
            if a.port == 0:
                raise SpecError(spec.source or "spec", f"cluster.{job}[{i}]",
                                f"port 'auto' cannot be chosen on a remote host; give {a.host} a fixed port")
    return list(dict.fromkeys(a.host for job in spec.jobs() for a in spec.addresses(job)))


def _ship_spec(hosts: Sequence[str], text: str, remote_dir: str, ssh_config: Optional[str],
               options: Sequence[str]) -> None:
    """Writes `<remote_dir>/cluster.yaml` on every host at once (stdin of one ssh per host, renamed into place)."""
    script = 'mkdir -p "$1" && cat > "$1/.cluster.yaml.$$" && mv -f "$1/.cluster.yaml.$$" "$1/cluster.yaml"'
    failures = run_on_hosts(hosts, ["sh", "-c", script, "sh", remote_dir], ssh_config=ssh_config,
                            timeout=SSH_COMMAND_TIMEOUT_SECS, options=options, stdin=text.encode())
    if failures:
        raise PsworkerError("could not write the spec to " + "; ".join(
            f"{host}:{remote_dir}/{SPEC_FILE}: {why}" for host, why in failures.items()) + "; nothing was started")


def prepare(config: LaunchConfig, console: TextIO) -> tuple[LaunchConfig, list]:
    """Checks every host over ssh (in parallel) before anything starts, makes the run dir here (cluster.yaml,
    logs/), writes the spec to `<remote_dir>/cluster.yaml` on every host, and returns the tasks.

    Raises:
        SpecError: an automatic port. UnreachableHosts: a host refused or did not answer (each one named).
    """
    from psworker.launcher.local import default_train_dir

    if config.command:
        raise UsageError("the ssh backend runs psworker's own trainer; `psworker run` is not supported on it")
    opts = _options(config)
    hosts = _check_hosts(config)
    require_reachable(hosts, ssh_config=opts["ssh_config"], options=opts["options"])
    spec = config.spec
    if config.train_dir or spec.train.train_dir:
        run_dir = Path(config.train_dir or spec.train.train_dir).resolve()
        run_dir.mkdir(parents=True, exist_ok=True)
    else:
        run_dir = default_train_dir(spec).resolve()
        print(f"psworker: train_dir is {run_dir}", file=console, flush=True)
    remote_dir = opts["remote_dir"] or str(run_dir)
    spec = dataclasses.replace(spec, train=dataclasses.replace(spec.train, train_dir=str(run_dir)))
    text = dump_spec(spec)
    (run_dir / LOG_SUBDIR).mkdir(exist_ok=True)
    tmp = run_dir / f".{SPEC_FILE}.{os.getpid()}.tmp"
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, run_dir / SPEC_FILE)
    _ship_spec(hosts, text, remote_dir, opts["ssh_config"], opts["options"])
    config = dataclasses.replace(config, spec=spec, train_dir=str(run_dir),
                                 backend_options=tuple({**dict(config.backend_options), "remote_dir": remote_dir}.items()))
    tasks = with_rejoin_grace(plan(spec, SPEC, python=PYTHON), config.policy)
    where = ", ".join(f"{t.name}={t.address.host}:{t.address.port}" for t in tasks)
    print(f"psworker: starting {len(tasks)} tasks over ssh ({where}); spec in {remote_dir}/{SPEC_FILE} on each "
          f"host; logs in {run_dir / LOG_SUBDIR}", file=console, flush=True)
    return config, tasks


def processes(config: LaunchConfig) -> "SshProcessBackend":
    """One ssh connection per task start; PYTHON is `config.python` on the remote hosts."""
    opts = _options(config)
    hosts = {tuple(t.argv): t.address.host
             for t in with_rejoin_grace(plan(config.spec, SPEC, python=PYTHON), config.policy)}
    remote_dir = opts["remote_dir"] or config.train_dir
    return SshProcessBackend(hosts, symbols={PYTHON: config.python, SPEC: f"{remote_dir}/{SPEC_FILE}"},
                             cwd=remote_dir, ssh_config=opts["ssh_config"], options=opts["options"])


def report_success(config: LaunchConfig, result: RunResult, seconds: float, console: TextIO) -> None:
    """The local backend's report (the chief's checkpoints are in train_dir on its host)."""
    from psworker.launcher import local
    local.report_success(config, result, seconds, console)


class _RemoteOutput:
    """ssh's stdout as the supervisor reads it: `\\r\\n` -> `\\n`, and the remote wrapper's pid line taken out."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self._first = True
        self.pid: Optional[int] = None

    def readline(self) -> bytes:
        line = self._raw.readline()
        if self._first:
            self._first = False
            said = events.RemotePid.parse(line.decode("utf-8", "replace"))
            if said is not None:
                self.pid = said.pid
                line = self._raw.readline()
        if line.endswith(b"\r\n"):
            line = line[:-2] + b"\n"
        return line.replace(b"\r", b"")

    def close(self) -> None:
        self._raw.close()


class SshProcessBackend:
    """Runs each task on its host over one `ssh -tt` connection; the task ends when the connection does."""

    def __init__(self, hosts: Mapping[tuple, str], *, symbols: Optional[Mapping[str, str]] = None,
                 cwd: Optional[str] = None, ssh_config: Optional[str] = None, options: Sequence[str] = (),
                 ssh: str = "ssh") -> None:
        """Args:
            hosts: the host of each task, by its (symbolic) argv.
            symbols: argv tokens to replace whole (PYTHON, SPEC) with their remote values.
            cwd: the tasks' remote working directory.
            ssh_config, options, ssh: as `psworker.schedulers.ssh.ssh_argv`.
        """
        self._hosts = dict(hosts)
        self._symbols = dict(symbols or {})
        self._cwd, self._config, self._options, self._ssh = cwd, ssh_config, tuple(options), ssh
        self._where: dict[int, str] = {}       # local ssh pid -> host

    def start(self, argv: Sequence[str], env: Mapping[str, str]) -> subprocess.Popen:
        try:
            host = self._hosts[tuple(argv)]
        except KeyError:
            raise UsageError(f"ssh backend: no task of this run has argv {list(argv)}") from None
        shipped = {k: v for k, v in env.items() if k in SHIPPED_ALWAYS or os.environ.get(k) != v}
        real = [*_PID_WRAPPER, *(self._symbols.get(a, a) for a in argv)]
        proc = subprocess.Popen(ssh_argv(host, real, env=shipped, cwd=self._cwd, ssh_config=self._config,
                                         ssh=self._ssh, options=self._options),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=die_with_parent())
        proc.stdout = _RemoteOutput(proc.stdout)
        self._where[proc.pid] = host
        return proc

    def _remote_kill(self, proc: subprocess.Popen, script: str) -> Optional[subprocess.Popen]:
        """Starts `ssh HOST sh -c SCRIPT sh PID` for the task's remote pid; None when the pid is not known yet."""
        pid = getattr(proc.stdout, "pid", None)
        if pid is None:
            return None
        argv = ssh_argv(self._where[proc.pid], ["sh", "-c", script, "sh", str(pid)], ssh_config=self._config,
                        ssh=self._ssh, options=self._options)
        argv.remove("-tt")
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)

    def signal(self, proc: subprocess.Popen, sig: int) -> None:
        if proc.poll() is not None:
            return                              # connection gone: the remote task got SIGHUP with it
        if sig != signal.SIGKILL:
            name = signal.Signals(sig).name.removeprefix("SIG")
            killer = self._remote_kill(proc, f'kill -{name} "$1"')
            if killer is not None:
                try:
                    killer.wait(SSH_COMMAND_TIMEOUT_SECS)
                    return
                except subprocess.TimeoutExpired:
                    killer.kill()
                    killer.wait()
            if sig in (signal.SIGSTOP, signal.SIGCONT, signal.SIGUSR1):   # SIGUSR1: a request for its stacks
                logger.warning("could not send %s to the remote task of ssh pid %d", name, proc.pid)
                return
        with contextlib.suppress(ProcessLookupError):
            proc.kill()                         # ends the connection: the remote task gets SIGHUP

    def stop(self, procs: Sequence[subprocess.Popen], grace_secs: float) -> None:
        running = [p for p in procs if p.poll() is None]
        killers = [self._remote_kill(p, 'kill -CONT "$1" 2>/dev/null; kill -TERM "$1"') for p in running]
        deadline = time.monotonic() + grace_secs
        for killer in killers:
            if killer is not None:
                try:
                    killer.wait(max(0.1, min(deadline - time.monotonic(), SSH_COMMAND_TIMEOUT_SECS)))
                except subprocess.TimeoutExpired:
                    killer.kill()
                    killer.wait()
        while any(p.poll() is None for p in running) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in running if p.poll() is None]
        if left:
            logger.warning("still running %.1f s after SIGTERM, closing their connections: %s", grace_secs,
                           ", ".join(self._where[p.pid] for p in left))
        for p in left:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
        for p in running:
            try:
                p.wait(_REAP_TIMEOUT_SECS)
            except subprocess.TimeoutExpired:
                logger.error("ssh pid %d survived SIGKILL", p.pid)
