"""Client <-> server messages (Waltz design, "Client-Server Communication"; original codec V4).

Every payload starts with ``byte type`` then the 16-byte :class:`ReqId`; the rest of each
message's layout is declared on its class (field annotations, see :mod:`.layout`), in field
order. Stream connections carry mount/append/feed/flush/lock-failure; RPC connections carry
transaction data, high-water marks and the admin requests. ``encode`` and ``decode`` are pure
functions: message in, bytes out and back.

Hand-written fast paths, registered as overrides of the generic codec and equivalent to it:
``AppendRequest`` (encoded from its fields by :func:`encode_append`, decoded by
:func:`_dec_append`) and ``FeedData`` (one struct each way). More work without message
objects: :func:`encode_feed_data` and :func:`encode_feed_batch` (the server's feed, from fields
and from FeedData payloads) and :func:`unpack_feed_data` and :func:`unpack_feed_batch` (the
client's stream reader, to plain tuples).
"""

from __future__ import annotations

import enum
import struct
import typing
from collections.abc import Iterator, Sequence
from typing import Annotated, Any, ClassVar, Final, TypeAlias

import attrs

from ..errors import ChecksumError, ProtocolError
from .layout import (
    BLOB,
    BOOL,
    INT32,
    INT64,
    INT_ARRAY,
    REQ_ID,
    STRING,
    UINT32,
    Array,
    Buf,
    Codec,
    Enum32,
    FamilyCodec,
    FixedTuple,
    Group,
    Nullable,
    Tuple,
)
from .wire import (
    I32,
    U32,
    Reader,
    ReqId,
    crc32,
    fast_req_id,
    w_blob,
    w_int_array,
    w_str,
)

PROTOCOL: Final = b"L"
#: 2 adds the transaction data range RPC (TYPE 23/24); a client sends it only on a link that
#: negotiated 2, so version-1 servers keep getting one TransactionDataRequest per transaction.
#: 3 adds FeedDataBatch (TYPE 25): the server sends the feed records of a commit in one frame
#: on a stream link that negotiated 3, and FeedData one by one on the others.
#: 4 adds AppendRefused (TYPE 26): on a link that negotiated 4 the server answers an append it
#: will not take (too large, too many locks); on the others it drops the append and logs it. And
#: the limits RPC (TYPE 27/28), which a client sends first on a stream link that negotiated 4 (a
#: frame above the server's limit would close the connection, again at every retry).
VERSIONS: Final = (1, 2, 3, 4)
DATA_RANGE_VERSION: Final = 2
FEED_BATCH_VERSION: Final = 3
LIMITS_VERSION: Final = 4


class PartitionState(enum.IntEnum):
    """Mount outcome (original V3+: an int state instead of a boolean)."""

    READY = 0
    NOT_READY = 1
    CLIENT_AHEAD = 2


class _DataOrError(Group):
    """TransactionDataResponse's ``data``, ``checksum`` and ``error``: ``bool ok``, then ``blob
    data, uint checksum`` when ok, else ``str error`` (no data: checksum 0, error at least "")."""

    fields = ("data", "checksum", "error")

    def write(self, out: list[bytes], value: tuple[Any, ...]) -> None:
        data, checksum, error = value
        if data is not None:
            out.append(b"\x01")
            w_blob(out, data)
            out.append(U32.pack(checksum))
        else:
            out.append(b"\x00")
            w_str(out, error or "")

    def read(self, r: Reader, label: str) -> tuple[Any, ...]:
        if r.bool("success flag"):
            return r.blob("data"), r.u32("checksum"), None
        return None, 0, r.str("error message")


#: Wire bytes per transaction of a range response besides its data (length + checksum).
DATA_RANGE_ITEM_OVERHEAD: Final = 8
_CRC_AND_SIZE: Final = struct.Struct(">Ii")  # one transaction's checksum + the next one's data length


class _DataWithChecksums(Group):
    """TransactionDataRangeResponse's ``data`` and ``checksums``: ``int`` count, then per
    transaction ``int`` length, data, ``uint`` checksum. A hot path on the client (one decode per
    range of up to hundreds of transactions): offsets are checked inline, every length against
    the bytes actually left before anything is copied."""

    fields = ("data", "checksums")

    def write(self, out: list[bytes], value: tuple[Any, ...]) -> None:
        data, checksums = value
        n = len(data)
        if len(checksums) != n:
            raise ValueError(f"{n} data but {len(checksums)} checksums")
        out.append(I32.pack(n))
        if n:
            # A checksum and the next length are packed together: one small allocation per
            # transaction instead of two.
            pack = _CRC_AND_SIZE.pack
            out.append(I32.pack(len(data[0])))
            for i in range(n - 1):
                out.append(data[i])
                out.append(pack(checksums[i], len(data[i + 1])))
            out.append(data[-1])
            out.append(U32.pack(checksums[-1]))

    def read(self, r: Reader, label: str) -> tuple[Any, ...]:
        n = r.count("transactions", DATA_RANGE_ITEM_OVERHEAD)
        buf, pos, end = r.buf, r.pos, r.end
        unpack_i32, unpack_u32 = I32.unpack_from, U32.unpack_from
        data: list[bytes] = []
        checksums: list[int] = []
        for i in range(n):
            if pos + DATA_RANGE_ITEM_OVERHEAD > end:
                raise ProtocolError(f"{r.what}: truncated at byte {pos} in transaction {i} of {n}")
            (size,) = unpack_i32(buf, pos)
            pos += 4
            if size < 0 or pos + size + 4 > end:
                raise ProtocolError(f"{r.what}: transaction {i} of {n} claims {size} data bytes, {end - pos} left")
            data.append(bytes(buf[pos : pos + size]))
            checksums.append(unpack_u32(buf, pos + size)[0])
            pos += size + 4
        r.pos = pos
        return tuple(data), tuple(checksums)


_DATA_OR_ERROR: Final = _DataOrError()
_DATA_WITH_CHECKSUMS: Final = _DataWithChecksums()
_ERROR: Final = Nullable(STRING, flag_label="error flag", label="error message")
_PARTITION_STATE: Final = Enum32(PartitionState)


# ----------------------------------------------------------------------------------- messages


@attrs.frozen(slots=True)
class MountRequest:
    TYPE: ClassVar[int] = 0
    req_id: ReqId
    client_high_water_mark: Annotated[int, INT64]
    #: the network client's sequence number; newer connections supersede older ones
    seq_num: Annotated[int, INT64]


@attrs.frozen(slots=True)
class MountResponse:
    TYPE: ClassVar[int] = 1
    req_id: ReqId
    state: Annotated[PartitionState, _PARTITION_STATE]


@attrs.frozen(slots=True)
class AppendRequest:
    TYPE: ClassVar[int] = 2
    req_id: ReqId
    client_high_water_mark: Annotated[int, INT64]
    write_locks: Annotated[tuple[int, ...], INT_ARRAY]
    read_locks: Annotated[tuple[int, ...], INT_ARRAY]
    append_locks: Annotated[tuple[int, ...], INT_ARRAY]
    header: Annotated[int, INT32]
    data: Annotated[bytes, BLOB]
    checksum: Annotated[int, UINT32]  #: CRC-32 of data; verified when decoded

    def verify(self) -> None:
        """ChecksumError unless ``checksum`` is the CRC-32 of ``data`` (decoding calls it)."""
        if crc32(self.data) != self.checksum:
            raise ChecksumError(f"AppendRequest {self.req_id}: transaction data checksum mismatch")


_new_object = object.__new__
(_set_req_id, _set_hwm, _set_write_locks, _set_read_locks, _set_append_locks, _set_header, _set_data,
 _set_checksum) = (getattr(AppendRequest, a.name).__set__ for a in attrs.fields(AppendRequest))


def _fast_append(req_id: ReqId, client_high_water_mark: int, write_locks: tuple[int, ...], read_locks: tuple[int, ...],
                 append_locks: tuple[int, ...], header: int, data: bytes, checksum: int) -> AppendRequest:
    """``AppendRequest(...)`` through the slot descriptors (523 -> 334 ns; see wire.fast_req_id):
    the server decodes one per transaction."""
    m: AppendRequest = _new_object(AppendRequest)
    _set_req_id(m, req_id)
    _set_hwm(m, client_high_water_mark)
    _set_write_locks(m, write_locks)
    _set_read_locks(m, read_locks)
    _set_append_locks(m, append_locks)
    _set_header(m, header)
    _set_data(m, data)
    _set_checksum(m, checksum)
    return m


@attrs.frozen(slots=True)
class FeedRequest:
    TYPE: ClassVar[int] = 3
    req_id: ReqId
    client_high_water_mark: Annotated[int, INT64]


@attrs.frozen(slots=True)
class FeedData:
    TYPE: ClassVar[int] = 4
    req_id: ReqId  #: the request id of the append that produced this transaction
    transaction_id: Annotated[int, INT64]
    header: Annotated[int, INT32]


#: One FeedData payload: type + req id + transaction id + header (29 bytes).
_FEED_DATA: Final = struct.Struct(">biiiiqi")
_FEED_DATA_SIZE: Final = _FEED_DATA.size


#: FeedDataBatch up to its records: type 25, the first record's request id, the ``int`` count.
_FEED_BATCH_HEAD: Final = struct.Struct(">b16si")
_FEED_BATCH_HEAD_SIZE: Final = _FEED_BATCH_HEAD.size
#: Where a payload's request id ends (after the type byte): in a FeedDataBatch, where its count starts.
_REQ_ID_END: Final = 1 + 16


class _FeedRecords(Codec[tuple[FeedData, ...]]):
    """FeedDataBatch's records: ``int`` count (at least 1), then each record as a whole FeedData
    payload (29 bytes, its type byte 4 included)."""

    min_size = 4 + _FEED_DATA_SIZE

    def write(self, out: list[bytes], value: tuple[FeedData, ...]) -> None:
        out.append(I32.pack(len(value)))
        out.extend(encode_feed_data(f.req_id, f.transaction_id, f.header) for f in value)

    def read(self, r: Reader, label: str) -> tuple[FeedData, ...]:
        n = r.count(label, _FEED_DATA_SIZE)
        if n == 0:
            raise ProtocolError(f"{r.what}: {label}: a batch holds at least one record")
        out: list[FeedData] = []
        unpack = _FEED_DATA.unpack_from
        for i in range(n):
            kind, c, g, p, s, t, h = unpack(r.buf, r.take(_FEED_DATA_SIZE, label))
            if kind != 4:
                raise ProtocolError(f"{r.what}: {label}: record {i} has type {kind}, not FeedData (4)")
            out.append(FeedData(ReqId(c, g, p, s), t, h))
        if r.buf[1:_REQ_ID_END] != r.buf[_FEED_BATCH_HEAD_SIZE + 1:_FEED_BATCH_HEAD_SIZE + _REQ_ID_END]:
            raise ProtocolError(f"{r.what}: the request id of the head is not the first record's")
        return tuple(out)


def _first_record_request(batch: FeedDataBatch, _attribute: Any, records: tuple[FeedData, ...]) -> None:
    if not records:
        raise ValueError("a FeedDataBatch holds at least one record")
    if records[0].req_id != batch.req_id:
        raise ValueError(f"a FeedDataBatch's req_id must be its first record's: {batch.req_id} is not "
                         f"{records[0].req_id}")


@attrs.frozen(slots=True)
class FeedDataBatch:
    """Version 3: feed records in one frame (a commit of many transactions, or the commits of many
    partitions, is one frame and one read for the client, not one per transaction). Each record
    names its own partition; a partition's records are in transaction order.

    ``req_id`` is the first record's (every message of the family starts with one). After it
    come the ``int`` count and each record as a whole FeedData payload, so the server joins the
    payloads it encoded once per commit for every client (:func:`encode_feed_batch`)."""

    TYPE: ClassVar[int] = 25
    req_id: ReqId
    records: Annotated[tuple[FeedData, ...], _FeedRecords()] = attrs.field(validator=_first_record_request)


@attrs.frozen(slots=True)
class FeedSuspended:
    TYPE: ClassVar[int] = 5
    req_id: ReqId


@attrs.frozen(slots=True)
class TransactionDataRequest:
    TYPE: ClassVar[int] = 6
    req_id: ReqId
    transaction_id: Annotated[int, INT64]


@attrs.frozen(slots=True)
class TransactionDataResponse:
    TYPE: ClassVar[int] = 7
    req_id: ReqId
    transaction_id: Annotated[int, INT64]
    data: Annotated[bytes | None, _DATA_OR_ERROR]  #: None when the fetch failed
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
    #: the high-water mark after the pending appends were processed
    transaction_id: Annotated[int, INT64]


@attrs.frozen(slots=True)
class LockFailure:
    TYPE: ClassVar[int] = 10
    req_id: ReqId
    #: the (estimated) transaction that made the lock request fail
    transaction_id: Annotated[int, INT64]


@attrs.frozen(slots=True)
class HighWaterMarkRequest:
    TYPE: ClassVar[int] = 11
    req_id: ReqId


@attrs.frozen(slots=True)
class HighWaterMarkResponse:
    TYPE: ClassVar[int] = 12
    req_id: ReqId
    transaction_id: Annotated[int, INT64]


@attrs.frozen(slots=True)
class CheckStorageConnectivityRequest:
    TYPE: ClassVar[int] = 13
    req_id: ReqId


@attrs.frozen(slots=True)
class CheckStorageConnectivityResponse:
    TYPE: ClassVar[int] = 14
    req_id: ReqId
    #: ("host:port", reachable)
    statuses: Annotated[tuple[tuple[str, bool], ...], Array(Tuple(STRING, BOOL))]


@attrs.frozen(slots=True)
class ServerPartitionsAssignmentRequest:
    TYPE: ClassVar[int] = 15
    req_id: ReqId


@attrs.frozen(slots=True)
class ServerPartitionsAssignmentResponse:
    TYPE: ClassVar[int] = 16
    req_id: ReqId
    partition_ids: Annotated[tuple[int, ...], INT_ARRAY]


@attrs.frozen(slots=True)
class AddPreferredPartitionRequest:
    TYPE: ClassVar[int] = 17
    req_id: ReqId
    partition_ids: Annotated[tuple[int, ...], INT_ARRAY]


@attrs.frozen(slots=True)
class AddPreferredPartitionResponse:
    TYPE: ClassVar[int] = 18
    req_id: ReqId
    ok: Annotated[bool, BOOL]


@attrs.frozen(slots=True)
class RemovePreferredPartitionRequest:
    TYPE: ClassVar[int] = 19
    req_id: ReqId
    partition_ids: Annotated[tuple[int, ...], INT_ARRAY]


@attrs.frozen(slots=True)
class RemovePreferredPartitionResponse:
    TYPE: ClassVar[int] = 20
    req_id: ReqId
    ok: Annotated[bool, BOOL]


@attrs.frozen(slots=True)
class ServerPartitionsHealthStatRequest:
    TYPE: ClassVar[int] = 21
    req_id: ReqId


@attrs.frozen(slots=True)
class ServerPartitionsHealthStatResponse:
    TYPE: ClassVar[int] = 22
    req_id: ReqId
    #: (partition id, healthy)
    health: Annotated[tuple[tuple[int, bool], ...], Array(FixedTuple(INT32, BOOL))]


@attrs.frozen(slots=True)
class TransactionDataRangeRequest:
    """Data of the committed transactions ``first_transaction_id, first_transaction_id + 1, ...``
    in one RPC (protocol version 2). The server answers at least the first transaction when it
    can, and at most ``max_count`` transactions and about ``max_bytes`` bytes of data (it caps
    both further itself)."""

    TYPE: ClassVar[int] = 23
    req_id: ReqId
    first_transaction_id: Annotated[int, INT64]
    max_count: Annotated[int, INT32]
    max_bytes: Annotated[int, INT32]


@attrs.frozen(slots=True)
class TransactionDataRangeResponse:
    """``data[i]`` and ``checksums[i]`` are transaction ``first_transaction_id + i``'s (the
    client verifies each CRC-32). ``error`` says why the server stopped before ``max_count``
    when that was a failure (not committed, storage read failed); with no data at all it is
    always set."""

    TYPE: ClassVar[int] = 24
    req_id: ReqId
    first_transaction_id: Annotated[int, INT64]
    data: Annotated[tuple[bytes, ...], _DATA_WITH_CHECKSUMS]
    checksums: tuple[int, ...]  #: one per element of ``data``
    error: Annotated[str | None, _ERROR]


@attrs.frozen(slots=True)
class AppendRefused:
    """The server will not take this append, now or ever (protocol 4): the client fails the
    transaction with the error the code names (:func:`waltz_core.errors.error_from_wire`) and
    does not send it again."""

    TYPE: ClassVar[int] = 26
    req_id: ReqId
    error_code: Annotated[int, INT32]
    message: Annotated[str, STRING]


@attrs.frozen(slots=True)
class ServerLimitsRequest:
    """The server's limits on what one transaction may be (protocol 4). Answered at once, in the
    order of the connection: a client that sends it first knows them before any mount is READY."""

    TYPE: ClassVar[int] = 27
    req_id: ReqId


@attrs.frozen(slots=True)
class ServerLimitsResponse:
    TYPE: ClassVar[int] = 28
    req_id: ReqId
    max_frame_size: Annotated[int, INT32]  #: the server's ``transport.max_frame_size``
    max_locks_per_transaction: Annotated[int, INT32]  #: the server's ``[server] max_locks_per_transaction``


ClientMessage: TypeAlias = (
    MountRequest | MountResponse | AppendRequest | FeedRequest | FeedData | FeedSuspended | TransactionDataRequest |
    TransactionDataResponse | FlushRequest | FlushResponse | LockFailure | HighWaterMarkRequest |
    HighWaterMarkResponse | CheckStorageConnectivityRequest | CheckStorageConnectivityResponse |
    ServerPartitionsAssignmentRequest | ServerPartitionsAssignmentResponse | AddPreferredPartitionRequest |
    AddPreferredPartitionResponse | RemovePreferredPartitionRequest | RemovePreferredPartitionResponse |
    ServerPartitionsHealthStatRequest | ServerPartitionsHealthStatResponse | TransactionDataRangeRequest |
    TransactionDataRangeResponse | FeedDataBatch | AppendRefused | ServerLimitsRequest | ServerLimitsResponse
)
#: every message class, in TYPE order (the alias above is the one list of them)
MESSAGES: Final[tuple[type, ...]] = typing.get_args(ClientMessage)

#: the generic codec derived from the declarations above (type table checked at import)
CODEC: Final[FamilyCodec[ClientMessage]] = FamilyCodec("client/server", "client message", (("req_id", REQ_ID),),
                                                       MESSAGES)
encode: Final = CODEC.encode
decode: Final = CODEC.decode


# --------------------------------------------------------------------------------- fast paths

_HEAD_LONG: Final = struct.Struct(">biiiiq")  # type + req id + one long
#: An append without locks: everything before the data in one struct (the common case).
_APPEND_PLAIN_HEAD: Final = struct.Struct(">biiiiqiiiii")


def encode_feed_data(req_id: ReqId, transaction_id: int, header: int) -> bytes:
    """The FeedData payload for one committed transaction, without building a message object
    (the server encodes each commit once and sends the same bytes to every mounted client)."""
    q = req_id
    return _FEED_DATA.pack(4, q.client_id, q.generation, q.partition_id, q.seq_num, transaction_id, header)


def encode_feed_data_run(commits: Sequence[Sequence[Any]]) -> list[bytes]:
    """:func:`encode_feed_data` of each commit given as ``(transaction id, req id, header, ...)``
    (the server's pending appends of a commit batch): one comprehension, no call per commit."""
    pack = _FEED_DATA.pack
    return [pack(4, q.client_id, q.generation, q.partition_id, q.seq_num, c[0], c[2]) for c in commits for q in (c[1],)]


@CODEC.encoder(FeedData)
def _enc_feed_data(m: FeedData) -> bytes:
    q = m.req_id  # encode_feed_data inlined: one call less per message
    return _FEED_DATA.pack(4, q.client_id, q.generation, q.partition_id, q.seq_num, m.transaction_id, m.header)


_unpack_feed_data: Final = _FEED_DATA.unpack  # bound once: the client decodes one per transaction


@CODEC.decoder(FeedData)
def _dec_feed_data(buf: Buf) -> FeedData:
    if len(buf) != _FEED_DATA_SIZE:
        raise ProtocolError(f"FeedData: expected {_FEED_DATA_SIZE} bytes, got {len(buf)}")
    _, c, g, p, s, t, h = _unpack_feed_data(buf)
    return FeedData(ReqId(c, g, p, s), t, h)


def unpack_feed_data(buf: bytes) -> tuple[int, int, int, int, int, int] | None:
    """``(client id, generation, partition id, seq num, transaction id, header)`` when ``buf`` is a
    well-formed FeedData payload, else None (decode it with :func:`decode`, which names the problem).

    The client's stream reader takes this path for every feed record: no message objects.
    """
    if len(buf) != _FEED_DATA_SIZE or buf[0] != 4:
        return None
    return _unpack_feed_fields(buf, 1)  # the fields without the type byte: no slice of a 7-tuple


_FEED_BATCH_KIND: Final = FeedDataBatch.TYPE
_pack_feed_batch_head: Final = _FEED_BATCH_HEAD.pack
_FEED_BATCH_COUNT: Final = I32.unpack_from
#: One record of a FeedDataBatch without its type byte (checked apart): the client's feed item.
_FEED_RECORD_FIELDS: Final = struct.Struct(">xiiiiqi")
_FEED_TYPE_BYTE: Final = bytes((FeedData.TYPE,))
#: Records in one FeedDataBatch a server sends: the frame stays within 1024 bytes, the smallest
#: ``transport.max_frame_size`` a Waltz process may have (the sender does not know the receiver's).
FEED_BATCH_MAX_RECORDS: Final = (1024 - _FEED_BATCH_HEAD_SIZE) // _FEED_DATA_SIZE


def encode_feed_batch(frames: list[bytes]) -> bytes:
    """The FeedDataBatch payload of FeedData payloads (:func:`encode_feed_data`'s, at least one),
    without message objects: the server joins the payloads it encoded once per commit."""
    parts = [_pack_feed_batch_head(_FEED_BATCH_KIND, frames[0][1:_REQ_ID_END], len(frames))]
    parts += frames
    return b"".join(parts)


def encode_feed_batches(frames: list[bytes]) -> list[bytes]:
    """FeedData payloads as the payloads to send to a client that reads FeedDataBatch: batches of
    at most :data:`FEED_BATCH_MAX_RECORDS`, a lone record as its FeedData."""
    n = len(frames)
    if n <= 1:
        return frames
    if n <= FEED_BATCH_MAX_RECORDS:
        return [encode_feed_batch(frames)]
    step = FEED_BATCH_MAX_RECORDS
    chunks = [frames[i:i + step] for i in range(0, n, step)]
    return [encode_feed_batch(c) if len(c) > 1 else c[0] for c in chunks]


def unpack_feed_batch(buf: bytes) -> Iterator[tuple[int, int, int, int, int, int]] | None:
    """The records of a well-formed FeedDataBatch payload as :func:`unpack_feed_data` gives each
    one, else None (decode it with :func:`decode`, which names the problem). The request id of
    the head must be the first record's. Any number of records is read (the frame's size is
    what the transport bounds)."""
    if not buf or buf[0] != _FEED_BATCH_KIND:
        return None
    n, rest = divmod(len(buf) - _FEED_BATCH_HEAD_SIZE, _FEED_DATA_SIZE)
    if (n <= 0 or rest or _FEED_BATCH_COUNT(buf, _REQ_ID_END)[0] != n
            or buf[_FEED_BATCH_HEAD_SIZE::_FEED_DATA_SIZE] != _FEED_TYPE_BYTE * n
            or buf[1:_REQ_ID_END] != buf[_FEED_BATCH_HEAD_SIZE + 1:_FEED_BATCH_HEAD_SIZE + _REQ_ID_END]):
        return None
    return _FEED_RECORD_FIELDS.iter_unpack(memoryview(buf)[_FEED_BATCH_HEAD_SIZE:])


# --- client-side fast paths (the client encodes/decodes these once per transaction or lock failure)

_unpack_feed_fields: Final = struct.Struct(">iiiiqi").unpack_from  # FeedData after its type byte
#: An append with one write lock and no read or append locks (a transaction on one key).
_APPEND_ONE_WRITE_HEAD: Final = struct.Struct(">biiiiqiiiiii")
_unpack_head_long: Final = _HEAD_LONG.unpack
_HEAD_LONG_SIZE: Final = _HEAD_LONG.size


@CODEC.decoder(LockFailure)
def _dec_lock_failure(buf: Buf) -> LockFailure:
    if len(buf) != _HEAD_LONG_SIZE:
        return CODEC.generic_decoder(LockFailure)(buf)  # raises the precise error
    _, c, g, p, s, t = _unpack_head_long(buf)
    return LockFailure(ReqId(c, g, p, s), t)


def unpack_lock_failure(buf: bytes) -> tuple[int, int, int, int, int] | None:
    """``(client id, generation, partition id, seq num, transaction id)`` when ``buf`` is a
    well-formed LockFailure payload, else None (the client's stream reader: no message objects)."""
    if len(buf) != _HEAD_LONG_SIZE or buf[0] != 10:
        return None
    return _unpack_lock_failure_fields(buf, 1)


_unpack_lock_failure_fields: Final = struct.Struct(">iiiiq").unpack_from


#: encode_append's payload without its data and locks: head, three lock counts, header, data
#: length, checksum. Each lock adds :data:`APPEND_LOCK_SIZE`.
APPEND_FIXED_SIZE: Final = _HEAD_LONG.size + 3 * 4 + 4 + 4 + 4
APPEND_LOCK_SIZE: Final = 4
#: Room a frame keeps around one transaction's data and locks. Every message that carries one
#: transaction alone fits in ``transport.max_frame_size`` when data + locks take at most the
#: rest: the client's append (:data:`APPEND_FIXED_SIZE` more), the server's append to a storage
#: node (93 at most), a record read back from one, a data range (tests/protocol/test_frame_headroom.py).
#: A record without that room would be refused by the link to every replica, again at every
#: recovery: the partition could never commit past it.
TRANSACTION_FRAME_HEADROOM: Final = 256


def encode_append(client_id: int, generation: int, partition_id: int, seq_num: int, client_high_water_mark: int,
                  write_locks: tuple[int, ...], read_locks: tuple[int, ...], append_locks: tuple[int, ...],
                  header: int, data: bytes, checksum: int) -> bytes:
    """The AppendRequest payload from its fields, without building message objects (the client
    sends one per transaction)."""
    if not read_locks and not append_locks:
        if not write_locks:
            return b"".join((_APPEND_PLAIN_HEAD.pack(2, client_id, generation, partition_id, seq_num,
                                                     client_high_water_mark, 0, 0, 0, header, len(data)),
                             data, U32.pack(checksum)))
        if len(write_locks) == 1:
            return b"".join((_APPEND_ONE_WRITE_HEAD.pack(2, client_id, generation, partition_id, seq_num,
                                                         client_high_water_mark, 1, write_locks[0], 0, 0, header,
                                                         len(data)),
                             data, U32.pack(checksum)))
    out = [_HEAD_LONG.pack(2, client_id, generation, partition_id, seq_num, client_high_water_mark)]
    w_int_array(out, write_locks)
    w_int_array(out, read_locks)
    w_int_array(out, append_locks)
    out.append(I32.pack(header))
    w_blob(out, data)
    out.append(U32.pack(checksum))
    return b"".join(out)


@CODEC.encoder(AppendRequest)
def _enc_append(m: AppendRequest) -> bytes:
    # encode_append's body on the message's fields: calling it with eleven arguments would cost
    # more than its pack does (tests keep the two equal)
    q = m.req_id
    data = m.data
    write_locks, read_locks, append_locks = m.write_locks, m.read_locks, m.append_locks
    if not write_locks and not read_locks and not append_locks:
        return b"".join((_APPEND_PLAIN_HEAD.pack(2, q.client_id, q.generation, q.partition_id, q.seq_num,
                                                 m.client_high_water_mark, 0, 0, 0, m.header, len(data)),
                         data, U32.pack(m.checksum)))
    out = [_HEAD_LONG.pack(2, q.client_id, q.generation, q.partition_id, q.seq_num, m.client_high_water_mark)]
    w_int_array(out, write_locks)
    w_int_array(out, read_locks)
    w_int_array(out, append_locks)
    out.append(I32.pack(m.header))
    w_blob(out, data)
    out.append(U32.pack(m.checksum))
    return b"".join(out)


_TWO_INTS: Final = struct.Struct(">ii")
_INT_ARRAYS: Final = tuple(struct.Struct(f">{n}i") for n in range(17))  # the common small lock lists
_APPEND_MIN: Final = _HEAD_LONG.size + 3 * 4 + 4 + 4 + 4  # no locks, no data
_APPEND_ONE_WRITE_MIN: Final = _APPEND_ONE_WRITE_HEAD.size + 4  # one write lock, no data
#: What :func:`_unpack_append_locks` reads: data start, header, data length, write, read, append locks.
_AppendLocks: TypeAlias = tuple[int, int, int, tuple[int, ...], tuple[int, ...], tuple[int, ...]]


@CODEC.decoder(AppendRequest)
def _dec_append(buf: Buf) -> AppendRequest:
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
        write_locks: tuple[int, ...] = ()
        read_locks: tuple[int, ...] = ()
        append_locks: tuple[int, ...] = ()
    else:
        fields = _unpack_append_locks(buf, end, nw)
        if fields is None:
            return _dec_append_checked(Reader(buf, 1, "AppendRequest"))
        start, header, n, write_locks, read_locks, append_locks = fields
    if n < 0 or start + n + 4 != end:
        return _dec_append_checked(Reader(buf, 1, "AppendRequest"))
    data = bytes(buf[start : start + n])
    (checksum,) = U32.unpack_from(buf, start + n)
    if crc32(data) != checksum:
        raise ChecksumError(f"AppendRequest {ReqId(c, g, p, s)}: transaction data checksum mismatch")
    return _fast_append(fast_req_id(c, g, p, s), hwm, write_locks, read_locks, append_locks, header, data, checksum)


def _unpack_append_locks(buf: Buf, end: int, write_count: int) -> _AppendLocks | None:
    """(where the data starts, header, data length, write, read and append locks) of an append
    with locks, or None when the lists do not fit (the checked decoder then names the problem)."""
    if write_count == 1 and end >= _APPEND_ONE_WRITE_MIN:
        # The usual locked append: one write lock, no read or append locks; one struct again.
        _, _, _, _, _, _, _, lock, nr, na, header, n = _APPEND_ONE_WRITE_HEAD.unpack_from(buf, 0)
        if nr == 0 and na == 0:
            return _APPEND_ONE_WRITE_HEAD.size, header, n, (lock,), (), ()
    pos = _HEAD_LONG.size
    locks = []
    for _ in range(3):
        (n,) = I32.unpack_from(buf, pos)
        pos += 4
        # 12 = at least the header, the data length and the checksum still follow
        if n < 0 or pos + 4 * n + 12 > end:
            return None
        locks.append(_INT_ARRAYS[n].unpack_from(buf, pos) if n < 17 else struct.unpack_from(f">{n}i", buf, pos))
        pos += 4 * n
    header, n = _TWO_INTS.unpack_from(buf, pos)
    return pos + 8, header, n, locks[0], locks[1], locks[2]


#: The generic AppendRequest decoder from byte 1: the fast path's fallback, which names the problem.
_dec_append_checked: Final = CODEC.body_reader(AppendRequest)
