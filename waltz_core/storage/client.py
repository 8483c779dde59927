"""Async clients of a storage node: :class:`StorageClient` (data port) and :class:`StorageAdminClient`.

Both are pipelined: any number of requests may be outstanding on one connection; responses are
matched to requests by sequence number. Refusals come back as the :mod:`waltz_core.errors`
class the node raised (``FailureResponse.error_code``, translated once here by
:func:`~waltz_core.errors.error_from_wire`). If the connection fails, every outstanding and
later call raises :class:`~waltz_core.errors.ConnectionClosedError` (or the error the node
sent before closing). All methods run on the event loop that called ``connect``.

Every request has a deadline (``request_timeout``): a node that stops answering while requests
are outstanding - a host that vanished, a hung disk - fails the connection with
:class:`~waltz_core.errors.RequestTimeoutError` within that time, whatever the transport's idle
timeout. Requests are pipelined and cannot be withdrawn one by one, so the whole connection goes;
one watchdog timer per connection checks the oldest outstanding request, nothing is added per
request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import (
    ConnectionClosedError,
    ProtocolError,
    RequestTimeoutError,
    StorageError,
    TransportError,
    WaltzError,
    error_from_wire,
)
from ..protocol import ADMIN, STORAGE, Family
from ..protocol import admin as am
from ..protocol import storage as sm
from ..protocol.framing import DEFAULT_MAX_FRAME_SIZE, MIN_MAX_FRAME_SIZE
from ..protocol.wire import INT32_MAX, Record, RecordBatch, RecordHeader, SessionInfo
from ..transport.base import Transport
from ..transport.channel import MessageChannel

log = logging.getLogger("waltz.storage.client")

#: What :meth:`_Pipeline.request_nowait` calls with the answer: (response, None) or (None, error).
ResponseCallback = Callable[[Any, WaltzError | None], None]

#: Seconds a data-port request may take before the connection is declared dead (servers pass
#: ``server.storage_request_timeout``).
DEFAULT_REQUEST_TIMEOUT = 5.0
#: Bytes of record batches one message of several partitions' appends carries at most (and at
#: most half the transport's largest frame): the appends queued beyond it go in the next message.
MANY_APPENDS_MAX_BYTES = 1024 * 1024
#: Admin requests (exports, assignment changes) may be slower; an operator's tool must not hang.
ADMIN_REQUEST_TIMEOUT = 60.0


class _Pipeline:
    """A channel with a reader task that resolves one future per sequence number.

    ``on_failure`` is called once, with the reason, when the connection fails for any reason
    other than :meth:`close` (the server's view of storage health listens to it).
    """

    def __init__(self, channel: MessageChannel,
                 failure_types: tuple[type[sm.FailureResponse] | type[am.AdminFailureResponse], ...],
                 request_timeout: float | None = None,
                 on_failure: Callable[[WaltzError], None] | None = None) -> None:
        self.channel = channel
        self._encode = channel.family.encode
        self._send = channel.conn.send
        #: the transport's optional send that never waits (``Connection.send_nowait``); without
        #: it, request_nowait sends from a task
        self._send_nowait: Callable[[bytes], None] | None = getattr(channel.conn, "send_nowait", None)
        self._sending: set[asyncio.Task[None]] = set()
        self._failure_types = failure_types
        #: seq -> the future a request awaits, or the callback of a request_nowait
        self._pending: dict[int, asyncio.Future[Any] | ResponseCallback] = {}
        self._seq = itertools.count(1)
        self._error: WaltzError | None = None
        self._on_failure = on_failure
        self._closing = False
        loop = asyncio.get_running_loop()
        self._reader = loop.create_task(self._read_loop())
        self._watchdog: asyncio.TimerHandle | None = None
        if request_timeout:
            self._timeout = request_timeout
            # Sequence numbers only grow and the pending dict keeps insertion order, so a request
            # still pending that was issued before a check at least request_timeout ago is late.
            self._checks: deque[tuple[float, int]] = deque()
            self._period = max(0.05, request_timeout / 4)
            self._watchdog = loop.call_later(self._period, self._check_deadlines)

    @property
    def closed(self) -> bool:
        return self._error is not None

    def error(self) -> WaltzError:
        """A fresh copy of why the connection failed (only when :attr:`closed`)."""
        assert self._error is not None
        return type(self._error)(str(self._error))

    def next_seq(self) -> int:
        self._last_seq = seq = next(self._seq)
        return seq

    _last_seq = 0

    async def request(self, seq: int, msg: Any) -> Any:
        if self._error is not None:
            raise type(self._error)(str(self._error))
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[seq] = fut
        try:
            await self._send(self._encode(msg))  # MessageChannel.send inlined: one coroutine less
        except WaltzError as exc:
            self._pending.pop(seq, None)
            if isinstance(exc, TransportError):
                self._fail(exc)
            raise
        response = await fut
        if isinstance(response, self._failure_types):
            raise error_from_wire(response.error_code, response.message)
        return response

    def request_nowait(self, seq: int, msg: Any, callback: ResponseCallback) -> None:
        """Send ``msg`` without awaiting; ``callback(response, None)`` or ``callback(None, error)``
        runs on the loop once it is answered or the connection fails.

        For a caller that bounds its own requests in flight (a replica session has one append
        outstanding at a time): the transport's back pressure is not waited for. No task, future
        or coroutine is made per request when the transport has ``send_nowait``. Raises (and
        does not call ``callback``) when the connection has already failed or the message
        cannot be sent.
        """
        if self._error is not None:
            raise type(self._error)(str(self._error))
        self.send_nowait(seq, self._encode(msg), callback)

    def send_nowait(self, seq: int, frame: bytes, callback: ResponseCallback) -> None:
        """:meth:`request_nowait` of a message its caller encoded already (``frame``)."""
        if self._error is not None:
            raise type(self._error)(str(self._error))
        self._pending[seq] = callback
        send_nowait = self._send_nowait
        if send_nowait is None:
            task = asyncio.get_running_loop().create_task(self._send_later(seq, frame))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)
            return
        try:
            send_nowait(frame)
        except WaltzError as exc:
            self._pending.pop(seq, None)
            if isinstance(exc, TransportError):
                self._fail(exc)
            raise

    async def _send_later(self, seq: int, frame: bytes) -> None:
        try:
            await self._send(frame)
        except WaltzError as exc:
            callback = self._pending.pop(seq, None)
            if isinstance(exc, TransportError):
                self._fail(exc)
            if callback is not None and not isinstance(callback, asyncio.Future):
                _answer(callback, None, exc)

    def _check_deadlines(self) -> None:
        if self._error is not None:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        checks = self._checks
        oldest = next(iter(self._pending), None)
        if oldest is None:
            checks.clear()
        else:
            while checks and checks[0][1] < oldest:
                checks.popleft()  # every request issued before that check has been answered
            if checks and now - checks[0][0] >= self._timeout:
                self._fail(RequestTimeoutError(
                    f"storage {self.channel.conn.peer}: no answer to a request within {self._timeout:g}s "
                    f"({len(self._pending)} outstanding)"))
                self._close_task = loop.create_task(self.channel.close())  # referenced until done
                return
            # Requests issued up to now (the last seq handed out) were sent before this check.
            issued = self._last_seq
            if not checks or checks[-1][1] != issued:
                checks.append((now, issued))
        self._watchdog = loop.call_later(self._period, self._check_deadlines)

    async def _read_loop(self) -> None:
        recv, decode = self.channel.conn.recv, self.channel.family.decode  # MessageChannel.recv inlined
        try:
            while True:
                msg = decode(await recv())
                if msg.seq_num == -1 and isinstance(msg, self._failure_types):
                    # The node rejected our bytes and closes the connection: every call fails with its reason.
                    self._fail(error_from_wire(msg.error_code, msg.message))
                    return
                waiter = self._pending.pop(msg.seq_num, None)
                if waiter is None:
                    continue
                if isinstance(waiter, asyncio.Future):
                    if not waiter.done():
                        waiter.set_result(msg)
                elif isinstance(msg, self._failure_types):
                    _answer(waiter, None, error_from_wire(msg.error_code, msg.message))
                else:
                    try:  # _answer inlined: once per append and replica
                        waiter(msg, None)
                    except Exception:
                        log.exception("storage client: a response callback failed")
        except ConnectionClosedError as exc:
            self._fail(exc)
        except (ProtocolError, TransportError) as exc:
            self._fail(exc)
            await self.channel.close()
        except asyncio.CancelledError:
            self._fail(ConnectionClosedError("the client was closed"))
            raise

    def _fail(self, exc: WaltzError) -> None:
        first = self._error is None
        if first:
            self._error = exc
            if self._watchdog is not None:
                self._watchdog.cancel()
        pending, self._pending = self._pending, {}
        for waiter in pending.values():
            if not isinstance(waiter, asyncio.Future):
                _answer(waiter, None, type(exc)(str(exc)))
            elif not waiter.done():
                waiter.set_exception(type(exc)(str(exc)))
        if first and not self._closing and self._on_failure is not None:
            self._on_failure(exc)

    async def close(self) -> None:
        self._closing = True
        self._reader.cancel()
        for task in self._sending:
            task.cancel()
        await asyncio.gather(self._reader, *self._sending, return_exceptions=True)
        self._fail(ConnectionClosedError("the client was closed"))
        await self.channel.close()


def _answer(callback: ResponseCallback, response: Any, error: WaltzError | None) -> None:
    # A callback's bug must not end the reader (every other request of the connection would hang).
    try:
        callback(response, error)
    except Exception:
        log.exception("storage client: a response callback failed")


async def _open_channel(transport: Transport, address: str, family: Family, role: str) -> MessageChannel:
    conn = await transport.connect(address)
    return await MessageChannel.open(conn, family, role)


class StorageClient:
    """Data-port client: the ten storage requests, pipelined. Use :meth:`connect`."""

    def __init__(self, pipeline: _Pipeline, address: str, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        self._p = pipeline
        self.address = address
        #: the node speaks storage protocol 4: appends of several partitions share a message
        self._many = pipeline.channel.version >= 4
        #: appends queued by append_nowait for the next message (session id, partition id, batch)
        self._queued: list[tuple[int, int, RecordBatch]] = []
        self._queued_done: list[Callable[[WaltzError | None], None]] = []
        self._queued_bytes = 0
        #: the node's frame limit, if it told (storage protocol 5)
        self.node_max_frame_size: int | None = None
        self._limit(max_frame_size)

    def _limit(self, max_frame_size: int) -> None:
        #: the largest frame this connection carries: ours, or the node's if smaller
        self.max_frame_size = max_frame_size
        #: bytes of records one append may carry (more, and the node would close the connection)
        self.max_batch_bytes = max_frame_size - sm.APPEND_BATCH_HEADROOM
        #: bytes of batches one message of several appends carries at most (a larger batch goes alone)
        self._many_max_bytes = max(1, min(MANY_APPENDS_MAX_BYTES, max_frame_size // 2))

    def _node_limit(self, max_frame_size: int) -> None:
        """The node's frame limit from its answer to the open: ours is lowered to it."""
        if max_frame_size < MIN_MAX_FRAME_SIZE:
            raise ProtocolError(f"storage {self.address} announced a max_frame_size of {max_frame_size} bytes, "
                                f"below the smallest allowed ({MIN_MAX_FRAME_SIZE})")
        self.node_max_frame_size = max_frame_size
        if max_frame_size < self.max_frame_size:
            self._limit(max_frame_size)

    def _too_large(self, records: RecordBatch) -> StorageError:
        what = (f"an append of {records.nbytes} bytes of records (transaction {records.first_transaction_id}"
                f"{'' if len(records) == 1 else f' and {len(records) - 1} more'})")
        node = self.node_max_frame_size
        if node is None or node > self.max_frame_size:
            return StorageError(f"{what} is over this process's transport.max_frame_size = {self.max_frame_size}")
        return StorageError(f"{what} is over what storage {self.address} takes: its transport.max_frame_size is "
                            f"{node}; give the storage nodes the servers' max_frame_size")

    @classmethod
    async def connect(cls, transport: Transport, address: str, cluster_key: uuid.UUID, num_partitions: int,
                      role: str = "waltz-storage-client", *, request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT,
                      on_failure: Callable[[WaltzError], None] | None = None) -> StorageClient:
        """Connect, handshake and send the open request; ClusterKeyMismatchError if the node refuses it.

        ``request_timeout`` bounds every request (None: no deadline); ``on_failure`` hears once
        why the connection failed (not called for :meth:`close`).
        """
        channel = await _open_channel(transport, address, STORAGE, role)
        client = cls(_Pipeline(channel, (sm.FailureResponse,), request_timeout, on_failure), address,
                     getattr(transport, "max_frame_size", DEFAULT_MAX_FRAME_SIZE))
        try:
            if channel.version >= sm.LIMITS_VERSION:  # each side learns the other's frame limit
                opened = await client._p.request(-1, sm.LimitedOpenRequest(
                    -1, -1, -1, cluster_key, num_partitions, min(client.max_frame_size, INT32_MAX)))
                if type(opened) is not sm.OpenResponse:
                    raise ProtocolError(f"storage {address} answered the open with {type(opened).__name__}")
                client._node_limit(opened.max_frame_size)
            else:
                await client._p.request(-1, sm.OpenRequest(-1, -1, -1, cluster_key, num_partitions))
        except BaseException:
            await client.close()
            raise
        return client

    @property
    def endpoint(self) -> str:
        """:attr:`address`, as :class:`~waltz_core.server.replica.ReplicaApi` names it."""
        return self.address

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
        """Durable on the node when this returns. A batch is sent as it is; Records are encoded first.
        StorageError, without sending, if the batch is over the node's frame limit."""
        batch = RecordBatch.of(records)
        if batch.nbytes > self.max_batch_bytes:
            raise self._too_large(batch)
        seq = self._p.next_seq()
        await self._p.request(seq, sm.StorageAppendRequest(session_id, seq, partition_id, batch, offline))

    def append_nowait(self, session_id: int, partition_id: int, records: RecordBatch,
                      done: Callable[[WaltzError | None], None]) -> None:
        """:meth:`append` without awaiting: ``done(None)`` once the batch is durable on the node,
        ``done(error)`` if it is refused or the connection fails (on the loop, from the reader).

        The replicated store streams with it (no task wake-up per batch); it keeps one append
        per partition outstanding, so nothing here waits for room. Raises, without calling
        ``done``, when the connection has already failed.

        With a node that speaks storage protocol 4 the appends go out together: queued, they
        are sent as one ``StorageAppendManyRequest`` (a single append still goes alone) by
        :meth:`send_appends`, which the caller calls once it has made the appends of a loop
        step, and which runs after the callbacks of every answer (they append the next batches)
        and, failing both, from a loop callback. So every partition's batch of a round shares
        one message and one answer.

        Raises StorageError, without sending, for a batch over the node's frame limit: sent, it
        would close the connection, and every partition's appends on it would fail."""
        if records.nbytes > self.max_batch_bytes:
            raise self._too_large(records)
        p = self._p
        if not self._many:
            seq = p.next_seq()
            p.send_nowait(seq, sm.encode_append(session_id, seq, partition_id, records),
                          lambda _response, error: done(error))
            return
        if p.closed:
            raise p.error()
        if self._queued and self._queued_bytes + records.nbytes > self._many_max_bytes:
            self.send_appends()  # a message stays within the limit unless one batch alone is larger
        queued = self._queued
        queued.append((session_id, partition_id, records))
        self._queued_done.append(done)
        self._queued_bytes += records.nbytes
        if len(queued) == 1:
            asyncio.get_running_loop().call_soon(self.send_appends)

    def send_appends(self) -> None:
        """Send the appends queued by :meth:`append_nowait`, all in one message (nothing if none)."""
        queued, dones = self._queued, self._queued_done
        if not queued:
            return
        self._queued, self._queued_done, self._queued_bytes = [], [], 0
        p = self._p
        seq = p.next_seq()
        try:
            if len(queued) == 1:
                session_id, partition_id, records = queued[0]
                frame = sm.encode_append(session_id, seq, partition_id, records)
            else:
                frame = sm.encode_append_many(seq, queued)
            p.send_nowait(seq, frame, _QueuedAppends(self, dones).answer)
        except Exception as exc:  # every append must be answered, or its replica waits forever
            if not isinstance(exc, WaltzError):
                log.exception("storage client: sending %d appends failed", len(dones))
            for done in dones:
                _answer_append(done, type(exc)(str(exc)) if isinstance(exc, WaltzError) else StorageError(
                    f"sending the append to {self.address} failed: {exc!r}"))

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


class _QueuedAppends:
    """The ``done`` callbacks of the appends sent in one message, answered from its answer: a
    SuccessResponse (one append), an AppendManyResponse (each refused append gets its own
    error) or the message's failure. Then the client sends what the callbacks appended."""

    __slots__ = ("client", "dones")

    def __init__(self, client: StorageClient, dones: list[Callable[[WaltzError | None], None]]) -> None:
        self.client = client
        self.dones = dones

    def answer(self, response: Any, error: WaltzError | None) -> None:
        dones = self.dones
        if error is None and len(dones) > 1 and type(response) is not sm.AppendManyResponse:
            error = ProtocolError(f"storage {self.client.address} answered {len(dones)} appends with a "
                                  f"{type(response).__name__}")
        if error is not None:
            for done in dones:
                _answer_append(done, type(error)(str(error)))
        else:
            failures = getattr(response, "failures", ())
            refused = {index: error_from_wire(code, message) for index, code, message in failures} if failures else {}
            for index, done in enumerate(dones):
                _answer_append(done, refused.get(index))
        self.client.send_appends()


def _answer_append(done: Callable[[WaltzError | None], None], error: WaltzError | None) -> None:
    # One partition's bug must not keep the others' acknowledgements from them (nor end the reader).
    try:
        done(error)
    except Exception:
        log.exception("storage client: a response callback failed (an append's)")


class StorageAdminClient:
    """Admin-port client (assignment, availability, export, session info, metrics, status)."""

    def __init__(self, pipeline: _Pipeline, address: str) -> None:
        self._p = pipeline
        self.address = address

    @classmethod
    async def connect(cls, transport: Transport, address: str, cluster_key: uuid.UUID, num_partitions: int,
                      role: str = "waltz-storage-admin-client", *,
                      request_timeout: float | None = ADMIN_REQUEST_TIMEOUT) -> StorageAdminClient:
        channel = await _open_channel(transport, address, ADMIN, role)
        client = cls(_Pipeline(channel, (am.AdminFailureResponse,), request_timeout), address)
        try:
            seq = client._p.next_seq()
            if channel.version >= am.LIMITS_VERSION:  # the node answers exports within our frames
                limit = min(getattr(transport, "max_frame_size", DEFAULT_MAX_FRAME_SIZE), INT32_MAX)
                await client._p.request(seq, am.LimitedAdminOpenRequest(seq, cluster_key, num_partitions, limit))
            else:
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
