"""A write that failed for want of space (a full disk, a quota, a read-only file system): recognised in any
exception (Python's `OSError`, TensorFlow's `OpError`, whose message ends `PATH; No space left on device`),
turned into `errors.DiskFull` naming the path and the free space (os.statvfs). Used by both sides: the task's
one error exit (`cli.main`) and the launcher's log copies."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path
from typing import Optional

from psworker.errors import DiskFull
from psworker.memory import format_size

__all__ = ["DISK_ERRNOS", "disk_full", "free_space", "is_disk_errno", "mount_point",
           "newest_checkpoint_bytes", "space_warning", "where_free", "write_atomically"]

DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)
_KINDS = {errno.ENOSPC: "disk full", errno.EDQUOT: "disk quota exceeded", errno.EROFS: "read-only file system"}
_STRERRORS = {os.strerror(code): code for code in DISK_ERRNOS}
# TensorFlow's file system errors read `<path>; <strerror>` (tsl's IOError), sometimes after `<what>: `.
_TF_MESSAGE = re.compile(r"(?P<path>[^\n;]*?); (?P<why>" + "|".join(map(re.escape, _STRERRORS)) + ")")


def is_disk_errno(err: BaseException) -> bool:
    """Whether `err` is an OSError for a full disk, an exceeded quota or a read-only file system."""
    return isinstance(err, OSError) and err.errno in DISK_ERRNOS


def _existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def mount_point(path: str) -> str:
    """The mount point of the file system that holds `path` (or would: its nearest existing ancestor)."""
    path = _existing(path)
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return path


def free_space(path: str) -> Optional[tuple[int, int]]:
    """(bytes free to an unprivileged user, bytes in all) of the file system that holds `path`; None if unknown."""
    try:
        st = os.statvfs(_existing(path))
    except OSError:
        return None
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def where_free(path: str) -> str:
    """`0 B free of 6.0 MiB on /mnt/train` for the file system holding `path`."""
    space = free_space(path)
    try:
        mount = mount_point(path)
    except OSError:
        mount = "?"
    if space is None:
        return f"free space unknown on {mount}"
    return f"{format_size(space[0])} free of {format_size(space[1])} on {mount}"


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _path_and_errno(exc: BaseException) -> Optional[tuple[str, int]]:
    if is_disk_errno(exc):
        return str(exc.filename or ""), exc.errno
    m = _TF_MESSAGE.search(getattr(exc, "message", None) or str(exc))
    if m is None:
        return None
    return m.group("path").rpartition(": ")[2].strip(), _STRERRORS[m.group("why")]


def disk_full(exc: BaseException) -> Optional[DiskFull]:
    """The `DiskFull` error for `exc` (or an exception in its chain) when it is a failed write for want of space
    or a read-only file system; None for anything else."""
    for err in _chain(exc):
        found = _path_and_errno(err)
        if found is not None:
            path, code = found
            what = f"{type(err).__name__}: {os.strerror(code)}"
            if not path:
                return DiskFull(f"{_KINDS[code]}: a write failed ({what})", path=None)
            return DiskFull(f"{_KINDS[code]}: cannot write {path} ({where_free(os.path.dirname(path) or '.')}; "
                            f"{what})", path=path)
    return None


_CHECKPOINT_FILE = re.compile(r"^(?P<prefix>.+-(?P<step>\d+))\.(?:index|meta|data-\d+-of-\d+)$")


def newest_checkpoint_bytes(train_dir: str) -> Optional[tuple[str, int]]:
    """(name, bytes on disk) of the newest checkpoint in `train_dir` by step (its .index, .meta and .data files),
    read from the file names alone (no TensorFlow); None when there is none."""
    sizes: dict[tuple[int, str], int] = {}
    try:
        entries = list(os.scandir(train_dir))
    except OSError:
        return None
    for entry in entries:
        m = _CHECKPOINT_FILE.match(entry.name)
        if m and entry.is_file():
            key = (int(m.group("step")), m.group("prefix"))
            sizes[key] = sizes.get(key, 0) + entry.stat().st_size
    if not sizes:
        return None
    (_, name), size = max(sizes.items())
    return name, size


def space_warning(train_dir: str) -> Optional[str]:
    """A warning when `train_dir`'s file system has less free space than two of its newest checkpoint (the one
    being written, and the state files and summaries around it): the next save may fail. None otherwise, or
    when the train dir holds no checkpoint yet."""
    newest, space = newest_checkpoint_bytes(train_dir), free_space(train_dir)
    if newest is None or space is None or space[0] >= 2 * newest[1]:
        return None
    return (f"{where_free(train_dir)}, less than two checkpoints need (the newest, {newest[0]}, takes "
            f"{format_size(newest[1])}): the next checkpoint may not fit")


def write_atomically(path: Path, text: str) -> None:
    """Writes `text` to `path` so that a reader sees the old file or the new one, never a part."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
    except OSError as err:       # a full disk fails the close, whose error names no file
        if err.filename is None:
            raise OSError(err.errno, err.strerror, str(tmp)) from err
        raise
    os.replace(tmp, path)
