"""A whole Waltz cluster on one machine, for tests: re-exported from :mod:`waltz_core.app.local_cluster`
(where ``waltz up`` finds it), and what tests of such a cluster wait for."""

from __future__ import annotations

import asyncio
import uuid

from ..app.local_cluster import (
    ClusterSpec,
    InProcessCluster,
    NodeSpec,
    ProcessCluster,
    to_toml,
)
from ..ports import free_ports
from ..storage.client import StorageAdminClient
from ..transport import open_transport

__all__ = ["ClusterSpec", "InProcessCluster", "NodeSpec", "ProcessCluster", "free_ports", "to_toml",
           "wait_replica_holds"]


async def wait_replica_holds(spec: ClusterSpec, i: int, key: uuid.UUID, num_partitions: int, transaction_id: int,
                             partition_id: int = 0, timeout: float = 60.0) -> None:
    """Ask storage node ``i``'s admin port until it holds ``transaction_id`` of the partition
    (its catch-up got there); AssertionError after ``timeout`` seconds."""
    transport = open_transport(spec.transport_config, spec.runtime.registries)
    admin = await StorageAdminClient.connect(transport, spec.admin_address(i), key, num_partitions)
    try:
        deadline = asyncio.get_running_loop().time() + timeout
        while not await admin.record_list(partition_id, transaction_id, 1):
            assert asyncio.get_running_loop().time() < deadline, f"replica {i} did not catch up to {transaction_id}"
            await asyncio.sleep(0.1)
    finally:
        await admin.close()
        await transport.aclose()
