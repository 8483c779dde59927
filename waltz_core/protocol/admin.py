"""Storage admin messages (the storage node's admin port; original AdminMessageCodecV0).

Every payload starts with ``byte type, long seq_num``.
"""

from __future__ import annotations

import struct
import uuid
from typing import ClassVar, Final, TypeAlias

import attrs

from ..errors import ProtocolError
from .wire import I32, Reader, Record, SessionInfo, w_int_array, w_records, w_session_info, w_str

PROTOCOL: Final = b"A"
VERSIONS: Final = (1,)

_PREFIX: Final = struct.Struct(">bq")


@attrs.frozen(slots=True)
class AdminSuccessResponse:
    TYPE: ClassVar[int] = 1
    seq_num: int


@attrs.frozen(slots=True)
class AdminFailureResponse:
    TYPE: ClassVar[int] = 2
    seq_num: int
    error_type: str
    message: str


@attrs.frozen(slots=True)
class AdminOpenRequest:
    TYPE: ClassVar[int] = 3
    seq_num: int
    cluster_key: uuid.UUID
    num_partitions: int


@attrs.frozen(slots=True)
class PartitionAvailableRequest:
    TYPE: ClassVar[int] = 4
    seq_num: int
    partition_ids: tuple[int, ...]
    available: bool


@attrs.frozen(slots=True)
class PartitionAssignmentRequest:
    TYPE: ClassVar[int] = 6
    seq_num: int
    partition_ids: tuple[int, ...]
    assigned: bool
    delete_storage_files: bool


@attrs.frozen(slots=True)
class AdminRecordListRequest:
    TYPE: ClassVar[int] = 7
    seq_num: int
    partition_id: int
    transaction_id: int
    max_records: int


@attrs.frozen(slots=True)
class AdminRecordListResponse:
    TYPE: ClassVar[int] = 8
    seq_num: int
    partition_id: int
    records: tuple[Record, ...]


@attrs.frozen(slots=True)
class AdminLastSessionInfoRequest:
    TYPE: ClassVar[int] = 9
    seq_num: int
    partition_id: int


@attrs.frozen(slots=True)
class AdminLastSessionInfoResponse:
    TYPE: ClassVar[int] = 10
    seq_num: int
    partition_id: int
    session_info: SessionInfo


@attrs.frozen(slots=True)
class MetricsRequest:
    TYPE: ClassVar[int] = 11
    seq_num: int


@attrs.frozen(slots=True)
class MetricsResponse:
    TYPE: ClassVar[int] = 12
    seq_num: int
    metrics_json: str


@attrs.frozen(slots=True)
class AssignedPartitionStatusRequest:
    TYPE: ClassVar[int] = 13
    seq_num: int


@attrs.frozen(slots=True)
class AssignedPartitionStatusResponse:
    TYPE: ClassVar[int] = 14
    seq_num: int
    statuses: tuple[tuple[int, bool], ...]  #: (partition id, assigned and available)


AdminMessage: TypeAlias = (
    AdminSuccessResponse | AdminFailureResponse | AdminOpenRequest | PartitionAvailableRequest |
    PartitionAssignmentRequest | AdminRecordListRequest | AdminRecordListResponse | AdminLastSessionInfoRequest |
    AdminLastSessionInfoResponse | MetricsRequest | MetricsResponse | AssignedPartitionStatusRequest |
    AssignedPartitionStatusResponse
)
MESSAGES: Final[tuple[type, ...]] = (
    AdminSuccessResponse, AdminFailureResponse, AdminOpenRequest, PartitionAvailableRequest,
    PartitionAssignmentRequest, AdminRecordListRequest, AdminRecordListResponse, AdminLastSessionInfoRequest,
    AdminLastSessionInfoResponse, MetricsRequest, MetricsResponse, AssignedPartitionStatusRequest,
    AssignedPartitionStatusResponse,
)
_BY_TYPE: Final[dict[int, type]] = {cls.TYPE: cls for cls in MESSAGES}  # type: ignore[attr-defined]
_CLASSES: Final = frozenset(MESSAGES)


def _flag(v: bool) -> bytes:
    return b"\x01" if v else b"\x00"


def encode(msg: AdminMessage) -> bytes:
    t = type(msg)
    if t not in _CLASSES:  # checked first: a foreign object has no seq_num to pack
        raise ProtocolError(f"not a storage admin message: {t.__name__}")
    try:
        out = [_PREFIX.pack(msg.TYPE, msg.seq_num)]
        if t is AdminFailureResponse:
            w_str(out, msg.error_type)  # type: ignore[union-attr]
            w_str(out, msg.message)  # type: ignore[union-attr]
        elif t is AdminOpenRequest:
            out.append(msg.cluster_key.bytes)  # type: ignore[union-attr]
            out.append(I32.pack(msg.num_partitions))  # type: ignore[union-attr]
        elif t is PartitionAvailableRequest:
            w_int_array(out, msg.partition_ids)  # type: ignore[union-attr]
            out.append(_flag(msg.available))  # type: ignore[union-attr]
        elif t is PartitionAssignmentRequest:
            w_int_array(out, msg.partition_ids)  # type: ignore[union-attr]
            out.append(_flag(msg.assigned))  # type: ignore[union-attr]
            out.append(_flag(msg.delete_storage_files))  # type: ignore[union-attr]
        elif t is AdminRecordListRequest:
            out.append(struct.pack(">iqi", msg.partition_id, msg.transaction_id, msg.max_records))  # type: ignore[union-attr]
        elif t is AdminRecordListResponse:
            out.append(I32.pack(msg.partition_id))  # type: ignore[union-attr]
            w_records(out, msg.records)  # type: ignore[union-attr]
        elif t is AdminLastSessionInfoRequest:
            out.append(I32.pack(msg.partition_id))  # type: ignore[union-attr]
        elif t is AdminLastSessionInfoResponse:
            out.append(I32.pack(msg.partition_id))  # type: ignore[union-attr]
            w_session_info(out, msg.session_info)  # type: ignore[union-attr]
        elif t is MetricsResponse:
            w_str(out, msg.metrics_json)  # type: ignore[union-attr]
        elif t is AssignedPartitionStatusResponse:
            out.append(I32.pack(len(msg.statuses)))  # type: ignore[union-attr]
            out.extend(struct.pack(">ib", pid, 1 if ok else 0) for pid, ok in msg.statuses)  # type: ignore[union-attr]
        elif t not in (AdminSuccessResponse, MetricsRequest, AssignedPartitionStatusRequest):
            raise ProtocolError(f"not a storage admin message: {t.__name__}")
        return b"".join(out)
    except struct.error as exc:
        raise ProtocolError(f"cannot encode {type(msg).__name__}: {exc}") from None


def decode(buf: bytes | memoryview) -> AdminMessage:
    if len(buf) < _PREFIX.size:
        raise ProtocolError(f"admin message: {len(buf)} bytes is shorter than the {_PREFIX.size}-byte prefix")
    kind, seq = _PREFIX.unpack_from(buf, 0)
    cls = _BY_TYPE.get(kind)
    if cls is None:
        raise ProtocolError(f"admin message: unknown message type {kind}")
    r = Reader(buf, _PREFIX.size, cls.__name__)
    msg: AdminMessage
    if cls is AdminFailureResponse:
        msg = AdminFailureResponse(seq, r.str("error type"), r.str("message"))
    elif cls is AdminOpenRequest:
        msg = AdminOpenRequest(seq, r.uuid("cluster key"), r.i32("number of partitions"))
    elif cls is PartitionAvailableRequest:
        msg = PartitionAvailableRequest(seq, r.int_array("partition ids"), r.bool("available"))
    elif cls is PartitionAssignmentRequest:
        msg = PartitionAssignmentRequest(seq, r.int_array("partition ids"), r.bool("assigned"), r.bool("delete storage files"))
    elif cls is AdminRecordListRequest:
        msg = AdminRecordListRequest(seq, r.i32("partition id"), r.i64("transaction id"), r.i32("max records"))
    elif cls is AdminRecordListResponse:
        msg = AdminRecordListResponse(seq, r.i32("partition id"), r.records("records"))
    elif cls is AdminLastSessionInfoRequest:
        msg = AdminLastSessionInfoRequest(seq, r.i32("partition id"))
    elif cls is AdminLastSessionInfoResponse:
        msg = AdminLastSessionInfoResponse(seq, r.i32("partition id"), r.session_info())
    elif cls is MetricsResponse:
        msg = MetricsResponse(seq, r.str("metrics"))
    elif cls is AssignedPartitionStatusResponse:
        n = r.count("statuses", 5)
        msg = AssignedPartitionStatusResponse(seq, tuple((r.i32("partition id"), r.bool("available")) for _ in range(n)))
    else:
        msg = cls(seq)
    r.done()
    return msg
