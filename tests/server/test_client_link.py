"""What the server writes to a client connection: the feed records of every partition posted
between two writes go in FeedDataBatch frames, and no other message overtakes them."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import attrs
import pytest

from waltz_core.protocol import CLIENT
from waltz_core.protocol import client as m
from waltz_core.protocol.client import FEED_BATCH_MAX_RECORDS, encode_feed_data
from waltz_core.protocol.wire import ReqId
from waltz_core.server.link import ClientLink
from waltz_core.transport.channel import MessageChannel

pytestmark = pytest.mark.timeout(30)


@attrs.define
class RecordingConnection:
    """A connection that keeps each write (one ``send_many``) as its list of frames."""

    writes: list[list[bytes]] = attrs.Factory(list)
    peer: str = "test-client"
    closed: bool = False

    async def send_many(self, frames: Sequence[bytes]) -> None:
        self.writes.append(list(frames))

    async def close(self) -> None:
        self.closed = True


def feed(partition: int, transaction_id: int) -> bytes:
    return encode_feed_data(ReqId(7, 1, partition, transaction_id + 100), transaction_id, 0)


def records(frames: list[bytes]) -> list[object]:
    """Each frame decoded; a FeedDataBatch as its (partition, transaction) pairs."""
    out: list[object] = []
    for frame in frames:
        msg = CLIENT.decode(frame)
        if isinstance(msg, m.FeedDataBatch):
            out.append([(r.req_id.partition_id, r.transaction_id) for r in msg.records])
        elif isinstance(msg, m.FeedData):
            out.append((msg.req_id.partition_id, msg.transaction_id))
        else:
            out.append(type(msg).__name__)
    return out


async def open_link(version: int) -> tuple[ClientLink, RecordingConnection]:
    conn = RecordingConnection()
    return ClientLink(MessageChannel(conn, CLIENT, version, "client")), conn  # type: ignore[arg-type]


async def test_feed_records_of_several_partitions_share_frames_and_keep_their_order() -> None:
    link, conn = await open_link(3)
    try:
        link.post_frames([feed(0, 5), feed(0, 6)])
        link.post_frames([feed(1, 9)])
        link.post_frames([feed(2, 3)])
        link.post(m.FlushResponse(ReqId(7, 1, 1, 0), 9))  # a message closes the run of feed records
        link.post_frames([feed(1, 10)])
        many = [feed(3, t) for t in range(FEED_BATCH_MAX_RECORDS + 1)]
        link.post_frames(many)
        await asyncio.sleep(0.01)
        assert len(conn.writes) == 1  # everything posted in one step goes in one write
        assert records(conn.writes[0]) == [
            [(0, 5), (0, 6), (1, 9), (2, 3)],
            "FlushResponse",
            [(1, 10)] + [(3, t) for t in range(FEED_BATCH_MAX_RECORDS - 1)],
            [(3, FEED_BATCH_MAX_RECORDS - 1), (3, FEED_BATCH_MAX_RECORDS)],
        ]
        assert all(len(frame) <= 1024 for frame in conn.writes[0])
        # The next write starts a new run.
        link.post_frames([feed(0, 7)])
        await asyncio.sleep(0.01)
        assert records(conn.writes[1]) == [(0, 7)]
    finally:
        await link.close()


async def test_an_older_client_gets_each_feed_record_alone() -> None:
    link, conn = await open_link(2)
    try:
        link.post_frames([feed(0, 5), feed(1, 2)])
        link.post(m.FlushResponse(ReqId(7, 1, 1, 0), 2))
        await asyncio.sleep(0.01)
        assert records(conn.writes[0]) == [(0, 5), (1, 2), "FlushResponse"]
    finally:
        await link.close()
