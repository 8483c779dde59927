"""Admin RPCs to a Waltz server over the client protocol (original ServerCli/ClusterCli requests).

Used by ``waltz server add-preferred-partition`` and ``waltz cluster check-connectivity|verify``.
One request at a time over one RPC connection; every call has a timeout.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from ..errors import ClientTimeoutError, ConnectionClosedError
from ..protocol import CLIENT
from ..protocol import client as m
from ..protocol.wire import ReqId
from ..timeouts import wait_for
from ..transport.base import Transport
from ..transport.channel import MessageChannel


class ServerAdminClient:
    def __init__(self, channel: MessageChannel, timeout: float) -> None:
        self._channel = channel
        self._timeout = timeout
        self._seq = itertools.count(1)
        self._lock = asyncio.Lock()

    @classmethod
    async def connect(cls, transport: Transport, address: str, timeout: float = 10.0) -> ServerAdminClient:
        conn = await wait_for(transport.connect(address), timeout)
        channel = await MessageChannel.open(conn, CLIENT, "waltz-admin", timeout)
        return cls(channel, timeout)

    async def close(self) -> None:
        await self._channel.close()

    async def _call(self, make: Any, response_type: type[Any]) -> Any:
        async with self._lock:
            req_id = ReqId(-1, -1, -1, next(self._seq))
            await self._channel.send(make(req_id))
            try:
                while True:
                    msg = await wait_for(self._channel.recv(), self._timeout)
                    if isinstance(msg, response_type) and msg.req_id == req_id:
                        return msg
            except TimeoutError:
                raise ClientTimeoutError(f"no answer from {self._channel.conn.peer} within {self._timeout}s") from None
            except ConnectionClosedError:
                raise ConnectionClosedError(f"server {self._channel.conn.peer} closed the connection") from None

    async def partitions(self) -> list[int]:
        r = await self._call(m.ServerPartitionsAssignmentRequest, m.ServerPartitionsAssignmentResponse)
        return list(r.partition_ids)

    async def partition_health(self) -> dict[int, bool]:
        r = await self._call(m.ServerPartitionsHealthStatRequest, m.ServerPartitionsHealthStatResponse)
        return dict(r.health)

    async def storage_connectivity(self) -> dict[str, bool]:
        r = await self._call(m.CheckStorageConnectivityRequest, m.CheckStorageConnectivityResponse)
        return dict(r.statuses)

    async def add_preferred_partitions(self, partition_ids: list[int]) -> bool:
        r = await self._call(lambda q: m.AddPreferredPartitionRequest(q, tuple(partition_ids)), m.AddPreferredPartitionResponse)
        return bool(r.ok)

    async def remove_preferred_partitions(self, partition_ids: list[int]) -> bool:
        r = await self._call(lambda q: m.RemovePreferredPartitionRequest(q, tuple(partition_ids)),
                             m.RemovePreferredPartitionResponse)
        return bool(r.ok)

    async def high_water_mark(self, partition_id: int) -> int:
        async with self._lock:
            req_id = ReqId(-1, -1, partition_id, next(self._seq))
            await self._channel.send(m.HighWaterMarkRequest(req_id))
            while True:
                msg = await wait_for(self._channel.recv(), self._timeout)
                if isinstance(msg, m.HighWaterMarkResponse) and msg.req_id == req_id:
                    return int(msg.transaction_id)
