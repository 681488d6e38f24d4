"""Shared fixtures: real local clusters (always torn down) and synthetic CIFAR-10 folders; and
`PSWORKER_REQUIRE`, which turns the skips of the named components into failures (CI sets it: .ci/run)."""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path

import pytest

from psworker.testing import LocalCluster
from tests.cluster_utils import Launcher
from tests.fake_tasks.fakes import HERE, stop_supervisors

# Synthetic CIFAR-10 examples per class (train, test) when a test module does not set CIFAR_PER_CLASS.
DEFAULT_CIFAR_PER_CLASS = (100, 20)

# `PSWORKER_REQUIRE=slurm,sshd,chromium,netns,memcg,prometheus`: a test that would skip for want of one of these
# fails instead.
REQUIRE_ENV = "PSWORKER_REQUIRE"
# component -> (fixtures whose skip is that component's, words in a skip reason that name it)
COMPONENTS = {
    "slurm": (("slurm",), ("slurm",)),
    "sshd": (("sshd",), ("sshd", "openssh")),
    "chromium": ((), ("chromium",)),
    "netns": ((), ("network namespace", "netns")),
    "memcg": ((), ("memory cgroup",)),
    "prometheus": (("prometheus",), ("prometheus", "promtool")),
}


def required_components() -> frozenset[str]:
    """The components named in `PSWORKER_REQUIRE` (comma-separated)."""
    return frozenset(n.strip() for n in os.environ.get(REQUIRE_ENV, "").split(",") if n.strip())


def skip_or_fail(component: str, reason: str) -> None:
    """Skips the test for want of `component`, or fails it when `PSWORKER_REQUIRE` names that component."""
    if component in required_components():
        pytest.fail(f"{REQUIRE_ENV} names {component}, but: {reason}", pytrace=False)
    pytest.skip(reason)


def pytest_configure(config) -> None:
    unknown = sorted(required_components() - COMPONENTS.keys())
    if unknown:
        raise pytest.UsageError(f"{REQUIRE_ENV}: unknown component(s) {', '.join(unknown)}; "
                                f"known: {', '.join(COMPONENTS)}")
    compile_sources()


# The repository's own packages that the suite's processes import (tasks, launchers, CLI commands, benchmarks).
COMPILED = ("psworker", "benchmarks", "tests")


def compile_sources() -> None:
    """Byte-compiles the repository's own modules (`COMPILED`) into their `__pycache__`, once per session.

    The suite starts well over a thousand Python processes (every task, launcher and CLI command), each importing
    psworker. Where `PYTHONDONTWRITEBYTECODE` is set (as on hosts that keep source trees free of caches) none of them
    writes a .pyc, so each compiled the ~70 psworker modules it imports from source again: ~0.1 s of CPU per
    process, ~4% of a task's CPU beside TensorFlow's import (py-spy over a launcher run). Reading a .pyc is still
    allowed there, and Python checks each one against its source's mtime and size, so an edited module is compiled
    afresh as usual; what runs is the same code either way. Files that cannot be written (a read-only checkout) are
    left to compile in each process, as before."""
    import compileall

    root = Path(__file__).resolve().parent.parent
    for name in COMPILED:
        compileall.compile_dir(str(root / name), quiet=2, force=False)


def _component_of(item, reason: str) -> str | None:
    for name, (fixtures, words) in COMPONENTS.items():
        if any(f in item.fixturenames for f in fixtures) or any(w in reason.lower() for w in words):
            return name
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A skip (a skipif mark, or pytest.skip in a fixture or test) of a required component becomes a failure."""
    outcome = yield
    report = outcome.get_result()
    required = required_components()
    if not (required and report.skipped) or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    component = _component_of(item, reason)
    if component in required:
        report.outcome = "failed"
        report.longrepr = f"{REQUIRE_ENV} names {component}, but the test skipped: {reason}"


@pytest.fixture
def make_cluster(tmp_path):
    """`make_cluster(**LocalCluster kwargs)`: a `LocalCluster` in `tmp_path`, closed when the test ends."""
    made: list[LocalCluster] = []

    def make(**kwargs) -> LocalCluster:
        cluster = LocalCluster(tmp_path, **kwargs)
        made.append(cluster)
        return cluster

    try:
        yield make
    finally:
        for cluster in made:
            cluster.close()


@pytest.fixture
def make_supervisor(tmp_path):
    """`make_supervisor(tasks, start=False, log_dir=tmp_path/logs, **Supervisor kwargs)`: a launcher `Supervisor` of
    (fake) tasks with a captured console and short grace periods (2 s, the ps 0.5 s) unless given; started with
    `start=True`. Every one made is stopped at teardown, and whatever it left is killed."""
    from psworker.launcher.backends.local import LocalBackend
    from psworker.launcher.supervise.supervisor import Supervisor

    made: list[Supervisor] = []

    def make(tasks, *, start: bool = False, log_dir: Path | None = None, **kwargs) -> Supervisor:
        kwargs.setdefault("backend", LocalBackend())
        kwargs.setdefault("console", io.StringIO())
        kwargs.setdefault("grace_period_secs", 2.0)
        kwargs.setdefault("ps_exit_grace_secs", 0.5)
        sup = Supervisor(tasks, log_dir or tmp_path / "logs", **kwargs)
        made.append(sup)
        if start:
            sup.start()
        return sup

    yield make
    stop_supervisors(made)


@pytest.fixture(scope="session")
def _cifar_dirs(tmp_path_factory):
    return {}


@pytest.fixture
def cifar_dir(request, _cifar_dirs, tmp_path_factory) -> Path:
    """A synthetic CIFAR-10 folder, `CIFAR_PER_CLASS = (train, test)` examples per class (set in the module)."""
    from psworker.data.cifar10_files import write_synthetic

    sizes = getattr(request.module, "CIFAR_PER_CLASS", DEFAULT_CIFAR_PER_CLASS)
    if sizes not in _cifar_dirs:
        path = tmp_path_factory.mktemp("cifar10")
        write_synthetic(str(path), train_per_class=sizes[0], test_per_class=sizes[1])
        _cifar_dirs[sizes] = path
    return _cifar_dirs[sizes]


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A real one-node Slurm for the session (tests/slurm_fixture.py); skips where this machine cannot run one."""
    from tests.slurm_fixture import running_slurm, why_no_slurm

    reason = why_no_slurm()
    if reason:
        pytest.skip(reason)
    with running_slurm(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster
    assert not cluster.forced, f"test Slurm: had to SIGKILL {cluster.forced} when it stopped"
    assert not cluster.job_processes(), f"test Slurm: job processes left: {cluster.job_processes()}"


@pytest.fixture(scope="session")
def sshd(tmp_path_factory):
    """A real sshd on 127.0.0.1-3 for the session (psworker/testing_sshd.py); skips where it cannot run."""
    from psworker.testing_sshd import running_sshd, why_no_sshd

    reason = why_no_sshd()
    if reason:
        pytest.skip(reason)
    with running_sshd(tmp_path_factory.mktemp("sshd")) as server:
        yield server


@pytest.fixture(scope="session")
def prometheus(tmp_path_factory):
    """A real Prometheus for the session, scraping every second the targets a test adds
    (tests/prometheus_fixture.py); skips where it is not installed."""
    from tests.prometheus_fixture import Prometheus, why_no_prometheus

    reason = why_no_prometheus()
    if reason:
        pytest.skip(reason)
    server = Prometheus(tmp_path_factory.mktemp("prometheus"))
    try:
        yield server
    finally:
        server.close()
    assert server.proc.returncode is not None


@pytest.fixture
def fake_python(tmp_path):
    """An executable that run_local can use as `python`: it runs tests/fake_tasks/fake_psworker.py."""
    exe = tmp_path / "bin" / "python"
    exe.parent.mkdir()
    exe.write_text(f"#!{sys.executable}\n"
                   "import runpy, sys\n"
                   f"sys.argv[0] = {str(HERE / 'fake_psworker.py')!r}\n"
                   "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    exe.chmod(0o755)
    return str(exe)


@pytest.fixture
def launcher(tmp_path):
    """`launcher(*args, command="local", tty=False)`: a real `psworker` launcher (`tests.cluster_utils.Launcher`) in
    `tmp_path`, killed if the test leaves it."""
    made: list[Launcher] = []

    def start(*args: str, **kwargs) -> Launcher:
        made.append(Launcher(args, tmp_path, **kwargs))
        return made[-1]

    yield start
    for run in made:
        run.close()
