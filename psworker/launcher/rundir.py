"""The run directory: chosen once per run (given, or a fresh `runs/<spec>-<time>`), and holding the run's
resolved `cluster.yaml` (`SPEC_FILE`) and `logs/<job>-<index>.log` (`LOG_SUBDIR`, `task_log_name`), written once,
here."""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Optional, TextIO, Union

from psworker.spec import ClusterSpec, CountSpec, dump_spec

__all__ = ["LOG_SUBDIR", "SPEC_FILE", "choose_run_dir", "fresh_run_dir", "task_log_name", "write_atomically",
           "write_run_dir"]

SPEC_FILE = "cluster.yaml"        # the run's resolved spec, in the run dir (and where remote tasks read it)
LOG_SUBDIR = "logs"


def task_log_name(task: str) -> str:
    """`worker-0.log`: the log file of task `worker:0` in `LOG_SUBDIR`."""
    return f"{task.replace(':', '-')}.log"


def fresh_run_dir(spec: Union[ClusterSpec, CountSpec], base: Union[str, os.PathLike] = ".") -> Path:
    """A fresh `runs/<spec file stem>-YYYYmmdd-HHMMSS[-N]` under `base`, created here (never reused)."""
    stem = Path(spec.source).stem if spec.source else "cluster"
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    runs = Path(base) / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    for n in range(1000):
        path = runs / (f"{stem}-{stamp}" + (f"-{n}" if n else ""))
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"no free run directory name under {runs} for {stem}-{stamp}")


def choose_run_dir(given: Optional[Union[str, os.PathLike]], spec: Union[ClusterSpec, CountSpec],
                   console: Optional[TextIO]) -> Path:
    """The run's directory: `given`, else the spec's train_dir (either made if missing), else a fresh one under
    `runs/` here, so that a rerun never resumes by surprise (its path is printed on `console`)."""
    chosen = given or spec.train.train_dir
    if chosen:
        path = Path(chosen)
        path.mkdir(parents=True, exist_ok=True)
        return path
    path = fresh_run_dir(spec)
    if console is not None:
        print(f"psworker: train_dir is {path}", file=console, flush=True)
    return path


def write_atomically(path: Path, text: str) -> None:
    """Writes `text` to `path` so that a reader sees the old file or the new one, never a part."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_run_dir(run_dir: Path, spec: ClusterSpec) -> str:
    """Writes `<run_dir>/cluster.yaml` (the spec every task reads) and makes `logs/`; returns the spec's text."""
    text = dump_spec(spec)
    (run_dir / LOG_SUBDIR).mkdir(parents=True, exist_ok=True)
    write_atomically(run_dir / SPEC_FILE, text)
    return text
