"""Length-prefixed framing for byte-stream transports (sans-IO).

A frame is ``uint32 length`` followed by ``length`` payload bytes. A zero length is a
keep-alive/heartbeat and carries no payload; :class:`FrameDecoder` drops it and counts it. The
decoder never buffers more than one maximal frame plus what one ``feed`` call brought, and
rejects a length above ``max_frame_size`` as soon as the 4-byte prefix arrives.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Final

from ..errors import FrameTooLargeError, ProtocolError

LENGTH: Final = struct.Struct(">I")
HEARTBEAT: Final = LENGTH.pack(0)
DEFAULT_MAX_FRAME_SIZE: Final = 16 * 1024 * 1024
#: the smallest ``transport.max_frame_size`` a process may have (and a peer may announce)
MIN_MAX_FRAME_SIZE: Final = 1024


def encode_frame(payload: bytes, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> bytes:
    n = len(payload)
    if n == 0:
        raise ProtocolError("empty frames are reserved for heartbeats")
    if n > max_frame_size:
        raise FrameTooLargeError(f"frame of {n} bytes exceeds the maximum of {max_frame_size}")
    return LENGTH.pack(n) + payload


def encode_frames(payloads: Iterable[bytes], max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> bytes:
    """Many frames in one buffer: one write (one syscall) for a whole batch."""
    out: list[bytes] = []
    pack = LENGTH.pack
    for p in payloads:
        n = len(p)
        if n == 0 or n > max_frame_size:
            encode_frame(p, max_frame_size)  # raises the precise error
        out.append(pack(n))
        out.append(p)
    return b"".join(out)


class FrameDecoder:
    """Bytes in, complete frame payloads out."""

    __slots__ = ("_buf", "_max", "heartbeats", "_error")

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        self._buf = bytearray()
        self._max = max_frame_size
        self.heartbeats = 0
        self._error: FrameTooLargeError | None = None

    @property
    def buffered(self) -> int:
        return len(self._buf)

    @property
    def error(self) -> FrameTooLargeError | None:
        """The error a ``feed`` found after returning the frames before it; the stream cannot go on.

        Check it after every ``feed`` that returned frames: the peer may send nothing more, so
        waiting for the next ``feed`` to raise it would keep a bad connection open forever.
        """
        return self._error

    def feed(self, data: bytes | bytearray | memoryview) -> list[bytes]:
        """Add received bytes; return every frame they complete (possibly none).

        Frames complete before an oversize length prefix are returned first; the
        :class:`FrameTooLargeError` is raised by the next call (the stream cannot continue).
        """
        if self._error is not None:
            raise self._error
        buf = self._buf
        pending = bool(buf)
        if pending:
            buf += data
            view = memoryview(buf)
        else:  # the usual case: parse the caller's bytes in place, keep only an incomplete tail
            view = memoryview(data)
        frames: list[bytes] = []
        pos = 0
        end = len(view)
        unpack = LENGTH.unpack_from
        limit = self._max
        with view:  # released before the buffer is resized below
            while end - pos >= 4:
                (n,) = unpack(view, pos)
                if n > limit:
                    self._error = FrameTooLargeError(f"peer announced a frame of {n} bytes; the maximum is {limit} "
                                                     "(transport.max_frame_size)")
                    if not frames:
                        raise self._error
                    break
                if n == 0:
                    self.heartbeats += 1
                    pos += 4
                    continue
                start = pos + 4
                if end - start < n:
                    break
                frames.append(view[start : start + n].tobytes())  # one copy, out of a buffer that is reused
                pos = start + n
            if not pending and pos < end:
                buf += view[pos:]
        if pending and pos:
            del buf[:pos]
        return frames
