"""SSH: the `ssh` argv that runs one task on a remote host (or, without a terminal, one command: `tty=False`).

A remote command travels to the remote login shell as one string, so it is built only from `shlex.quote`d
parts (POSIX quoting: the remote login shell must be sh-compatible: sh, bash, dash, zsh, ksh). The
environment is passed explicitly as `env K=V ...` in that string (no `SendEnv`/`AcceptEnv` needed on the
server).

**`-tt` (a remote pseudo-terminal), so the remote task dies with its connection.** Without a terminal the
remote process only notices a dropped connection when it next writes to its closed stdout (SIGPIPE); a
TensorFlow ps that is quietly serving would run on forever and keep its port. With a terminal, when the
connection ends (local ssh killed, even with SIGKILL, or the launcher gone), sshd closes the terminal and the
kernel sends SIGHUP to the remote session: the task (the session leader, through `exec`) dies. The costs, which
the launcher absorbs: stdout and stderr arrive merged on ssh's stdout (one log per task anyway; a terminal may
also turn line ends into `\\r\\n`), and ssh's own stdin must be /dev/null (`stdin=subprocess.DEVNULL`). OpenSSH
forwards no signals: a signal to local ssh ends the connection, and the remote task gets SIGHUP, not that signal.
A silently dead network (no FIN/RST) is noticed by the client after `ServerAliveInterval * ServerAliveCountMax`
(15 s): local ssh exits 255; the remote side then depends on the server's `ClientAliveInterval`/TCP keepalive.

Exit status of local ssh: the remote command's status, or 255 when ssh itself failed (connection, auth) or
the remote process was killed by a signal (the two are told apart only by ssh's stderr).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from typing import Optional, Union

from psworker.errors import UsageError

__all__ = ["SSH_OPTIONS", "remote_command", "ssh_argv"]

# Never prompt (a launcher has no person at the keyboard); detect a dead peer within 15 s.
SSH_OPTIONS = ("-o", "BatchMode=yes", "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_HOST = re.compile(r"[^\s\-][^\s]*\Z")

EnvLike = Union[Mapping[str, str], Iterable[tuple[str, str]]]


def _check_host(host: str) -> str:
    if not _HOST.match(host or ""):
        raise UsageError(f"ssh host {host!r}: must be non-empty, without spaces, and not start with '-'")
    return host


def remote_command(argv: Sequence[str], env: EnvLike = (), cwd: Optional[str] = None) -> str:
    """The one string the remote shell runs: `[cd DIR &&] exec env K=V ... ARGV...`, every part quoted.

    Args:
        argv: the program and its arguments (argv[0] must not contain '=', which `env` would read as a variable).
        env: variables for the task (a mapping or `(name, value)` pairs); names must be shell identifiers.
        cwd: remote working directory (default: the login directory).

    Raises:
        UsageError: empty argv, a bad variable name, or argv[0] containing '='.
    """
    if not argv:
        raise UsageError("remote command: empty argv")
    if "=" in argv[0]:
        raise UsageError(f"remote command: program {argv[0]!r} contains '=' (env would take it for a variable)")
    pairs = list(env.items() if isinstance(env, Mapping) else env)
    for name, _ in pairs:
        if not _ENV_NAME.match(str(name)):
            raise UsageError(f"remote command: environment variable name {name!r} is not a shell identifier")
    parts = ["exec", "env", *(f"{k}={v}" for k, v in pairs), *argv]
    command = " ".join(shlex.quote(str(p)) for p in parts)
    return f"cd {shlex.quote(cwd)} && {command}" if cwd is not None else command


def ssh_argv(host: str, argv: Sequence[str], *, env: EnvLike = (), cwd: Optional[str] = None,
             ssh_config: Optional[str] = None, ssh: str = "ssh", options: Sequence[str] = (),
             tty: bool = True) -> list[str]:
    """The local argv that runs one task on `host`: `ssh [-F cfg] -tt <options> -- HOST 'exec env ... argv'`.

    Run it with stdin=subprocess.DEVNULL. Killing this local ssh process (any signal) ends the remote task.
    With `tty=False` (no `-tt`): a one-off command (a host check, a remote kill), whose stdin may carry data.

    Args:
        host: `host` or `user@host` (ssh_config aliases work).
        argv: the task's argv on the remote host.
        env: the task's environment variables (see `remote_command`).
        cwd: remote working directory.
        ssh_config: a client config file (`ssh -F`); default: ssh's own (~/.ssh/config, /etc/ssh/ssh_config).
        ssh: the ssh program.
        options: extra ssh options, e.g. `("-p", "2222")` or `("-o", "ConnectTimeout=5")`.
    """
    config = ["-F", str(ssh_config)] if ssh_config is not None else []
    terminal = ["-tt"] if tty else []
    return [ssh, *config, *terminal, *SSH_OPTIONS, *options, "--", _check_host(host), remote_command(argv, env, cwd)]
