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
