"""The `psworker` command line: `main` parses the flags (`parser`: every subcommand in one table), and each command
(one small module per family: `specs`, `tasks`, `launchers`, `slurm`, `k8s`, `outputs`) builds one config and calls
one function below. Errors are reported here, once.

Heavy modules (TensorFlow, the trainer, backends) are imported inside the commands that need them, so
`validate`, `plan` and `tf-config` stay fast.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from typing import ContextManager, Optional

from psworker import environment, errorfile, events
from psworker.cli.parser import LAUNCHER, TASK, build_parser
from psworker.diskspace import disk_full
from psworker.errors import EXIT_FAILED, EXIT_USAGE, PsworkerError
from psworker.models import registry

__all__ = ["main", "build_parser"]

log = logging.getLogger(__name__)


def _configure_logging(args: argparse.Namespace) -> None:
    """A task logs with timestamps (its output is a log file); every other command talks to a person, in
    `psworker: ...` lines (`psworker: warning: ...`), as the launchers do."""
    if args.kind == TASK:
        logging.basicConfig(level=logging.INFO, format=events.LOG_FORMAT, stream=sys.stderr)
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_people_formatter())
    verbose = args.kind == LAUNCHER and args.verbose
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, handlers=[handler])


def _people_formatter() -> logging.Formatter:
    """psworker's own records as `psworker: ...`; another library's (TensorFlow's, in `export`) in the log format,
    never passed off as psworker's (`cli.quiet` hides its chatter)."""
    from psworker.launcher.console.lines import PeopleFormatter

    class Formatter(PeopleFormatter):
        plain = logging.Formatter(events.LOG_FORMAT)

        def format(self, record: logging.LogRecord) -> str:
            own = record.name == "psworker" or record.name.startswith("psworker.") or record.name == "__main__"
            return super().format(record) if own else self.plain.format(record)

    return Formatter()


def _print_error(exc: PsworkerError, cause: Optional[BaseException] = None) -> int:
    """The one place that reports an error: `psworker: error: MESSAGE` on stderr for a person, and the error file
    the launcher asked for (`errorfile.report`). Returns the exit code."""
    return errorfile.report(exc, exc.exit_code, cause=cause)


def _quiet(args: argparse.Namespace) -> ContextManager[None]:
    """A one-shot command that imports TensorFlow runs with its C++ start-up chatter hidden (`cli.quiet`)."""
    if not args.quiet_tf:
        return contextlib.nullcontext()
    from psworker.cli.quiet import cpp_chatter_hidden

    return cpp_chatter_hidden()


def _parse(given: list[str]) -> argparse.Namespace:
    """The parsed flags (`command`: the subcommand), with `user_command` the words after `--`
    (a command's own, for those that take one).

    Raises:
        SystemExit: --help, or a usage error (argparse printed it).
    """
    at = given.index("--") if "--" in given else len(given)
    parser = build_parser()
    args = parser.parse_args(given[:at])
    if at < len(given) and not args.takes_command:
        parser.parse_args(given)           # argparse's own error for the words after `--`
    args.user_command = given[at + 1:]
    return args


def main(argv: Optional[list[str]] = None) -> int:
    """Runs the `psworker` command line.

    A task process (`psworker ps|worker` run as a command) leaves through `task.hard_exit.exit_now` right here, after
    flushing: TensorFlow's threads can keep a normal interpreter exit waiting on a dead peer.

    Args:
        argv: arguments without the program name (default: `sys.argv[1:]`).

    Returns:
        The exit status: 0 on success, the error's `exit_code` (see `psworker.errors`), 130 on Ctrl-C.
    """
    try:   # a bad PSWORKER_* value or a broken PSWORKER_MODELS module fails every command before it reads a flag
        environment.check()
        registry.import_plugins()
    except PsworkerError as e:
        return _print_error(e)
    try:
        args = _parse(sys.argv[1:] if argv is None else list(argv))
    except SystemExit as e:  # --help or a usage error already printed by argparse
        return e.code if isinstance(e.code, int) else 0 if e.code is None else EXIT_USAGE
    args.argv = sys.argv[1:] if argv is None else None   # None: called in-process, never re-exec
    task_process = args.kind == TASK
    _configure_logging(args)
    try:
        with _quiet(args):
            code = int(args.func(args) or 0)
    except PsworkerError as e:
        code = _print_error(e)
    except KeyboardInterrupt as e:
        print("psworker: interrupted", file=sys.stderr, flush=True)
        code = errorfile.report(e, 130, line=False)
    except Exception as e:  # noqa: BLE001 - a bug: its traceback, then the same prompt exit for a task process
        disk = disk_full(e)     # a checkpoint, summary or log write that found no space: no bug, no traceback
        if disk is not None:
            code = _print_error(disk, cause=e)
        else:
            errorfile.report(e, EXIT_FAILED, line=False)
            if not task_process:
                raise
            log.exception("psworker %s failed", args.command)
            code = EXIT_FAILED
    if task_process and args.argv is not None:
        from psworker.task.hard_exit import exit_now

        exit_now(code)
    return code
