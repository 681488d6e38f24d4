"""Structured errors: each carries the process exit code the CLI returns for it.

Exit codes of every psworker task process (the launcher's restart policy and Kubeflow's TFJob `ExitCode`
policy both read them: 1-127 are permanent, 128-255 are retryable):

| code | constant | meaning | retried |
|---|---|---|---|
| 0 | EXIT_OK | done | - |
| 1 | EXIT_FAILED | an unexpected error (a bug, an unhandled exception) | no |
| 2 | EXIT_USAGE | bad spec, flags or TF_CONFIG; a refusal (batch larger than the data, existing export, ...) | no |
| 3 | EXIT_TRAINING_FAILED | training itself failed: NaN loss, bad data dir, unusable checkpoint | no |
| 4 | EXIT_DISK_FULL | a checkpoint, summary, export or log could not be written: disk full, quota, read-only | no |
| 170 | EXIT_PEER_GONE | a peer went away or did not answer in time (ps down, chief gone, step timeout) | yes |
| 171 | EXIT_PREEMPTED | an elastic job's worker got SIGTERM (a preemption), finished its step and left the job | yes |
| 128+N | - | killed by signal N (130 SIGINT, 137 SIGKILL, 143 SIGTERM) | yes |
"""

from __future__ import annotations

import contextlib
import difflib
from typing import Any, Iterable, Iterator, Mapping

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_TRAINING_FAILED = 3
EXIT_DISK_FULL = 4       # not retried: the same write fails again until someone frees space
EXIT_PEER_GONE = 170
EXIT_PREEMPTED = 171     # an elastic job's worker left on SIGTERM (a preemption); a worker scaled away exits 0


class PsworkerError(Exception):
    """Base class of every error psworker reports to a person (no traceback, just the message)."""

    exit_code: int = EXIT_FAILED


class SpecError(PsworkerError):
    """A cluster spec, TF_CONFIG or flag value is invalid.

    Renders as `SOURCE: FIELD_PATH: MESSAGE`, e.g.
    `cluster_specs/x.yaml: cluster.worker[1]: port 70000 is out of range 1-65535`.

    Attributes:
        source: where the value came from: a file path, `TF_CONFIG` or `--flags`.
        field_path: dotted path of the bad field (`cluster.worker[1]`, `train.mode`, `--max_steps`);
            empty when the problem is the whole input (empty file, YAML syntax).
        message: what is wrong, naming the bad value.
    """

    exit_code = EXIT_USAGE

    def __init__(self, source: str, field_path: str, message: str) -> None:
        self.source = str(source)
        self.field_path = field_path
        self.message = message
        super().__init__(str(self))

    def __str__(self) -> str:
        parts = [p for p in (self.source, self.field_path) if p]
        return ": ".join(parts + [self.message])

    def __reduce__(self):  # keep it picklable across processes despite the 3-argument constructor
        return (type(self), (self.source, self.field_path, self.message))


class SpecErrors(SpecError):
    """Every problem found in one input at once (a spec with `wroker:` and `max_step:` names both), one per line in
    the order found; raised only for two or more (`SpecProblems.raise_any`)."""

    def __init__(self, errors: "tuple[SpecError, ...]") -> None:
        self.errors = tuple(errors)
        first = self.errors[0]
        super().__init__(first.source, first.field_path, first.message)

    def __str__(self) -> str:
        return "\n".join(str(e) for e in self.errors)

    def __reduce__(self):
        return (type(self), (self.errors,))


class SpecProblems:
    """Collects the SpecErrors of checks that do not depend on each other, to report them together."""

    def __init__(self) -> None:
        self.errors: list[SpecError] = []

    @contextlib.contextmanager
    def check(self) -> Iterator[None]:
        """Runs the block; a SpecError it raises is kept (the block's further checks are skipped)."""
        try:
            yield
        except SpecErrors as e:
            self.errors.extend(e.errors)
        except SpecError as e:
            self.errors.append(e)

    def raise_any(self) -> None:
        """Raises what was kept: the one SpecError, or all of them as SpecErrors."""
        if len(self.errors) == 1:
            raise self.errors[0]
        if self.errors:
            raise SpecErrors(tuple(self.errors))


def describe_value(value: Any) -> str:
    """`bool true`, `int 5`, `str 'x'`, `list [...]`: a bad value and its type, for messages."""
    if isinstance(value, bool):
        return f"bool {str(value).lower()}"
    if value is None:
        return "null"
    kind = {dict: "mapping", list: "list"}.get(type(value), type(value).__name__)
    return f"{kind} {value!r}"


def unknown_key(key: Any, valid: Iterable[str], source: str, path: str) -> SpecError:
    """The SpecError for an unknown key, suggesting the closest valid one."""
    valid = list(valid)
    close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return SpecError(source, path, f"unknown key {key!r}{hint} (valid keys: {', '.join(valid)})")


class UsageError(PsworkerError):
    """The command line is inconsistent (conflicting flags, missing cluster source, index out of range)."""

    exit_code = EXIT_USAGE


class StartupTimeout(PsworkerError):
    """A task this one needs (a ps, or every task for the in-graph client) did not answer within the startup
    timeout; retried, since it may simply be late."""

    exit_code = EXIT_PEER_GONE


class PeerGone(PsworkerError):
    """A peer went away: the in-graph client vanished, or every worker left a ps without saying it was done."""

    exit_code = EXIT_PEER_GONE


class StepTimeout(PsworkerError):
    """One training step did not finish within `--step_timeout_secs` (a peer is down or overloaded)."""

    exit_code = EXIT_PEER_GONE


class AlreadyComplete(PsworkerError):
    """A worker started after training ended: the train_dir's newest checkpoint is at `--max_steps`. Not a
    failure: the worker exits 0."""

    exit_code = EXIT_OK

    def __init__(self, message: str, *, global_step: int) -> None:
        super().__init__(message)
        self.global_step = global_step


class LeftJob(PsworkerError):
    """An elastic job's worker left it on a signal: scaled away (SIGUSR2, exits 0) or preempted (SIGTERM, exits
    `EXIT_PREEMPTED`). Not a failure of the job."""

    def __init__(self, message: str, *, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class StoppedEarly(PsworkerError):
    """The training loop ended before the global step reached `--max_steps` (the chief closed the sync queue)."""

    exit_code = EXIT_PEER_GONE


class TrainingFailed(PsworkerError):
    """Training itself cannot succeed: NaN loss, an unusable data dir or checkpoint, an empty evaluation split."""

    exit_code = EXIT_TRAINING_FAILED


class DiskFull(PsworkerError):
    """A write failed for want of space: the disk is full, a quota is exceeded, or the file system is read-only
    (`psworker.diskspace.disk_full` recognises it in any exception). The message names the path and the free space.

    Attributes:
        path: the file that could not be written (None: not known).
    """

    exit_code = EXIT_DISK_FULL

    def __init__(self, message: str, *, path: "str | None" = None) -> None:
        super().__init__(message)
        self.path = path


class ServerError(PsworkerError):
    """This task cannot serve: its address is public, unresolvable, or its port is taken."""

    exit_code = EXIT_FAILED


class ClusterError(PsworkerError):
    """The Kubernetes API refused a request or cannot be reached."""

    exit_code = EXIT_FAILED


class UnreachableHosts(PsworkerError):
    """One or more hosts refused or did not answer an `ssh HOST true` before anything started."""

    exit_code = EXIT_FAILED

    def __init__(self, failures: Mapping[str, str]) -> None:
        self.failures = dict(failures)
        lines = "\n".join(f"  {host}: {why}" for host, why in self.failures.items())
        super().__init__(f"{len(self.failures)} host(s) unreachable over ssh; nothing was started:\n{lines}")


class SubmitError(PsworkerError):
    """sbatch refused the job or could not be run."""

    exit_code = EXIT_FAILED


class TensorBoardError(PsworkerError):
    """TensorBoard is not installed, exited, or did not answer in time."""


class ExportExistsError(PsworkerError):
    """The export directory of this global step exists already (exports are never overwritten): a refusal, so a
    usage error (exit 2).

    Attributes:
        path: that directory, when it holds a finished export (None: the final move failed).
    """

    exit_code = EXIT_USAGE

    def __init__(self, message: str, *, path: "str | None" = None) -> None:
        super().__init__(message)
        self.path = path


def op_error_line(exc: BaseException) -> str:
    """A TensorFlow `OpError`'s cause in one line: its message's first line that says something (TF 2's messages
    start "Graph execution error:", then a blank line, then the cause)."""
    lines = [line.strip() for line in (getattr(exc, "message", None) or str(exc)).splitlines()]
    said = [line for line in lines if line and not line.startswith(("Graph execution error", "Detected at node"))]
    return said[0] if said else type(exc).__name__


__all__ = ["op_error_line", "describe_value", "unknown_key", "EXIT_OK", "EXIT_FAILED", "EXIT_USAGE",
           "EXIT_TRAINING_FAILED", "EXIT_PEER_GONE", "EXIT_PREEMPTED", "LeftJob", "PsworkerError", "SpecError",
           "SpecErrors", "SpecProblems", "UsageError", "StartupTimeout", "PeerGone", "StepTimeout", "AlreadyComplete",
           "StoppedEarly", "EXIT_DISK_FULL", "DiskFull", "TrainingFailed", "ServerError", "ExportExistsError",
           "TensorBoardError", "UnreachableHosts", "SubmitError", "ClusterError"]
