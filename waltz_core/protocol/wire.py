"""Wire primitives shared by every message family: ReqId, records, a bounded reader, CRC-32.

All integers are big-endian. Strings are UTF-8 with an ``int`` byte length; byte arrays are an
``int`` length then the bytes; int arrays are an ``int`` count then the elements. A reader
checks every length against the bytes that are actually left *before* allocating, so a hostile
length prefix costs nothing but a :class:`~waltz_core.errors.ProtocolError`.
"""

from __future__ import annotations

import struct
import uuid
import zlib
from typing import Final

import attrs

from ..errors import ChecksumError, ProtocolError

I8: Final = struct.Struct(">b")
I32: Final = struct.Struct(">i")
U32: Final = struct.Struct(">I")
I64: Final = struct.Struct(">q")
REQ_ID: Final = struct.Struct(">iiii")
UUID: Final = struct.Struct(">16s")
#: transaction id, req id (4 ints), header, data length
RECORD_HEAD: Final = struct.Struct(">qiiiiii")
RECORD_HEADER: Final = struct.Struct(">qiiiii")  # transaction id, req id, header

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def crc32(data: bytes | bytearray | memoryview) -> int:
    """CRC-32 (zlib/IEEE, as java.util.zip.CRC32) as an unsigned 32-bit integer."""
    return zlib.crc32(data)


@attrs.frozen(slots=True)
class ReqId:
    """Request id (seed: client id, generation, partition id, sequence number; 16 bytes on the wire)."""

    client_id: int
    generation: int
    partition_id: int
    seq_num: int

    def encode(self) -> bytes:
        return REQ_ID.pack(self.client_id, self.generation, self.partition_id, self.seq_num)


@attrs.frozen(slots=True)
class RecordHeader:
    """What feeds carry: transaction id, the appending request's id, the 32-bit header."""

    transaction_id: int
    req_id: ReqId
    header: int


@attrs.frozen(slots=True)
class Record:
    """A whole transaction record: header fields plus data and the data's CRC-32."""

    transaction_id: int
    req_id: ReqId
    header: int
    data: bytes
    checksum: int

    def verify(self) -> None:
        if crc32(self.data) != self.checksum:
            raise ChecksumError(f"transaction {self.transaction_id}: data checksum mismatch")


@attrs.frozen(slots=True)
class SessionInfo:
    """A storage partition's last store session (from its control file)."""

    session_id: int
    low_water_mark: int
    local_low_water_mark: int


class Reader:
    """Bounds-checked sequential reader over one frame."""

    __slots__ = ("buf", "pos", "end", "what")

    def __init__(self, buf: bytes | memoryview, pos: int = 0, what: str = "message") -> None:
        self.buf = buf
        self.pos = pos
        self.end = len(buf)
        self.what = what

    def _need(self, n: int, field: str) -> int:
        pos = self.pos
        if n < 0 or pos + n > self.end:
            raise ProtocolError(
                f"{self.what}: truncated at byte {pos} reading {field} (needs {n} bytes, {self.end - pos} left)"
            )
        self.pos = pos + n
        return pos

    def unpack(self, st: struct.Struct, field: str) -> tuple:
        return st.unpack_from(self.buf, self._need(st.size, field))

    def i8(self, field: str) -> int:
        return I8.unpack_from(self.buf, self._need(1, field))[0]

    def bool(self, field: str) -> bool:
        v = self.buf[self._need(1, field)]
        if v > 1:
            raise ProtocolError(f"{self.what}: {field} must be 0 or 1, got {v}")
        return v == 1

    def i32(self, field: str) -> int:
        return I32.unpack_from(self.buf, self._need(4, field))[0]

    def u32(self, field: str) -> int:
        return U32.unpack_from(self.buf, self._need(4, field))[0]

    def i64(self, field: str) -> int:
        return I64.unpack_from(self.buf, self._need(8, field))[0]

    def count(self, field: str, element_size: int) -> int:
        """A non-negative element count whose elements must fit in the bytes left."""
        n = self.i32(field)
        if n < 0:
            raise ProtocolError(f"{self.what}: negative length {n} for {field}")
        if n * element_size > self.end - self.pos:
            raise ProtocolError(
                f"{self.what}: {field} claims {n} elements but only {self.end - self.pos} bytes are left"
            )
        return n

    def blob(self, field: str) -> bytes:
        n = self.count(field, 1)
        pos = self._need(n, field)
        return bytes(self.buf[pos : pos + n])

    def str(self, field: str) -> str:
        raw = self.blob(field)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ProtocolError(f"{self.what}: {field} is not valid UTF-8 ({exc.reason})") from None

    def int_array(self, field: str) -> tuple[int, ...]:
        n = self.count(field, 4)
        pos = self._need(4 * n, field)
        return struct.unpack_from(f">{n}i", self.buf, pos)

    def uuid(self, field: str) -> uuid.UUID:
        return uuid.UUID(bytes=UUID.unpack_from(self.buf, self._need(16, field))[0])

    def req_id(self) -> ReqId:
        return ReqId(*REQ_ID.unpack_from(self.buf, self._need(16, "request id")))

    def record_header(self) -> RecordHeader:
        t, c, g, p, s, h = RECORD_HEADER.unpack_from(self.buf, self._need(RECORD_HEADER.size, "record header"))
        return RecordHeader(t, ReqId(c, g, p, s), h)

    def record(self) -> Record:
        t, c, g, p, s, h, n = RECORD_HEAD.unpack_from(self.buf, self._need(RECORD_HEAD.size, "record"))
        if n < 0 or n + 4 > self.end - self.pos:
            raise ProtocolError(f"{self.what}: record {t} claims {n} data bytes, {self.end - self.pos} left")
        pos = self.pos
        data = bytes(self.buf[pos : pos + n])
        checksum = U32.unpack_from(self.buf, pos + n)[0]
        self.pos = pos + n + 4
        return Record(t, ReqId(c, g, p, s), h, data, checksum)

    def records(self, field: str) -> tuple[Record, ...]:
        # Hot path (storage appends and record lists): same checks as record(), in one loop.
        n = self.count(field, RECORD_HEAD.size + 4)
        buf, end, pos = self.buf, self.end, self.pos
        head, unpack_head, unpack_u32 = RECORD_HEAD.size, RECORD_HEAD.unpack_from, U32.unpack_from
        out = []
        for _ in range(n):
            if pos + head > end:
                self.pos = pos
                self._need(head, "record")  # raises the truncation error
            t, c, g, p, s, h, m = unpack_head(buf, pos)
            pos += head
            if m < 0 or pos + m + 4 > end:
                raise ProtocolError(f"{self.what}: record {t} claims {m} data bytes, {end - pos} left")
            data = bytes(buf[pos : pos + m])
            out.append(Record(t, ReqId(c, g, p, s), h, data, unpack_u32(buf, pos + m)[0]))
            pos += m + 4
        self.pos = pos
        return tuple(out)

    def record_headers(self, field: str) -> tuple[RecordHeader, ...]:
        n = self.count(field, RECORD_HEADER.size)
        return tuple(self.record_header() for _ in range(n))

    def session_info(self) -> SessionInfo:
        return SessionInfo(self.i64("session id"), self.i64("low-water mark"), self.i64("local low-water mark"))

    def done(self) -> None:
        if self.pos != self.end:
            raise ProtocolError(f"{self.what}: {self.end - self.pos} unexpected trailing bytes")


# ----------------------------------------------------------------------------------- writers
# Writers append to a list of byte strings that the caller joins once (no repeated concatenation).


def w_blob(out: list[bytes], data: bytes) -> None:
    out.append(I32.pack(len(data)))
    out.append(data)


def w_str(out: list[bytes], text: str) -> None:
    w_blob(out, text.encode("utf-8"))


#: ``count + elements`` structs for the common small arrays (lock lists), compiled once.
_COUNTED_INTS: Final = tuple(struct.Struct(f">i{n}i") for n in range(17))
_EMPTY_INT_ARRAY: Final = I32.pack(0)


def w_int_array(out: list[bytes], values: tuple[int, ...] | list[int]) -> None:
    n = len(values)
    if n == 0:  # the usual case: a transaction without read or append locks
        out.append(_EMPTY_INT_ARRAY)
    elif n < 17:
        out.append(_COUNTED_INTS[n].pack(n, *values))
    else:
        out.append(struct.pack(f">i{n}i", n, *values))


def w_record(out: list[bytes], r: Record) -> None:
    q = r.req_id
    out.append(RECORD_HEAD.pack(r.transaction_id, q.client_id, q.generation, q.partition_id, q.seq_num, r.header, len(r.data)))
    out.append(r.data)
    out.append(U32.pack(r.checksum))


def w_records(out: list[bytes], records: tuple[Record, ...] | list[Record]) -> None:
    out.append(I32.pack(len(records)))
    for r in records:
        w_record(out, r)


def w_record_header(out: list[bytes], h: RecordHeader) -> None:
    q = h.req_id
    out.append(RECORD_HEADER.pack(h.transaction_id, q.client_id, q.generation, q.partition_id, q.seq_num, h.header))


def w_session_info(out: list[bytes], s: SessionInfo) -> None:
    out.append(struct.pack(">qqq", s.session_id, s.low_water_mark, s.local_low_water_mark))


def check_range(value: int, lo: int, hi: int, field: str) -> None:
    if not lo <= value <= hi:
        raise ProtocolError(f"{field} {value} out of range [{lo}, {hi}]")
