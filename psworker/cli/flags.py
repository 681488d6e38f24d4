"""The flag groups of the `psworker` commands (training settings, cluster sources, launch options, status) with
their value checks, and the one typed config each group becomes. Parsing only; no command runs here."""

from __future__ import annotations

import argparse
import difflib
import sys
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence, Union

from psworker.cli.values import int_type, non_negative_float, port_type, positive_float, value_type
from psworker.errors import PsworkerError
from psworker.launcher.backends.local import NETWORK_MODES

if TYPE_CHECKING:
    from psworker.launcher.config import LaunchConfig
from psworker.spec.plan import AnySpec, with_train
from psworker.spec import TRAIN_FIELDS, TRAIN_TYPES, ClusterSpec, CountSpec, TrainConfig
from psworker.spec.train_config import DEFAULT_SAVE_CHECKPOINT_SECS, parse_setting, setting_doc

class _LiveChoices:
    """argparse `choices` read each time they are shown or checked (the model registry can grow)."""

    def __init__(self, read: Callable[[], tuple[str, ...]]) -> None:
        self._read = read

    def _names(self) -> tuple[str, ...]:
        try:
            return self._read()
        except PsworkerError:         # a PSWORKER_MODELS module that fails (`cli.main` reports it before parsing)
            return ()

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, value: object) -> bool:
        return value in self._names()


def _train_flag_help(name: str) -> tuple[str, Optional[str], Optional[_LiveChoices]]:
    """(help, metavar, choices) of one training-setting flag, from its `SettingDoc`."""
    doc = setting_doc(name)
    choices = _LiveChoices(doc.choices) if doc.choices is not None else None
    metavar = doc.metavar or (None if choices is not None else TRAIN_TYPES[name][0].__name__.upper())
    return f"{doc.meaning} (default: {doc.default})".replace("%", "%%"), metavar, choices


def _setting_type(name: str) -> Callable[[str], str]:
    """Checks one setting's value alone and keeps the text as given (merge_train parses it with the spec's)."""
    def check(text: str) -> str:
        parse_setting(name, text)
        return text
    return value_type(check, name)


def add_train_flags(p: argparse.ArgumentParser) -> None:
    """Adds a flag per TrainConfig field a person changes (its `SettingDoc.flag`), `--checkpoint_every`, and `--set
    NAME=VALUE` for every setting; each value is checked alone when parsed (default None: the spec's value
    stands). A spec setting's old flag still works, with a one-line hint (`_OldSpelling`)."""
    g = p.add_argument_group("training settings (each overrides the spec's train section; the default applies "
                             "when neither sets it)")
    for name in TRAIN_FIELDS:
        help_, metavar, choices = _train_flag_help(name)
        if setting_doc(name).flag:
            g.add_argument(f"--{name}", default=None, metavar=metavar, choices=choices, type=_setting_type(name),
                           help=help_)
        else:
            p.add_argument(f"--{name}", default=None, choices=choices, type=_setting_type(name),
                           action=_OldSpelling, help=argparse.SUPPRESS)
    g.add_argument("--checkpoint_every", default=None, type=value_type(parse_interval, "interval"),
                   metavar="{Nsteps,Ns,Nm}", dest="checkpoint_every",
                   help="write a checkpoint every N global steps (500steps) or every N seconds (60s, 10m) (default: "
                        f"every {DEFAULT_SAVE_CHECKPOINT_SECS:g} s)")
    _add_set(p, train=True)


def parse_interval(text: str) -> tuple[str, Union[int, float]]:
    """`500steps` -> ("save_checkpoint_steps", 500); `60s`, `10m`, `1h` -> ("save_checkpoint_secs", seconds)."""
    value = text.strip().lower()
    for unit, scale in (("steps", 0), ("s", 1), ("m", 60), ("h", 3600)):
        if value.endswith(unit) and value[:-len(unit)].strip():
            number = value[:-len(unit)].strip()
            if scale == 0:
                return "save_checkpoint_steps", parse_setting("save_checkpoint_steps", number, "--checkpoint_every")
            return "save_checkpoint_secs", parse_setting("save_checkpoint_secs", number, "--checkpoint_every") * scale
    raise ValueError(f"expected N steps or a time, e.g. 500steps, 60s, 10m; got {text!r}")


class _OldSpelling(argparse.Action):
    """A flag that became a spec setting (or another flag): takes its value as before and says once, on stderr,
    how to write it now (not again in a launcher re-executed in its network namespace)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: Optional[str] = None) -> None:
        setattr(namespace, self.dest, True if self.nargs == 0 else values)
        _hint(option_string or self.dest, self.dest, values)


def _hint(flag: str, name: str, value: Any) -> None:
    from psworker.launcher import netns
    if netns.inside():
        return
    shown = "true" if value == [] else value
    spec = f", or {name}: {shown} in the spec's train section" if name in TRAIN_FIELDS else ""
    now = _NEW_SPELLING.get(name, f"--set {name}={shown}{spec}")
    print(f"psworker: note: {flag} is old spelling; write {now}", file=sys.stderr, flush=True)


_NEW_SPELLING = {"save_checkpoint_steps": "--checkpoint_every NUMBERsteps", "save_checkpoint_secs":
                 "--checkpoint_every NUMBERs", "verbose": "--console verbose", "no_live": "--console plain"}


def _add_set(p: Any, train: bool) -> None:
    """`--set NAME=VALUE`, once per command: launcher settings (`add_launch_flags`), and training settings too where
    the command has them (`add_train_flags`)."""
    existing = p._option_string_actions.get("--set")
    if existing is not None:
        existing.train = existing.train or train
        existing.help = _SET_HELP[existing.train]
        return
    p.add_argument("--set", action=_SetAction, train=train, default=None, metavar="NAME=VALUE", dest="settings",
                   help=_SET_HELP[train])


_SET_HELP = {True: "any setting of the spec's train section or of the launcher without a flag of its own, "
                   "repeatable, e.g. --set step_timeout_secs=60 --set pack_transfers=false (docs/spec.md lists them)",
             False: "a launcher setting without a flag of its own, repeatable, e.g. --set grace_period_secs=30 "
                    "(docs/spec.md lists them)"}


class _SetAction(argparse.Action):
    """`--set NAME=VALUE`: a training setting (checked as its flag would be; on commands with training settings)
    or a launcher setting that has no flag of its own on this command (`LAUNCH_SETTINGS`), set on the namespace
    under its own name."""

    def __init__(self, *args: Any, train: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.train = train

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: Optional[str] = None) -> None:
        name, eq, text = str(values).partition("=")
        name = name.strip()
        known = sorted(set(TRAIN_FIELDS if self.train else ()) | {n for n in LAUNCH_SETTINGS if hasattr(namespace, n)})
        if not eq or name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            parser.error("argument --set: expected NAME=VALUE with NAME a setting"
                         + (f" (did you mean {close[0]}?)" if close else f" ({', '.join(known)})")
                         + f", got {values!r}")
        check = _setting_type(name) if name in TRAIN_FIELDS and self.train else LAUNCH_SETTINGS[name]
        try:
            setattr(namespace, name, check(text))
        except argparse.ArgumentTypeError as e:
            parser.error(f"argument --set {name}: {e}")


def add_model_flag(p: argparse.ArgumentParser, help_: str) -> None:
    """`--model` outside the training settings (`plan`, `eval`, `export`): the same choices and check."""
    _, _, choices = _train_flag_help("model")
    p.add_argument("--model", default=None, choices=choices, type=_setting_type("model"), help=help_)


def add_memory_limit_flag(p: argparse.ArgumentParser, help_: str) -> None:
    """`--ps_memory_limit SIZE` (`local`, `plan`): bytes, from `memory.parse_size` (a bad size: exit 2)."""
    from psworker.memory import parse_size
    p.add_argument("--ps_memory_limit", type=value_type(parse_size, "size"), default=None, metavar="SIZE", help=help_)


def train_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The training settings a command's flags give (None: not given; a command without a flag gives None);
    `--checkpoint_every` is save_checkpoint_steps or save_checkpoint_secs."""
    given = {name: getattr(args, name, None) for name in TRAIN_FIELDS}
    every = getattr(args, "checkpoint_every", None)
    if every is not None:
        given.update({"save_checkpoint_steps": None, "save_checkpoint_secs": None, every[0]: every[1]})
    return given


def with_train_flags(spec: AnySpec, args: argparse.Namespace) -> AnySpec:
    """The spec with the command's training flags applied, as every command applies them (`plan.with_train`)."""
    return with_train(spec, train_overrides(args))


def add_cluster_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster (one of: --spec, --ps_hosts/--worker_hosts, env PSWORKER_SPEC, "
                             "env TF_CONFIG)")
    g.add_argument("--spec", dest="spec_path", help="cluster spec YAML file")
    g.add_argument("--ps_hosts", help="comma-separated host:port list of the ps job")
    g.add_argument("--worker_hosts", help="comma-separated host:port list of the worker job")
    g.add_argument("--job_name", help="must match the command (ps or worker) when given")
    g.add_argument("--task_index", type=int_type(0), metavar="INT", help="this task's index within its job")
    p.add_argument("--allow_public_bind", action="store_true",
                   help="serve even when this task's host resolves to a public IP address (TensorFlow's servers are "
                        "unauthenticated; the default refuses)")
    p.add_argument("--metrics_port", type=port_type(free_ok=True), default=None, metavar="PORT",
                   help="serve this task's metrics for Prometheus at http://HOST:PORT/metrics, HOST being its own "
                        "address's (0: a free port, named in its log; default: off)")


def train_config(spec: ClusterSpec, args: argparse.Namespace) -> TrainConfig:
    """The spec's train section with the task's flags applied (`with_train_flags`)."""
    return with_train_flags(spec, args).train


def launch_config(args: argparse.Namespace, spec: Union[ClusterSpec, CountSpec], backend: Any, *,
                  command: Sequence[str] = (), run_dir: Optional[str] = None,
                  python: str = sys.executable) -> "LaunchConfig":
    """The one `LaunchConfig` of a launcher command: its launch flags (`add_launch_flags`), `backend` (the
    backend's typed options) and, for `psworker run`, the user's command."""
    from psworker.launcher.config import LaunchConfig
    from psworker.launcher.metrics import MetricsOptions
    from psworker.launcher.policy import RestartPolicy, SuccessPolicy

    policy = RestartPolicy(max_restarts=args.max_restarts, backoff_secs=args.restart_backoff_secs)
    metrics = None if args.metrics_port is None else MetricsOptions(
        port=args.metrics_port, host=args.metrics_host, allow_public=args.metrics_allow_public_bind,
        stall_secs=args.metrics_stall_secs, linger_secs=args.metrics_linger_secs)
    return LaunchConfig(spec=spec, backend=backend, run_dir=run_dir, command=tuple(command), policy=policy,
                        metrics=metrics,
                        faults=tuple(args.inject), stall_timeout_secs=args.stall_timeout_secs, verbose=args.verbose,
                        live=False if args.no_live else None, grace_period_secs=args.grace_period_secs,
                        success=SuccessPolicy(args.success_policy, args.worker_exit_grace_secs), python=python)


def add_launch_flags(p: Any, network: bool = True) -> None:
    """Flags shared by the launchers (`local`, `run`, `ssh`, `slurm launch`): restarts, fault injection, console,
    metrics; `--network` only where the cluster runs on this machine. The seconds of grace and backoff and the
    success policy are `--set` settings (`LAUNCH_SETTINGS`)."""
    from psworker.launcher.inject import parse_fault
    from psworker.launcher.policy import CHIEF_OR_WORKER0, WORKER_EXIT_GRACE_SECS

    p.add_argument("--max_restarts", type=int_type(0), default=0, metavar="N",
                   help="restart a task whose exit is retryable (killed by a signal, exit code >= 128, e.g. 170 "
                        "for a peer gone) up to N times; other exits fail the run at once (default 0)")
    p.add_argument("--stall_timeout_secs", type=positive_float, default=None, metavar="SECS",
                   help="kill (and restart under --max_restarts) a worker whose step line has not shown a new "
                        "global step for this long (default: off)")
    p.add_argument("--inject", action="append", type=value_type(parse_fault, "fault"), default=[], metavar="FAULT",
                   help="inject a fault, repeatable: kill:worker:1@step=300, kill:ps:0@time=20, "
                        "stop:worker:1@step=200,for=10, exit:worker:0@step=100,code=143, "
                        "preempt:worker:2@step=300 (SIGTERM; an elastic job's worker leaves and exits 171)")
    if network:
        p.add_argument("--network", choices=NETWORK_MODES, default="auto",
                       help="isolated: run the cluster in a private network namespace where only loopback exists "
                            "(TensorFlow's servers listen on every interface otherwise); auto (default): isolated "
                            "when this machine allows it; host: no isolation")
    else:
        p.set_defaults(network="host")
    p.add_argument("--console", choices=CONSOLE_MODES, default=None, action=_Console,
                   help="auto (default): a live view on a terminal, plain status lines otherwise; plain: status "
                        "lines even on a terminal; verbose: also every line the tasks print (the full output is "
                        "always in <train_dir>/logs/)")
    p.set_defaults(verbose=False, no_live=False, grace_period_secs=10.0, restart_backoff_secs=1.0,
                   success_policy=CHIEF_OR_WORKER0, worker_exit_grace_secs=WORKER_EXIT_GRACE_SECS)
    for name in ("grace_period_secs", "restart_backoff_secs", "success_policy", "worker_exit_grace_secs"):
        p.add_argument(f"--{name}", type=LAUNCH_SETTINGS[name], action=_OldSpelling, help=argparse.SUPPRESS)
    for name in ("verbose", "no_live"):
        p.add_argument(f"--{name}", nargs=0, action=_OldSpelling, help=argparse.SUPPRESS)
    add_metrics_flags(p)
    _add_set(p, train=False)


CONSOLE_MODES = ("auto", "plain", "verbose")


class _Console(argparse.Action):
    """`--console MODE` as the two switches the launcher reads (`verbose`, `no_live`)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: Optional[str] = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.verbose = values == "verbose"
        namespace.no_live = values == "plain"


def not_one_of(value: object, choices: Sequence[str]) -> str:
    """`'critoe' is not one of mlp, cifar10, linear, criteo; did you mean 'criteo'?`: the spec's wording
    (`train_config`), for a flag's value or a command's name."""
    close = difflib.get_close_matches(str(value), choices, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{str(value)!r} is not one of {', '.join(choices)}{hint}"


def _success_policy(text: str) -> str:
    from psworker.launcher.policy import SUCCESS_POLICIES
    if text not in SUCCESS_POLICIES:
        raise argparse.ArgumentTypeError(not_one_of(text, SUCCESS_POLICIES))
    return text


def _host(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a host name or address")
    return text.strip()


def _boolean(text: str) -> bool:
    if text.strip().lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.strip().lower() == "true"


# The launcher's settings without a flag of their own (`--set NAME=VALUE`; their old flags still parse):
# name -> argparse type. What each means: docs/spec.md.
LAUNCH_SETTINGS: dict[str, Callable[[str], Any]] = {
    "grace_period_secs": non_negative_float,            # after a failure or Ctrl-C, before SIGKILL (10)
    "restart_backoff_secs": non_negative_float,         # before a task's first restart, doubled each next (1)
    "success_policy": _success_policy,                  # chief-or-worker0 (Kubeflow TFJob's) or all-workers
    "worker_exit_grace_secs": non_negative_float,       # once the run succeeded, for the other workers to exit
    "metrics_host": _host,                              # where /metrics listens (127.0.0.1)
    "metrics_allow_public_bind": _boolean,              # serve /metrics on a public address (false)
    "metrics_stall_secs": positive_float,               # psworker_task_stalled after this (stall timeout, or 300)
    "metrics_linger_secs": non_negative_float,          # after the end, serve until the next scrape, at most (30)
}


def add_metrics_flags(p: Any) -> None:
    """`--metrics_port`: the launcher's /metrics for Prometheus (`launcher/metrics.py`); its host, public bind,
    stall and linger seconds are `--set` settings (`LAUNCH_SETTINGS`)."""
    p.add_argument("--metrics_port", type=port_type(free_ok=True), default=None, metavar="PORT",
                   help="serve the run's metrics for Prometheus at http://127.0.0.1:PORT/metrics while the run lasts "
                        "(0: a free port, printed at the start; default: off; --set metrics_host=HOST for another "
                        "address: a public one is refused without --set metrics_allow_public_bind=true, the "
                        "endpoint is unauthenticated)")
    p.set_defaults(metrics_host="127.0.0.1", metrics_allow_public_bind=False, metrics_stall_secs=None,
                   metrics_linger_secs=30.0)
    for name in ("metrics_host", "metrics_stall_secs", "metrics_linger_secs"):
        p.add_argument(f"--{name}", type=LAUNCH_SETTINGS[name], action=_OldSpelling, help=argparse.SUPPRESS)
    p.add_argument("--metrics_allow_public_bind", nargs=0, action=_OldSpelling, help=argparse.SUPPRESS)


COMMAND_EPILOG = ("after '--' (optional): your own program and its arguments, run once per task instead of "
                  "psworker's trainer, with TF_CONFIG and PSWORKER_JOB_NAME, PSWORKER_TASK_INDEX, PSWORKER_PS_HOSTS, "
                  "PSWORKER_WORKER_HOSTS set; {job_name} {task_index} {ps_hosts} {worker_hosts} are replaced per "
                  "task, e.g. -- python train.py --job_name={job_name} --task_index={task_index}")


def add_status_flags(p: argparse.ArgumentParser) -> None:
    """The options of `psworker status` and `psworker slurm status`."""
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--silent_secs", type=positive_float, default=60.0, metavar="SECS",
                   help="call a running task silent when its log has not grown for this long (default 60)")
    p.add_argument("--watch", nargs="?", type=positive_float, const=2.0, default=None, metavar="SECS",
                   help="refresh the view every SECS (default 2) until the run ends or its launcher is gone; "
                        "Ctrl-C ends it (exit 0)")


__all__ = ["value_type", "port_type", "int_type", "positive_float", "non_negative_float", "add_train_flags",
           "add_model_flag", "train_overrides", "with_train_flags", "add_cluster_flags", "train_config",
           "launch_config", "add_launch_flags", "add_metrics_flags", "add_status_flags"]
