"""The run directory: chosen once per run (given, or a fresh `runs/<spec>-<time>`), and holding the run's
resolved `cluster.yaml` (`SPEC_FILE`), `logs/<job>-<index>.log` (`LOG_SUBDIR`, `task_log_name`), written once,
here, and a failed task's `logs/<job>-<index>.error.json` (`task_error_name`). An earlier run of another model
there is refused before anything is written (`check_earlier_run`)."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
from pathlib import Path
from typing import Optional, TextIO, Union

import yaml

from psworker.diskspace import write_atomically
from psworker.errors import UsageError
from psworker.states import RunState
from psworker.spec import ClusterSpec, CountSpec, TrainConfig, dump_spec

__all__ = ["ELASTIC_FILE", "END_FILE", "LOG_SUBDIR", "SPEC_FILE", "RunEnd", "check_earlier_run", "choose_run_dir",
           "fresh_run_dir", "read_elastic_state", "read_end", "read_json", "task_error_name", "task_log_name",
           "write_end", "write_run_dir"]

SPEC_FILE = "cluster.yaml"        # the run's resolved spec, in the run dir (and where remote tasks read it)
LOG_SUBDIR = "logs"
END_FILE = "ended.json"   # how the run ended, written by its launcher (`psworker status` reads it)
ELASTIC_FILE = "elastic.json"   # an elastic job's launcher state (`scale_inbox.ScaleInbox` writes it)
_CHECKPOINT_FILE = re.compile(r"^model\.ckpt-(\d+)\.")   # the chief's checkpoints (`train.checkpoints` names them)


def task_log_name(task: str) -> str:
    """`worker-0.log`: the log file of task `worker:0` in `LOG_SUBDIR`."""
    return f"{task.replace(':', '-')}.log"


def task_error_name(task: str) -> str:
    """`worker-0.error.json`: the error file (`psworker.errorfile`) of task `worker:0`'s attempt, beside its log."""
    return f"{task.replace(':', '-')}.error.json"


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


def _earlier_run(run_dir: Path) -> Optional[tuple[str, int]]:
    """`(model, newest checkpoint step)` of the earlier run in `run_dir`: the model its cluster.yaml names, where
    checkpoint files are there too; else None (no earlier run, or nothing of it to lose)."""
    steps = [int(m[1]) for name in (os.listdir(run_dir) if run_dir.is_dir() else ())
             if (m := _CHECKPOINT_FILE.match(name))]
    if not steps:
        return None
    try:
        recorded = yaml.safe_load((run_dir / SPEC_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    train = (recorded.get("train") or {}) if isinstance(recorded, dict) else None
    model = train.get("model", TrainConfig().model) if isinstance(train, dict) else None
    return (model, max(steps)) if isinstance(model, str) else None


def check_earlier_run(run_dir: Optional[Union[str, os.PathLike]], train: TrainConfig) -> None:
    """Refuses, before anything is written there, a run of psworker's trainer in a run dir whose checkpoints are
    another model's (its chief would refuse them only after the launcher had rewritten cluster.yaml, which names the
    model that `psworker eval` and `export` then use); `allow_fresh_start` lets it start afresh there.

    Raises:
        UsageError: the run dir holds another model's run.
    """
    earlier = _earlier_run(Path(run_dir)) if run_dir else None
    if earlier is None or earlier[0] == train.model or train.allow_fresh_start:
        return
    model, step = earlier
    raise UsageError(f"train dir {run_dir} holds a run of model {model} (its {SPEC_FILE}; checkpoints up to global "
                     f"step {step}), not {train.model}: pass --model {model} to go on with it, or give another "
                     f"--train_dir (--allow_fresh_start true starts {train.model} there afresh, over its checkpoints)")


def write_run_dir(run_dir: Path, spec: ClusterSpec) -> str:
    """Writes `<run_dir>/cluster.yaml` (the spec every task reads) and makes `logs/`; returns the spec's text."""
    text = dump_spec(spec)
    (run_dir / LOG_SUBDIR).mkdir(parents=True, exist_ok=True)
    write_atomically(run_dir / SPEC_FILE, text)
    return text


@dataclasses.dataclass(frozen=True)
class RunEnd:
    """How a launcher's run ended: `succeeded`, `failed` or `stopped` (by a signal), with the launcher's exit
    status, its reason in words, the first failing task (if any), how long it ran and when it ended."""

    outcome: str
    exit_status: int
    reason: str
    seconds: float
    ended_at: str                   # local time, `YYYY-MM-DD HH:MM:SS`
    first_failure: Optional[str] = None

    def describe(self) -> str:
        """`succeeded in 61.3 s (exit 0) at 2026-12-02 18:30:01` and the like, for people."""
        what = "was stopped" if self.outcome == RunState.STOPPED else self.outcome
        why = f": {self.reason}" if self.reason and self.outcome != RunState.SUCCEEDED else ""
        return f"{what} after {self.seconds:.1f} s (exit {self.exit_status}) at {self.ended_at}{why}"


def write_end(run_dir: Path, end: Optional[RunEnd]) -> None:
    """Records how the run ended in `<run_dir>/ended.json`; None removes an earlier run's record (a new run starts
    in the same directory)."""
    path = Path(run_dir) / END_FILE
    if end is None:
        path.unlink(missing_ok=True)
    else:
        write_atomically(path, json.dumps(dataclasses.asdict(end), indent=2) + "\n")


def read_end(run_dir: Path) -> Optional[RunEnd]:
    """The launcher's record of how the run ended, or None (still running, started elsewhere, or unreadable)."""
    try:
        return RunEnd(**json.loads((Path(run_dir) / END_FILE).read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        return None


def read_json(path: Path) -> Optional[dict]:
    """The JSON object in `path`; None when it is missing, unreadable or not an object."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def read_elastic_state(run_dir: Union[str, os.PathLike]) -> Optional[dict]:
    """An elastic job's launcher state file of `run_dir` (see `scale_inbox`); None when there is none."""
    return read_json(Path(run_dir) / ELASTIC_FILE)
