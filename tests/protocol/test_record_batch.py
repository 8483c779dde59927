"""Record batches: the stored-layout records that storage appends and record lists carry.

Round trips through the storage codec, the one-pass validation the storage node runs before
writing, and its refusal of every malformed or corrupted batch (with nothing collected).
"""

from __future__ import annotations

import struct
import zlib
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from waltz_core.errors import ChecksumError, HandshakeError, ProtocolError
from waltz_core.protocol import STORAGE
from waltz_core.protocol import storage as sm
from waltz_core.protocol.handshake import Hello, negotiate
from waltz_core.protocol.wire import (
    STORED_RECORD_HEAD,
    STORED_RECORD_OVERHEAD,
    Record,
    RecordBatch,
    ReqId,
    crc32,
    encode_stored_record,
)
from waltz_core.storage.format import RECORD_HEAD, scan_records

from .strategies import record_batches


def _records(first: int, payloads: list[bytes]) -> list[Record]:
    return [Record(first + i, ReqId(3, 1, 0, (first + i) & 0x7FFFFFFF), i, p, crc32(p)) for i, p in enumerate(payloads)]


def _sample(n: int = 4, first: int = 10) -> list[Record]:
    return _records(first, [bytes([65 + i]) * (i * 7) for i in range(n)])


def _validate(batch: RecordBatch, base: int = 0) -> array:
    offsets = array("q")
    batch.validate_into(offsets, base)
    return offsets


# ----------------------------------------------------------------------------- round trips


@settings(max_examples=150, deadline=None)
@given(batch=record_batches(), session=st.integers(0, 2**40), seq=st.integers(0, 2**40), offline=st.booleans())
def test_append_request_round_trip_keeps_the_bytes(batch: RecordBatch, session: int, seq: int, offline: bool) -> None:
    msg = sm.StorageAppendRequest(session, seq, 2, batch, offline)
    raw = sm.encode(msg)
    decoded = sm.decode(raw)
    assert decoded == msg
    got = decoded.records
    assert isinstance(got.data, memoryview)  # a view of the frame: no copy per record or per batch
    assert bytes(got.data) == bytes(batch.data)
    assert list(got) == list(batch)
    assert _validate(got) == batch.offsets
    assert sm.encode(decoded) == raw


@settings(max_examples=150, deadline=None)
@given(payloads=st.lists(st.binary(max_size=200), max_size=8), first=st.integers(0, 2**62))
def test_batch_is_the_stored_layout_of_its_records(payloads: list[bytes], first: int) -> None:
    records = _records(first, payloads)
    batch = RecordBatch.from_records(records)
    assert len(batch) == len(records) and batch.first_transaction_id == (first if records else 0)
    assert batch.last_transaction_id == batch.first_transaction_id + len(records) - 1
    # Byte for byte what the segmented layout writes, record checksums included.
    assert bytes(batch.data) == b"".join(
        encode_stored_record(r.transaction_id, r.req_id, r.header, r.data, r.checksum) for r in records)
    scan = scan_records(batch.data, 0, batch.nbytes, first)
    assert scan.error is None and scan.offsets == list(batch.offsets)
    assert list(batch) == records and batch == records and batch == tuple(records)
    assert _validate(batch, 1000) == array("q", [1000 + o for o in batch.offsets])
    for i, r in enumerate(records):
        assert batch[i] == r and batch[i - len(records)] == r
    if records:
        lo, hi = len(records) // 3, len(records) - len(records) // 3
        part = batch[lo:hi]
        assert part == records[lo:hi] and part.first_transaction_id == first + lo
        assert _validate(part) == part.offsets


def test_record_list_response_round_trip_and_version() -> None:
    batch = RecordBatch.from_records(_sample())
    msg = sm.RecordListResponse(1, 2, 3, batch)
    assert sm.decode(sm.encode(msg)) == msg
    # Records given as a list are encoded on construction (the slow paths keep working).
    assert sm.StorageAppendRequest(1, 2, 3, _sample()).records == batch
    assert RecordBatch.of(batch) is batch
    assert RECORD_HEAD is STORED_RECORD_HEAD  # one definition of the record layout
    # 5: the node's frame limit; 4: appends of several partitions; 3: numeric error codes; batches since 2
    assert STORAGE.versions == (3, 4, 5)


@pytest.mark.parametrize("old", [1, 2])
def test_an_older_peer_fails_the_handshake_clearly(old: int) -> None:
    with pytest.raises(HandshakeError, match=rf"no common protocol version.*we speak \[3, 4, 5\], it speaks \[{old}\]"):
        negotiate(Hello(sm.PROTOCOL, sm.VERSIONS, "storage-node"), Hello(sm.PROTOCOL, (old,), "old-server"))


def test_a_version_3_peer_is_spoken_to_in_version_3() -> None:
    """A node or server of the release before speaks 3 only: the link uses 3, and the server
    sends every append alone (StorageClient checks the version)."""
    assert negotiate(Hello(sm.PROTOCOL, sm.VERSIONS, "storage-node"), Hello(sm.PROTOCOL, (3,), "old-server")) == 3
    assert negotiate(Hello(sm.PROTOCOL, (3,), "old-node"), Hello(sm.PROTOCOL, sm.VERSIONS, "server")) == 3
    assert negotiate(Hello(sm.PROTOCOL, (3, 4), "node"), Hello(sm.PROTOCOL, sm.VERSIONS, "server")) == 4
    assert negotiate(Hello(sm.PROTOCOL, sm.VERSIONS, "node"), Hello(sm.PROTOCOL, sm.VERSIONS, "server")) == 5


# ------------------------------------------------------------------------- malformed batches


def _refused(batch: RecordBatch, error: type[ProtocolError], match: str) -> None:
    offsets = array("q", [1, 2, 3])  # what earlier batches of the same group collected
    with pytest.raises(error, match=match) as info:
        batch.validate_into(offsets, 99)
    assert type(info.value) is error
    assert offsets == array("q", [1, 2, 3]), "a refused batch must leave nothing behind"


def test_truncated_batches_are_refused() -> None:
    good = RecordBatch.from_records(_sample())
    data = bytes(good.data)
    for cut in (1, 4, 37, len(data) - good.offsets[-1] - 1):
        _refused(RecordBatch(data[:-cut], len(good), good.first_transaction_id), ProtocolError,
                 "truncated|claims .* data bytes")
    _refused(RecordBatch(data, len(good) + 1, good.first_transaction_id), ProtocolError, "truncated")


def test_trailing_bytes_and_a_short_count_are_refused() -> None:
    good = RecordBatch.from_records(_sample())
    _refused(RecordBatch(bytes(good.data) + b"\0", len(good), good.first_transaction_id), ProtocolError,
             "1 bytes after its 4 records")
    _refused(RecordBatch(good.data, len(good) - 1, good.first_transaction_id), ProtocolError, "bytes after")


def test_non_contiguous_ids_and_a_wrong_first_id_are_refused() -> None:
    gap = RecordBatch.from_records(_sample(2, 10) + _sample(2, 13)[1:])
    _refused(gap, ProtocolError, "record 2 has transaction id 14, expected 12")
    good = RecordBatch.from_records(_sample())
    _refused(RecordBatch(good.data, len(good), 11), ProtocolError, "record 0 has transaction id 10, expected 11")


def test_a_corrupted_record_fails_its_record_checksum() -> None:
    good = RecordBatch.from_records(_sample())
    data = bytearray(good.data)
    data[good.offsets[2] + STORED_RECORD_HEAD.size + 3] ^= 0x10  # a data byte of record 12
    _refused(RecordBatch(bytes(data), len(good), 10), ProtocolError, "record 12 fails its record checksum")


def test_a_data_checksum_that_does_not_match_is_a_checksum_error() -> None:
    # A sender that sealed a wrong data checksum in a good record checksum: today's ChecksumError.
    records = _sample()
    records[1] = Record(11, records[1].req_id, 0, records[1].data, records[1].checksum ^ 1)
    _refused(RecordBatch.from_records(records), ChecksumError, "transaction 11: data checksum does not match")


@settings(max_examples=300, deadline=None)
@given(batch=record_batches().filter(len), data=st.data())
def test_every_bit_flip_is_refused(batch: RecordBatch, data: st.DataObject) -> None:
    raw = bytearray(batch.data)
    bit = data.draw(st.integers(0, len(raw) * 8 - 1))
    raw[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(ProtocolError):
        _validate(RecordBatch(bytes(raw), len(batch), batch.first_transaction_id))


@pytest.mark.parametrize(("count", "nbytes", "match"), [
    (-1, 0, "negative count"),
    (0, -5, "negative"),
    (2, STORED_RECORD_OVERHEAD * 2 - 1, "claims 2 records in 79 bytes"),
    (0, 40, "claims 0 records in 40 bytes"),
    (2**31 - 1, 80, "claims 2147483647 records"),
])
def test_batch_heads_that_cannot_be_right_fail_decoding(count: int, nbytes: int, match: str) -> None:
    body = struct.pack(">bqqi", sm.StorageAppendRequest.TYPE, 1, 2, 0) + struct.pack(">iqi", count, 0, nbytes)
    with pytest.raises(ProtocolError, match=match):
        sm.decode(body + b"\0" * max(nbytes, 0) + b"\0")


def test_a_malformed_record_list_fails_when_decoded() -> None:
    good = RecordBatch.from_records(_sample())
    bad = RecordBatch(good.data, len(good), 3)  # ids do not start where the head says
    with pytest.raises(ProtocolError, match="record 0 has transaction id 10, expected 3"):
        sm.decode(sm.encode(sm.RecordListResponse(1, 2, 3, bad)))


def test_record_checksum_is_crc32_of_head_and_data() -> None:
    r = _sample()[2]
    raw = encode_stored_record(r.transaction_id, r.req_id, r.header, r.data, r.checksum)
    head = STORED_RECORD_HEAD.size
    assert len(raw) == STORED_RECORD_OVERHEAD + len(r.data)
    assert int.from_bytes(raw[-4:], "big") == zlib.crc32(raw[: head + len(r.data)])
