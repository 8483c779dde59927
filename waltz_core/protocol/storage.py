"""Server <-> storage messages: the original Waltz's ten request/response patterns.

Every payload starts with ``byte type, long session_id, long seq_num, int partition_id`` (the
family head); the rest of each message's layout is declared on its class (field annotations,
see :mod:`.layout`), in field order. The open request uses -1 for all three head fields.
``offline`` marks requests of offline recovery tools (original ``usedByOfflineRecovery``).
Failures carry a numeric error code and a message, from which the server raises the matching
:mod:`waltz_core.errors` class.

Version 2: appends and record lists carry a :class:`~.wire.RecordBatch` (``int count, long first
transaction id, int byte length`` and the records in the stored layout, record checksums
included) instead of version 1's per-record encoding.

Version 3: ``FailureResponse`` carries ``int error_code`` (a numeric code from
:mod:`waltz_core.errors`) where version 2 had ``str error_type`` (an exception class name), in
the same position.

Version 4 adds ``StorageAppendManyRequest`` and its answer ``AppendManyResponse``: the appends of
several partitions (one per partition and store session, each as a ``StorageAppendRequest``
would carry it) in one message, answered by one message that lists only the appends refused. A
server sends the batches its partitions have ready for one node together, so a round of a node
with many partitions is one request and one answer instead of one per partition. Versions 3 and
4 are spoken; with a version-3 peer every append goes alone. An older peer fails the handshake.

Version 5 opens with ``LimitedOpenRequest`` and ``OpenResponse`` (``OpenRequest`` and
``SuccessResponse`` before), which carry the server's and the node's ``transport.max_frame_size``.
A process closes a connection whose peer sends a frame over its limit, and every partition's
requests on it fail: so the server sends the node no append over the node's limit, and the node
answers the server's reads (record and header lists) within half of the smaller limit.

Hand-written fast paths, registered as overrides of the generic codec and equivalent to it: the
record batches of ``StorageAppendRequest`` and ``RecordListResponse`` (head and batch head in
one struct), and the decoding of ``SuccessResponse`` (an append's acknowledgement).
"""

from __future__ import annotations

import struct
import typing
import uuid
from collections.abc import Iterable
from typing import Annotated, ClassVar, Final, TypeAlias

import attrs

from ..errors import ProtocolError
from .layout import (
    BOOL,
    INT32,
    INT64,
    ONE_RECORD,
    RECORD_HEADER,
    RECORD_HEADERS,
    SESSION_INFO,
    STRING,
    UUID,
    Array,
    Buf,
    Codec,
    FamilyCodec,
    Nullable,
    RecordBatchCodec,
    Tuple,
)
from .wire import (
    I32,
    RECORD_BATCH_HEAD,
    STORED_RECORD_OVERHEAD,
    Reader,
    Record,
    RecordBatch,
    RecordHeader,
    SessionInfo,
)

PROTOCOL: Final = b"S"
#: 5: both sides' frame limits in the open; 4: appends of several partitions in one message;
#: 3: numeric error codes in failures
VERSIONS: Final = (3, 4, 5)
#: the version whose open exchange carries both sides' frame limits
LIMITS_VERSION: Final = 5

#: Bytes a storage append adds around its batch (38 alone, 53 as the one batch of a message of
#: several partitions; tests/protocol/test_frame_headroom.py): a batch of at most
#: ``max_frame_size - APPEND_BATCH_HEADROOM`` bytes goes in one frame.
APPEND_BATCH_HEADROOM: Final = 64

_RECORD_BATCH: Final = RecordBatchCodec(walk=False)
#: one append of a StorageAppendManyRequest: session id, partition id, then its batch head
_PART_HEAD: Final = struct.Struct(">qi" + RECORD_BATCH_HEAD.format[1:])
_PART_HEAD_SIZE: Final = _PART_HEAD.size
#: record lists are walked when decoded: a malformed list fails here, not in whoever reads it
_RECORD_BATCH_WALKED: Final = RecordBatchCodec(walk=True)


def _record_batch(records: RecordBatch | Iterable[Record]) -> RecordBatch:
    """:meth:`RecordBatch.of` as a function: mypy's attrs plugin takes no classmethod for a converter."""
    return RecordBatch.of(records)


@attrs.frozen(slots=True)
class OpenRequest:
    TYPE: ClassVar[int] = 1
    session_id: int
    seq_num: int
    partition_id: int
    cluster_key: Annotated[uuid.UUID, UUID]
    num_partitions: Annotated[int, INT32]


@attrs.frozen(slots=True)
class LastSessionInfoRequest:
    TYPE: ClassVar[int] = 2
    session_id: int
    seq_num: int
    partition_id: int
    offline: Annotated[bool, BOOL] = False


@attrs.frozen(slots=True)
class LastSessionInfoResponse:
    TYPE: ClassVar[int] = 3
    session_id: int
    seq_num: int
    partition_id: int
    session_info: Annotated[SessionInfo, SESSION_INFO]


@attrs.frozen(slots=True)
class SetLowWaterMarkRequest:
    TYPE: ClassVar[int] = 4
    session_id: int
    seq_num: int
    partition_id: int
    low_water_mark: Annotated[int, INT64]
    offline: Annotated[bool, BOOL] = False


@attrs.frozen(slots=True)
class TruncateRequest:
    TYPE: ClassVar[int] = 5
    session_id: int
    seq_num: int
    partition_id: int
    transaction_id: Annotated[int, INT64]  #: the max transaction id to retain
    offline: Annotated[bool, BOOL] = False


@attrs.frozen(slots=True)
class StorageAppendRequest:
    TYPE: ClassVar[int] = 6
    session_id: int
    seq_num: int
    partition_id: int
    #: records in the stored layout; Records (any iterable) are encoded on construction
    records: Annotated[RecordBatch, _RECORD_BATCH] = attrs.field(converter=_record_batch)
    offline: Annotated[bool, BOOL] = False


@attrs.frozen(slots=True)
class SuccessResponse:
    TYPE: ClassVar[int] = 7
    session_id: int
    seq_num: int
    partition_id: int


@attrs.frozen(slots=True)
class FailureResponse:
    TYPE: ClassVar[int] = 8
    session_id: int
    seq_num: int
    partition_id: int
    error_code: Annotated[int, INT32]  #: a numeric error code from waltz_core.errors (version 3)
    message: Annotated[str, STRING]


@attrs.frozen(slots=True)
class RecordHeaderRequest:
    TYPE: ClassVar[int] = 9
    session_id: int
    seq_num: int
    partition_id: int
    transaction_id: Annotated[int, INT64]


@attrs.frozen(slots=True)
class RecordHeaderResponse:
    TYPE: ClassVar[int] = 10
    session_id: int
    seq_num: int
    partition_id: int
    #: None when the transaction is not there
    record_header: Annotated[RecordHeader | None, Nullable(RECORD_HEADER)]


@attrs.frozen(slots=True)
class RecordRequest:
    TYPE: ClassVar[int] = 11
    session_id: int
    seq_num: int
    partition_id: int
    transaction_id: Annotated[int, INT64]


@attrs.frozen(slots=True)
class RecordResponse:
    TYPE: ClassVar[int] = 12
    session_id: int
    seq_num: int
    partition_id: int
    #: None when the transaction is not there; else a list of exactly one record (per-record layout)
    record: Annotated[Record | None, Nullable(ONE_RECORD)]


@attrs.frozen(slots=True)
class MaxTransactionIdRequest:
    TYPE: ClassVar[int] = 13
    session_id: int
    seq_num: int
    partition_id: int
    offline: Annotated[bool, BOOL] = False


@attrs.frozen(slots=True)
class MaxTransactionIdResponse:
    TYPE: ClassVar[int] = 14
    session_id: int
    seq_num: int
    partition_id: int
    transaction_id: Annotated[int, INT64]


@attrs.frozen(slots=True)
class RecordHeaderListRequest:
    TYPE: ClassVar[int] = 15
    session_id: int
    seq_num: int
    partition_id: int
    transaction_id: Annotated[int, INT64]
    max_records: Annotated[int, INT32]


@attrs.frozen(slots=True)
class RecordHeaderListResponse:
    TYPE: ClassVar[int] = 16
    session_id: int
    seq_num: int
    partition_id: int
    record_headers: Annotated[tuple[RecordHeader, ...], RECORD_HEADERS]


@attrs.frozen(slots=True)
class RecordListRequest:
    TYPE: ClassVar[int] = 17
    session_id: int
    seq_num: int
    partition_id: int
    transaction_id: Annotated[int, INT64]
    max_records: Annotated[int, INT32]


@attrs.frozen(slots=True)
class RecordListResponse:
    TYPE: ClassVar[int] = 18
    session_id: int
    seq_num: int
    partition_id: int
    #: as read from the storage files
    records: Annotated[RecordBatch, _RECORD_BATCH_WALKED] = attrs.field(converter=_record_batch)


class AppendParts(Codec[tuple["StorageAppendRequest", ...]]):
    """The appends of a :class:`StorageAppendManyRequest`: ``int`` count, then each append's
    ``long session_id, int partition_id`` and record batch.

    Each decodes as the ``StorageAppendRequest`` a storage node handles: its sequence number is
    its index in the message (the answer names a refused append by it), and it is not offline
    (offline recovery appends one batch at a time). Encoding refuses anything else."""

    min_size = _PART_HEAD_SIZE

    def write(self, out: list[bytes], value: tuple[StorageAppendRequest, ...]) -> None:
        out.append(I32.pack(len(value)))
        for index, part in enumerate(value):
            if part.seq_num != index or part.offline:
                raise ValueError(f"append {index} must have sequence number {index} and not be offline")
            b = part.records
            out.append(_PART_HEAD.pack(part.session_id, part.partition_id, len(b), b.first_transaction_id, b.nbytes))
            out.append(b.data)  # type: ignore[arg-type]  # joined with the rest: any bytes-like object

    def read(self, r: Reader, label: str) -> tuple[StorageAppendRequest, ...]:
        n = r.count(label, _PART_HEAD_SIZE)
        parts = []
        for index in range(n):
            session_id = r.i64(f"{label} session id")
            partition_id = r.i32(f"{label} partition id")
            parts.append(StorageAppendRequest(session_id, index, partition_id, r.record_batch(label)))
        return tuple(parts)


@attrs.frozen(slots=True)
class StorageAppendManyRequest:
    """Appends to several partitions (version 4). The head's session id and partition id are
    -1: each append carries its own."""

    TYPE: ClassVar[int] = 19
    session_id: int
    seq_num: int
    partition_id: int
    appends: Annotated[tuple[StorageAppendRequest, ...], AppendParts()]


@attrs.frozen(slots=True)
class AppendManyResponse:
    """The answer to a :class:`StorageAppendManyRequest` (version 4): every append not listed
    is durable on the node; each listed one was refused, as ``(index in the request, error
    code, message)``, as a ``FailureResponse`` would have said."""

    TYPE: ClassVar[int] = 20
    session_id: int
    seq_num: int
    partition_id: int
    failures: Annotated[tuple[tuple[int, int, str], ...], Array(Tuple(INT32, INT32, STRING))] = ()


@attrs.frozen(slots=True)
class LimitedOpenRequest:
    """:class:`OpenRequest` with the sender's frame limit (version 5): the node answers its reads
    within it. Answered by :class:`OpenResponse`."""

    TYPE: ClassVar[int] = 22
    session_id: int
    seq_num: int
    partition_id: int
    cluster_key: Annotated[uuid.UUID, UUID]
    num_partitions: Annotated[int, INT32]
    max_frame_size: Annotated[int, INT32]  #: the sender's ``transport.max_frame_size``


@attrs.frozen(slots=True)
class OpenResponse:
    """The answer to a :class:`LimitedOpenRequest` (version 5), with the node's limit: the server
    sends it no frame above it."""

    TYPE: ClassVar[int] = 21
    session_id: int
    seq_num: int
    partition_id: int
    max_frame_size: Annotated[int, INT32]  #: the node's ``transport.max_frame_size``


StorageMessage: TypeAlias = (
    OpenRequest | LastSessionInfoRequest | LastSessionInfoResponse | SetLowWaterMarkRequest | TruncateRequest |
    StorageAppendRequest | SuccessResponse | FailureResponse | RecordHeaderRequest | RecordHeaderResponse |
    RecordRequest | RecordResponse | MaxTransactionIdRequest | MaxTransactionIdResponse | RecordHeaderListRequest |
    RecordHeaderListResponse | RecordListRequest | RecordListResponse | StorageAppendManyRequest |
    AppendManyResponse | OpenResponse | LimitedOpenRequest
)
#: every message class, in TYPE order (the alias above is the one list of them)
MESSAGES: Final[tuple[type, ...]] = typing.get_args(StorageMessage)

#: the generic codec derived from the declarations above (type table checked at import)
CODEC: Final[FamilyCodec[StorageMessage]] = FamilyCodec(
    "storage", "storage message", (("session_id", INT64), ("seq_num", INT64), ("partition_id", INT32)), MESSAGES)
encode: Final = CODEC.encode
decode: Final = CODEC.decode


# --------------------------------------------------------------------------------- fast paths
# Record batches: the family head and the batch head in one struct, the records as they are.

#: type, session id, sequence number, partition id; record count, first transaction id, byte length
_BATCH_HEAD: Final = struct.Struct(">bqqi" + RECORD_BATCH_HEAD.format[1:])
_FLAGS: Final = (b"\x00", b"\x01")
#: the fast decoders hand anything unusual to the generic ones, which name the problem
_generic_append: Final = CODEC.generic_decoder(StorageAppendRequest)
_generic_record_list: Final = CODEC.generic_decoder(RecordListResponse)


def _batch_message(m: StorageAppendRequest | RecordListResponse) -> list[bytes | memoryview]:
    b = m.records
    return [_BATCH_HEAD.pack(m.TYPE, m.session_id, m.seq_num, m.partition_id, len(b), b.first_transaction_id,
                             b.nbytes), b.data]


def encode_append(session_id: int, seq_num: int, partition_id: int, records: RecordBatch,
                  offline: bool = False) -> bytes:
    """``encode(StorageAppendRequest(...))`` without making the message: a server sends one per
    partition, replica and batch."""
    try:
        head = _BATCH_HEAD.pack(6, session_id, seq_num, partition_id, len(records), records.first_transaction_id,
                                records.nbytes)
    except struct.error as exc:
        raise ProtocolError(f"cannot encode StorageAppendRequest: {exc}") from None
    return b"".join((head, records.data, _FLAGS[1 if offline else 0]))


@CODEC.encoder(StorageAppendRequest)
def _enc_append(m: StorageAppendRequest) -> bytes:
    return encode_append(m.session_id, m.seq_num, m.partition_id, m.records, m.offline)


@CODEC.encoder(RecordListResponse)
def _enc_record_list(m: RecordListResponse) -> bytes:
    return b"".join(_batch_message(m))


def _unpack_batch(buf: Buf, tail: int) -> tuple[int, int, int, RecordBatch] | None:
    """Head fields and the batch (a view of ``buf``) when the batch head is plausible and exactly
    ``tail`` bytes follow the batch, else None."""
    end = len(buf)
    if end < _BATCH_HEAD.size:
        return None
    _, session_id, seq_num, partition_id, count, first, nbytes = _BATCH_HEAD.unpack_from(buf, 0)
    start = _BATCH_HEAD.size
    if (count < 0 or nbytes < 0 or count * STORED_RECORD_OVERHEAD > nbytes or (count == 0 and nbytes)
            or start + nbytes + tail != end):
        return None
    return session_id, seq_num, partition_id, RecordBatch(memoryview(buf)[start : start + nbytes], count, first)


@CODEC.decoder(StorageAppendRequest)
def _dec_append(buf: Buf) -> StorageAppendRequest:
    # Only the batch head is checked here: the storage node validates every record (ids,
    # lengths, checksums) on the partition's I/O thread, where a bad batch fails alone.
    fields = _unpack_batch(buf, 1)
    offline = buf[-1]
    if fields is None or offline > 1:
        return _generic_append(buf)
    session_id, seq_num, partition_id, records = fields
    m: StorageAppendRequest = _new_object(StorageAppendRequest)
    _set_append_session_id(m, session_id)
    _set_append_seq_num(m, seq_num)
    _set_append_partition_id(m, partition_id)
    _set_append_records(m, records)
    _set_append_offline(m, offline == 1)
    return m


@CODEC.decoder(RecordListResponse)
def _dec_record_list(buf: Buf) -> RecordListResponse:
    fields = _unpack_batch(buf, 0)
    if fields is None:
        return _generic_record_list(buf)
    fields[3].offsets  # noqa: B018 - walk it now: a malformed list fails here, not in whoever reads it
    return RecordListResponse(*fields)


# Acknowledgements: a storage node makes one per append and replica, and the server reads it.
# Messages made once per batch are built through their slot descriptors (see wire.fast_req_id;
# the protocol tests keep them equal to the attrs constructors).
_new_object: Final = object.__new__
(_set_append_session_id, _set_append_seq_num, _set_append_partition_id, _set_append_records,
 _set_append_offline) = (getattr(StorageAppendRequest, a.name).__set__ for a in attrs.fields(StorageAppendRequest))
_set_success_session_id, _set_success_seq_num, _set_success_partition_id = (
    getattr(SuccessResponse, a.name).__set__ for a in attrs.fields(SuccessResponse))
_HEAD: Final = struct.Struct(">bqqi")
_generic_success: Final = CODEC.generic_decoder(SuccessResponse)


def success_response(session_id: int, seq_num: int, partition_id: int) -> SuccessResponse:
    """``SuccessResponse(session_id, seq_num, partition_id)``, made faster."""
    m: SuccessResponse = _new_object(SuccessResponse)
    _set_success_session_id(m, session_id)
    _set_success_seq_num(m, seq_num)
    _set_success_partition_id(m, partition_id)
    return m


@CODEC.decoder(SuccessResponse)
def _dec_success(buf: Buf) -> SuccessResponse:
    if len(buf) != _HEAD.size:
        return _generic_success(buf)  # raises the precise error
    _, session_id, seq_num, partition_id = _HEAD.unpack_from(buf, 0)
    return success_response(session_id, seq_num, partition_id)


# Appends of several partitions (version 4): a server sends one per node and round, the node
# answers it once.
_MANY_HEAD: Final = struct.Struct(">bqqii")  # the family head, then the count of appends
_MANY_TYPE: Final = StorageAppendManyRequest.TYPE
_set_many_session_id, _set_many_seq_num, _set_many_partition_id, _set_many_appends = (
    getattr(StorageAppendManyRequest, a.name).__set__ for a in attrs.fields(StorageAppendManyRequest))
_generic_append_many: Final = CODEC.generic_decoder(StorageAppendManyRequest)
_generic_many_response: Final = CODEC.generic_decoder(AppendManyResponse)
_NO_FAILURES: Final = _MANY_HEAD.size  # an AppendManyResponse with an empty list is just the head and 0


def encode_append_many(seq_num: int, appends: Iterable[tuple[int, int, RecordBatch]]) -> bytes:
    """``encode(StorageAppendManyRequest(-1, seq_num, -1, ...))`` from ``(session id, partition
    id, batch)`` triples, without making the messages."""
    out: list[bytes | memoryview] = [b""]
    pack = _PART_HEAD.pack
    n = 0
    try:
        for session_id, partition_id, b in appends:
            out.append(pack(session_id, partition_id, len(b), b.first_transaction_id, b.nbytes))
            out.append(b.data)
            n += 1
        out[0] = _MANY_HEAD.pack(_MANY_TYPE, -1, seq_num, -1, n)
    except struct.error as exc:
        raise ProtocolError(f"cannot encode StorageAppendManyRequest: {exc}") from None
    return b"".join(out)


@CODEC.encoder(StorageAppendManyRequest)
def _enc_append_many(m: StorageAppendManyRequest) -> bytes:
    for index, part in enumerate(m.appends):
        if part.seq_num != index or part.offline:
            raise ProtocolError(f"cannot encode StorageAppendManyRequest: append {index} must have sequence number "
                                f"{index} and not be offline")
    if m.session_id != -1 or m.partition_id != -1:
        return CODEC.generic_encode(m)
    return encode_append_many(m.seq_num, ((p.session_id, p.partition_id, p.records) for p in m.appends))


@CODEC.decoder(StorageAppendManyRequest)
def _dec_append_many(buf: Buf) -> StorageAppendManyRequest:
    # As _dec_append: batch heads are checked here, the records by the partitions' rounds.
    end = len(buf)
    if end < _MANY_HEAD.size:
        return _generic_append_many(buf)
    _, session_id, seq_num, partition_id, n = _MANY_HEAD.unpack_from(buf, 0)
    pos = _MANY_HEAD.size
    if n < 0 or n * _PART_HEAD_SIZE > end - pos:
        return _generic_append_many(buf)
    view = memoryview(buf)
    unpack, new = _PART_HEAD.unpack_from, _new_object
    parts = []
    for index in range(n):
        if pos + _PART_HEAD_SIZE > end:
            return _generic_append_many(buf)
        part_session, part_partition, count, first, nbytes = unpack(buf, pos)
        pos += _PART_HEAD_SIZE
        if (count < 0 or nbytes < 0 or count * STORED_RECORD_OVERHEAD > nbytes or (count == 0 and nbytes)
                or pos + nbytes > end):
            return _generic_append_many(buf)
        m: StorageAppendRequest = new(StorageAppendRequest)
        _set_append_session_id(m, part_session)
        _set_append_seq_num(m, index)
        _set_append_partition_id(m, part_partition)
        _set_append_records(m, RecordBatch(view[pos : pos + nbytes], count, first))
        _set_append_offline(m, False)
        parts.append(m)
        pos += nbytes
    if pos != end:
        return _generic_append_many(buf)
    many: StorageAppendManyRequest = new(StorageAppendManyRequest)
    _set_many_session_id(many, session_id)
    _set_many_seq_num(many, seq_num)
    _set_many_partition_id(many, partition_id)
    _set_many_appends(many, tuple(parts))
    return many


@CODEC.decoder(AppendManyResponse)
def _dec_many_response(buf: Buf) -> AppendManyResponse:
    if len(buf) != _NO_FAILURES or buf[-4:] != b"\x00\x00\x00\x00":
        return _generic_many_response(buf)  # failures listed (rare), or the precise error
    _, session_id, seq_num, partition_id, _n = _MANY_HEAD.unpack_from(buf, 0)
    return AppendManyResponse(session_id, seq_num, partition_id)
