"""Fixtures for the partition tests: a store whose commits and session resets the test scripts,
and a client link that records what the partition posts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any
from zlib import crc32

import pytest

from waltz_core.config import ServerConfig
from waltz_core.locks.exact import ExactLockTable
from waltz_core.protocol import client as m
from waltz_core.protocol.wire import Record, RecordHeader, ReqId
from waltz_core.server.partition import Partition, StoreSink


class ScriptedStore:
    """Assigns ids on append; commits and session resets happen when the test says so."""

    def __init__(self) -> None:
        self.high_water_mark = -1
        self.appended: list[bytes] = []  #: data by transaction id, this session's and before
        self.sink: StoreSink | None = None
        self._changed = asyncio.Event()

    async def open(self, sink: StoreSink) -> int:
        self.sink = sink
        return -1

    def append(self, req_id: ReqId, header: int, data: bytes, checksum: int) -> int:
        self.appended.append(data)
        return len(self.appended) - 1

    def append_if_writable(self, req_id: ReqId, header: int, data: bytes, checksum: int) -> int | None:
        return self.append(req_id, header, data, checksum)

    @property
    def writable(self) -> bool:
        return True

    async def wait_writable(self) -> None:
        return None

    async def flush(self) -> None:
        target = len(self.appended) - 1
        while self.high_water_mark < target:
            await self._changed.wait()

    def commit(self, high_water_mark: int) -> None:
        self.high_water_mark = high_water_mark
        assert self.sink is not None
        self.sink.on_committed(high_water_mark)
        self._wake()

    def reset(self, high_water_mark: int) -> None:
        """A new store session recovered ``high_water_mark``: what was appended after it is gone."""
        del self.appended[high_water_mark + 1:]
        self.high_water_mark = high_water_mark
        assert self.sink is not None
        self.sink.on_session_reset(high_water_mark)
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def read_headers(self, first: int, max_count: int) -> Sequence[RecordHeader]:
        return []

    async def read_record(self, transaction_id: int) -> Record | None:
        return None

    async def read_records(self, first: int, max_count: int) -> Sequence[Record]:
        return []

    async def close(self) -> None:
        return None

    @property
    def healthy(self) -> bool:
        return True

    @property
    def buffered_bytes(self) -> int:
        return 0


class Link:
    """What the partition posts to one client connection."""

    peer = "test"
    closed = False

    def __init__(self) -> None:
        self.posted: list[Any] = []
        self.fed: list[int] = []  #: transaction ids of the feed records posted, in order
        self.writable = True

    def post(self, msg: Any) -> None:
        self.posted.append(msg)

    def post_frames(self, frames: list[bytes]) -> None:
        for frame in frames:
            fields = m.unpack_feed_data(frame)
            assert fields is not None
            self.fed.append(fields[4])

    def inbound_added(self) -> None:
        return None

    def inbound_done(self) -> None:
        return None

    async def wait_writable(self) -> None:
        return None

    def of(self, kind: type) -> list[Any]:
        return [x for x in self.posted if type(x) is kind]


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


@pytest.fixture
async def mounted() -> AsyncIterator[tuple[ScriptedStore, Partition, Link]]:
    store = ScriptedStore()
    partition = Partition(0, 1, store, lambda hwm: ExactLockTable(hwm), ServerConfig())
    await partition.open()
    link = Link()
    await partition.submit(m.MountRequest(ReqId(1, 1, 0, 0), -1, 1), link)  # type: ignore[arg-type]
    await settle()
    assert link.of(m.MountResponse)[0].state is m.PartitionState.READY
    yield store, partition, link
    await partition.close()


def append(seq: int, data: bytes, write: tuple[int, ...] = ()) -> m.AppendRequest:
    return m.AppendRequest(ReqId(1, 1, 0, seq), -1, write, (), (), 0, data, crc32(data))
