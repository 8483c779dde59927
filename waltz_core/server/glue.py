"""Adapters from the store layer's seams to coordination and storage nodes.

* :class:`CoordinationMetadata` implements the store's ``MetadataAccess`` over the coordination
  recipes: new session ids and replica states are written only by compare-and-set, and a
  partition's metadata never goes back to an older generation (a stale owner is refused).
* :class:`StorageConnector` keeps one pipelined :class:`~waltz_core.storage.client.StorageClient`
  per storage node, shared by every partition of this server, and reconnects on demand.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Mapping

from ..coordination.metadata import PartitionMetadata, ReplicaState
from ..coordination.recipes import StoreMetadata
from ..errors import CasConflictError, GenerationMismatchError, WaltzError
from ..storage.client import StorageClient
from ..transport.base import Transport

log = logging.getLogger("waltz.server")


class CoordinationMetadata:
    def __init__(self, store_metadata: StoreMetadata) -> None:
        self.sm = store_metadata

    async def begin_session(self, partition_id: int, generation: int) -> tuple[int, dict[str, ReplicaState], list[str]]:
        while True:
            meta, version = await self.sm.get_partition_metadata(partition_id)
            if meta.generation > generation:
                raise GenerationMismatchError(
                    f"partition {partition_id} is at generation {meta.generation}; this server has {generation}")
            new = PartitionMetadata(generation=generation, session_id=meta.session_id + 1, replicas=meta.replicas)
            try:
                await self.sm.cas_partition_metadata(partition_id, new, version)
            except CasConflictError:
                continue  # another writer raced us: read again
            assignments = await self.sm.get_replica_assignments()
            assigned = sorted(ep for ep, pids in assignments.items() if partition_id in pids)
            return new.session_id, dict(meta.replicas), assigned

    async def write_states(self, partition_id: int, generation: int, session_id: int,
                           states: Mapping[str, ReplicaState]) -> None:
        while True:
            meta, version = await self.sm.get_partition_metadata(partition_id)
            if meta.generation > generation:
                raise GenerationMismatchError(f"partition {partition_id} moved on to generation {meta.generation}")
            if meta.session_id != session_id:
                raise CasConflictError(f"partition {partition_id} is in session {meta.session_id}, not {session_id}")
            new = PartitionMetadata(generation=meta.generation, session_id=session_id,
                                    replicas={**meta.replicas, **states})
            try:
                await self.sm.cas_partition_metadata(partition_id, new, version)
                return
            except CasConflictError:
                continue


class StorageConnector:
    """``await connector(endpoint)`` -> a connected client, or None while the node is unreachable."""

    def __init__(self, transport: Transport, cluster_key: uuid.UUID, num_partitions: int, role: str,
                 connect_timeout: float = 5.0) -> None:
        self.transport = transport
        self.cluster_key = cluster_key
        self.num_partitions = num_partitions
        self.role = role
        self.connect_timeout = connect_timeout
        self._clients: dict[str, StorageClient] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def __call__(self, endpoint: str) -> StorageClient | None:
        client = self._clients.get(endpoint)
        if client is not None and not client.closed:
            return client
        lock = self._locks.setdefault(endpoint, asyncio.Lock())
        async with lock:
            client = self._clients.get(endpoint)
            if client is not None and not client.closed:
                return client
            try:
                client = await asyncio.wait_for(
                    StorageClient.connect(self.transport, endpoint, self.cluster_key, self.num_partitions, self.role),
                    self.connect_timeout)
            except (WaltzError, TimeoutError, OSError) as exc:
                log.debug("storage %s unreachable: %s", endpoint, exc)
                return None
            self._clients[endpoint] = client
            return client

    async def check(self, endpoint: str) -> bool:
        return await self(endpoint) is not None

    async def close(self) -> None:
        clients, self._clients = self._clients, {}
        await asyncio.gather(*(c.close() for c in clients.values()), return_exceptions=True)
