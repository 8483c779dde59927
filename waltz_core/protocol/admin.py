"""Storage admin messages (the storage node's admin port; original AdminMessageCodecV0).

Every payload starts with ``byte type, long seq_num`` (the family head); the rest of each
message's layout is declared on its class (field annotations, see :mod:`.layout`), in field
order.

Version 2: ``AdminFailureResponse`` carries ``int error_code`` (a numeric code from
:mod:`waltz_core.errors`) where version 1 had ``str error_type`` (an exception class name), in
the same position. Only version 2 is spoken: an older peer fails the handshake.
"""

from __future__ import annotations

import typing
import uuid
from typing import Annotated, ClassVar, Final, TypeAlias

import attrs

from .layout import (
    BOOL,
    INT32,
    INT64,
    INT_ARRAY,
    RECORDS,
    SESSION_INFO,
    STRING,
    UUID,
    Array,
    FamilyCodec,
    FixedTuple,
)
from .wire import Record, SessionInfo

PROTOCOL: Final = b"A"
VERSIONS: Final = (2,)  #: 2: numeric error codes in failures (see the module doc)


@attrs.frozen(slots=True)
class AdminSuccessResponse:
    TYPE: ClassVar[int] = 1
    seq_num: int


@attrs.frozen(slots=True)
class AdminFailureResponse:
    TYPE: ClassVar[int] = 2
    seq_num: int
    error_code: Annotated[int, INT32]  #: a numeric error code from waltz_core.errors (version 2)
    message: Annotated[str, STRING]


@attrs.frozen(slots=True)
class AdminOpenRequest:
    TYPE: ClassVar[int] = 3
    seq_num: int
    cluster_key: Annotated[uuid.UUID, UUID]
    num_partitions: Annotated[int, INT32]


@attrs.frozen(slots=True)
class PartitionAvailableRequest:
    TYPE: ClassVar[int] = 4
    seq_num: int
    partition_ids: Annotated[tuple[int, ...], INT_ARRAY]
    available: Annotated[bool, BOOL]


@attrs.frozen(slots=True)
class PartitionAssignmentRequest:
    TYPE: ClassVar[int] = 6
    seq_num: int
    partition_ids: Annotated[tuple[int, ...], INT_ARRAY]
    assigned: Annotated[bool, BOOL]
    delete_storage_files: Annotated[bool, BOOL]


@attrs.frozen(slots=True)
class AdminRecordListRequest:
    TYPE: ClassVar[int] = 7
    seq_num: int
    partition_id: Annotated[int, INT32]
    transaction_id: Annotated[int, INT64]
    max_records: Annotated[int, INT32]


@attrs.frozen(slots=True)
class AdminRecordListResponse:
    TYPE: ClassVar[int] = 8
    seq_num: int
    partition_id: Annotated[int, INT32]
    records: Annotated[tuple[Record, ...], RECORDS]


@attrs.frozen(slots=True)
class AdminLastSessionInfoRequest:
    TYPE: ClassVar[int] = 9
    seq_num: int
    partition_id: Annotated[int, INT32]


@attrs.frozen(slots=True)
class AdminLastSessionInfoResponse:
    TYPE: ClassVar[int] = 10
    seq_num: int
    partition_id: Annotated[int, INT32]
    session_info: Annotated[SessionInfo, SESSION_INFO]


@attrs.frozen(slots=True)
class MetricsRequest:
    TYPE: ClassVar[int] = 11
    seq_num: int


@attrs.frozen(slots=True)
class MetricsResponse:
    TYPE: ClassVar[int] = 12
    seq_num: int
    metrics_json: Annotated[str, STRING]


@attrs.frozen(slots=True)
class AssignedPartitionStatusRequest:
    TYPE: ClassVar[int] = 13
    seq_num: int


@attrs.frozen(slots=True)
class AssignedPartitionStatusResponse:
    TYPE: ClassVar[int] = 14
    seq_num: int
    #: (partition id, assigned and available)
    statuses: Annotated[tuple[tuple[int, bool], ...], Array(FixedTuple(INT32, BOOL))]


AdminMessage: TypeAlias = (
    AdminSuccessResponse | AdminFailureResponse | AdminOpenRequest | PartitionAvailableRequest |
    PartitionAssignmentRequest | AdminRecordListRequest | AdminRecordListResponse | AdminLastSessionInfoRequest |
    AdminLastSessionInfoResponse | MetricsRequest | MetricsResponse | AssignedPartitionStatusRequest |
    AssignedPartitionStatusResponse
)
#: every message class, in TYPE order (the alias above is the one list of them)
MESSAGES: Final[tuple[type, ...]] = typing.get_args(AdminMessage)

#: the generic codec derived from the declarations above (type table checked at import)
CODEC: Final[FamilyCodec[AdminMessage]] = FamilyCodec("storage admin", "admin message", (("seq_num", INT64),),
                                                      MESSAGES)
encode: Final = CODEC.encode
decode: Final = CODEC.decode
