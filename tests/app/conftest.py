"""Fixtures of the app tests: an in-process cluster (fast) for the bank, validate and the user guide."""

from __future__ import annotations

import pytest

from waltz_core.testing.cluster import ClusterSpec, InProcessCluster


@pytest.fixture
async def inprocess_cluster(tmp_path):
    spec = ClusterSpec(tmp_path / "cluster", num_partitions=2, num_storages=3, num_servers=1)
    async with InProcessCluster(spec) as running:
        yield running
