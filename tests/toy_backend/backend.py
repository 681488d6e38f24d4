"""The toy backend: every task runs on this machine as if on a host of its own, in its own directory
(`<run dir>/hosts/<job>-<index>/`), in its own process group. It supplies only what differs (`place`, `banner`,
`start`, `signal`); the skeleton, the supervisor and the teardown are psworker's."""

from __future__ import annotations

import contextlib
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Mapping, Optional, Sequence

from psworker.launcher.backends.base import Backend
from psworker.launcher.children import die_with_parent
from psworker.launcher.backends.local import resolve_local_spec
from psworker.launcher.rundir import SPEC_FILE
from psworker.spec.plan import Task
from psworker.spec import ClusterSpec

HOSTS = "hosts"


@dataclass(frozen=True)
class ToyOptions:
    """The toy backend's options: its name in the registry, and where its "hosts" are in the run dir."""

    BACKEND: ClassVar[str] = "toy"

    hosts_subdir: str = HOSTS


class ToyBackend(Backend):
    """Runs each task in `<run dir>/<hosts_subdir>/<job>-<index>/`, its own session; signals its group."""

    Options = ToyOptions
    LOCAL_PIDS = True
    run_dir: Optional[Path] = None

    def place(self, spec: ClusterSpec, run_dir: Path) -> ClusterSpec:
        self.run_dir = Path(run_dir).resolve()
        return resolve_local_spec(spec, self.run_dir)        # 127.0.0.1 and free ports, as the local backend

    def spec_path(self, run_dir: Path) -> str:
        return str(Path(run_dir).resolve() / SPEC_FILE)      # the tasks run elsewhere: an absolute path

    def banner(self, tasks: Sequence[Task], log_dir: Path) -> str:
        return f"starting {len(tasks)} toy tasks, each in its own dir under {self.run_dir}/{self.options.hosts_subdir}"

    def start(self, task: Task, env: Mapping[str, str]) -> subprocess.Popen:
        home = self.run_dir / self.options.hosts_subdir / task.name.replace(":", "-")
        home.mkdir(parents=True, exist_ok=True)
        return subprocess.Popen(list(task.argv), cwd=home, env=dict(env), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=die_with_parent())

    def signal(self, proc: subprocess.Popen, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
