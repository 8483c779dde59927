"""Storage admin messages (the storage node's admin port; original AdminMessageCodecV0).

Every payload starts with ``byte type, long seq_num`` (the family head); the rest of each
message's layout is declared on its class (field annotations, see :mod:`.layout`), in field
order.

Version 2: ``AdminFailureResponse`` carries ``int error_code`` (a numeric code from
:mod:`waltz_core.errors`) where version 1 had ``str error_type`` (an exception class name), in
the same position. An older peer fails the handshake.

Version 3 adds ``LimitedAdminOpenRequest``: the open with the tool's ``transport.max_frame_size``.
The node answers that connection's record exports within half of the smaller of the two limits,
as it answers a server's record lists (storage protocol 5): a tool with smaller frames than the
node would otherwise close the connection on the first large export. Versions 2 and 3 are spoken.
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
#: 3: the tool's frame limit in the open; 2: numeric error codes in failures (see the module doc)
VERSIONS: Final = (2, 3)
#: the version whose open carries the tool's frame limit
LIMITS_VERSION: Final = 3


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


@attrs.frozen(slots=True)
class LimitedAdminOpenRequest:
    """:class:`AdminOpenRequest` with the sender's frame limit (version 3): the node answers its
    record exports within it. Answered by :class:`AdminSuccessResponse`."""

    TYPE: ClassVar[int] = 15
    seq_num: int
    cluster_key: Annotated[uuid.UUID, UUID]
    num_partitions: Annotated[int, INT32]
    max_frame_size: Annotated[int, INT32]  #: the sender's ``transport.max_frame_size``


AdminMessage: TypeAlias = (
    AdminSuccessResponse | AdminFailureResponse | AdminOpenRequest | PartitionAvailableRequest |
    PartitionAssignmentRequest | AdminRecordListRequest | AdminRecordListResponse | AdminLastSessionInfoRequest |
    AdminLastSessionInfoResponse | MetricsRequest | MetricsResponse | AssignedPartitionStatusRequest |
    AssignedPartitionStatusResponse | LimitedAdminOpenRequest
)
#: every message class, in TYPE order (the alias above is the one list of them)
MESSAGES: Final[tuple[type, ...]] = typing.get_args(AdminMessage)

#: the generic codec derived from the declarations above (type table checked at import)
CODEC: Final[FamilyCodec[AdminMessage]] = FamilyCodec("storage admin", "admin message", (("seq_num", INT64),),
                                                      MESSAGES)
encode: Final = CODEC.encode
decode: Final = CODEC.decode
