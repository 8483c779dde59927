"""Regression scenarios from the original Waltz's history (bugs reported against the original Java Waltz).

Only the scenario that had no test lives here: a mount that never becomes ready times out
clearly. The others are covered where their code lives (listed in ``docs/reliability.md``):

* client ahead of the server (CLIENT_AHEAD): ``tests/server/test_server_protocol.py`` and the
  checker's ``client-ahead`` rule on every smoke test history;
* stale replica sessions: ``tests/storage/test_node.py::test_session_fencing_higher_wins_lower_rejected_from_then_on``
  and ``tests/server/test_server_protocol.py::test_stale_connection_and_stale_generation_are_ignored``;
* all replicas down then back: ``tests/reliability/test_negative_controls.py::test_power_loss_of_every_replica``;
* an apply callback that throws: ``tests/client/test_client_mock.py::test_failed_apply_is_redelivered_in_order``.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from waltz_core.app.local_cluster import ClusterSpec, InProcessCluster
from waltz_core.client import AsyncWaltzClient, TransactionContext, WaltzClientCallbacks
from waltz_core.errors import ClientTimeoutError


class NoApp(WaltzClientCallbacks):
    """An application that never gets anything to apply: the partition never mounts."""

    def __init__(self) -> None:
        self.applied: list[tuple[int, int]] = []

    def client_high_water_mark(self, partition_id: int) -> int:
        return -1

    def apply_transaction(self, txn) -> None:  # type: ignore[no-untyped-def]
        self.applied.append((txn.partition_id, txn.transaction_id))

    def uncaught_exception(self, partition_id: int, transaction_id: int, exc: BaseException) -> None:
        raise AssertionError(f"unexpected uncaught exception: {exc!r}")


class Put(TransactionContext):
    def __init__(self, partition: int) -> None:
        super().__init__()
        self.partition = partition
        self.executions = 0

    def partition_id(self, num_partitions: int) -> int:
        return self.partition

    def execute(self, builder) -> bool:  # type: ignore[no-untyped-def]
        self.executions += 1
        builder.set_transaction_data(b"never", None)
        return True


@pytest.mark.timeout(60)
async def test_mount_that_never_becomes_ready_times_out_naming_the_partition(tmp_path: Path) -> None:
    """PR #174: 2 of 3 storage nodes down from the start, so the partition's store never recovers
    (no quorum) and the server answers NOT_READY forever: the client must not hang."""
    spec = ClusterSpec(tmp_path / "cluster", num_partitions=2, num_storages=3, num_servers=1)
    cluster = InProcessCluster(spec)
    spec.write_configs()
    await spec.bootstrap()
    await cluster.start_storage(0)  # storage-1 and storage-2 never start
    await cluster.start_server(0)
    mount_timeout = 1.5
    client = AsyncWaltzClient(NoApp(), spec.client_config(mount_timeout=mount_timeout))
    try:
        await client.start()
        put = Put(1)
        began = time.monotonic()
        with pytest.raises(ClientTimeoutError, match=r"partition 1 not mounted within 1\.5s"):
            await client.submit(put)
        waited = time.monotonic() - began
        assert mount_timeout - 0.1 <= waited < mount_timeout + 3.0, waited
        assert put.executions == 0  # nothing was executed or sent for a partition that is not mounted
        with pytest.raises(ClientTimeoutError, match=r"not mounted within 1\.0s: partitions \[0, 1\]"):
            await client.wait_mounted(1.0)
        assert not any(p.healthy for p in cluster.servers[0].partitions.values())
    finally:
        await client.close()
        await cluster.stop()
