"""Round-trip properties: ``decode(encode(m)) == m`` for every message of every family."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from waltz_core.errors import ChecksumError, ProtocolError
from waltz_core.protocol import FAMILIES, admin, client, storage
from waltz_core.protocol.handshake import decode_hello, encode_hello
from waltz_core.protocol.wire import (
    Reader,
    ReqId,
    w_record,
    w_record_header,
    w_session_info,
)

from .strategies import BY_FAMILY, hellos, record_headers, records, req_ids, session_infos

FAMILY_MODULES = (client, storage, admin)
ALL_CASES = [(fam, cls) for fam in FAMILY_MODULES for cls in fam.MESSAGES]


@pytest.mark.parametrize("family", FAMILY_MODULES, ids=lambda f: f.__name__.rsplit(".", 1)[-1])
def test_every_message_class_has_a_strategy(family: Any) -> None:
    # A message added to MESSAGES without a strategy here must fail this test.
    assert set(BY_FAMILY[family]) == set(family.MESSAGES)
    assert len(family.MESSAGES) == len(set(family.MESSAGES))


@pytest.mark.parametrize("family", FAMILY_MODULES, ids=lambda f: f.__name__.rsplit(".", 1)[-1])
def test_type_bytes_are_unique_within_a_family(family: Any) -> None:
    types = [cls.TYPE for cls in family.MESSAGES]
    assert len(types) == len(set(types))


def test_families_expose_the_family_modules() -> None:
    assert [f.messages for f in FAMILIES] == [m.MESSAGES for m in FAMILY_MODULES]
    assert len({f.protocol for f in FAMILIES}) == 3


@pytest.mark.parametrize(("family", "cls"), ALL_CASES, ids=lambda v: getattr(v, "__name__", "").rsplit(".", 1)[-1])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_round_trip(family: Any, cls: type, data: st.DataObject) -> None:
    msg = data.draw(BY_FAMILY[family][cls])
    assert type(msg) is cls
    raw = family.encode(msg)
    assert isinstance(raw, bytes)
    assert raw[0] == cls.TYPE  # type: ignore[attr-defined]
    assert family.decode(raw) == msg
    assert family.decode(memoryview(raw)) == msg  # framers may hand out views
    assert family.encode(family.decode(raw)) == raw  # the encoding is canonical


@settings(max_examples=200, deadline=None)
@given(hellos)
def test_hello_round_trip(hello: Any) -> None:
    assert decode_hello(encode_hello(hello)) == hello


@given(req_ids)
def test_req_id_is_16_bytes_and_round_trips(q: ReqId) -> None:
    raw = q.encode()
    assert len(raw) == 16
    assert Reader(raw).req_id() == q


@given(records())
def test_record_round_trip(rec: Any) -> None:
    out: list[bytes] = []
    w_record(out, rec)
    r = Reader(b"".join(out))
    assert r.record() == rec
    r.done()
    rec.verify()  # the strategy produced a matching checksum


@given(records(valid_checksum=False))
def test_record_verify_detects_a_wrong_checksum(rec: Any) -> None:
    from waltz_core.protocol.wire import crc32

    if crc32(rec.data) == rec.checksum:
        rec.verify()
    else:
        with pytest.raises(ChecksumError):
            rec.verify()


@given(record_headers)
def test_record_header_round_trip(h: Any) -> None:
    out: list[bytes] = []
    w_record_header(out, h)
    r = Reader(b"".join(out))
    assert r.record_header() == h
    r.done()


@given(session_infos)
def test_session_info_round_trip(s: Any) -> None:
    out: list[bytes] = []
    w_session_info(out, s)
    r = Reader(b"".join(out))
    assert r.session_info() == s
    r.done()


# ------------------------------------------------------------------------ encode-side limits


def test_out_of_range_fields_are_protocol_errors_on_encode() -> None:
    q = ReqId(1, 2, 3, 4)
    with pytest.raises(ProtocolError, match="FeedData"):
        client.encode(client.FeedData(q, 2**63, 0))
    with pytest.raises(ProtocolError, match="AppendRequest"):
        client.encode(client.AppendRequest(q, 0, (2**31,), (), (), 0, b"", 0))
    with pytest.raises(ProtocolError, match="MountRequest"):
        client.encode(client.MountRequest(ReqId(2**31, 0, 0, 0), 0, 0))
    with pytest.raises(ProtocolError, match="TruncateRequest"):
        storage.encode(storage.TruncateRequest(0, 0, 0, -(2**63) - 1))
    with pytest.raises(ProtocolError, match="AdminRecordListRequest"):
        admin.encode(admin.AdminRecordListRequest(0, 2**31, 0, 0))


def test_encoding_a_foreign_object_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="not a client/server message"):
        client.encode(storage.SuccessResponse(0, 0, 0))  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="not a storage message: FeedData"):
        storage.encode(client.FeedData(ReqId(0, 0, 0, 0), 0, 0))  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="not a storage admin message: SuccessResponse"):
        admin.encode(storage.SuccessResponse(0, 0, 0))  # type: ignore[arg-type]


def test_feed_data_wire_layout_is_the_seeds() -> None:
    # type byte, 16-byte req id, long transaction id, int header: 29 bytes.
    raw = client.encode(client.FeedData(ReqId(1, 2, 3, 4), 5, 6))
    assert raw == bytes([4]) + ReqId(1, 2, 3, 4).encode() + (5).to_bytes(8, "big") + (6).to_bytes(4, "big")


@pytest.mark.parametrize("family", FAMILY_MODULES, ids=lambda f: f.__name__.rsplit(".", 1)[-1])
def test_deterministic_samples_cover_and_round_trip(family: Any) -> None:
    from .strategies import sample_messages

    samples = sample_messages(family)
    assert {type(m) for m in samples} == set(family.MESSAGES)
    for msg in samples:
        assert family.decode(family.encode(msg)) == msg
