"""The transaction data range RPC (TYPE 23/24, protocol version 2): layout and malformed input.

Generic properties (round trips, truncations, bit flips, hostile lengths at every offset) cover
these messages through ``strategies.py``; this file pins the wire layout and the errors.
"""

from __future__ import annotations

import struct
import tracemalloc

import pytest

from waltz_core.errors import ProtocolError
from waltz_core.protocol import CLIENT
from waltz_core.protocol import client as m
from waltz_core.protocol.wire import ReqId, crc32

Q = ReqId(1, 2, 3, 4)
HEAD = bytes([24]) + Q.encode() + struct.pack(">q", 10)  # type, req id, first transaction id


def test_versions_keep_1_and_add_the_range_version() -> None:
    assert 1 in m.VERSIONS and m.DATA_RANGE_VERSION in m.VERSIONS
    assert CLIENT.versions == m.VERSIONS
    assert m.TransactionDataRangeRequest.TYPE == 23 and m.TransactionDataRangeResponse.TYPE == 24
    assert m.MESSAGES[:23] == tuple(cls for cls in m.MESSAGES if cls.TYPE < 23)  # nothing renumbered


def test_request_layout() -> None:
    raw = m.encode(m.TransactionDataRangeRequest(Q, 10, 256, 1 << 20))
    assert raw == bytes([23]) + Q.encode() + struct.pack(">qii", 10, 256, 1 << 20)
    assert m.decode(raw) == m.TransactionDataRangeRequest(Q, 10, 256, 1 << 20)


def test_response_layout() -> None:
    msg = m.TransactionDataRangeResponse(Q, 10, (b"ab", b"", b"xyz"), (crc32(b"ab"), 0, 7), None)
    raw = m.encode(msg)
    body = (struct.pack(">i", 3) + struct.pack(">i", 2) + b"ab" + struct.pack(">I", crc32(b"ab"))
            + struct.pack(">i", 0) + struct.pack(">I", 0) + struct.pack(">i", 3) + b"xyz" + struct.pack(">I", 7))
    assert raw == HEAD + body + b"\x00"
    assert m.decode(raw) == msg
    assert m.decode(memoryview(raw)) == msg


@pytest.mark.parametrize("msg", [
    m.TransactionDataRangeResponse(Q, 10, (), (), "transaction 10 is not committed"),
    m.TransactionDataRangeResponse(Q, 10, (b"a" * 1000,), (crc32(b"a" * 1000),), "storage read failed: gone"),
    m.TransactionDataRangeResponse(Q, -1, (b"",) * 300, (0,) * 300, None),
])
def test_response_shapes_round_trip(msg: m.TransactionDataRangeResponse) -> None:
    raw = m.encode(msg)
    assert m.decode(raw) == msg
    assert m.encode(m.decode(raw)) == raw


def test_encoding_mismatched_data_and_checksums_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="2 data but 1 checksums"):
        m.encode(m.TransactionDataRangeResponse(Q, 0, (b"a", b"b"), (1,), None))
    with pytest.raises(ProtocolError, match="TransactionDataRangeRequest"):
        m.encode(m.TransactionDataRangeRequest(Q, 0, 2**31, 1))


@pytest.mark.parametrize(("body", "problem"), [
    (struct.pack(">i", -1) + b"\x00", "negative length -1 for transactions"),
    (struct.pack(">i", 2**31 - 1) + b"\x00", "transactions claims 2147483647 elements"),
    (struct.pack(">ii", 1, 2**31 - 1) + b"\x00" * 8, "claims 2147483647 data bytes"),
    (struct.pack(">ii", 1, -5) + b"\x00" * 8, "claims -5 data bytes"),
    (struct.pack(">ii", 2, 4) + b"abcd" + b"\x00" * 8, "truncated at byte 41 in transaction 1 of 2"),
    (struct.pack(">i", 0), "truncated .* error flag"),
    (struct.pack(">i", 0) + b"\x02", "error flag must be 0 or 1"),
    (struct.pack(">i", 0) + b"\x01" + struct.pack(">i", 50) + b"abc", "error message claims 50 elements"),
    (struct.pack(">i", 0) + b"\x01" + struct.pack(">i", 2) + b"\xff\xfe", "not valid UTF-8"),
    (struct.pack(">i", 0) + b"\x00" + b"extra", "5 unexpected trailing bytes"),
])
def test_malformed_responses_are_protocol_errors(body: bytes, problem: str) -> None:
    with pytest.raises(ProtocolError, match=problem):
        m.decode(HEAD + body)


def test_malformed_requests_are_protocol_errors() -> None:
    raw = m.encode(m.TransactionDataRangeRequest(Q, 10, 256, 4096))
    with pytest.raises(ProtocolError, match="TransactionDataRangeRequest: truncated"):
        m.decode(raw[:-1])
    with pytest.raises(ProtocolError, match="1 unexpected trailing bytes"):
        m.decode(raw + b"\x00")


def test_a_hostile_count_allocates_nothing() -> None:
    # A count that the bytes present cannot hold is refused before any list is built.
    raw = HEAD + struct.pack(">i", 2**31 - 1) + b"\x00" * 64
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError):
            m.decode(raw)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024
