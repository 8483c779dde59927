"""Hypothesis strategies for every wire message of the three families.

``STRATEGIES`` maps each message class to a strategy producing valid instances: integers stay in
their wire ranges and checksums match the data wherever a decoder verifies them.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from waltz_core.protocol import admin, client, storage
from waltz_core.protocol.handshake import Hello
from waltz_core.protocol.wire import Record, RecordBatch, RecordHeader, ReqId, SessionInfo, crc32

i8 = st.integers(-(2**7), 2**7 - 1)
i32 = st.integers(-(2**31), 2**31 - 1)
u32 = st.integers(0, 2**32 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)
flags = st.booleans()
data = st.binary(max_size=300)
text = st.text(max_size=40)
int_arrays = st.lists(i32, max_size=12).map(tuple)
uuids = st.uuids()

req_ids = st.builds(ReqId, i32, i32, i32, i32)
record_headers = st.builds(RecordHeader, i64, req_ids, i32)
session_infos = st.builds(SessionInfo, i64, i64, i64)


@st.composite
def records(draw: st.DrawFn, *, valid_checksum: bool = True) -> Record:
    payload = draw(data)
    checksum = crc32(payload) if valid_checksum else draw(u32)
    return Record(draw(i64), draw(req_ids), draw(i32), payload, checksum)


record_lists = st.lists(records(), max_size=5).map(tuple)


@st.composite
def record_batches(draw: st.DrawFn, *, valid_checksums: bool = True) -> RecordBatch:
    """A batch of records with contiguous ids (what storages store and send)."""
    first = draw(st.integers(-(2**63), 2**63 - 6))
    body = draw(st.lists(records(valid_checksum=valid_checksums), max_size=5))
    return RecordBatch.from_records([Record(first + i, r.req_id, r.header, r.data, r.checksum)
                                     for i, r in enumerate(body)])


@st.composite
def append_requests(draw: st.DrawFn) -> client.AppendRequest:
    payload = draw(data)
    return client.AppendRequest(draw(req_ids), draw(i64), draw(int_arrays), draw(int_arrays), draw(int_arrays),
                                draw(i32), payload, crc32(payload))


@st.composite
def transaction_data_responses(draw: st.DrawFn) -> client.TransactionDataResponse:
    # The wire has two shapes: success (data + checksum, no error) and failure (error, no data).
    q, txn = draw(req_ids), draw(i64)
    if draw(flags):
        payload = draw(data)
        # The client verifies this checksum itself (it re-fetches on mismatch), so any u32 is legal.
        return client.TransactionDataResponse(q, txn, payload, draw(st.one_of(st.just(crc32(payload)), u32)), None)
    return client.TransactionDataResponse(q, txn, None, 0, draw(text))


@st.composite
def transaction_data_range_responses(draw: st.DrawFn) -> client.TransactionDataRangeResponse:
    # Any number of transactions (the client verifies each checksum, so any u32 is legal), with or
    # without the error that says why the range stopped early.
    payloads = tuple(draw(st.lists(data, max_size=5)))
    checksums = tuple(draw(st.one_of(st.just(crc32(p)), u32)) for p in payloads)
    return client.TransactionDataRangeResponse(draw(req_ids), draw(i64), payloads, checksums,
                                               draw(st.none() | text))


@st.composite
def feed_data_batches(draw: st.DrawFn) -> client.FeedDataBatch:
    # Any records, of any clients and partitions: the head's request id is the first one's.
    records = tuple(draw(st.lists(st.builds(client.FeedData, req_ids, i64, i32), min_size=1, max_size=6)))
    return client.FeedDataBatch(records[0].req_id, records)


@st.composite
def append_many_requests(draw: st.DrawFn) -> storage.StorageAppendManyRequest:
    # Each append's sequence number is its index and none is offline (the layout has neither).
    parts = draw(st.lists(st.tuples(i64, i32, record_batches(valid_checksums=False) | record_lists), max_size=4))
    appends = tuple(storage.StorageAppendRequest(sid, index, pid, batch) for index, (sid, pid, batch) in enumerate(parts))
    return storage.StorageAppendManyRequest(draw(i64), draw(i64), draw(i32), appends)


hellos = st.builds(Hello, st.binary(min_size=1, max_size=1), st.lists(st.integers(0, 2**16 - 1), min_size=1,
                   max_size=20).map(tuple), text)

_c = client
CLIENT: dict[type, st.SearchStrategy[Any]] = {
    _c.MountRequest: st.builds(_c.MountRequest, req_ids, i64, i64),
    _c.MountResponse: st.builds(_c.MountResponse, req_ids, st.sampled_from(_c.PartitionState)),
    _c.AppendRequest: append_requests(),
    _c.FeedRequest: st.builds(_c.FeedRequest, req_ids, i64),
    _c.FeedData: st.builds(_c.FeedData, req_ids, i64, i32),
    _c.FeedSuspended: st.builds(_c.FeedSuspended, req_ids),
    _c.TransactionDataRequest: st.builds(_c.TransactionDataRequest, req_ids, i64),
    _c.TransactionDataResponse: transaction_data_responses(),
    _c.FlushRequest: st.builds(_c.FlushRequest, req_ids),
    _c.FlushResponse: st.builds(_c.FlushResponse, req_ids, i64),
    _c.LockFailure: st.builds(_c.LockFailure, req_ids, i64),
    _c.HighWaterMarkRequest: st.builds(_c.HighWaterMarkRequest, req_ids),
    _c.HighWaterMarkResponse: st.builds(_c.HighWaterMarkResponse, req_ids, i64),
    _c.CheckStorageConnectivityRequest: st.builds(_c.CheckStorageConnectivityRequest, req_ids),
    _c.CheckStorageConnectivityResponse: st.builds(
        _c.CheckStorageConnectivityResponse, req_ids, st.lists(st.tuples(text, flags), max_size=6).map(tuple)),
    _c.ServerPartitionsAssignmentRequest: st.builds(_c.ServerPartitionsAssignmentRequest, req_ids),
    _c.ServerPartitionsAssignmentResponse: st.builds(_c.ServerPartitionsAssignmentResponse, req_ids, int_arrays),
    _c.AddPreferredPartitionRequest: st.builds(_c.AddPreferredPartitionRequest, req_ids, int_arrays),
    _c.AddPreferredPartitionResponse: st.builds(_c.AddPreferredPartitionResponse, req_ids, flags),
    _c.RemovePreferredPartitionRequest: st.builds(_c.RemovePreferredPartitionRequest, req_ids, int_arrays),
    _c.RemovePreferredPartitionResponse: st.builds(_c.RemovePreferredPartitionResponse, req_ids, flags),
    _c.ServerPartitionsHealthStatRequest: st.builds(_c.ServerPartitionsHealthStatRequest, req_ids),
    _c.ServerPartitionsHealthStatResponse: st.builds(
        _c.ServerPartitionsHealthStatResponse, req_ids, st.lists(st.tuples(i32, flags), max_size=8).map(tuple)),
    _c.TransactionDataRangeRequest: st.builds(_c.TransactionDataRangeRequest, req_ids, i64, i32, i32),
    _c.TransactionDataRangeResponse: transaction_data_range_responses(),
    _c.FeedDataBatch: feed_data_batches(),
    _c.AppendRefused: st.builds(_c.AppendRefused, req_ids, i32, text),
    _c.ServerLimitsRequest: st.builds(_c.ServerLimitsRequest, req_ids),
    _c.ServerLimitsResponse: st.builds(_c.ServerLimitsResponse, req_ids, i32, i32),
}

_s = storage
_head = (i64, i64, i32)  # session id, sequence number, partition id
STORAGE: dict[type, st.SearchStrategy[Any]] = {
    _s.OpenRequest: st.builds(_s.OpenRequest, *_head, uuids, i32),
    _s.LastSessionInfoRequest: st.builds(_s.LastSessionInfoRequest, *_head, flags),
    _s.LastSessionInfoResponse: st.builds(_s.LastSessionInfoResponse, *_head, session_infos),
    _s.SetLowWaterMarkRequest: st.builds(_s.SetLowWaterMarkRequest, *_head, i64, flags),
    _s.TruncateRequest: st.builds(_s.TruncateRequest, *_head, i64, flags),
    # Any records: the codec checks only the batch head, the storage node validates the records.
    _s.StorageAppendRequest: st.builds(_s.StorageAppendRequest, *_head,
                                       record_batches(valid_checksums=False) | record_lists, flags),
    _s.SuccessResponse: st.builds(_s.SuccessResponse, *_head),
    _s.FailureResponse: st.builds(_s.FailureResponse, *_head, i32, text),  # error code, message
    _s.RecordHeaderRequest: st.builds(_s.RecordHeaderRequest, *_head, i64),
    _s.RecordHeaderResponse: st.builds(_s.RecordHeaderResponse, *_head, st.none() | record_headers),
    _s.RecordRequest: st.builds(_s.RecordRequest, *_head, i64),
    _s.RecordResponse: st.builds(_s.RecordResponse, *_head, st.none() | records()),
    _s.MaxTransactionIdRequest: st.builds(_s.MaxTransactionIdRequest, *_head, flags),
    _s.MaxTransactionIdResponse: st.builds(_s.MaxTransactionIdResponse, *_head, i64),
    _s.RecordHeaderListRequest: st.builds(_s.RecordHeaderListRequest, *_head, i64, i32),
    _s.RecordHeaderListResponse: st.builds(
        _s.RecordHeaderListResponse, *_head, st.lists(record_headers, max_size=6).map(tuple)),
    _s.RecordListRequest: st.builds(_s.RecordListRequest, *_head, i64, i32),
    _s.RecordListResponse: st.builds(_s.RecordListResponse, *_head, record_batches()),
    _s.StorageAppendManyRequest: append_many_requests(),
    _s.AppendManyResponse: st.builds(  # (index, error code, message) of each refused append
        _s.AppendManyResponse, *_head, st.lists(st.tuples(i32, i32, text), max_size=4).map(tuple)),
    _s.OpenResponse: st.builds(_s.OpenResponse, *_head, i32),
    _s.LimitedOpenRequest: st.builds(_s.LimitedOpenRequest, *_head, uuids, i32, i32),
}

_a = admin
ADMIN: dict[type, st.SearchStrategy[Any]] = {
    _a.AdminSuccessResponse: st.builds(_a.AdminSuccessResponse, i64),
    _a.AdminFailureResponse: st.builds(_a.AdminFailureResponse, i64, i32, text),  # error code, message
    _a.AdminOpenRequest: st.builds(_a.AdminOpenRequest, i64, uuids, i32),
    _a.PartitionAvailableRequest: st.builds(_a.PartitionAvailableRequest, i64, int_arrays, flags),
    _a.PartitionAssignmentRequest: st.builds(_a.PartitionAssignmentRequest, i64, int_arrays, flags, flags),
    _a.AdminRecordListRequest: st.builds(_a.AdminRecordListRequest, i64, i32, i64, i32),
    _a.AdminRecordListResponse: st.builds(_a.AdminRecordListResponse, i64, i32, record_lists),
    _a.AdminLastSessionInfoRequest: st.builds(_a.AdminLastSessionInfoRequest, i64, i32),
    _a.AdminLastSessionInfoResponse: st.builds(_a.AdminLastSessionInfoResponse, i64, i32, session_infos),
    _a.MetricsRequest: st.builds(_a.MetricsRequest, i64),
    _a.MetricsResponse: st.builds(_a.MetricsResponse, i64, text),
    _a.AssignedPartitionStatusRequest: st.builds(_a.AssignedPartitionStatusRequest, i64),
    _a.AssignedPartitionStatusResponse: st.builds(
        _a.AssignedPartitionStatusResponse, i64, st.lists(st.tuples(i32, flags), max_size=8).map(tuple)),
    _a.LimitedAdminOpenRequest: st.builds(_a.LimitedAdminOpenRequest, i64, uuids, i32, i32),
}

#: family module -> {message class: strategy}
BY_FAMILY: dict[Any, dict[type, st.SearchStrategy[Any]]] = {client: CLIENT, storage: STORAGE, admin: ADMIN}


def messages_of(family: Any) -> st.SearchStrategy[Any]:
    """Any message of one family."""
    return st.one_of(*BY_FAMILY[family].values())


__all__ = ["ADMIN", "BY_FAMILY", "CLIENT", "STORAGE", "hellos", "messages_of", "record_batches", "record_headers",
           "records", "req_ids", "session_infos"]


# ------------------------------------------------------------------ deterministic samples
# One hand-shaped instance per class with every list non-empty, for exhaustive byte-offset scans
# (Hypothesis' find() shrinks far too slowly for that).

_SAMPLE_RECORD = Record(7, ReqId(1, 2, 3, 4), 5, b"abcdef", crc32(b"abcdef"))
_SAMPLE_BATCH = RecordBatch.from_records([_SAMPLE_RECORD, Record(8, ReqId(1, 2, 3, 5), 6, b"gh", crc32(b"gh"))])
_SAMPLE_HEADER = RecordHeader(7, ReqId(1, 2, 3, 4), 5)
_SAMPLE_BY_TYPE: dict[Any, Any] = {
    int: 7, bool: True, bytes: b"abcdef", str: "h\u00e9llo", ReqId: ReqId(1, 2, 3, 4),
    SessionInfo: SessionInfo(9, 3, 2), client.PartitionState: client.PartitionState.CLIENT_AHEAD,
    tuple[int, ...]: (1, 2, 3), tuple[Record, ...]: (_SAMPLE_RECORD, _SAMPLE_RECORD),
    tuple[RecordHeader, ...]: (_SAMPLE_HEADER, _SAMPLE_HEADER), Record | None: _SAMPLE_RECORD,
    RecordHeader | None: _SAMPLE_HEADER, bytes | None: b"abcdef", str | None: None, RecordBatch: _SAMPLE_BATCH,
    tuple[tuple[str, bool], ...]: (("h:1", True), ("h:2", False)),
    tuple[tuple[int, bool], ...]: ((1, True), (2, False)),
    tuple[bytes, ...]: (b"abc", b"", b"defgh"),  # as many as the tuple[int, ...] sample (range checksums)
    # the first record's request id is the message's (the ReqId sample)
    tuple[client.FeedData, ...]: (client.FeedData(ReqId(1, 2, 3, 4), 7, 1), client.FeedData(ReqId(5, 2, 3, 9), 8, -2)),
    # each append's sequence number is its index in the message
    tuple[storage.StorageAppendRequest, ...]: (storage.StorageAppendRequest(5, 0, 1, _SAMPLE_BATCH),
                                               storage.StorageAppendRequest(6, 1, 2, _SAMPLE_BATCH)),
    tuple[tuple[int, int, str], ...]: ((1, 4, "stale"), (3, 9, "h\u00e9llo")),
}


def sample_messages(family: Any) -> list[Any]:
    """A deterministic instance of every message class of ``family`` (plus variants of optional shapes)."""
    import typing
    import uuid as _uuid

    import attrs

    out = []
    for cls in family.MESSAGES:
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for f in attrs.fields(cls):
            tp = hints[f.name]
            kwargs[f.name] = _uuid.UUID(int=0x1234) if tp is _uuid.UUID else _SAMPLE_BY_TYPE[tp]
        if "checksum" in kwargs:
            kwargs["checksum"] = crc32(kwargs["data"])
        out.append(cls(**kwargs))
    if family is client:
        out.append(client.TransactionDataResponse(ReqId(1, 2, 3, 4), 7, None, 0, "storage failed"))
        out.append(client.TransactionDataRangeResponse(ReqId(1, 2, 3, 4), 7, (), (), "not committed"))
        out.append(client.TransactionDataRangeResponse(ReqId(1, 2, 3, 4), 7, (b"ab",), (crc32(b"ab"),),
                                                       "storage read failed"))
    if family is storage:
        out += [storage.RecordResponse(1, 2, 3, None), storage.RecordHeaderResponse(1, 2, 3, None)]
    return out
