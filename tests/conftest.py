"""Shared fixtures: a real-process cluster that is always torn down."""

from __future__ import annotations

import pytest

from tests.cluster_utils import Cluster


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.stop_all()


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
    """A real sshd on 127.0.0.1-3 for the session (tests/sshd_fixture.py); skips where it cannot run."""
    from tests.sshd_fixture import running_sshd, why_no_sshd

    reason = why_no_sshd()
    if reason:
        pytest.skip(reason)
    with running_sshd(tmp_path_factory.mktemp("sshd")) as server:
        yield server
