"""The sbatch script `psworker slurm submit` writes: its `#SBATCH` lines (each value checked as Slurm reads it) and
the `psworker slurm launch` line that runs the slurm backend inside the allocation.
"""

from __future__ import annotations

import datetime
import os
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from psworker.errors import UsageError
from psworker.spec import DEFAULT_PORT_BASE

__all__ = ["DEFAULT_STOP_WARNING_SECS", "SCRIPT_NAME", "SUBMITTED_SPEC", "SbatchOptions", "check_nodes",
           "check_sbatch_value", "check_stop_warning", "check_time",
           "launch_argv", "sbatch_script", "write_sbatch_script"]

SCRIPT_NAME = "psworker.sbatch"
SUBMITTED_SPEC = "submitted-spec.yaml"
_SBATCH_VALUE = re.compile(r"[^\s'\"\\#]+\Z")
_NODES = re.compile(r"([1-9]\d*)(?:-([1-9]\d*))?\Z")
_TIME = re.compile(r"(?:\d+-)?\d+(?::\d+){0,2}\Z")
_TIME_FORMATS = "MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"
DEFAULT_STOP_WARNING_SECS = 120   # a step and a checkpoint; Slurm may send the signal up to 60 s early
_NO_TIME_LIMIT = ("-1", "INFINITE", "UNLIMITED")


def check_nodes(text: str) -> str:
    """An sbatch `--nodes` value: a count (`2`) or a range (`2-4`), each >= 1 and the range increasing (0 nodes,
    which sbatch takes, runs no task; count lists, `1,3`, need Slurm 23.02).

    Raises:
        ValueError: the message names the value and the forms taken.
    """
    m = _NODES.match(text)
    if m is None:
        raise ValueError(f"{text!r} is not a node count: use N (>= 1) or MIN-MAX")
    if m.group(2) is not None and int(m.group(2)) < int(m.group(1)):
        raise ValueError(f"{text!r}: the range goes backwards")
    return text


def check_time(text: str) -> str:
    """An sbatch `--time` limit in one of Slurm's forms: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS (each
    field a whole number; Slurm carries over, 1:90 is 2:30), or 0, -1, INFINITE, UNLIMITED: no limit.

    Raises:
        ValueError: the message names the value and Slurm's forms.
    """
    if text.upper() in _NO_TIME_LIMIT or _TIME.match(text):
        return text
    raise ValueError(f"{text!r} is not a Slurm time limit: use {_TIME_FORMATS} (0 or UNLIMITED: none)")


def check_sbatch_value(text: str) -> str:
    """A name or path for an `#SBATCH` line (partition, account, job name, output): one word sbatch reads as is,
    so no whitespace, control characters, quotes, '\\' or '#'.

    Raises:
        ValueError: the message names the value.
    """
    if not _SBATCH_VALUE.match(text) or any(ord(c) < 32 or ord(c) == 127 for c in text):
        raise ValueError(f"{text!r}: an #SBATCH value cannot be empty or hold whitespace, control characters, "
                         f"quotes, '\\' or '#'")
    return text


@dataclass(frozen=True)
class SbatchOptions:
    """The `#SBATCH` settings of a psworker job. `ntasks` is the spec's task count (None until the job's spec is
    read: the script needs it); the other None values leave Slurm's default."""

    ntasks: Optional[int] = None
    job_name: str = "psworker"
    nodes: Optional[str] = None          # a count or a range, e.g. "2" or "2-4"
    time: Optional[str] = None           # Slurm time, e.g. "1:00:00" or "2-00:00:00"
    partition: Optional[str] = None
    account: Optional[str] = None
    output: Optional[str] = None         # default: <run_dir>/slurm-%j.out
    overcommit: bool = False             # more tasks than CPUs (the ps tasks are mostly idle)
    stop_warning_secs: int = DEFAULT_STOP_WARNING_SECS   # SIGTERM to the launcher this long before the time limit

    def lines(self, run_dir: Path) -> list[str]:
        """The `#SBATCH --opt=value` lines (values checked: sbatch does not shell-parse them)."""
        if self.ntasks is None:
            raise ValueError("SbatchOptions.ntasks: the job's task count is not set")
        values = [("job-name", self.job_name), ("ntasks", str(self.ntasks)), ("nodes", self.nodes),
                  ("time", self.time), ("partition", self.partition), ("account", self.account),
                  ("output", self.output or str(run_dir / "slurm-%j.out")), ("chdir", str(run_dir))]
        out = []
        for name, value in values:
            if value is None:
                continue
            try:
                _SBATCH_CHECKS.get(name, check_sbatch_value)(value)
            except ValueError as e:
                raise UsageError(f"--{name}: {e}") from None
            out.append(f"#SBATCH --{name}={value}")
        if self.overcommit:
            out.insert(2, "#SBATCH --overcommit")
        if self.stop_warning_secs:   # B: the batch shell only, which is the launcher (exec): it stops the workers first
            out.append(f"#SBATCH --signal=B:TERM@{check_stop_warning(self.stop_warning_secs)}")
        return out


_SBATCH_CHECKS = {"nodes": check_nodes, "time": check_time}


def check_stop_warning(secs: int) -> int:
    """`--signal`'s warning time: 0 (none) to 65535 s, Slurm's limit.

    Raises:
        UsageError: out of range.
    """
    if not 0 <= secs <= 65535:
        raise UsageError(f"--stop_warning_secs: {secs} is not in 0..65535 (Slurm's --signal limit)")
    return secs


def launch_argv(spec_path: Union[str, os.PathLike], run_dir: Union[str, os.PathLike], *, python: str,
                port_base: int = DEFAULT_PORT_BASE, worker_flags: Sequence[str] = ()) -> list[str]:
    """`PYTHON -m psworker slurm launch SPEC --run_dir D --port_base P [worker flags]`: what the batch script runs."""
    return [python, "-m", "psworker", "slurm", "launch", os.fspath(spec_path), "--run_dir", os.fspath(run_dir),
            "--port_base", str(port_base), *worker_flags]


def sbatch_script(options: SbatchOptions, run_dir: Path, inner_argv: Sequence[str], *,
                  description: str = "") -> str:
    """The text of a readable, re-submittable batch script that runs `inner_argv` (each part shell-quoted)."""
    stamp = datetime.datetime.now().isoformat(timespec="seconds")
    header = [
        "#!/bin/bash",
        f"# psworker job{': ' + description if description else ''}",
        f"# Written by `psworker slurm submit` on {stamp}. Submit it again by hand with:",
        f"#   sbatch {shlex.quote(str(run_dir / SCRIPT_NAME))}",
        "# Inside the allocation, the line at the bottom starts one `srun` step per task (ps first, then",
        "# workers) on the nodes TensorFlow's SlurmClusterResolver would choose, and watches them.",
    ]
    if options.stop_warning_secs:
        header += ["# --signal=B:TERM@N: N s before the time limit Slurm sends SIGTERM to this script, which is the",
                   "# launcher: the workers stop after their running step, the chief writes a checkpoint, then the ps",
                   "# tasks stop; submitting the script again goes on from that checkpoint."]
    body = ["", "set -euo pipefail", "", "exec " + " ".join(shlex.quote(str(a)) for a in inner_argv)]
    return "\n".join(header + options.lines(run_dir) + body) + "\n"


def write_sbatch_script(run_dir: Union[str, os.PathLike], options: SbatchOptions, inner_argv: Sequence[str],
                        *, description: str = "") -> Path:
    """Writes `<run_dir>/psworker.sbatch` (mode 0755) and returns its path; run_dir must exist."""
    run_dir = Path(run_dir).resolve()
    path = run_dir / SCRIPT_NAME
    path.write_text(sbatch_script(options, run_dir, inner_argv, description=description))
    path.chmod(0o755)
    return path
