"""Client <-> server messages (Waltz design, "Client-Server Communication"; original codec V4).

Every payload starts with ``byte type`` then the 16-byte :class:`ReqId`. Stream connections
carry mount/append/feed/flush/lock-failure; RPC connections carry transaction data, high-water
marks and the admin requests. ``encode`` and ``decode`` are pure functions: bytes in, message out.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable
from typing import Any, ClassVar, Final, TypeAlias

import attrs

from ..errors import ChecksumError, ProtocolError
from .wire import (
    I32,
    U32,
    Reader,
    ReqId,
    crc32,
    w_blob,
    w_int_array,
    w_str,
)

PROTOCOL: Final = b"L"
#: 2 adds the transaction data range RPC (TYPE 23/24); a client sends it only on a link that
#: negotiated 2, so version-1 servers keep getting one TransactionDataRequest per transaction.
VERSIONS: Final = (1, 2)
DATA_RANGE_VERSION: Final = 2


class PartitionState(enum.IntEnum):
    """Mount outcome (original V3+: an int state instead of a boolean)."""

    READY = 0
    NOT_READY = 1
    CLIENT_AHEAD = 2


@attrs.frozen(slots=True)
class MountRequest:
    TYPE: ClassVar[int] = 0
    req_id: ReqId
    client_high_water_mark: int
    seq_num: int  #: the network client's sequence number; newer connections supersede older ones


@attrs.frozen(slots=True)
class MountResponse:
    TYPE: ClassVar[int] = 1
    req_id: ReqId
    state: PartitionState


@attrs.frozen(slots=True)
class AppendRequest:
    TYPE: ClassVar[int] = 2
    req_id: ReqId
    client_high_water_mark: int
    write_locks: tuple[int, ...]
    read_locks: tuple[int, ...]
    append_locks: tuple[int, ...]
    header: int
    data: bytes
    checksum: int  #: CRC-32 of data; verified when decoded


@attrs.frozen(slots=True)
class FeedRequest:
    TYPE: ClassVar[int] = 3
    req_id: ReqId
    client_high_water_mark: int


@attrs.frozen(slots=True)
class FeedData:
    TYPE: ClassVar[int] = 4
    req_id: ReqId  #: the request id of the append that produced this transaction
    transaction_id: int
    header: int


@attrs.frozen(slots=True)
class FeedSuspended:
    TYPE: ClassVar[int] = 5
    req_id: ReqId


@attrs.frozen(slots=True)
class TransactionDataRequest:
    TYPE: ClassVar[int] = 6
    req_id: ReqId
    transaction_id: int


@attrs.frozen(slots=True)
class TransactionDataResponse:
    TYPE: ClassVar[int] = 7
    req_id: ReqId
    transaction_id: int
    data: bytes | None  #: None when the fetch failed
    checksum: int
    error: str | None  #: set when the fetch failed


@attrs.frozen(slots=True)
class FlushRequest:
    TYPE: ClassVar[int] = 8
    req_id: ReqId


@attrs.frozen(slots=True)
class FlushResponse:
    TYPE: ClassVar[int] = 9
    req_id: ReqId
    transaction_id: int  #: the high-water mark after the pending appends were processed


@attrs.frozen(slots=True)
class LockFailure:
    TYPE: ClassVar[int] = 10
    req_id: ReqId
    transaction_id: int  #: the (estimated) transaction that made the lock request fail


@attrs.frozen(slots=True)
class HighWaterMarkRequest:
    TYPE: ClassVar[int] = 11
    req_id: ReqId


@attrs.frozen(slots=True)
class HighWaterMarkResponse:
    TYPE: ClassVar[int] = 12
    req_id: ReqId
    transaction_id: int


@attrs.frozen(slots=True)
class CheckStorageConnectivityRequest:
    TYPE: ClassVar[int] = 13
    req_id: ReqId


@attrs.frozen(slots=True)
class CheckStorageConnectivityResponse:
    TYPE: ClassVar[int] = 14
    req_id: ReqId
    statuses: tuple[tuple[str, bool], ...]  #: ("host:port", reachable)


@attrs.frozen(slots=True)
class ServerPartitionsAssignmentRequest:
    TYPE: ClassVar[int] = 15
    req_id: ReqId


@attrs.frozen(slots=True)
class ServerPartitionsAssignmentResponse:
    TYPE: ClassVar[int] = 16
    req_id: ReqId
    partition_ids: tuple[int, ...]


@attrs.frozen(slots=True)
class AddPreferredPartitionRequest:
    TYPE: ClassVar[int] = 17
    req_id: ReqId
    partition_ids: tuple[int, ...]


@attrs.frozen(slots=True)
class AddPreferredPartitionResponse:
    TYPE: ClassVar[int] = 18
    req_id: ReqId
    ok: bool


@attrs.frozen(slots=True)
class RemovePreferredPartitionRequest:
    TYPE: ClassVar[int] = 19
    req_id: ReqId
    partition_ids: tuple[int, ...]


@attrs.frozen(slots=True)
class RemovePreferredPartitionResponse:
    TYPE: ClassVar[int] = 20
    req_id: ReqId
    ok: bool


@attrs.frozen(slots=True)
class ServerPartitionsHealthStatRequest:
    TYPE: ClassVar[int] = 21
    req_id: ReqId


@attrs.frozen(slots=True)
class ServerPartitionsHealthStatResponse:
    TYPE: ClassVar[int] = 22
    req_id: ReqId
    health: tuple[tuple[int, bool], ...]  #: (partition id, healthy)


@attrs.frozen(slots=True)
class TransactionDataRangeRequest:
    """Data of the committed transactions ``first_transaction_id, first_transaction_id + 1, ...``
    in one RPC (protocol version 2). The server answers at least the first transaction when it
    can, and at most ``max_count`` transactions and about ``max_bytes`` bytes of data (it caps
    both further itself)."""

    TYPE: ClassVar[int] = 23
    req_id: ReqId
    first_transaction_id: int
    max_count: int
    max_bytes: int


@attrs.frozen(slots=True)
class TransactionDataRangeResponse:
    """``data[i]`` and ``checksums[i]`` are transaction ``first_transaction_id + i``'s (the
    client verifies each CRC-32). ``error`` says why the server stopped before ``max_count``
    when that was a failure (not committed, storage read failed); with no data at all it is
    always set."""

    TYPE: ClassVar[int] = 24
    req_id: ReqId
    first_transaction_id: int
    data: tuple[bytes, ...]
    checksums: tuple[int, ...]  #: one per element of ``data``
    error: str | None


ClientMessage: TypeAlias = (
    MountRequest | MountResponse | AppendRequest | FeedRequest | FeedData | FeedSuspended | TransactionDataRequest |
    TransactionDataResponse | FlushRequest | FlushResponse | LockFailure | HighWaterMarkRequest |
    HighWaterMarkResponse | CheckStorageConnectivityRequest | CheckStorageConnectivityResponse |
    ServerPartitionsAssignmentRequest | ServerPartitionsAssignmentResponse | AddPreferredPartitionRequest |
    AddPreferredPartitionResponse | RemovePreferredPartitionRequest | RemovePreferredPartitionResponse |
    ServerPartitionsHealthStatRequest | ServerPartitionsHealthStatResponse | TransactionDataRangeRequest |
    TransactionDataRangeResponse
)

MESSAGES: Final[tuple[type, ...]] = (
    MountRequest, MountResponse, AppendRequest, FeedRequest, FeedData, FeedSuspended,
    TransactionDataRequest, TransactionDataResponse, FlushRequest, FlushResponse, LockFailure,
    HighWaterMarkRequest, HighWaterMarkResponse, CheckStorageConnectivityRequest,
    CheckStorageConnectivityResponse, ServerPartitionsAssignmentRequest, ServerPartitionsAssignmentResponse,
    AddPreferredPartitionRequest, AddPreferredPartitionResponse, RemovePreferredPartitionRequest,
    RemovePreferredPartitionResponse, ServerPartitionsHealthStatRequest, ServerPartitionsHealthStatResponse,
    TransactionDataRangeRequest, TransactionDataRangeResponse,
)

# ------------------------------------------------------------------------------------ structs
_HEAD: Final = struct.Struct(">biiii")  # type + req id
_HEAD_LONG: Final = struct.Struct(">biiiiq")  # type + req id + one long
_FEED_DATA: Final = struct.Struct(">biiiiqi")  # type + req id + transaction id + header
_MOUNT_REQ: Final = struct.Struct(">biiiiqq")
_MOUNT_RESP: Final = struct.Struct(">biiiii")
_HEAD_BOOL: Final = struct.Struct(">biiiib")

_LONG_BODIED: dict[type, str] = {
    FeedRequest: "client_high_water_mark", TransactionDataRequest: "transaction_id", FlushResponse: "transaction_id",
    LockFailure: "transaction_id", HighWaterMarkResponse: "transaction_id"}
_EMPTY_BODIED = (FeedSuspended, FlushRequest, HighWaterMarkRequest, CheckStorageConnectivityRequest,
                 ServerPartitionsAssignmentRequest, ServerPartitionsHealthStatRequest)


def _head(msg: ClientMessage) -> bytes:
    q = msg.req_id
    return _HEAD.pack(msg.TYPE, q.client_id, q.generation, q.partition_id, q.seq_num)


def encode(msg: ClientMessage) -> bytes:
    """Encode one message to a frame payload."""
    try:
        return _ENCODERS[type(msg)](msg)
    except struct.error as exc:
        raise ProtocolError(f"cannot encode {type(msg).__name__}: {exc}") from None
    except KeyError:
        raise ProtocolError(f"not a client/server message: {type(msg).__name__}") from None


def encode_feed_data(req_id: ReqId, transaction_id: int, header: int) -> bytes:
    """The FeedData payload for one committed transaction, without building a message object
    (the server encodes each commit once and sends the same bytes to every mounted client)."""
    q = req_id
    return _FEED_DATA.pack(4, q.client_id, q.generation, q.partition_id, q.seq_num, transaction_id, header)


def _enc_feed_data(m: FeedData) -> bytes:
    return encode_feed_data(m.req_id, m.transaction_id, m.header)


def _enc_mount_req(m: MountRequest) -> bytes:
    q = m.req_id
    return _MOUNT_REQ.pack(0, q.client_id, q.generation, q.partition_id, q.seq_num, m.client_high_water_mark, m.seq_num)


def _enc_mount_resp(m: MountResponse) -> bytes:
    q = m.req_id
    return _MOUNT_RESP.pack(1, q.client_id, q.generation, q.partition_id, q.seq_num, int(m.state))


#: An append without locks: everything before the data in one struct (the common case).
_APPEND_PLAIN_HEAD: Final = struct.Struct(">biiiiqiiiii")


def encode_append(client_id: int, generation: int, partition_id: int, seq_num: int, client_high_water_mark: int,
                  write_locks: tuple[int, ...], read_locks: tuple[int, ...], append_locks: tuple[int, ...],
                  header: int, data: bytes, checksum: int) -> bytes:
    """The AppendRequest payload from its fields, without building message objects (the client
    sends one per transaction)."""
    if not write_locks and not read_locks and not append_locks:
        return b"".join((_APPEND_PLAIN_HEAD.pack(2, client_id, generation, partition_id, seq_num,
                                                 client_high_water_mark, 0, 0, 0, header, len(data)),
                         data, U32.pack(checksum)))
    out = [_HEAD_LONG.pack(2, client_id, generation, partition_id, seq_num, client_high_water_mark)]
    w_int_array(out, write_locks)
    w_int_array(out, read_locks)
    w_int_array(out, append_locks)
    out.append(I32.pack(header))
    w_blob(out, data)
    out.append(U32.pack(checksum))
    return b"".join(out)


def _enc_append(m: AppendRequest) -> bytes:
    q = m.req_id
    return encode_append(q.client_id, q.generation, q.partition_id, q.seq_num, m.client_high_water_mark,
                         m.write_locks, m.read_locks, m.append_locks, m.header, m.data, m.checksum)


def _enc_long(m: ClientMessage) -> bytes:
    q = m.req_id
    return _HEAD_LONG.pack(m.TYPE, q.client_id, q.generation, q.partition_id, q.seq_num, getattr(m, _LONG_BODIED[type(m)]))


def _enc_txn_data_resp(m: TransactionDataResponse) -> bytes:
    q = m.req_id
    out = [_HEAD_LONG.pack(7, q.client_id, q.generation, q.partition_id, q.seq_num, m.transaction_id)]
    if m.data is not None:
        out.append(b"\x01")
        w_blob(out, m.data)
        out.append(U32.pack(m.checksum))
    else:
        out.append(b"\x00")
        w_str(out, m.error or "")
    return b"".join(out)


def _enc_statuses(m: CheckStorageConnectivityResponse) -> bytes:
    out = [_head(m), I32.pack(len(m.statuses))]
    for endpoint, ok in m.statuses:
        w_str(out, endpoint)
        out.append(b"\x01" if ok else b"\x00")
    return b"".join(out)


def _enc_ids(m: ServerPartitionsAssignmentResponse | AddPreferredPartitionRequest | RemovePreferredPartitionRequest) -> bytes:
    out = [_head(m)]
    w_int_array(out, m.partition_ids)
    return b"".join(out)


def _enc_ok(m: AddPreferredPartitionResponse | RemovePreferredPartitionResponse) -> bytes:
    q = m.req_id
    return _HEAD_BOOL.pack(m.TYPE, q.client_id, q.generation, q.partition_id, q.seq_num, 1 if m.ok else 0)


def _enc_health(m: ServerPartitionsHealthStatResponse) -> bytes:
    out = [_head(m), I32.pack(len(m.health))]
    out.extend(struct.pack(">ib", pid, 1 if ok else 0) for pid, ok in m.health)
    return b"".join(out)


_DATA_RANGE_REQ: Final = struct.Struct(">biiiiqii")  # type + req id + first id + max count + max bytes
_DATA_RANGE_RESP_HEAD: Final = struct.Struct(">biiiiqi")  # type + req id + first id + transaction count
_CRC_AND_SIZE: Final = struct.Struct(">Ii")  # one transaction's checksum + the next one's data length
#: Wire bytes per transaction of a range response besides its data (length + checksum).
DATA_RANGE_ITEM_OVERHEAD: Final = 8


def _enc_txn_data_range_req(m: TransactionDataRangeRequest) -> bytes:
    q = m.req_id
    return _DATA_RANGE_REQ.pack(23, q.client_id, q.generation, q.partition_id, q.seq_num, m.first_transaction_id,
                                m.max_count, m.max_bytes)


def _enc_txn_data_range_resp(m: TransactionDataRangeResponse) -> bytes:
    q = m.req_id
    data, checksums = m.data, m.checksums
    n = len(data)
    if len(checksums) != n:
        raise ProtocolError(f"TransactionDataRangeResponse: {n} data but {len(checksums)} checksums")
    out = [_DATA_RANGE_RESP_HEAD.pack(24, q.client_id, q.generation, q.partition_id, q.seq_num,
                                      m.first_transaction_id, n)]
    if n:
        # Layout per transaction: int length, data, uint checksum. A checksum and the next length
        # are packed together: one small allocation per transaction instead of two.
        pack = _CRC_AND_SIZE.pack
        out.append(I32.pack(len(data[0])))
        for i in range(n - 1):
            out.append(data[i])
            out.append(pack(checksums[i], len(data[i + 1])))
        out.append(data[-1])
        out.append(U32.pack(checksums[-1]))
    if m.error is None:
        out.append(b"\x00")
    else:
        out.append(b"\x01")
        w_str(out, m.error)
    return b"".join(out)


_ENCODERS: dict[type, Callable[[Any], bytes]] = {
    TransactionDataRangeRequest: _enc_txn_data_range_req,
    TransactionDataRangeResponse: _enc_txn_data_range_resp,
    MountRequest: _enc_mount_req,
    MountResponse: _enc_mount_resp,
    AppendRequest: _enc_append,
    FeedData: _enc_feed_data,
    TransactionDataResponse: _enc_txn_data_resp,
    CheckStorageConnectivityResponse: _enc_statuses,
    ServerPartitionsAssignmentResponse: _enc_ids,
    AddPreferredPartitionRequest: _enc_ids,
    RemovePreferredPartitionRequest: _enc_ids,
    AddPreferredPartitionResponse: _enc_ok,
    RemovePreferredPartitionResponse: _enc_ok,
    ServerPartitionsHealthStatResponse: _enc_health,
    **{cls: _enc_long for cls in _LONG_BODIED},
    **{cls: _head for cls in _EMPTY_BODIED},
}

# ------------------------------------------------------------------------------------ decoding


def decode(buf: bytes | memoryview) -> ClientMessage:
    """Decode one frame payload. Anything malformed raises :class:`ProtocolError` naming the problem."""
    if not buf:
        raise ProtocolError("client message: empty frame")
    kind = buf[0]
    if kind >= len(_DECODERS):
        raise ProtocolError(f"client message: unknown message type {kind}")
    # Fast paths: fixed-size messages decode with one precompiled struct.
    if kind == 4:
        if len(buf) != _FEED_DATA.size:
            raise ProtocolError(f"FeedData: expected {_FEED_DATA.size} bytes, got {len(buf)}")
        _, c, g, p, s, t, h = _FEED_DATA.unpack(buf)
        return FeedData(ReqId(c, g, p, s), t, h)
    if kind == 2:
        return _dec_append(buf)
    decoder = _DECODERS[kind]
    assert decoder is not None  # the kinds without one took their fast path above
    return decoder(Reader(buf, 1, _NAMES[kind]))


def unpack_feed_data(buf: bytes) -> tuple[int, int, int, int, int, int] | None:
    """``(client id, generation, partition id, seq num, transaction id, header)`` when ``buf`` is a
    well-formed FeedData payload, else None (decode it with :func:`decode`, which names the problem).

    The client's stream reader takes this path for every feed record: no message objects.
    """
    if len(buf) != _FEED_DATA.size or buf[0] != 4:
        return None
    return _FEED_DATA.unpack(buf)[1:]


_Decoder: TypeAlias = Callable[[Reader], ClientMessage]


def _dec_req(cls: Callable[[ReqId], ClientMessage]) -> _Decoder:
    def dec(r: Reader) -> ClientMessage:
        q = r.req_id()
        r.done()
        return cls(q)
    return dec


def _dec_long(cls: type[Any]) -> _Decoder:
    def dec(r: Reader) -> ClientMessage:
        q = r.req_id()
        v = r.i64(_LONG_BODIED[cls])
        r.done()
        msg: ClientMessage = cls(q, v)
        return msg
    return dec


def _dec_mount_req(r: Reader) -> MountRequest:
    q = r.req_id()
    m = MountRequest(q, r.i64("client high-water mark"), r.i64("sequence number"))
    r.done()
    return m


def _dec_mount_resp(r: Reader) -> MountResponse:
    q = r.req_id()
    raw = r.i32("partition state")
    try:
        state = PartitionState(raw)
    except ValueError:
        raise ProtocolError(f"MountResponse: unknown partition state {raw}") from None
    r.done()
    return MountResponse(q, state)


_TWO_INTS: Final = struct.Struct(">ii")
_INT_ARRAYS: Final = tuple(struct.Struct(f">{n}i") for n in range(17))  # the common small lock lists
_APPEND_MIN: Final = _HEAD_LONG.size + 3 * 4 + 4 + 4 + 4  # no locks, no data


def _dec_append(buf: bytes | memoryview) -> AppendRequest:
    """AppendRequest fast path (the server decodes one per transaction).

    Offsets are computed directly instead of through :class:`Reader`; anything that does not
    fit exactly is re-parsed by :func:`_dec_append_checked`, which raises the precise error.
    """
    end = len(buf)
    if end < _APPEND_MIN:
        return _dec_append_checked(Reader(buf, 1, "AppendRequest"))
    # The common append has no locks: one struct reads everything before the data.
    _, c, g, p, s, hwm, nw, nr, na, header, n = _APPEND_PLAIN_HEAD.unpack_from(buf, 0)
    if nw == 0 and nr == 0 and na == 0:
        start = _APPEND_PLAIN_HEAD.size
        if n < 0 or start + n + 4 != end:
            return _dec_append_checked(Reader(buf, 1, "AppendRequest"))
        data = bytes(buf[start : start + n])
        (checksum,) = U32.unpack_from(buf, start + n)
        if crc32(data) != checksum:
            raise ChecksumError(f"AppendRequest {ReqId(c, g, p, s)}: transaction data checksum mismatch")
        return AppendRequest(ReqId(c, g, p, s), hwm, (), (), (), header, data, checksum)
    pos = _HEAD_LONG.size
    locks = []
    for _ in range(3):
        (n,) = I32.unpack_from(buf, pos)
        pos += 4
        # 12 = at least the header, the data length and the checksum still follow
        if n < 0 or pos + 4 * n + 12 > end:
            return _dec_append_checked(Reader(buf, 1, "AppendRequest"))
        locks.append(_INT_ARRAYS[n].unpack_from(buf, pos) if n < 17 else struct.unpack_from(f">{n}i", buf, pos))
        pos += 4 * n
    header, n = _TWO_INTS.unpack_from(buf, pos)
    pos += 8
    if n < 0 or pos + n + 4 != end:
        return _dec_append_checked(Reader(buf, 1, "AppendRequest"))
    data = bytes(buf[pos : pos + n])
    (checksum,) = U32.unpack_from(buf, pos + n)
    q = ReqId(c, g, p, s)
    if crc32(data) != checksum:
        raise ChecksumError(f"AppendRequest {q}: transaction data checksum mismatch")
    return AppendRequest(q, hwm, locks[0], locks[1], locks[2], header, data, checksum)


def _dec_append_checked(r: Reader) -> AppendRequest:
    q = r.req_id()
    hwm = r.i64("client high-water mark")
    wl = r.int_array("write locks")
    rl = r.int_array("read locks")
    al = r.int_array("append locks")
    header = r.i32("header")
    data = r.blob("data")
    checksum = r.u32("checksum")
    r.done()
    if crc32(data) != checksum:
        raise ChecksumError(f"AppendRequest {q}: transaction data checksum mismatch")
    return AppendRequest(q, hwm, wl, rl, al, header, data, checksum)


def _dec_txn_data_resp(r: Reader) -> TransactionDataResponse:
    q = r.req_id()
    txn = r.i64("transaction id")
    if r.bool("success flag"):
        data = r.blob("data")
        checksum = r.u32("checksum")
        r.done()
        return TransactionDataResponse(q, txn, data, checksum, None)
    error = r.str("error message")
    r.done()
    return TransactionDataResponse(q, txn, None, 0, error)


def _dec_statuses(r: Reader) -> CheckStorageConnectivityResponse:
    q = r.req_id()
    n = r.count("statuses", 5)
    statuses = tuple((r.str("endpoint"), r.bool("reachable")) for _ in range(n))
    r.done()
    return CheckStorageConnectivityResponse(q, statuses)


def _dec_ids(cls: Callable[[ReqId, tuple[int, ...]], ClientMessage]) -> _Decoder:
    def dec(r: Reader) -> ClientMessage:
        q = r.req_id()
        ids = r.int_array("partition ids")
        r.done()
        return cls(q, ids)
    return dec


def _dec_ok(cls: Callable[[ReqId, bool], ClientMessage]) -> _Decoder:
    def dec(r: Reader) -> ClientMessage:
        q = r.req_id()
        ok = r.bool("result")
        r.done()
        return cls(q, ok)
    return dec


def _dec_health(r: Reader) -> ServerPartitionsHealthStatResponse:
    q = r.req_id()
    n = r.count("health", 5)
    health = tuple((r.i32("partition id"), r.bool("healthy")) for _ in range(n))
    r.done()
    return ServerPartitionsHealthStatResponse(q, health)


_DATA_RANGE_REQ_BODY: Final = struct.Struct(">iiiiqii")  # _DATA_RANGE_REQ after the type byte


def _dec_txn_data_range_req(r: Reader) -> TransactionDataRangeRequest:
    c, g, p, s, first, max_count, max_bytes = r.unpack(_DATA_RANGE_REQ_BODY, "request id, range and limits")
    r.done()
    return TransactionDataRangeRequest(ReqId(c, g, p, s), first, max_count, max_bytes)


def _dec_txn_data_range_resp(r: Reader) -> TransactionDataRangeResponse:
    # Hot path on the client (one call per range of up to hundreds of transactions): offsets are
    # checked inline, every length against the bytes actually left before anything is copied.
    q = r.req_id()
    first = r.i64("first transaction id")
    n = r.count("transactions", DATA_RANGE_ITEM_OVERHEAD)
    buf, pos, end = r.buf, r.pos, r.end
    unpack_i32, unpack_u32 = I32.unpack_from, U32.unpack_from
    data: list[bytes] = []
    checksums: list[int] = []
    for i in range(n):
        if pos + DATA_RANGE_ITEM_OVERHEAD > end:
            raise ProtocolError(f"TransactionDataRangeResponse: truncated at byte {pos} in transaction {i} of {n}")
        (size,) = unpack_i32(buf, pos)
        pos += 4
        if size < 0 or pos + size + 4 > end:
            raise ProtocolError(f"TransactionDataRangeResponse: transaction {i} of {n} claims {size} data bytes, "
                                f"{end - pos} left")
        data.append(bytes(buf[pos : pos + size]))
        checksums.append(unpack_u32(buf, pos + size)[0])
        pos += size + 4
    r.pos = pos
    error = r.str("error message") if r.bool("error flag") else None
    r.done()
    return TransactionDataRangeResponse(q, first, tuple(data), tuple(checksums), error)


_DECODERS: tuple[_Decoder | None, ...] = (
    _dec_mount_req,
    _dec_mount_resp,
    None,  # AppendRequest: fast path in decode()
    _dec_long(FeedRequest),
    None,  # FeedData: fast path in decode()
    _dec_req(FeedSuspended),
    _dec_long(TransactionDataRequest),
    _dec_txn_data_resp,
    _dec_req(FlushRequest),
    _dec_long(FlushResponse),
    _dec_long(LockFailure),
    _dec_req(HighWaterMarkRequest),
    _dec_long(HighWaterMarkResponse),
    _dec_req(CheckStorageConnectivityRequest),
    _dec_statuses,
    _dec_req(ServerPartitionsAssignmentRequest),
    _dec_ids(ServerPartitionsAssignmentResponse),
    _dec_ids(AddPreferredPartitionRequest),
    _dec_ok(AddPreferredPartitionResponse),
    _dec_ids(RemovePreferredPartitionRequest),
    _dec_ok(RemovePreferredPartitionResponse),
    _dec_req(ServerPartitionsHealthStatRequest),
    _dec_health,
    _dec_txn_data_range_req,
    _dec_txn_data_range_resp,
)
_NAMES: tuple[str, ...] = tuple(cls.__name__ for cls in MESSAGES)
assert all(cls.TYPE == i for i, cls in enumerate(MESSAGES))  # type: ignore[attr-defined]
