"""Async clients of a storage node: :class:`StorageClient` (data port) and :class:`StorageAdminClient`.

Both are pipelined: any number of requests may be outstanding on one connection; responses are
matched to requests by sequence number. Refusals come back as the :mod:`waltz_core.errors`
class the node raised (``FailureResponse.error_type``, via
:func:`~waltz_core.errors.error_from_wire`). If the connection fails, every outstanding and
later call raises :class:`~waltz_core.errors.ConnectionClosedError` (or the error the node
sent before closing). All methods run on the event loop that called ``connect``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections.abc import Sequence
from typing import Any

from ..errors import ConnectionClosedError, ProtocolError, TransportError, WaltzError, error_from_wire
from ..protocol import ADMIN, STORAGE, Family
from ..protocol import admin as am
from ..protocol import storage as sm
from ..protocol.wire import Record, RecordBatch, RecordHeader, SessionInfo
from ..transport.base import Transport
from ..transport.channel import MessageChannel

log = logging.getLogger("waltz.storage.client")


class _Pipeline:
    """A channel with a reader task that resolves one future per sequence number."""

    def __init__(self, channel: MessageChannel, failure_types: tuple[type, ...]) -> None:
        self.channel = channel
        self._failure_types = failure_types
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._seq = itertools.count(1)
        self._error: WaltzError | None = None
        self._reader = asyncio.get_running_loop().create_task(self._read_loop())

    @property
    def closed(self) -> bool:
        return self._error is not None

    def next_seq(self) -> int:
        return next(self._seq)

    async def request(self, seq: int, msg: Any) -> Any:
        if self._error is not None:
            raise type(self._error)(str(self._error))
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[seq] = fut
        try:
            await self.channel.send(msg)
        except WaltzError as exc:
            self._pending.pop(seq, None)
            if isinstance(exc, TransportError):
                self._fail(exc)
            raise
        response = await fut
        if isinstance(response, self._failure_types):
            raise error_from_wire(response.error_type, response.message)
        return response

    async def _read_loop(self) -> None:
        try:
            while True:
                msg = await self.channel.recv()
                if msg.seq_num == -1 and isinstance(msg, self._failure_types):
                    # The node rejected our bytes and closes the connection: every call fails with its reason.
                    self._fail(error_from_wire(msg.error_type, msg.message))
                    return
                fut = self._pending.pop(msg.seq_num, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
        except ConnectionClosedError as exc:
            self._fail(exc)
        except (ProtocolError, TransportError) as exc:
            self._fail(exc)
            await self.channel.close()
        except asyncio.CancelledError:
            self._fail(ConnectionClosedError("the client was closed"))
            raise

    def _fail(self, exc: WaltzError) -> None:
        if self._error is None:
            self._error = exc
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(type(exc)(str(exc)))

    async def close(self) -> None:
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)
        self._fail(ConnectionClosedError("the client was closed"))
        await self.channel.close()


async def _open_channel(transport: Transport, address: str, family: Family, role: str) -> MessageChannel:
    conn = await transport.connect(address)
    return await MessageChannel.open(conn, family, role)


class StorageClient:
    """Data-port client: the ten storage requests, pipelined. Use :meth:`connect`."""

    def __init__(self, pipeline: _Pipeline, address: str) -> None:
        self._p = pipeline
        self.address = address

    @classmethod
    async def connect(cls, transport: Transport, address: str, cluster_key: uuid.UUID, num_partitions: int,
                      role: str = "waltz-storage-client") -> StorageClient:
        """Connect, handshake and send the open request; ClusterKeyMismatchError if the node refuses it."""
        channel = await _open_channel(transport, address, STORAGE, role)
        client = cls(_Pipeline(channel, (sm.FailureResponse,)), address)
        try:
            await client._p.request(-1, sm.OpenRequest(-1, -1, -1, cluster_key, num_partitions))
        except BaseException:
            await client.close()
            raise
        return client

    @property
    def closed(self) -> bool:
        return self._p.closed

    async def close(self) -> None:
        await self._p.close()

    async def last_session_info(self, session_id: int, partition_id: int, *, offline: bool = False) -> SessionInfo:
        seq = self._p.next_seq()
        r = await self._p.request(seq, sm.LastSessionInfoRequest(session_id, seq, partition_id, offline))
        return r.session_info  # type: ignore[no-any-return]

    async def max_transaction_id(self, session_id: int, partition_id: int, *, offline: bool = False) -> int:
        seq = self._p.next_seq()
        r = await self._p.request(seq, sm.MaxTransactionIdRequest(session_id, seq, partition_id, offline))
        return r.transaction_id  # type: ignore[no-any-return]

    async def truncate(self, session_id: int, partition_id: int, transaction_id: int, *, offline: bool = False) -> None:
        seq = self._p.next_seq()
        await self._p.request(seq, sm.TruncateRequest(session_id, seq, partition_id, transaction_id, offline))

    async def set_low_water_mark(self, session_id: int, partition_id: int, low_water_mark: int, *,
                                 offline: bool = False) -> None:
        seq = self._p.next_seq()
        await self._p.request(seq, sm.SetLowWaterMarkRequest(session_id, seq, partition_id, low_water_mark, offline))

    async def append(self, session_id: int, partition_id: int, records: RecordBatch | Sequence[Record], *,
                     offline: bool = False) -> None:
        """Durable on the node when this returns. A batch is sent as it is; Records are encoded first."""
        seq = self._p.next_seq()
        await self._p.request(seq, sm.StorageAppendRequest(session_id, seq, partition_id, RecordBatch.of(records),
                                                           offline))

    async def record_header(self, session_id: int, partition_id: int, transaction_id: int) -> RecordHeader | None:
        seq = self._p.next_seq()
        r = await self._p.request(seq, sm.RecordHeaderRequest(session_id, seq, partition_id, transaction_id))
        return r.record_header  # type: ignore[no-any-return]

    async def record(self, session_id: int, partition_id: int, transaction_id: int) -> Record | None:
        seq = self._p.next_seq()
        r = await self._p.request(seq, sm.RecordRequest(session_id, seq, partition_id, transaction_id))
        return r.record  # type: ignore[no-any-return]

    async def record_header_list(self, session_id: int, partition_id: int, transaction_id: int,
                                 max_records: int) -> tuple[RecordHeader, ...]:
        seq = self._p.next_seq()
        r = await self._p.request(seq, sm.RecordHeaderListRequest(session_id, seq, partition_id, transaction_id,
                                                                  max_records))
        return r.record_headers  # type: ignore[no-any-return]

    async def record_list(self, session_id: int, partition_id: int, transaction_id: int,
                          max_records: int) -> RecordBatch:
        """The stored bytes of up to ``max_records`` records from ``transaction_id`` (a sequence of Records)."""
        seq = self._p.next_seq()
        r = await self._p.request(seq, sm.RecordListRequest(session_id, seq, partition_id, transaction_id, max_records))
        batch: RecordBatch = r.records
        if len(batch) and batch.first_transaction_id != transaction_id:
            raise ProtocolError(f"storage {self.address}: asked for records from {transaction_id}, got them from "
                                f"{batch.first_transaction_id}")
        return batch


class StorageAdminClient:
    """Admin-port client (assignment, availability, export, session info, metrics, status)."""

    def __init__(self, pipeline: _Pipeline, address: str) -> None:
        self._p = pipeline
        self.address = address

    @classmethod
    async def connect(cls, transport: Transport, address: str, cluster_key: uuid.UUID, num_partitions: int,
                      role: str = "waltz-storage-admin-client") -> StorageAdminClient:
        channel = await _open_channel(transport, address, ADMIN, role)
        client = cls(_Pipeline(channel, (am.AdminFailureResponse,)), address)
        try:
            seq = client._p.next_seq()
            await client._p.request(seq, am.AdminOpenRequest(seq, cluster_key, num_partitions))
        except BaseException:
            await client.close()
            raise
        return client

    async def close(self) -> None:
        await self._p.close()

    async def set_assignment(self, partition_ids: Sequence[int], assigned: bool, *,
                             delete_storage_files: bool = False) -> None:
        seq = self._p.next_seq()
        await self._p.request(seq, am.PartitionAssignmentRequest(seq, tuple(partition_ids), assigned,
                                                                 delete_storage_files))

    async def set_availability(self, partition_ids: Sequence[int], available: bool) -> None:
        seq = self._p.next_seq()
        await self._p.request(seq, am.PartitionAvailableRequest(seq, tuple(partition_ids), available))

    async def record_list(self, partition_id: int, transaction_id: int, max_records: int) -> tuple[Record, ...]:
        seq = self._p.next_seq()
        r = await self._p.request(seq, am.AdminRecordListRequest(seq, partition_id, transaction_id, max_records))
        return r.records  # type: ignore[no-any-return]

    async def last_session_info(self, partition_id: int) -> SessionInfo:
        seq = self._p.next_seq()
        r = await self._p.request(seq, am.AdminLastSessionInfoRequest(seq, partition_id))
        return r.session_info  # type: ignore[no-any-return]

    async def metrics_json(self) -> str:
        seq = self._p.next_seq()
        r = await self._p.request(seq, am.MetricsRequest(seq))
        return r.metrics_json  # type: ignore[no-any-return]

    async def assigned_partition_status(self) -> dict[int, bool]:
        """Assigned partition id -> available."""
        seq = self._p.next_seq()
        r = await self._p.request(seq, am.AssignedPartitionStatusRequest(seq))
        return dict(r.statuses)
