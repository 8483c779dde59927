"""Reading a client connection and handing its messages to partitions (the server's dispatch).

One task per client connection runs :func:`read_client_messages`: it decodes each message and
gives it to the partition it names, or answers for a partition this server does not own. A
partition whose inbox is full, or a connection with too many messages queued in partitions,
stops the reading (back pressure to the client's socket). It knows partitions only through
:class:`PartitionPort`, so the in-memory cluster (:mod:`waltz_core.testing.mock_cluster`) runs
the same dispatch with its fault injection in front of the server's partitions.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from ..protocol import client as m
from .link import ClientLink

#: Requests about the server, not about one partition: the caller's ``admin`` handles them.
ADMIN_REQUESTS = (
    m.CheckStorageConnectivityRequest, m.ServerPartitionsAssignmentRequest, m.AddPreferredPartitionRequest,
    m.RemovePreferredPartitionRequest, m.ServerPartitionsHealthStatRequest,
)


class PartitionPort(Protocol):
    """What the dispatch needs of a partition: :class:`~waltz_core.server.partition.Partition`
    has it (``offer`` returns a future to await while the partition's inbox is full)."""

    def offer(self, msg: Any, link: ClientLink) -> asyncio.Future[None] | None: ...


async def read_client_messages(link: ClientLink, partitions: Mapping[int, PartitionPort],
                               admin: Callable[[Any, ClientLink], None]) -> None:
    """Read ``link``'s connection until it fails: :data:`ADMIN_REQUESTS` go to ``admin`` (which
    must not block), every other message to the partition it names; a partition not in
    ``partitions`` (looked up per message: it changes with the assignment) gets the answers of a
    server that does not own it.

    Raises what the connection raises (``ConnectionClosedError``, ``TransportError``) or
    ``ProtocolError`` for bytes that do not decode; the caller closes the link.
    """
    channel = link.channel
    recv, decode = channel.conn.recv, channel.family.decode
    append_type = m.AppendRequest
    # Most frames are appends: their decoder without the family's dispatch call (client links
    # speak the client family, whose decode is m.CODEC's).
    append_kind, decode_append = append_type.TYPE, m.CODEC.decoder_of(append_type)
    limits_request = m.ServerLimitsRequest
    while True:
        frame = await recv()
        # ProtocolError for bytes that do not decode
        msg: Any = decode_append(frame) if frame and frame[0] == append_kind else decode(frame)
        t = type(msg)
        if t is not append_type:  # an append (most messages) is neither of these
            if t in ADMIN_REQUESTS:
                admin(msg, link)
                continue
            if t is limits_request:  # answered here, before the mounts that follow it
                link.post(m.ServerLimitsResponse(msg.req_id, *link.limits))
                continue
        partition = partitions.get(msg.req_id.partition_id)
        if partition is not None:
            full = partition.offer(msg, link)
            if full is not None:
                await full
            if not link.readable:
                await link.wait_readable()
        elif t is m.MountRequest:
            link.post(m.MountResponse(msg.req_id, m.PartitionState.NOT_READY))
        elif t is m.TransactionDataRequest:
            link.post(m.TransactionDataResponse(msg.req_id, msg.transaction_id, None, 0,
                                                f"partition {msg.req_id.partition_id} is not on this server"))
        elif t is m.TransactionDataRangeRequest:
            link.post(m.TransactionDataRangeResponse(
                msg.req_id, msg.first_transaction_id, (), (),
                f"partition {msg.req_id.partition_id} is not on this server"))
        elif t is m.HighWaterMarkRequest:
            link.post(m.HighWaterMarkResponse(msg.req_id, -2))  # -2: partition not here
        # appends, flushes, feed requests for partitions we do not own are dropped (original)
