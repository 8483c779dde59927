"""The hot-path codecs agree with the general ones: ``encode_append`` (client, no message object),
the ``AppendRequest`` decode without locks or with one write lock (server), ``unpack_feed_data`` (client stream reader), and
the storage family's ``encode_append`` and ``success_response`` (server and storage node)."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from waltz_core.protocol import client as m
from waltz_core.protocol import storage as sm
from waltz_core.protocol.wire import Reader

from .strategies import STORAGE, append_requests, data, i32, i64, messages_of, req_ids


@given(append_requests())
def test_encode_append_from_fields_equals_encoding_the_message(msg: m.AppendRequest) -> None:
    q = msg.req_id
    raw = m.encode_append(q.client_id, q.generation, q.partition_id, q.seq_num, msg.client_high_water_mark,
                          msg.write_locks, msg.read_locks, msg.append_locks, msg.header, msg.data, msg.checksum)
    assert raw == m.encode(msg)
    assert m.decode(raw) == msg


@given(req_ids, i64, i32, data)
def test_lock_free_append_fast_path_equals_the_checked_decoder(q: Any, hwm: int, header: int, payload: bytes) -> None:
    from waltz_core.protocol.wire import crc32

    msg = m.AppendRequest(q, hwm, (), (), (), header, payload, crc32(payload))
    raw = m.encode(msg)
    assert m.decode(raw) == msg == m._dec_append_checked(Reader(raw, 1, "AppendRequest"))
    assert m.decode(memoryview(raw)) == msg  # frames may arrive as memoryviews


@given(req_ids, i64, i32, i32, data)
def test_one_write_lock_append_fast_path_equals_the_checked_decoder(q: Any, hwm: int, lock: int, header: int,
                                                                    payload: bytes) -> None:
    from waltz_core.protocol.wire import crc32

    msg = m.AppendRequest(q, hwm, (lock,), (), (), header, payload, crc32(payload))
    raw = m.encode(msg)
    assert m.decode(raw) == msg == m._dec_append_checked(Reader(raw, 1, "AppendRequest"))
    assert m.decode(memoryview(raw)) == msg
    # One write lock with read or append locks too takes the general path, with the same result.
    for other in (m.AppendRequest(q, hwm, (lock,), (lock,), (), header, payload, crc32(payload)),
                  m.AppendRequest(q, hwm, (lock,), (), (lock, 1), header, payload, crc32(payload))):
        raw = m.encode(other)
        assert m.decode(raw) == other == m._dec_append_checked(Reader(raw, 1, "AppendRequest"))


@given(messages_of(m))
def test_unpack_feed_data_takes_feed_records_only(msg: Any) -> None:
    raw = m.encode(msg)
    fields = m.unpack_feed_data(raw)
    if type(msg) is m.FeedData:
        q = msg.req_id
        assert fields == (q.client_id, q.generation, q.partition_id, q.seq_num, msg.transaction_id, msg.header)
    else:
        assert fields is None


@given(st.binary(max_size=64))
def test_unpack_feed_data_never_raises_on_random_bytes(raw: bytes) -> None:
    fields = m.unpack_feed_data(raw)
    assert fields is None or (len(raw) == 41 and raw[0] == 4)


@given(append_requests())
def test_objects_made_through_slot_descriptors_equal_the_attrs_constructors(msg: m.AppendRequest) -> None:
    """fast_req_id and the decoder's AppendRequest skip attrs' __init__: same values, equality,
    hash and repr, and still frozen."""
    import attrs
    import pytest

    from waltz_core.protocol.wire import ReqId, fast_req_id

    q = msg.req_id
    fast_q = fast_req_id(q.client_id, q.generation, q.partition_id, q.seq_num)
    assert type(fast_q) is ReqId and fast_q == q and hash(fast_q) == hash(q) and repr(fast_q) == repr(q)
    fast = m._fast_append(*attrs.astuple(msg, recurse=False))
    assert type(fast) is m.AppendRequest and fast == msg and repr(fast) == repr(msg)
    assert attrs.astuple(fast, recurse=False) == attrs.astuple(msg, recurse=False)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        fast.header = 1  # type: ignore[misc]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        fast_q.seq_num = 1  # type: ignore[misc]


@given(STORAGE[sm.StorageAppendRequest])
def test_storage_encode_append_from_fields_equals_encoding_the_message(msg: sm.StorageAppendRequest) -> None:
    raw = sm.encode_append(msg.session_id, msg.seq_num, msg.partition_id, msg.records, msg.offline)
    assert raw == sm.encode(msg) == sm.CODEC.generic_encode(msg)
    assert sm.decode(raw) == msg


@given(i64, i64, i32)
def test_storage_acknowledgements_made_through_slot_descriptors_equal_the_attrs_constructor(
        session_id: int, seq_num: int, partition_id: int) -> None:
    import attrs
    import pytest

    msg = sm.SuccessResponse(session_id, seq_num, partition_id)
    fast = sm.success_response(session_id, seq_num, partition_id)
    assert type(fast) is sm.SuccessResponse and fast == msg and hash(fast) == hash(msg) and repr(fast) == repr(msg)
    decoded = sm.decode(sm.encode(msg))
    assert type(decoded) is sm.SuccessResponse and decoded == msg
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        fast.seq_num = 1  # type: ignore[misc]


def test_storage_encode_append_refuses_values_that_do_not_fit() -> None:
    import pytest

    from waltz_core.errors import ProtocolError
    from waltz_core.protocol.wire import RecordBatch

    with pytest.raises(ProtocolError, match="cannot encode StorageAppendRequest"):
        sm.encode_append(2**63, 1, 0, RecordBatch(b"", 0, 0))


@given(STORAGE[sm.StorageAppendManyRequest])
def test_storage_encode_append_many_from_fields_equals_encoding_the_message(msg: sm.StorageAppendManyRequest) -> None:
    """The server encodes its queued (session id, partition id, batch) triples; the node decodes
    each append as the request it handles, its index as its sequence number."""
    import attrs

    many = attrs.evolve(msg, session_id=-1, partition_id=-1)
    raw = sm.encode_append_many(many.seq_num, [(p.session_id, p.partition_id, p.records) for p in many.appends])
    assert raw == sm.encode(many) == sm.CODEC.generic_encode(many)
    decoded = sm.decode(raw)
    assert decoded == many == sm.CODEC.generic_decode(raw)
    assert all(type(p) is sm.StorageAppendRequest and p.seq_num == i and not p.offline
               for i, p in enumerate(decoded.appends))
    assert sm.decode(memoryview(raw)) == many  # frames may arrive as memoryviews


def test_storage_append_many_refuses_appends_it_cannot_carry() -> None:
    """Its layout has no sequence number and no offline flag per append: an append whose
    sequence number is not its index, or an offline one, cannot be encoded."""
    import pytest

    from waltz_core.errors import ProtocolError
    from waltz_core.protocol.wire import RecordBatch

    empty = RecordBatch(b"", 0, 0)
    for appends in ((sm.StorageAppendRequest(1, 1, 0, empty),), (sm.StorageAppendRequest(1, 0, 0, empty, True),)):
        for encode in (sm.encode, sm.CODEC.generic_encode):
            with pytest.raises(ProtocolError, match="cannot encode StorageAppendManyRequest"):
                encode(sm.StorageAppendManyRequest(-1, 3, -1, appends))
    with pytest.raises(ProtocolError, match="cannot encode StorageAppendManyRequest"):
        sm.encode_append_many(1, [(2**63, 0, empty)])


@given(STORAGE[sm.AppendManyResponse])
def test_storage_append_many_response_fast_decode_equals_the_generic_one(msg: sm.AppendManyResponse) -> None:
    raw = sm.encode(msg)
    assert sm.decode(raw) == msg == sm.CODEC.generic_decode(raw)
