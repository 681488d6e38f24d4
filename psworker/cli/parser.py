"""The `psworker` argument parser: every subcommand in one table (`COMMANDS`), each with the function it runs
and the flag groups it takes."""

from __future__ import annotations

import argparse
import difflib
from dataclasses import dataclass
from typing import Callable, Optional

from psworker.cli import k8s, launchers, outputs, scale, slurm, specs, tasks
from psworker.cli.flags import add_cluster_flags, add_train_flags, not_one_of

__all__ = ["COMMANDS", "Command", "Parser", "build_parser", "not_one_of", "unrecognized"]

TASK, LAUNCHER, OTHER = "task", "launcher", "other"   # how a command logs (see `psworker.cli.main`)


@dataclass(frozen=True)
class Command:
    """One subcommand: `path` (e.g. `slurm submit`), what it runs, its help, its flag groups, its kind."""

    path: str
    run: Callable[[argparse.Namespace], int]
    help: str
    flags: tuple[Callable[[argparse.ArgumentParser], None], ...] = ()
    kind: str = OTHER
    takes_command: bool = False      # `-- COMMAND...` after its flags
    quiet_tf: bool = False           # imports TensorFlow in this process: its C++ chatter hidden (`cli.quiet`)
    description: Optional[str] = None


GROUPS = {"slurm": "run a spec's cluster as a Slurm job",
          "k8s": "run on Kubernetes: write manifests, apply, status, logs, delete"}

COMMANDS = (
    Command("validate", specs.cmd_validate, "check cluster spec files", (specs.validate_flags,)),
    Command("plan", specs.cmd_plan, "show the tasks a spec starts and how to start them by hand",
            (specs.plan_flags,), quiet_tf=True),
    Command("tf-config", specs.cmd_tf_config, "print one task's TF_CONFIG JSON", (specs.tf_config_flags,)),
    Command("ps", tasks.cmd_ps, "run one parameter server task", (add_cluster_flags, tasks.ps_flags), TASK),
    Command("worker", tasks.cmd_worker, "run one worker task (worker 0 is the chief)",
            (add_cluster_flags, add_train_flags), TASK),
    Command("local", launchers.cmd_local, "run a whole spec's cluster on this machine", (launchers.local_flags,),
            LAUNCHER),
    Command("run", launchers.cmd_run, "run your own distributed-TensorFlow script once per task of a spec "
                                      "(TF_CONFIG and classic flags filled in)", (launchers.run_flags,), LAUNCHER,
            takes_command=True),
    Command("status", launchers.cmd_status, "show the status of a run from its run directory (started by any "
                                            "backend)", (launchers.status_flags,)),
    Command("scale", scale.cmd_scale, "change the number of workers of a running elastic job",
            (scale.scale_flags,), description="Asks the launcher of RUN_DIR (through files in it) to run N workers: "
            "the lowest reserved workers start, or the highest running ones (never worker 0) finish their step, "
            "leave and exit 0. Waits for the launcher's answer."),
    Command("data", outputs.cmd_data, "download or write a data set", (outputs.data_flags,)),
    Command("eval", outputs.cmd_eval, "evaluate checkpoints from a train_dir", (outputs.eval_flags,), quiet_tf=True),
    Command("export", outputs.cmd_export,
            "export a checkpoint as a SavedModel into <train_dir>/export/<global_step>", (outputs.export_flags,),
            quiet_tf=True),
    Command("tensorboard", outputs.cmd_tensorboard, "serve a run dir with TensorBoard on 127.0.0.1 until Ctrl-C",
            (outputs.tensorboard_flags,)),
    Command("slurm submit", slurm.cmd_slurm_submit,
            "write a batch script for a spec into the run dir and submit it", (slurm.submit_flags,),
            takes_command=True, description="Writes <run_dir>/psworker.sbatch (#SBATCH lines, then the "
            "`psworker slurm launch` line it runs) and submits it with sbatch; prints the job id."),
    Command("slurm launch", slurm.cmd_slurm_launch, "inside an allocation: run every task of a spec as its own srun "
            "step", (slurm.launch_flags,), LAUNCHER, takes_command=True,
            description="Lays the spec's tasks out on the allocation's nodes "
            "(TensorFlow's SlurmClusterResolver rules), starts each as its own `srun` step and supervises them. Run "
            "by the batch script `psworker slurm submit` writes."),
    Command("slurm status", slurm.cmd_slurm_status, "show the status of a Slurm job's run", (slurm.status_flags,),
            description="`psworker status` of the run dir of a job `psworker slurm submit` queued."),
    Command("ssh", launchers.cmd_ssh, "run a spec's cluster on the hosts its addresses name, over ssh",
            (launchers.ssh_flags,), LAUNCHER, takes_command=True,
            description="Checks every host (ssh BatchMode, in parallel) before "
            "starting anything, writes the spec on each host, starts each task over its own ssh connection and "
            "supervises them; a task dies with its connection."),
    Command("k8s manifest", k8s.cmd_k8s_manifest, "write a spec's Kubernetes objects as YAML", (k8s.manifest_flags,),
            takes_command=True),
    Command("k8s apply", k8s.cmd_k8s_apply, "create or update a manifest file's objects", (k8s.apply_flags,)),
    Command("k8s status", k8s.cmd_k8s_status, "show each task pod of a run", (k8s.run_flags,)),
    Command("k8s logs", k8s.cmd_k8s_logs, "print a run's task logs", (k8s.logs_flags,)),
    Command("k8s delete", k8s.cmd_k8s_delete, "delete every object of a run", (k8s.run_flags,)),
)


def unrecognized(extras: list[str], options: list[str]) -> str:
    """argparse's "unrecognized arguments" message, with the closest of `options` to each unknown flag: those
    fewest typing slips away (a swapped pair is one slip: `--modle` -> --model or --mode), else difflib's."""
    close = [m for word in extras if word.startswith("-") for m in _closest(word.partition("=")[0], options)]
    hint = f"; did you mean {' or '.join(dict.fromkeys(close))}?" if close else ""
    return f"unrecognized arguments: {' '.join(extras)}{hint}"


def _closest(word: str, options: list[str]) -> list[str]:
    slips = {o: _slips(word, o) for o in options}
    fewest = min(slips.values(), default=3)
    if fewest <= 2:
        tied = [o for o, n in slips.items() if n == fewest]
        return sorted(tied, key=lambda o: -difflib.SequenceMatcher(None, word, o).ratio())[:2]
    return difflib.get_close_matches(word, options, n=1, cutoff=0.6)


def _slips(a: str, b: str) -> int:
    """Edits from `a` to `b`, a swap of two neighbours counting one (optimal string alignment distance)."""
    d = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                d[i][j] = min(d[i][j], d[i - 2][j - 2] + 1)
    return d[len(a)][len(b)]


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line, as a spec's are (`psworker local: error: argument --model:
    'critoe' is not one of ...; did you mean 'criteo'?`, exit 2): a command (a parser without subcommands) prints no
    usage before it, and a bad choice names the closest one. Its commands refuse unknown flags themselves,
    suggesting the closest flag (`--max_stesp`: did you mean --max_steps?)."""

    def _check_value(self, action: argparse.Action, value: object) -> None:
        if action.choices is not None and value not in action.choices:
            raise argparse.ArgumentError(action, not_one_of(value, [str(c) for c in action.choices]))

    def error(self, message: str):
        if self._subparsers is not None and " is not one of " not in message:
            super().error(message)     # `psworker` alone: the usage lists the commands
        self.exit(2, f"{self.prog}: error: {message}\n")

    def parse_known_args(self, args=None, namespace=None):
        parsed, extras = super().parse_known_args(args, namespace)
        if self._subparsers is None and any(word.startswith("-") for word in extras):
            self.error(unrecognized(extras, [s for a in self._actions for s in a.option_strings]))
        return parsed, extras


def build_parser() -> argparse.ArgumentParser:
    """Builds the argument parser from `COMMANDS` (no side effects; called by `main`)."""
    parser = Parser(
        prog="psworker", description="Parameter-server clusters for TensorFlow: validate specs, start ps and worker "
                                     "tasks locally, over SSH, on Slurm or Kubernetes; train, evaluate, export.")
    top = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    groups: dict[str, argparse._SubParsersAction] = {}
    for command in COMMANDS:
        group, _, name = command.path.rpartition(" ")
        if group and group not in groups:
            group_parser = top.add_parser(group, help=GROUPS[group], description=GROUPS[group])
            groups[group] = group_parser.add_subparsers(dest=f"{group}_command", required=True,
                                                        metavar=f"{group.upper()}_COMMAND")
        p = (groups[group] if group else top).add_parser(name, help=command.help,
                                                         description=command.description or command.help)
        p.set_defaults(func=command.run, kind=command.kind, takes_command=command.takes_command,
                       quiet_tf=command.quiet_tf)
        for add in command.flags:
            add(p)
    return parser
