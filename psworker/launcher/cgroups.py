"""`--ps_memory_limit`: a real memory cap per ps task, with the cgroup v1 memory controller.

One cgroup per ps (`psworker-<launcher pid>-<token>-ps-<i>`), made inside the launcher's own memory cgroup (so a
container's limit still holds above it): `memory.limit_in_bytes` (and `memory.memsw.limit_in_bytes` where swap is
accounted, so the cap cannot be swapped around). The task joins it in its own process between fork and exec
(`joiner`, a preexec step), so everything the interpreter and TensorFlow allocate is charged to it and anything it
starts inherits it: no window in which it runs uncapped. Over the cap the kernel's OOM killer ends it with SIGKILL;
`oom_kills` tells that exit apart from any other SIGKILL. Every cgroup made is removed at the end (`remove`), and
ones an earlier launcher left behind (it was killed) are removed when empty (`remove_stale`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional

from psworker import events
from psworker.deadline import poll_until
from psworker.launcher.rundir import LOG_SUBDIR, task_log_name
from psworker.memory import format_mib, format_size

__all__ = ["MemoryCgroup", "create", "killed_over_limit", "new_name", "own_memory_cgroup", "peak_line", "remove_stale",
           "unavailable"]

logger = logging.getLogger(__name__)

PREFIX = "psworker-"
_STALE = re.compile(rf"^{PREFIX}(\d+)-[0-9a-f]+-ps-\d+$")
REMOVE_TIMEOUT_SECS = 5.0


def _memory_mount() -> Optional[tuple[str, str]]:
    """(mount point, the hierarchy's path mounted there) of the cgroup v1 memory controller; None if not mounted."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, after = left.split(), right.split()
        if len(fields) >= 5 and len(after) >= 3 and after[0] == "cgroup" and "memory" in after[2].split(","):
            return fields[4], fields[3]
    return None


def own_memory_cgroup() -> Optional[Path]:
    """The directory of this process's memory cgroup (v1), or the controller's mount point where that directory is
    not visible; None without a v1 memory controller."""
    mount = _memory_mount()
    if mount is None:
        return None
    point, root = mount
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return Path(point)
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            rel = os.path.relpath(path, root) if path.startswith(root) else "."
            own = Path(point) / rel
            return own if rel != ".." and not rel.startswith("../") and own.is_dir() else Path(point)
    return Path(point)


def unavailable() -> Optional[str]:
    """Why a memory cgroup cannot be made here, in words; None when it can (a probe cgroup is made and removed)."""
    if not sys.platform.startswith("linux"):
        return "it needs Linux's cgroup v1 memory controller"
    parent = own_memory_cgroup()
    if parent is None:
        v2 = Path("/sys/fs/cgroup/cgroup.controllers").exists() or Path("/sys/fs/cgroup/unified").is_dir()
        return ("this machine has cgroup v2 only (no cgroup v1 memory controller is mounted)" if v2
                else "no cgroup v1 memory controller is mounted")
    probe = parent / f"{PREFIX}probe-{os.getpid()}-{secrets.token_hex(3)}"
    try:
        probe.mkdir()
    except OSError as e:
        why = "needs root" if isinstance(e, PermissionError) or os.geteuid() != 0 else e.strerror
        return f"cannot create a memory cgroup in {parent} ({why})"
    with contextlib.suppress(OSError):
        probe.rmdir()
    return None


@dataclass(frozen=True)
class MemoryCgroup:
    """One ps task's memory cgroup: `path`, capped at `limit` bytes."""

    path: Path
    limit: int

    def _read(self, name: str) -> str:
        return (self.path / name).read_text()

    def _write(self, name: str, value: str) -> None:
        (self.path / name).write_text(value)

    def joiner(self) -> Callable[[], None]:
        """A preexec step: the forked child moves itself into this cgroup before it executes the task (plain
        system calls only, as the child of a threaded launcher must)."""
        procs = os.fsencode(self.path / "cgroup.procs")

        def join() -> None:
            fd = os.open(procs, os.O_WRONLY)
            try:
                os.write(fd, b"%d" % os.getpid())
            finally:
                os.close(fd)

        return join

    def reset(self) -> None:
        """Before a new attempt: its peak and failure count start again from now."""
        for name in ("memory.max_usage_in_bytes", "memory.failcnt"):
            with contextlib.suppress(OSError):
                self._write(name, "0")

    def peak(self) -> Optional[int]:
        """The most it has held since the last `reset` (`memory.max_usage_in_bytes`: page cache included)."""
        try:
            return int(self._read("memory.max_usage_in_bytes"))
        except (OSError, ValueError):
            return None

    def oom_kills(self) -> Optional[int]:
        """How many processes the OOM killer has ended in it (`memory.oom_control`'s `oom_kill`; kernels before
        4.13 lack it: then its `memory.failcnt`, which also counts page cache reclaimed at the limit)."""
        try:
            fields = dict(line.split() for line in self._read("memory.oom_control").splitlines() if line.strip())
            if "oom_kill" in fields:
                return int(fields["oom_kill"])
            return int(self._read("memory.failcnt"))
        except (OSError, ValueError):
            return None

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in self._read("cgroup.procs").split()]
        except (OSError, ValueError):
            return []

    def remove(self) -> None:
        """Ends what is left in it (ours: the launcher's teardown has run), then removes it; a failure is logged."""
        errors: list[OSError] = []

        def removed() -> bool:
            for pid in self.pids():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            try:
                self.path.rmdir()
            except FileNotFoundError:
                pass
            except OSError as e:
                errors.append(e)
                return False
            return True

        if not poll_until(removed, REMOVE_TIMEOUT_SECS, interval=0.05):
            logger.warning("cannot remove the memory cgroup %s: %s (pids in it: %s)", self.path, errors[-1].strerror,
                           " ".join(map(str, self.pids())) or "none")


def create(parent: Path, name: str, limit: int) -> MemoryCgroup:
    """Makes the cgroup `parent/name` capped at `limit` bytes (RAM, and RAM plus swap where swap is accounted).

    Raises:
        OSError: it cannot be made or capped (it is removed again).
    """
    cgroup = MemoryCgroup(parent / name, limit)
    cgroup.path.mkdir()
    try:
        cgroup._write("memory.limit_in_bytes", str(limit))
        if (cgroup.path / "memory.memsw.limit_in_bytes").exists():
            with contextlib.suppress(OSError):       # swap accounting off: there is no swap to charge
                cgroup._write("memory.memsw.limit_in_bytes", str(limit))
    except OSError:
        cgroup.remove()
        raise
    return cgroup


def new_name(index: int, token: str) -> str:
    """`psworker-<launcher pid>-<token>-ps-<index>`: unique per launcher (`token`: one per run)."""
    return f"{PREFIX}{os.getpid()}-{token}-ps-{index}"


def remove_stale(parent: Path) -> None:
    """Removes the empty ps cgroups of launchers that are gone (killed before they could remove their own)."""
    for path in parent.glob(f"{PREFIX}*-ps-*"):
        m = _STALE.match(path.name)
        if m is None or _alive(int(m[1])):
            continue
        cgroup = MemoryCgroup(path, 0)
        if not cgroup.pids():
            with contextlib.suppress(OSError):
                path.rmdir()
                logger.info("removed %s, left behind by launcher pid %s", path, m[1])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def killed_over_limit(cgroup: MemoryCgroup, returncode: int, kills_before: Optional[int]) -> Optional[str]:
    """`killed by the kernel: over its memory limit (--ps_memory_limit 1.0 GiB; peak 1.0 GiB)` when the task's
    SIGKILL came from the OOM killer in its cgroup (its count went up since the task started); else None."""
    if returncode not in (-int(signal.SIGKILL), 128 + int(signal.SIGKILL)):
        return None
    kills = cgroup.oom_kills()
    if kills is None or kills <= (kills_before or 0):
        return None
    peak = cgroup.peak()
    return (f"killed by the kernel: over its memory limit (--ps_memory_limit {format_size(cgroup.limit)}; "
            f"peak {'?' if peak is None else format_size(peak)})")


def peak_line(cgroups: Mapping[int, MemoryCgroup], run_dir: Optional[Path]) -> str:
    """After the run: each ps's peak memory, as its own count of resident memory (the RSS its last line gives,
    `events.PsDone`; `?` for a ps that did not exit by itself) and as its cgroup's, page cache included."""
    limits = {c.limit for c in cgroups.values()}
    parts = []
    for index, cgroup in sorted(cgroups.items()):
        rss, peak = _ps_peak_rss(run_dir, f"ps:{index}"), cgroup.peak()
        parts.append(f"ps:{index} {'?' if rss is None else format_mib(rss)} / "
                     f"{'?' if peak is None else format_mib(peak)}")
    limit = "/".join(f"{format_size(n)} ({format_mib(n)})" for n in sorted(limits))
    return (f"--ps_memory_limit {limit} per ps; peak memory (RSS / the cgroup's, page cache included): "
            + ", ".join(parts))


def _ps_peak_rss(run_dir: Optional[Path], name: str) -> Optional[int]:
    if run_dir is None:
        return None
    try:
        text = (run_dir / LOG_SUBDIR / task_log_name(name)).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    done = events.last(events.PsDone, events.current_attempt(text))
    return None if done is None else done.peak_rss
