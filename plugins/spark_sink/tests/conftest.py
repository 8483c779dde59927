"""One real local SparkSession and one real Waltz cluster for the whole Spark test session.

The cluster (1 server, 1 storage node, 4 partitions, tcp, local coordination, the exact lock
table) runs as an :class:`InProcessCluster` on its own event loop in a daemon thread; Spark's
Python workers reach it through ``client.toml`` like any other client. Tests share both, so each
test works on data it tells apart (its own partitions, or ids it recorded before it wrote).
``one_slot_cluster`` is a second cluster, started only by the tests that ask for it, whose lock
table reports false conflicts on demand.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from waltz_core.testing import require


def _have(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


class RunningCluster:
    """An InProcessCluster on a private loop thread (start/stop are blocking)."""

    def __init__(self, directory: Path, server_overrides: dict[str, Any] | None = None) -> None:
        from waltz_core.testing.cluster import ClusterSpec, InProcessCluster

        self.spec = ClusterSpec(directory, num_partitions=4, num_storages=1, num_servers=1,
                                server_overrides=server_overrides or {"lock_table": "exact"})
        self.cluster = InProcessCluster(self.spec)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="waltz-test-cluster", daemon=True)
        self.thread.start()
        self.run(self._start(), 60)

    async def _start(self) -> None:
        await self.cluster.start()
        await self.cluster.wait_ready()

    def run(self, coro: Any, timeout: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def lock_failures(self) -> int:
        """Appends the servers' lock tables rejected so far (every partition)."""
        async def total() -> int:
            return sum(p.lock_failures for server in self.cluster.servers.values() for p in server.partitions.values())

        return int(self.run(total(), 10))

    @property
    def client_toml(self) -> str:
        return str(self.spec.directory / "client.toml")

    def stop(self) -> None:
        try:
            self.run(self.cluster.stop(), 60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


@pytest.fixture(scope="session")
def waltz_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCluster]:
    running = RunningCluster(tmp_path_factory.mktemp("waltz-spark-cluster"))
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="session")
def one_slot_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCluster]:
    """A cluster whose ``hashed`` lock table has one slot and one hash: every two keys collide."""
    running = RunningCluster(tmp_path_factory.mktemp("waltz-spark-one-slot"),
                             {"lock_table": "hashed", "lock_table_size": 1, "lock_hash_count": 1})
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    require(_have("pyspark") and _have("pyarrow"), "pyspark[sql] (pyspark with pyarrow)")
    require(shutil.which("java") is not None, "Java 17+ (for Spark)")
    from waltz_spark.session import local_session

    session = local_session("waltz-spark-tests", cores=2)
    try:
        yield session
    finally:
        session.stop()
