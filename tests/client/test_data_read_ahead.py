"""Transaction data by range: the client's sequential read-ahead and ``fetch_data_range``.

Against the in-memory cluster, which records every data RPC it serves: (partition, transaction)
for TransactionDataRequest and (partition, first, max count) for TransactionDataRangeRequest.
"""

from __future__ import annotations

import asyncio
import time

import attrs
import pytest

from waltz_core.client import TransactionBuilder, TransactionContext, WaltzClientCallbacks, readahead
from waltz_core.client.link import ServerLink
from waltz_core.errors import ChecksumError, ClientError, ClientTimeoutError
from waltz_core.testing.mock_cluster import MockCluster

pytestmark = pytest.mark.timeout(60)


def payload(i: int) -> bytes:
    return f"transaction-{i}".encode() * (1 + i % 3)


class Put(TransactionContext):
    def __init__(self, data: bytes) -> None:
        super().__init__()
        self.data = data

    def partition_id(self, num_partitions: int) -> int:
        return 0

    def execute(self, builder: TransactionBuilder) -> bool:
        builder.set_transaction_data(self.data)
        return True


class Ignore(WaltzClientCallbacks):
    def client_high_water_mark(self, partition_id: int) -> int:
        return -1

    def apply_transaction(self, txn) -> None:
        """These clients write, or fetch ranges directly: they do not apply the feed."""


class Reader(WaltzClientCallbacks):
    """Fetches the data of every transaction (or of those ``wanted`` says) in apply order."""

    def __init__(self, wanted=lambda tid: True) -> None:
        self.wanted = wanted
        self.data: dict[int, bytes] = {}
        self.seen = -1

    def client_high_water_mark(self, partition_id: int) -> int:
        return -1

    async def apply_transaction(self, txn) -> None:
        if self.wanted(txn.transaction_id):
            self.data[txn.transaction_id] = await txn.fetch_data()
        self.seen = txn.transaction_id


class SyncReader(Reader):
    def apply_transaction(self, txn) -> None:  # type: ignore[override]
        self.data[txn.transaction_id] = txn.get_data()
        self.seen = txn.transaction_id


async def populate(cluster: MockCluster, count: int) -> None:
    async with cluster.async_client(Ignore()) as client:
        for i in range(count):
            await client.submit(Put(payload(i)))
        await client.flush()
    cluster.data_requests.clear()
    cluster.data_range_requests.clear()


async def read_all(cluster: MockCluster, app: Reader, last: int, **client_config: object) -> None:
    config = cluster.client_process_config()
    config = attrs.evolve(config, client=attrs.evolve(config.client, **client_config))
    async with cluster.async_client(app, config):
        deadline = time.monotonic() + 20
        while app.seen < last:
            assert time.monotonic() < deadline, f"applied up to {app.seen} of {last}"
            await asyncio.sleep(0.01)


def assert_contiguous(ranges: list[tuple[int, int, int]], start: int) -> None:
    # The mock serves every transaction asked for, so each range starts where the last one ended.
    for _, first, count in ranges:
        assert first == start
        start += count


async def test_sequential_fetches_read_ahead_in_growing_ranges() -> None:
    async with MockCluster(1) as cluster:
        await populate(cluster, 600)
        app = Reader()
        await read_all(cluster, app, 599)
        assert app.data == {i: payload(i) for i in range(600)}
        # The first fetch has nothing before it: alone. From the second on: ranges, 4 then doubling.
        assert cluster.data_requests == [(0, 0)]
        counts = [count for _, _, count in cluster.data_range_requests]
        assert counts[0] == readahead.READ_AHEAD_START
        assert max(counts) <= 256
        assert len(counts) < 30, counts  # not one RPC per transaction
        assert_contiguous(cluster.data_range_requests, 1)
        assert sum(counts) <= 600 - 1  # never beyond what the feed delivered (all committed)


async def test_read_ahead_window_follows_the_config() -> None:
    async with MockCluster(1) as cluster:
        await populate(cluster, 120)
        app = Reader()
        await read_all(cluster, app, 119, data_read_ahead=16)
        assert app.data == {i: payload(i) for i in range(120)}
        counts = [count for _, _, count in cluster.data_range_requests]
        assert counts[:3] == [4, 8, 16] and max(counts) == 16
        assert_contiguous(cluster.data_range_requests, 1)


async def test_read_ahead_off_is_one_transaction_per_rpc() -> None:
    async with MockCluster(1) as cluster:
        await populate(cluster, 30)
        app = Reader()
        await read_all(cluster, app, 29, data_read_ahead=0)
        assert app.data == {i: payload(i) for i in range(30)}
        assert cluster.data_requests == [(0, i) for i in range(30)]
        assert cluster.data_range_requests == []


async def test_random_access_fetches_one_transaction_per_rpc() -> None:
    async with MockCluster(1) as cluster:
        await populate(cluster, 60)
        app = Reader(wanted=lambda tid: tid % 3 == 0)  # never two in a row
        await read_all(cluster, app, 59)
        assert app.data == {i: payload(i) for i in range(0, 60, 3)}
        assert cluster.data_requests == [(0, i) for i in range(0, 60, 3)]
        assert cluster.data_range_requests == []


async def test_a_reader_at_the_head_of_the_log_reads_nothing_uncommitted() -> None:
    async with MockCluster(1) as cluster:
        app = Reader()
        async with cluster.async_client(app) as client:
            for i in range(40):
                await client.submit(Put(payload(i)))
                await client.flush()
        assert app.data == {i: payload(i) for i in range(40)}
        # Read-ahead stops at the last transaction received in the feed: no range reaches past
        # what was committed when it was asked for (the mock would answer "not committed").
        for _, first, count in cluster.data_range_requests:
            assert first + count - 1 <= 39


async def test_fetch_data_range() -> None:
    async with MockCluster(2) as cluster:
        await populate(cluster, 50)
        async with cluster.async_client(Ignore()) as client:
            assert await client.fetch_data_range(0, 5, 20) == [payload(i) for i in range(5, 25)]
            assert cluster.data_range_requests == [(0, 5, 20)]
            assert await client.fetch_data_range(0, 49, 1) == [payload(49)]
            assert await client.fetch_data_range(0, 7, 0) == []
            with pytest.raises(ValueError):
                await client.fetch_data_range(0, 0, -1)
            with pytest.raises(ClientError, match="no partition 9"):
                await client.fetch_data_range(9, 0, 1)
            with pytest.raises(ClientError, match="transaction ids start at 0"):
                await client.fetch_data_range(0, -1, 1)


async def test_fetch_data_range_splits_what_one_rpc_cannot_carry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(readahead, "RANGE_REQUEST_MAX", 7)
    async with MockCluster(1) as cluster:
        await populate(cluster, 30)
        async with cluster.async_client(Ignore()) as client:
            assert await client.fetch_data_range(0, 2, 20) == [payload(i) for i in range(2, 22)]
        assert cluster.data_range_requests == [(0, 2, 7), (0, 9, 7), (0, 16, 6)]


async def test_fetch_data_range_waits_for_uncommitted_transactions_then_times_out() -> None:
    async with MockCluster(1) as cluster:
        await populate(cluster, 3)
        config = cluster.client_process_config()
        config = attrs.evolve(config, client=attrs.evolve(config.client, data_fetch_timeout=0.3))
        async with cluster.async_client(Ignore(), config) as client:
            with pytest.raises(ClientTimeoutError, match=r"transaction 3 of partition 0.*not committed"):
                await client.fetch_data_range(0, 1, 5)  # 1 and 2 arrive; 3 never commits


async def test_range_checksums_are_verified_and_retried() -> None:
    async with MockCluster(1) as cluster:
        await populate(cluster, 10)
        async with cluster.async_client(Ignore()) as client:
            cluster.corrupt_next_data(2)  # attempts 1 and 2 corrupt, 3 of 5 succeeds
            assert await client.fetch_data_range(0, 0, 10) == [payload(i) for i in range(10)]
            assert len(cluster.data_range_requests) == 3
            cluster.corrupt_next_data(5)
            with pytest.raises(ChecksumError, match="transaction 4 of partition 0"):
                await client.fetch_data_range(0, 4, 3)


async def test_a_version_1_server_gets_one_transaction_per_rpc(monkeypatch: pytest.MonkeyPatch) -> None:
    async def version_1(self: ServerLink) -> int:
        return 1

    monkeypatch.setattr(ServerLink, "rpc_version", version_1)
    async with MockCluster(1) as cluster:
        await populate(cluster, 20)
        app = Reader()
        await read_all(cluster, app, 19)
        assert app.data == {i: payload(i) for i in range(20)}
        assert cluster.data_range_requests == []
        assert [t for _, t in cluster.data_requests] == list(range(20))
        cluster.data_requests.clear()
        async with cluster.async_client(Ignore()) as client:
            assert await client.fetch_data_range(0, 3, 4) == [payload(i) for i in range(3, 7)]
        assert cluster.data_requests == [(0, 3), (0, 4), (0, 5), (0, 6)]


def test_sync_client_reads_ahead_from_its_consumer_threads() -> None:
    with MockCluster(2) as cluster:
        with cluster.client(Ignore()) as producer:
            for i in range(300):
                producer.submit(Put(payload(i)))
            producer.flush()
        cluster.data_requests.clear()
        cluster.data_range_requests.clear()
        app = SyncReader()
        with cluster.client(app) as client:
            deadline = time.monotonic() + 20
            while app.seen < 299:
                assert time.monotonic() < deadline, f"applied up to {app.seen}"
                time.sleep(0.01)
            assert client.fetch_data_range(0, 10, 5) == [payload(i) for i in range(10, 15)]
        assert app.data == {i: payload(i) for i in range(300)}
        assert cluster.data_requests == [(0, 0)]
        assert len(cluster.data_range_requests) < 20
        assert_contiguous(cluster.data_range_requests[:-1], 1)  # the last one: fetch_data_range
        assert cluster.data_range_requests[-1] == (0, 10, 5)
