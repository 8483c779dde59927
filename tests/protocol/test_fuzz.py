"""Hostile bytes: every decoder and the framer raise only ProtocolError (or subclasses).

Whatever a peer sends, ``decode`` either returns a valid message (whose canonical encoding is
exactly the bytes received) or raises :class:`waltz_core.errors.ProtocolError`. Lengths and
counts are checked against the bytes present before anything is allocated.
"""

from __future__ import annotations

import struct
import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from waltz_core.errors import ChecksumError, FrameTooLargeError, HandshakeError, ProtocolError
from waltz_core.protocol import admin, client, storage
from waltz_core.protocol.framing import FrameDecoder, encode_frame
from waltz_core.protocol.handshake import Hello, decode_hello, encode_hello
from waltz_core.protocol.wire import ReqId, crc32

from .strategies import hellos, messages_of, sample_messages

FAMILY_MODULES = (client, storage, admin)
FAMILY_IDS = ("client", "storage", "admin")
HOSTILE_INTS = (2**31 - 1, 2**31 - 2, -1, -(2**31), 0x7FFF0000, 0x00FFFFFF, 65536)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

family_params = pytest.mark.parametrize("family", FAMILY_MODULES, ids=FAMILY_IDS)


def decode_or_protocol_error(family: Any, raw: bytes) -> Any:
    """Decode ``raw``; a result must be a message of the family that re-encodes to ``raw``."""
    try:
        msg = family.decode(raw)
    except ProtocolError:
        return None
    assert type(msg) in family.MESSAGES
    assert family.encode(msg) == raw
    return msg


def type_bytes(family: Any) -> list[int]:
    return [cls.TYPE for cls in family.MESSAGES]


@family_params
@FUZZ
@given(raw=st.binary(max_size=200))
def test_random_bytes(family: Any, raw: bytes) -> None:
    decode_or_protocol_error(family, raw)


@family_params
@FUZZ
@given(data=st.data())
def test_random_bodies_after_a_valid_type_byte(family: Any, data: st.DataObject) -> None:
    kind = data.draw(st.sampled_from(type_bytes(family)))
    # storage/admin prefixes are longer than the type byte; give them a plausible prefix too
    prefix = bytes([kind]) + data.draw(st.binary(min_size=0, max_size=20))
    decode_or_protocol_error(family, prefix + data.draw(st.binary(max_size=200)))


@family_params
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_every_truncation_of_a_valid_encoding_is_rejected(family: Any, data: st.DataObject) -> None:
    raw = family.encode(data.draw(messages_of(family)))
    for cut in range(len(raw)):
        with pytest.raises(ProtocolError):
            family.decode(raw[:cut])
    # and one byte too many is trailing garbage, not a silently ignored suffix
    with pytest.raises(ProtocolError):
        family.decode(raw + b"\x00")


@family_params
@FUZZ
@given(data=st.data())
def test_bit_flips(family: Any, data: st.DataObject) -> None:
    raw = bytearray(family.encode(data.draw(messages_of(family))))
    for _ in range(data.draw(st.integers(1, 3))):
        bit = data.draw(st.integers(0, len(raw) * 8 - 1))
        raw[bit // 8] ^= 1 << (bit % 8)
    decode_or_protocol_error(family, bytes(raw))


@family_params
@FUZZ
@given(data=st.data())
def test_hostile_int32_anywhere(family: Any, data: st.DataObject) -> None:
    # Overwrite any 4 bytes with a hostile length/count: covers every length prefix without
    # knowing the layout (counts of 2**31-1, negative lengths, ...).
    raw = bytearray(family.encode(data.draw(messages_of(family))))
    pos = data.draw(st.integers(0, max(0, len(raw) - 4)))
    raw[pos : pos + 4] = struct.pack(">i", data.draw(st.sampled_from(HOSTILE_INTS)))
    decode_or_protocol_error(family, bytes(raw))


@family_params
def test_hostile_lengths_at_every_offset_allocate_nothing_large(family: Any) -> None:
    samples = [family.encode(m) for m in sample_messages(family)]
    tracemalloc.start()
    try:
        for raw in samples:
            for pos in range(len(raw) - 3):
                for hostile in HOSTILE_INTS:
                    mutated = raw[:pos] + struct.pack(">i", hostile) + raw[pos + 4 :]
                    tracemalloc.reset_peak()
                    try:
                        family.decode(mutated)
                    except ProtocolError:
                        pass
                    _, peak = tracemalloc.get_traced_memory()
                    assert peak < 256 * 1024, f"decode of {mutated!r} allocated {peak} bytes"
    finally:
        tracemalloc.stop()


def test_append_request_checksum_mismatch_is_a_checksum_error() -> None:
    q = ReqId(1, 2, 3, 4)
    good = client.AppendRequest(q, 10, (1, 2), (), (), 0, b"payload", crc32(b"payload"))
    assert client.decode(client.encode(good)) == good
    bad = client.AppendRequest(q, 10, (1, 2), (), (), 0, b"payload", crc32(b"payload") ^ 1)
    with pytest.raises(ChecksumError, match="checksum"):
        client.decode(client.encode(bad))
    # corrupted data in transit: same error class (retriable), not a generic protocol error
    raw = bytearray(client.encode(good))
    raw[-5] ^= 0x01  # last data byte (before the 4-byte checksum)
    with pytest.raises(ChecksumError):
        client.decode(bytes(raw))
    assert ChecksumError.retriable


@pytest.mark.parametrize("family", FAMILY_MODULES, ids=FAMILY_IDS)
def test_error_messages_name_the_problem(family: Any) -> None:
    with pytest.raises(ProtocolError, match=r"unknown message type|shorter"):
        family.decode(b"\x7f" + b"\x00" * 30)
    with pytest.raises(ProtocolError):
        family.decode(b"")


def test_hostile_array_count_names_the_field() -> None:
    raw = bytearray(client.encode(client.AppendRequest(ReqId(0, 0, 0, 0), 0, (), (), (), 0, b"", 0)))
    raw[25:29] = struct.pack(">i", 2**31 - 1)  # write-lock count (after type, req id, hwm)
    with pytest.raises(ProtocolError, match="write locks claims 2147483647 elements"):
        client.decode(bytes(raw))


# ------------------------------------------------------------------------------------ hello


@FUZZ
@given(raw=st.binary(max_size=100))
def test_decode_hello_random_bytes(raw: bytes) -> None:
    try:
        hello = decode_hello(raw)
    except ProtocolError:
        return
    assert isinstance(hello, Hello)


@FUZZ
@given(hello=hellos, data=st.data())
def test_decode_hello_truncated_and_flipped(hello: Hello, data: st.DataObject) -> None:
    raw = encode_hello(hello)
    for cut in range(len(raw)):
        with pytest.raises(ProtocolError):
            decode_hello(raw[:cut])
    flipped = bytearray(raw)
    bit = data.draw(st.integers(0, len(raw) * 8 - 1))
    flipped[bit // 8] ^= 1 << (bit % 8)
    try:
        assert isinstance(decode_hello(bytes(flipped)), Hello)
    except ProtocolError:
        pass


def test_decode_hello_rejects_a_non_waltz_peer_with_a_handshake_error() -> None:
    with pytest.raises(HandshakeError, match="does not speak the Waltz protocol"):
        decode_hello(b"GET / HTTP/1.1\r\n")


def test_decode_hello_hostile_role_length() -> None:
    raw = bytearray(encode_hello(Hello(b"L", (1,), "x")))
    raw[5:9] = struct.pack(">i", 2**31 - 1)
    with pytest.raises(ProtocolError, match="role"):
        decode_hello(bytes(raw))


# ---------------------------------------------------------------------------------- framing


@FUZZ
@given(chunks=st.lists(st.binary(max_size=64), max_size=10))
def test_frame_decoder_random_bytes(chunks: list[bytes]) -> None:
    dec = FrameDecoder(max_frame_size=256)
    fed = 0
    try:
        for chunk in chunks:
            fed += len(chunk)
            for frame in dec.feed(chunk):
                assert 0 < len(frame) <= 256
            # never holds more than a frame's prefix + a maximal frame
            assert dec.buffered <= 4 + 256 or dec.buffered <= len(chunk)
    except FrameTooLargeError as exc:
        assert "maximum is 256" in str(exc)


@FUZZ
@given(payloads=st.lists(st.binary(min_size=1, max_size=50), min_size=1, max_size=5), data=st.data())
def test_frame_decoder_truncated_and_flipped_streams(payloads: list[bytes], data: st.DataObject) -> None:
    stream = bytearray(b"".join(encode_frame(p) for p in payloads))
    cut = data.draw(st.integers(0, len(stream)))
    bit = data.draw(st.integers(0, len(stream) * 8 - 1))
    stream[bit // 8] ^= 1 << (bit % 8)
    dec = FrameDecoder(max_frame_size=1024)
    try:
        frames = dec.feed(bytes(stream[:cut]))
    except FrameTooLargeError:
        return
    assert sum(len(f) + 4 for f in frames) + 4 * dec.heartbeats + dec.buffered == cut


def test_frame_decoder_hostile_length_is_rejected_before_buffering() -> None:
    dec = FrameDecoder(max_frame_size=1 << 20)
    with pytest.raises(FrameTooLargeError, match="2147483647"):
        dec.feed(struct.pack(">I", 2**31 - 1))
    dec = FrameDecoder(max_frame_size=1 << 20)
    with pytest.raises(FrameTooLargeError):
        dec.feed(struct.pack(">I", 2**32 - 1))


def test_frame_decoder_does_not_preallocate_an_announced_frame() -> None:
    # A legal but large announced frame: the decoder holds only the bytes that actually arrived.
    dec = FrameDecoder(max_frame_size=2**32 - 1)
    tracemalloc.start()
    try:
        assert dec.feed(struct.pack(">I", 2**31) + b"abc") == []
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert dec.buffered == 7
    assert peak < 64 * 1024


def _all_decoders() -> list[tuple[str, Callable[[bytes], Any]]]:
    return [("client", client.decode), ("storage", storage.decode), ("admin", admin.decode), ("hello", decode_hello),
            ("framer", lambda b: FrameDecoder(1024).feed(b))]


@pytest.mark.parametrize(("name", "decode"), _all_decoders(), ids=[n for n, _ in _all_decoders()])
@settings(max_examples=200, deadline=None)
@given(raw=st.binary(max_size=64))
def test_no_decoder_raises_anything_but_protocol_error(name: str, decode: Callable[[bytes], Any], raw: bytes) -> None:
    try:
        decode(raw)
    except ProtocolError:
        pass
    # any other exception propagates and fails the test


@FUZZ
@given(data=st.data())
def test_append_fast_path_agrees_with_the_checked_decoder(data: st.DataObject) -> None:
    # client.decode takes a fast path for AppendRequest; on any input it must behave exactly like
    # the field-by-field Reader decoder (same message, or the same error class).
    from waltz_core.protocol.wire import Reader

    from .strategies import CLIENT

    raw = bytearray(client.encode(data.draw(CLIENT[client.AppendRequest])))
    mutation = data.draw(st.sampled_from(["none", "truncate", "extend", "int32", "flip"]))
    if mutation == "truncate":
        del raw[data.draw(st.integers(1, len(raw) - 1)) :]
    elif mutation == "extend":
        raw += data.draw(st.binary(min_size=1, max_size=8))
    elif mutation == "int32":
        pos = data.draw(st.integers(1, len(raw) - 4))
        raw[pos : pos + 4] = struct.pack(">i", data.draw(st.sampled_from(HOSTILE_INTS)))
    elif mutation == "flip":
        bit = data.draw(st.integers(8, len(raw) * 8 - 1))
        raw[bit // 8] ^= 1 << (bit % 8)
    outcomes = []
    for decode in (client.decode, lambda b: client._dec_append_checked(Reader(b, 1, "AppendRequest"))):
        try:
            outcomes.append(decode(bytes(raw)))
        except ProtocolError as exc:
            outcomes.append(type(exc))
    assert outcomes[0] == outcomes[1]
