"""The server's transaction data range RPC against a real in-process cluster (3 storage nodes).

Raw protocol messages, no client library: ranges served from the data cache, a cache miss read
from storage in one read, the count and byte caps, committed transactions only, and errors.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from waltz_core.errors import PartitionNotReadyError
from waltz_core.protocol import CLIENT
from waltz_core.protocol import client as m
from waltz_core.protocol.wire import ReqId, crc32
from waltz_core.server import partition as partition_module
from waltz_core.server.caches import DATA_ENTRY_OVERHEAD
from waltz_core.server.partition import Partition
from waltz_core.testing.cluster import ClusterSpec, InProcessCluster
from waltz_core.transport import MessageChannel, open_transport

pytestmark = pytest.mark.timeout(60)

# The data cache holds the last 25 transactions of 40 bytes (each costs its data plus the entry's
# overhead); one bigger than a quarter of the budget is never cached.
CACHE_BYTES = 25 * (40 + DATA_ENTRY_OVERHEAD)
BIG = CACHE_BYTES // 4 + 100


def payload(i: int, size: int = 40) -> bytes:
    return (f"{i:06d}-" * size).encode()[:size]


class Conn:
    """One raw client connection to the server owning partition 0."""

    def __init__(self, channel: MessageChannel, generation: int) -> None:
        self.ch = channel
        self.generation = generation
        self.seq = 0

    def q(self, partition: int = 0) -> ReqId:
        self.seq += 1
        return ReqId(1, self.generation, partition, self.seq)

    async def until(self, kind: type, req_id: ReqId) -> Any:
        while True:
            msg = await asyncio.wait_for(self.ch.recv(), 10)
            if type(msg) is kind and msg.req_id == req_id:
                return msg

    async def append_all(self, datas: list[bytes]) -> int:
        mount = self.q()
        await self.ch.send(m.MountRequest(mount, -1, 1))
        await self.until(m.MountResponse, mount)
        for data in datas:
            await self.ch.send(m.AppendRequest(self.q(), -1, (), (), (), 0, data, crc32(data)))
        flush = self.q()
        await self.ch.send(m.FlushRequest(flush))
        return (await self.until(m.FlushResponse, flush)).transaction_id  # type: ignore[no-any-return]

    async def data_range(self, first: int, max_count: int, max_bytes: int = 1 << 20,
                         partition: int = 0) -> m.TransactionDataRangeResponse:
        q = self.q(partition)
        await self.ch.send(m.TransactionDataRangeRequest(q, first, max_count, max_bytes))
        resp = await self.until(m.TransactionDataRangeResponse, q)
        assert resp.first_transaction_id == first
        assert all(crc32(d) == c for d, c in zip(resp.data, resp.checksums, strict=True))
        return resp  # type: ignore[no-any-return]


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[InProcessCluster]:
    spec = ClusterSpec(tmp_path, num_partitions=1, transport="tcp",
                       server_overrides={"data_cache_budget": CACHE_BYTES})
    async with InProcessCluster(spec) as cl:
        yield cl


async def connect(cl: InProcessCluster) -> Conn:
    server = cl.servers[0]
    conn = await open_transport(cl.spec.transport_config, cl.spec.runtime.registries).connect(server.address)
    return Conn(await MessageChannel.open(conn, CLIENT, "test"), server.partitions[0].generation)


def spy_storage_reads(partition: Partition) -> list[tuple[int, int]]:
    calls: list[tuple[int, int]] = []
    read_records = partition.store.read_records

    async def spy(first: int, max_count: int) -> list[Any]:
        calls.append((first, max_count))
        return await read_records(first, max_count)

    partition.store.read_records = spy  # type: ignore[method-assign]
    return calls


async def test_range_from_the_cache_up_to_the_high_water_mark(cluster: InProcessCluster) -> None:
    c = await connect(cluster)
    assert await c.append_all([payload(i) for i in range(10)]) == 9
    reads = spy_storage_reads(cluster.servers[0].partitions[0])
    resp = await c.data_range(2, 5)
    assert resp.data == tuple(payload(i) for i in range(2, 7)) and resp.error is None
    resp = await c.data_range(8, 100)  # committed transactions only: 8 and 9
    assert resp.data == (payload(8), payload(9)) and resp.error is None
    assert reads == []  # all of it from the data cache
    for first, count, problem in [(10, 5, "transaction 10 is not committed \\(high-water mark 9\\)"),
                                  (-1, 5, "transaction -1 is not committed"),
                                  (0, 0, "max_count \\(0\\) and max_bytes \\(1048576\\) must be positive")]:
        resp = await c.data_range(first, count)
        assert resp.data == () and resp.checksums == ()
        assert resp.error is not None and re.search(problem, resp.error), resp.error
    resp = await c.data_range(0, 5, partition=3)
    assert resp.data == () and "partition 3 is not on this server" in (resp.error or "")


async def test_cache_miss_is_one_storage_read(cluster: InProcessCluster) -> None:
    c = await connect(cluster)
    assert await c.append_all([payload(i) for i in range(60)]) == 59  # the cache keeps 35..59
    reads = spy_storage_reads(cluster.servers[0].partitions[0])
    resp = await c.data_range(0, 60)
    assert resp.data == tuple(payload(i) for i in range(60)) and resp.error is None
    assert reads == [(0, 60)]
    reads.clear()
    # A cached prefix, then a transaction too big for the cache: the rest in one storage read.
    big = payload(60, BIG)
    assert await c.append_all([big, payload(61), payload(62)]) == 62
    resp = await c.data_range(57, 100)
    assert resp.data == (payload(57), payload(58), payload(59), big, payload(61), payload(62))
    assert reads == [(60, 3)]


async def test_count_and_byte_caps(cluster: InProcessCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    c = await connect(cluster)
    assert await c.append_all([payload(i) for i in range(60)]) == 59
    partition = cluster.servers[0].partitions[0]
    assert partition._range_max_bytes == 4 * 1024 * 1024  # min(4 MiB, max frame size / 4)
    monkeypatch.setattr(partition_module, "DATA_RANGE_MAX_COUNT", 8)
    assert (await c.data_range(40, 1000)).data == tuple(payload(i) for i in range(40, 48))  # cache
    assert (await c.data_range(0, 1000)).data == tuple(payload(i) for i in range(8))  # storage
    # Bytes: 40 of data + 8 of framing per transaction; the first is sent whatever its size.
    assert (await c.data_range(40, 50, max_bytes=100)).data == (payload(40), payload(41))
    assert (await c.data_range(0, 50, max_bytes=100)).data == (payload(0), payload(1))
    assert (await c.data_range(40, 50, max_bytes=1)).data == (payload(40),)
    assert (await c.data_range(0, 50, max_bytes=1)).data == (payload(0),)
    monkeypatch.setattr(partition, "_range_max_bytes", 150)  # the server's own cap wins over the client's
    assert len((await c.data_range(40, 50)).data) == 3
    assert len((await c.data_range(0, 50)).data) == 3


async def test_storage_failure_is_an_error_answer(cluster: InProcessCluster) -> None:
    c = await connect(cluster)
    assert await c.append_all([payload(i) for i in range(60)]) == 59
    big = payload(60, BIG)
    assert await c.append_all([big, payload(61)]) == 61
    partition = cluster.servers[0].partitions[0]

    async def failing(first: int, max_count: int) -> list[Any]:
        raise PartitionNotReadyError("no replica could serve it")

    partition.store.read_records = failing  # type: ignore[method-assign]
    resp = await c.data_range(0, 10)
    assert resp.data == () and resp.error == "storage read failed: no replica could serve it"
    resp = await c.data_range(58, 10)  # the cached prefix, and why the rest is missing
    assert resp.data == (payload(58), payload(59)) and resp.error == "storage read failed: no replica could serve it"
    resp = await c.data_range(59, 10, max_bytes=1)  # full after 59: storage is not even asked
    assert resp.data == (payload(59),) and resp.error is None
    assert (await c.data_range(61, 10)).data == (payload(61),)  # cached, no storage read needed
