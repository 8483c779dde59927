"""Fixtures for the storage tests: a node on the in-memory transport and record factories."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
import zlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from waltz_core.protocol.wire import Record, ReqId
from waltz_core.storage.client import StorageAdminClient, StorageClient
from waltz_core.storage.node import LoopRounds, PartitionWorker, StorageNode
from waltz_core.storage.segmented import SegmentedLayout
from waltz_core.transport.memory import MemoryTransport

NUM_PARTITIONS = 4


@contextlib.asynccontextmanager
async def io_thread_blocked(worker: PartitionWorker) -> AsyncIterator[None]:
    """The I/O thread of ``worker`` stays inside one round (a call waiting on the loop) until the
    block ends; what is queued meanwhile waits for the next round."""
    # On the loop's own rounds the blocker would wait for the loop it blocks: fail, do not hang.
    assert not isinstance(worker.io, LoopRounds), "io_thread_blocked needs an I/O thread: start the node with io_threads=1"
    gate = asyncio.Event()
    loop = asyncio.get_running_loop()
    blocker = asyncio.ensure_future(worker.call(lambda: asyncio.run_coroutine_threadsafe(gate.wait(), loop).result()))
    await asyncio.sleep(0.05)  # the thread is inside the blocker's round
    try:
        yield
    finally:
        gate.set()
        await blocker


async def write_held_batches(node: StorageNode, *partition_ids: int) -> None:
    """Make a live node write into the partitions' files (all partitions without ids) what its
    stores hold in memory: a journaled node gathers small batches before it writes them
    (segmented.PENDING_WRITE_BYTES)."""
    for worker in node.workers if not partition_ids else [node.workers[p] for p in partition_ids]:
        store = worker.store
        if store is not None:
            await worker.call(store.start_writeback)  # type: ignore[attr-defined]


def make_record(txn: int, data: bytes | None = None, partition_id: int = 0) -> Record:
    if data is None:
        data = f"transaction {txn} ".encode() * (1 + txn % 5)
    return Record(txn, ReqId(7, 1, partition_id, txn), txn & 0xFFFF, data, zlib.crc32(data))


def make_records(start: int, count: int, partition_id: int = 0) -> list[Record]:
    return [make_record(t, partition_id=partition_id) for t in range(start, start + count)]


class NodeHarness:
    """A storage node on the memory transport that tests can stop and restart on the same directory."""

    def __init__(self, directory: Path, cluster_key: uuid.UUID, *, node_options: dict[str, Any] | None = None,
                 transport: Any = None, **layout_options: Any) -> None:
        self.directory = directory
        self.cluster_key = cluster_key
        self.layout_options = layout_options
        self.node_options = node_options or {}
        #: the memory transport unless given (its listen takes any host name; tcp needs 127.0.0.1)
        self.transport = transport or MemoryTransport(max_frame_size=1024 * 1024)
        self._host = "storage" if transport is None else "127.0.0.1"
        self.node: StorageNode | None = None
        self.data_listener: Any = None
        self.admin_listener: Any = None
        self.clients: list[Any] = []

    async def start(self) -> StorageNode:
        layout = SegmentedLayout(self.directory, **self.layout_options)
        self.node = StorageNode(layout, self.cluster_key, NUM_PARTITIONS, max_frame_size=self.transport.max_frame_size,
                                **self.node_options)
        await self.node.start()
        self.data_listener = await self.transport.listen(self._host, 0, self.node.serve_data)
        self.admin_listener = await self.transport.listen(
            "storage-admin" if self._host == "storage" else self._host, 0, self.node.serve_admin)
        return self.node

    async def stop(self) -> None:
        for c in self.clients:
            await c.close()
        self.clients.clear()
        for listener in (self.data_listener, self.admin_listener):
            if listener is not None:
                await listener.close()
        if self.node is not None:
            await self.node.close()
            self.node = None

    async def restart(self) -> StorageNode:
        await self.stop()
        return await self.start()

    async def client(self, cluster_key: uuid.UUID | None = None, num_partitions: int = NUM_PARTITIONS) -> StorageClient:
        c = await StorageClient.connect(self.transport, self.data_listener.address, cluster_key or self.cluster_key,
                                        num_partitions)
        self.clients.append(c)
        return c

    async def admin(self) -> StorageAdminClient:
        c = await StorageAdminClient.connect(self.transport, self.admin_listener.address, self.cluster_key,
                                             NUM_PARTITIONS)
        self.clients.append(c)
        return c


@pytest.fixture
def cluster_key() -> uuid.UUID:
    return uuid.uuid4()


@pytest.fixture
async def harness(tmp_path: Path, cluster_key: uuid.UUID) -> AsyncIterator[NodeHarness]:
    h = NodeHarness(tmp_path / "storage", cluster_key, index_checkpoint_interval=10, segment_size_threshold=4096)
    await h.start()
    try:
        yield h
    finally:
        await h.stop()


@pytest.fixture
def records() -> Callable[[int, int], list[Record]]:
    return make_records
