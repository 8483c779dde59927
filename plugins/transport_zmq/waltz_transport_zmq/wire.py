"""Control messages of the ``zmq`` transport (sans-IO: structs and parsing only).

Every ZeroMQ message between a DEALER (client) and the ROUTER (listener) is multipart:
part 0 is a header whose first byte is the message kind; DATA messages carry the payload
frames, unchanged, as parts 1..n (so a payload is never copied to add a prefix, and a
``send_many`` batch travels as one atomic ZeroMQ message). Integers are big-endian.

====== ==== ===================================  =============================================
kind   byte header layout                         meaning
====== ==== ===================================  =============================================
HELLO  0x01 kind u8, version u8, u32, u64         client opens; the window it grants (frames, bytes)
WELCOME 0x02 same as HELLO                        listener accepts; the window it grants
DATA   0x03 kind u8, u64 seq + parts 1..n         frames; seq = frames sent before on this link
ACK    0x04 kind u8, u64 frames, u64 bytes        cumulative frames/bytes the application consumed
PROBE  0x05 kind u8                               sender is out of credit: answer with an ACK
PING   0x06 kind u8                               heartbeat (sent when idle)
CLOSE  0x07 kind u8, u8 reason                    no more DATA from me; answer with CLOSE_ACK
CLOSE_ACK 0x08 kind u8                            I received everything up to your CLOSE
====== ==== ===================================  =============================================

Any other header is a protocol error that closes that link only.
"""

from __future__ import annotations

import enum
import struct

from waltz_core.errors import ProtocolError

VERSION = 1

HELLO = 0x01
WELCOME = 0x02
DATA = 0x03
ACK = 0x04
PROBE = 0x05
PING = 0x06
CLOSE = 0x07
CLOSE_ACK = 0x08

_OPEN = struct.Struct(">BBIQ")
_DATA = struct.Struct(">BQ")
_ACK = struct.Struct(">BQQ")
_CLOSE = struct.Struct(">BB")

PROBE_MSG = bytes([PROBE])
PING_MSG = bytes([PING])
CLOSE_ACK_MSG = bytes([CLOSE_ACK])


class CloseReason(enum.IntEnum):
    """Why a side sent CLOSE (shown in the peer's ConnectionClosedError)."""

    NORMAL = 0
    FRAME_TOO_LARGE = 1
    PROTOCOL_ERROR = 2
    UNKNOWN_CONNECTION = 3
    TIMEOUT = 4
    LISTENER_CLOSED = 5

    def describe(self) -> str:
        return self.name.lower().replace("_", " ")


def encode_open(kind: int, window_frames: int, window_bytes: int) -> bytes:
    return _OPEN.pack(kind, VERSION, window_frames, window_bytes)


def decode_open(header: bytes) -> tuple[int, int]:
    """HELLO/WELCOME header -> (window_frames, window_bytes) the sender grants."""
    if len(header) != _OPEN.size:
        raise ProtocolError(f"malformed open message of {len(header)} bytes")
    _, version, frames, nbytes = _OPEN.unpack(header)
    if version != VERSION:
        raise ProtocolError(f"unsupported zmq transport version {version} (this side speaks {VERSION})")
    if frames < 1 or nbytes < 1:
        raise ProtocolError("peer granted an empty window")
    return frames, nbytes


def encode_data(seq: int) -> bytes:
    return _DATA.pack(DATA, seq)


def decode_data(header: bytes) -> int:
    if len(header) != _DATA.size:
        raise ProtocolError(f"malformed DATA header of {len(header)} bytes")
    value: int = _DATA.unpack(header)[1]
    return value


def encode_ack(frames: int, nbytes: int) -> bytes:
    return _ACK.pack(ACK, frames, nbytes)


def decode_ack(header: bytes) -> tuple[int, int]:
    if len(header) != _ACK.size:
        raise ProtocolError(f"malformed ACK of {len(header)} bytes")
    _, frames, nbytes = _ACK.unpack(header)
    return frames, nbytes


def encode_close(reason: CloseReason) -> bytes:
    return _CLOSE.pack(CLOSE, reason)


def decode_close(header: bytes) -> CloseReason:
    if len(header) != _CLOSE.size:
        raise ProtocolError(f"malformed CLOSE of {len(header)} bytes")
    try:
        return CloseReason(header[1])
    except ValueError:
        return CloseReason.PROTOCOL_ERROR
