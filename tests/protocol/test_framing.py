"""Length-prefixed framing: reassembly across arbitrary splits, heartbeats, size limits."""

from __future__ import annotations

import itertools
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from waltz_core.errors import FrameTooLargeError, ProtocolError
from waltz_core.protocol.framing import HEARTBEAT, FrameDecoder, encode_frame, encode_frames

payloads = st.lists(st.binary(min_size=1, max_size=200), max_size=12)


@st.composite
def streams(draw: st.DrawFn) -> tuple[list[bytes], int, bytes]:
    """Frames interleaved with heartbeats: (payloads, heartbeat count, stream bytes)."""
    frames = draw(payloads)
    parts: list[bytes] = []
    beats = 0
    for p in frames:
        n = draw(st.integers(0, 2))
        beats += n
        parts += [HEARTBEAT] * n
        parts.append(encode_frame(p))
    trailing = draw(st.integers(0, 2))
    parts += [HEARTBEAT] * trailing
    return frames, beats + trailing, b"".join(parts)


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    bounds = [0, *points, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


@settings(max_examples=300, deadline=None)
@given(stream=streams(), cuts=st.lists(st.integers(0, 10_000), max_size=20))
def test_frames_split_anywhere_reassemble_exactly(stream: tuple[list[bytes], int, bytes], cuts: list[int]) -> None:
    frames, beats, raw = stream
    dec = FrameDecoder(max_frame_size=200)
    got: list[bytes] = []
    for chunk in split_at(raw, cuts):
        got += dec.feed(chunk)
    assert got == frames
    assert dec.heartbeats == beats
    assert dec.buffered == 0


@given(stream=streams())
def test_byte_by_byte_feeding(stream: tuple[list[bytes], int, bytes]) -> None:
    frames, beats, raw = stream
    dec = FrameDecoder(max_frame_size=200)
    got: list[bytes] = []
    for i in range(len(raw)):
        got += dec.feed(memoryview(raw)[i : i + 1])
    assert got == frames
    assert dec.heartbeats == beats


def test_incomplete_frame_is_held_until_complete() -> None:
    dec = FrameDecoder()
    raw = encode_frame(b"hello world")
    assert dec.feed(raw[:7]) == []
    assert dec.buffered == 7
    assert dec.feed(raw[7:] + raw[:2]) == [b"hello world"]
    assert dec.buffered == 2


def test_heartbeats_only() -> None:
    dec = FrameDecoder()
    assert dec.feed(HEARTBEAT * 3 + HEARTBEAT[:2]) == []
    assert dec.heartbeats == 3
    assert dec.feed(HEARTBEAT[2:]) == []
    assert dec.heartbeats == 4


def test_length_above_max_raises_as_soon_as_the_prefix_arrives() -> None:
    dec = FrameDecoder(max_frame_size=100)
    assert dec.feed(encode_frame(b"x" * 100)) == [b"x" * 100]  # exactly the maximum is fine
    assert dec.feed(struct.pack(">I", 101)[:3]) == []  # prefix incomplete: nothing to judge yet
    with pytest.raises(FrameTooLargeError, match="101 bytes; the maximum is 100"):
        dec.feed(struct.pack(">I", 101)[3:])  # no payload byte needed


def test_encode_frame_limits() -> None:
    with pytest.raises(FrameTooLargeError, match="exceeds the maximum of 10"):
        encode_frame(b"x" * 11, max_frame_size=10)
    with pytest.raises(ProtocolError, match="heartbeat"):
        encode_frame(b"")
    with pytest.raises(FrameTooLargeError):
        encode_frames([b"ok", b"x" * 11], max_frame_size=10)
    with pytest.raises(ProtocolError):
        encode_frames([b"ok", b""])


@given(payloads)
def test_encode_frames_is_the_concatenation_of_frames(ps: list[bytes]) -> None:
    assert encode_frames(ps) == b"".join(encode_frame(p) for p in ps)
    assert FrameDecoder().feed(encode_frames(ps)) == ps
