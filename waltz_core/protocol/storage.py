"""Server <-> storage messages: the original Waltz's ten request/response patterns.

Every payload starts with ``byte type, long session_id, long seq_num, int partition_id``. The
open request uses -1 for all three. Failures carry the error class name and a message so the
server re-raises the same :mod:`waltz_core.errors` class (:func:`waltz_core.errors.error_from_wire`).
``offline`` marks requests of offline recovery tools (original ``usedByOfflineRecovery``).

Version 2: appends and record lists carry a :class:`~.wire.RecordBatch` (``int count, long first
transaction id, int byte length`` and the records in the stored layout, record checksums
included) instead of version 1's per-record encoding; a version-1 peer fails the handshake.
"""

from __future__ import annotations

import struct
import uuid
from collections.abc import Iterable
from typing import ClassVar, Final, TypeAlias

import attrs

from ..errors import ProtocolError
from .wire import (
    I32,
    I64,
    Reader,
    Record,
    RecordBatch,
    RecordHeader,
    SessionInfo,
    w_record_batch,
    w_record_header,
    w_records,
    w_session_info,
    w_str,
)

PROTOCOL: Final = b"S"
VERSIONS: Final = (2,)  #: 2: record batches in the stored layout (see the module doc)

_PREFIX: Final = struct.Struct(">bqqi")


@attrs.frozen(slots=True)
class OpenRequest:
    TYPE: ClassVar[int] = 1
    session_id: int
    seq_num: int
    partition_id: int
    cluster_key: uuid.UUID
    num_partitions: int


@attrs.frozen(slots=True)
class LastSessionInfoRequest:
    TYPE: ClassVar[int] = 2
    session_id: int
    seq_num: int
    partition_id: int
    offline: bool = False


@attrs.frozen(slots=True)
class LastSessionInfoResponse:
    TYPE: ClassVar[int] = 3
    session_id: int
    seq_num: int
    partition_id: int
    session_info: SessionInfo


@attrs.frozen(slots=True)
class SetLowWaterMarkRequest:
    TYPE: ClassVar[int] = 4
    session_id: int
    seq_num: int
    partition_id: int
    low_water_mark: int
    offline: bool = False


def _record_batch(records: RecordBatch | Iterable[Record]) -> RecordBatch:
    """:meth:`RecordBatch.of` as a function: mypy's attrs plugin takes no classmethod for a converter."""
    return RecordBatch.of(records)


@attrs.frozen(slots=True)
class TruncateRequest:
    TYPE: ClassVar[int] = 5
    session_id: int
    seq_num: int
    partition_id: int
    transaction_id: int  #: the max transaction id to retain
    offline: bool = False


@attrs.frozen(slots=True)
class StorageAppendRequest:
    TYPE: ClassVar[int] = 6
    session_id: int
    seq_num: int
    partition_id: int
    #: records in the stored layout; Records (any iterable) are encoded on construction
    records: RecordBatch = attrs.field(converter=_record_batch)
    offline: bool = False


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
    error_type: str  #: a class name from waltz_core.errors
    message: str


@attrs.frozen(slots=True)
class RecordHeaderRequest:
    TYPE: ClassVar[int] = 9
    session_id: int
    seq_num: int
    partition_id: int
    transaction_id: int


@attrs.frozen(slots=True)
class RecordHeaderResponse:
    TYPE: ClassVar[int] = 10
    session_id: int
    seq_num: int
    partition_id: int
    record_header: RecordHeader | None  #: None when the transaction is not there


@attrs.frozen(slots=True)
class RecordRequest:
    TYPE: ClassVar[int] = 11
    session_id: int
    seq_num: int
    partition_id: int
    transaction_id: int


@attrs.frozen(slots=True)
class RecordResponse:
    TYPE: ClassVar[int] = 12
    session_id: int
    seq_num: int
    partition_id: int
    record: Record | None


@attrs.frozen(slots=True)
class MaxTransactionIdRequest:
    TYPE: ClassVar[int] = 13
    session_id: int
    seq_num: int
    partition_id: int
    offline: bool = False


@attrs.frozen(slots=True)
class MaxTransactionIdResponse:
    TYPE: ClassVar[int] = 14
    session_id: int
    seq_num: int
    partition_id: int
    transaction_id: int


@attrs.frozen(slots=True)
class RecordHeaderListRequest:
    TYPE: ClassVar[int] = 15
    session_id: int
    seq_num: int
    partition_id: int
    transaction_id: int
    max_records: int


@attrs.frozen(slots=True)
class RecordHeaderListResponse:
    TYPE: ClassVar[int] = 16
    session_id: int
    seq_num: int
    partition_id: int
    record_headers: tuple[RecordHeader, ...]


@attrs.frozen(slots=True)
class RecordListRequest:
    TYPE: ClassVar[int] = 17
    session_id: int
    seq_num: int
    partition_id: int
    transaction_id: int
    max_records: int


@attrs.frozen(slots=True)
class RecordListResponse:
    TYPE: ClassVar[int] = 18
    session_id: int
    seq_num: int
    partition_id: int
    records: RecordBatch = attrs.field(converter=_record_batch)  #: as read from the storage files


StorageMessage: TypeAlias = (
    OpenRequest | LastSessionInfoRequest | LastSessionInfoResponse | SetLowWaterMarkRequest | TruncateRequest |
    StorageAppendRequest | SuccessResponse | FailureResponse | RecordHeaderRequest | RecordHeaderResponse |
    RecordRequest | RecordResponse | MaxTransactionIdRequest | MaxTransactionIdResponse | RecordHeaderListRequest |
    RecordHeaderListResponse | RecordListRequest | RecordListResponse
)

MESSAGES: Final[tuple[type, ...]] = (
    OpenRequest, LastSessionInfoRequest, LastSessionInfoResponse, SetLowWaterMarkRequest, TruncateRequest,
    StorageAppendRequest, SuccessResponse, FailureResponse, RecordHeaderRequest, RecordHeaderResponse,
    RecordRequest, RecordResponse, MaxTransactionIdRequest, MaxTransactionIdResponse,
    RecordHeaderListRequest, RecordHeaderListResponse, RecordListRequest, RecordListResponse,
)
_BY_TYPE: Final[dict[int, type]] = {cls.TYPE: cls for cls in MESSAGES}  # type: ignore[attr-defined]
_CLASSES: Final = frozenset(MESSAGES)


def _flag(v: bool) -> bytes:
    return b"\x01" if v else b"\x00"


def encode(msg: StorageMessage) -> bytes:
    """Encode one storage message to a frame payload."""
    t = type(msg)
    if t not in _CLASSES:  # checked first: a foreign object has no session_id to pack
        raise ProtocolError(f"not a storage message: {t.__name__}")
    try:
        out = [_PREFIX.pack(msg.TYPE, msg.session_id, msg.seq_num, msg.partition_id)]
        if t is StorageAppendRequest:
            w_record_batch(out, msg.records)  # type: ignore[union-attr]
            out.append(_flag(msg.offline))  # type: ignore[union-attr]
        elif t is RecordListResponse:
            w_record_batch(out, msg.records)  # type: ignore[union-attr]
        elif t is OpenRequest:
            out.append(msg.cluster_key.bytes)  # type: ignore[union-attr]
            out.append(I32.pack(msg.num_partitions))  # type: ignore[union-attr]
        elif t in (LastSessionInfoRequest, MaxTransactionIdRequest):
            out.append(_flag(msg.offline))  # type: ignore[union-attr]
        elif t is LastSessionInfoResponse:
            w_session_info(out, msg.session_info)  # type: ignore[union-attr]
        elif t is SetLowWaterMarkRequest:
            out.append(I64.pack(msg.low_water_mark))  # type: ignore[union-attr]
            out.append(_flag(msg.offline))  # type: ignore[union-attr]
        elif t is TruncateRequest:
            out.append(I64.pack(msg.transaction_id))  # type: ignore[union-attr]
            out.append(_flag(msg.offline))  # type: ignore[union-attr]
        elif t is FailureResponse:
            w_str(out, msg.error_type)  # type: ignore[union-attr]
            w_str(out, msg.message)  # type: ignore[union-attr]
        elif t in (RecordHeaderRequest, RecordRequest, MaxTransactionIdResponse):
            out.append(I64.pack(msg.transaction_id))  # type: ignore[union-attr]
        elif t is RecordHeaderResponse:
            h = msg.record_header  # type: ignore[union-attr]
            out.append(_flag(h is not None))
            if h is not None:
                w_record_header(out, h)
        elif t is RecordResponse:
            rec = msg.record  # type: ignore[union-attr]
            out.append(_flag(rec is not None))
            if rec is not None:
                w_records(out, (rec,))
        elif t in (RecordHeaderListRequest, RecordListRequest):
            out.append(struct.pack(">qi", msg.transaction_id, msg.max_records))  # type: ignore[union-attr]
        elif t is RecordHeaderListResponse:
            out.append(I32.pack(len(msg.record_headers)))  # type: ignore[union-attr]
            for h in msg.record_headers:  # type: ignore[union-attr]
                w_record_header(out, h)
        elif t is not SuccessResponse:
            raise ProtocolError(f"not a storage message: {t.__name__}")
        return b"".join(out)
    except struct.error as exc:
        raise ProtocolError(f"cannot encode {type(msg).__name__}: {exc}") from None


def decode(buf: bytes | memoryview) -> StorageMessage:
    """Decode one storage frame payload; malformed input raises :class:`ProtocolError`."""
    if len(buf) < _PREFIX.size:
        raise ProtocolError(f"storage message: {len(buf)} bytes is shorter than the {_PREFIX.size}-byte prefix")
    kind, session_id, seq_num, partition_id = _PREFIX.unpack_from(buf, 0)
    cls = _BY_TYPE.get(kind)
    if cls is None:
        raise ProtocolError(f"storage message: unknown message type {kind}")
    r = Reader(buf, _PREFIX.size, cls.__name__)
    head = (session_id, seq_num, partition_id)
    msg: StorageMessage
    if cls is StorageAppendRequest:
        # Only the batch head is checked here: the storage node validates every record (ids,
        # lengths, checksums) on the partition thread, where a bad batch fails alone.
        msg = StorageAppendRequest(*head, r.record_batch("records"), r.bool("offline"))
    elif cls is RecordListResponse:
        batch = r.record_batch("records")
        batch.offsets  # noqa: B018 - walk it now: a malformed list fails here, not in whoever reads it
        msg = RecordListResponse(*head, batch)
    elif cls is OpenRequest:
        msg = OpenRequest(*head, r.uuid("cluster key"), r.i32("number of partitions"))
    elif cls in (LastSessionInfoRequest, MaxTransactionIdRequest):
        msg = cls(*head, r.bool("offline"))
    elif cls is LastSessionInfoResponse:
        msg = LastSessionInfoResponse(*head, r.session_info())
    elif cls is SetLowWaterMarkRequest:
        msg = SetLowWaterMarkRequest(*head, r.i64("low-water mark"), r.bool("offline"))
    elif cls is TruncateRequest:
        msg = TruncateRequest(*head, r.i64("transaction id"), r.bool("offline"))
    elif cls is FailureResponse:
        msg = FailureResponse(*head, r.str("error type"), r.str("message"))
    elif cls in (RecordHeaderRequest, RecordRequest, MaxTransactionIdResponse):
        msg = cls(*head, r.i64("transaction id"))
    elif cls is RecordHeaderResponse:
        msg = RecordHeaderResponse(*head, r.record_header() if r.bool("present") else None)
    elif cls is RecordResponse:
        if r.bool("present"):
            recs = r.records("record")
            if len(recs) != 1:
                raise ProtocolError(f"RecordResponse: expected 1 record, got {len(recs)}")
            msg = RecordResponse(*head, recs[0])
        else:
            msg = RecordResponse(*head, None)
    elif cls in (RecordHeaderListRequest, RecordListRequest):
        msg = cls(*head, r.i64("transaction id"), r.i32("max records"))
    elif cls is RecordHeaderListResponse:
        msg = RecordHeaderListResponse(*head, r.record_headers("record headers"))
    else:
        msg = SuccessResponse(*head)
    r.done()
    return msg
