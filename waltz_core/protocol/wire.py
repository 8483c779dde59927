"""Wire primitives shared by every message family: ReqId, records, a bounded reader, CRC-32.

All integers are big-endian. Strings are UTF-8 with an ``int`` byte length; byte arrays are an
``int`` length then the bytes; int arrays are an ``int`` count then the elements. A reader
checks every length against the bytes that are actually left *before* allocating, so a hostile
length prefix costs nothing but a :class:`~waltz_core.errors.ProtocolError`.
"""

from __future__ import annotations

import builtins
import struct
import uuid
from array import array
from collections.abc import Iterable, Iterator, Sequence
from itertools import islice
from typing import Any, Final, overload

import attrs

from ..errors import ChecksumError, ProtocolError
from .checksum import crc32 as crc32  # the fastest implementation installed (re-exported)

I8: Final = struct.Struct(">b")
I32: Final = struct.Struct(">i")
U32: Final = struct.Struct(">I")
I64: Final = struct.Struct(">q")
REQ_ID: Final = struct.Struct(">iiii")
UUID: Final = struct.Struct(">16s")
#: transaction id, req id (4 ints), header, data length
RECORD_HEAD: Final = struct.Struct(">qiiiiii")
RECORD_HEADER: Final = struct.Struct(">qiiiii")  # transaction id, req id, header
#: The stored record layout (what the segmented layout keeps on disk, see storage/format.py):
#: transaction id, req id (4 ints), header, data length, data checksum; then the data; then the
#: record checksum = CRC-32 of the 36-byte head and the data.
STORED_RECORD_HEAD: Final = struct.Struct(">qiiiiiiI")
STORED_RECORD_OVERHEAD: Final = STORED_RECORD_HEAD.size + 4
#: record count, first transaction id, byte length: the head of a record batch on the wire
RECORD_BATCH_HEAD: Final = struct.Struct(">iqi")
_STORED_TXN_LENGTH_CRC: Final = struct.Struct(">q20xiI")  # transaction id, data length, data checksum

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1



@attrs.frozen(slots=True)
class ReqId:
    """Request id (client id, generation, partition id, sequence number; 16 bytes on the wire)."""

    client_id: int
    generation: int
    partition_id: int
    seq_num: int

    def encode(self) -> bytes:
        return REQ_ID.pack(self.client_id, self.generation, self.partition_id, self.seq_num)


# A frozen attrs class's __init__ sets each field through object.__setattr__; the slot
# descriptors' own __set__ does the same in a third less time (ReqId: 337 -> 209 ns, timed
# alone). Only for the decoders that make one object per transaction; tests keep them equal to
# the attrs constructor.
_new_object = object.__new__
_set_client_id, _set_generation, _set_partition_id, _set_seq_num = (
    getattr(ReqId, a.name).__set__ for a in attrs.fields(ReqId))


def fast_req_id(client_id: int, generation: int, partition_id: int, seq_num: int) -> ReqId:
    """``ReqId(client_id, generation, partition_id, seq_num)``, made faster (see above)."""
    q: ReqId = _new_object(ReqId)
    _set_client_id(q, client_id)
    _set_generation(q, generation)
    _set_partition_id(q, partition_id)
    _set_seq_num(q, seq_num)
    return q


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


def encode_stored_record(transaction_id: int, req_id: ReqId, header: int, data: bytes, checksum: int) -> bytes:
    """One record in the stored layout, record checksum included (the server encodes each record once)."""
    try:
        head = STORED_RECORD_HEAD.pack(transaction_id, req_id.client_id, req_id.generation, req_id.partition_id,
                                       req_id.seq_num, header, len(data), checksum)
    except struct.error as exc:
        raise ProtocolError(f"cannot encode record {transaction_id}: {exc}") from None
    return b"".join((head, data, U32.pack(crc32(data, crc32(head)))))


def _walk_batch(buf: bytes | memoryview, count: int, first_transaction_id: int, offsets: array[int], base: int,
                verify: bool) -> None:
    """Append ``base + offset`` of each record of ``buf`` to ``offsets``; ProtocolError if malformed.

    Checks bounds, lengths, transaction ids ``first, first + 1, ...`` and that exactly ``count``
    records fill ``buf``; with ``verify`` also each record checksum and data checksum. One pass,
    no per-record objects: this is the storage node's whole per-record cost of an append.
    """
    buf = memoryview(buf)  # record slices below are views, never copies
    end = len(buf)
    pos = 0
    unpack = _STORED_TXN_LENGTH_CRC.unpack_from
    unpack_u32 = U32.unpack_from
    crc = crc32
    add = offsets.append
    head = STORED_RECORD_HEAD.size
    overhead = STORED_RECORD_OVERHEAD
    expected = first_transaction_id
    for i in range(count):
        if end - pos < overhead:
            raise ProtocolError(f"record batch: record {i} of {count} is truncated: {end - pos} bytes left at byte {pos}")
        txn, length, data_checksum = unpack(buf, pos)
        if txn != expected:
            raise ProtocolError(f"record batch: record {i} has transaction id {txn}, expected {expected} "
                                f"(ids are contiguous from {first_transaction_id})")
        data_end = pos + head + length
        if length < 0 or data_end + 4 > end:
            raise ProtocolError(f"record batch: record {txn} claims {length} data bytes, {end - pos - overhead} left")
        if verify:
            if crc(buf[pos:data_end]) != unpack_u32(buf, data_end)[0]:
                raise ProtocolError(f"record batch: record {txn} fails its record checksum (corrupted in transit)")
            if crc(buf[pos + head : data_end]) != data_checksum:
                raise ChecksumError(f"transaction {txn}: data checksum does not match its data")
        add(base + pos)
        pos = data_end + 4
        expected += 1
    if pos != end:
        raise ProtocolError(f"record batch: {end - pos} bytes after its {count} records")


class RecordBatch(Sequence[Record]):
    """Consecutive records in the stored layout, as one buffer: what storage appends and record lists carry.

    The server encodes each record once (:func:`encode_stored_record`) and sends the same bytes
    to every replica; the storage node checks them with :meth:`validate_into` and writes them as
    they are. As a sequence it decodes :class:`Record` objects on demand, for the slow paths
    (recovery, catch-up, tools, tests); compared with a list or tuple it compares its records.
    """

    __slots__ = ("data", "first_transaction_id", "_count", "_offsets")

    def __init__(self, data: bytes | memoryview, count: int, first_transaction_id: int,
                 offsets: array[int] | None = None) -> None:
        self.data = data
        self.first_transaction_id = first_transaction_id
        self._count = count
        self._offsets = offsets  #: record starts in ``data``; None until needed

    @classmethod
    def from_records(cls, records: Iterable[Record]) -> RecordBatch:
        """Encode records (ids are taken as they are: a storage node refuses gaps)."""
        parts: list[bytes] = []
        offsets = array("q")
        pos = 0
        first = 0
        for r in records:
            if not parts:
                first = r.transaction_id
            encoded = encode_stored_record(r.transaction_id, r.req_id, r.header, r.data, r.checksum)
            offsets.append(pos)
            parts.append(encoded)
            pos += len(encoded)
        return cls(b"".join(parts), len(parts), first, offsets)

    @classmethod
    def of(cls, records: RecordBatch | Iterable[Record]) -> RecordBatch:
        """``records`` itself if it is a batch, else its records encoded."""
        return records if isinstance(records, RecordBatch) else cls.from_records(records)

    @property
    def last_transaction_id(self) -> int:
        return self.first_transaction_id + self._count - 1

    @property
    def nbytes(self) -> int:
        return len(self.data)

    @property
    def offsets(self) -> array[int]:
        """Start of each record in :attr:`data` (bounds and ids checked once; ProtocolError if malformed)."""
        offsets = self._offsets
        if offsets is None:
            offsets = array("q")
            _walk_batch(self.data, self._count, self.first_transaction_id, offsets, 0, False)
            self._offsets = offsets
        return offsets

    def validate_into(self, offsets: array[int], base: int = 0) -> None:
        """Check every record (bounds, contiguous ids, record and data checksums) and append
        ``base + offset`` of each to ``offsets``; nothing is appended if any check fails.

        ProtocolError for malformed or corrupted bytes, ChecksumError (a ProtocolError) when a
        record's data does not match the data checksum it carries.
        """
        mark = len(offsets)
        try:
            _walk_batch(self.data, self._count, self.first_transaction_id, offsets, base, True)
        except BaseException:
            del offsets[mark:]
            raise

    def _record_at(self, offset: int) -> Record:
        t, c, g, p, s, h, n, checksum = STORED_RECORD_HEAD.unpack_from(self.data, offset)
        start = offset + STORED_RECORD_HEAD.size
        return Record(t, ReqId(c, g, p, s), h, bytes(self.data[start : start + n]), checksum)

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[Record]:
        record_at = self._record_at
        for offset in self.offsets:
            yield record_at(offset)

    @overload
    def __getitem__(self, index: int) -> Record: ...

    @overload
    def __getitem__(self, index: slice) -> RecordBatch: ...

    def __getitem__(self, index: int | slice) -> Record | RecordBatch:
        offsets = self.offsets
        n = self._count
        if isinstance(index, slice):
            start, stop, step = index.indices(n)
            if step != 1:
                raise ValueError("a record batch slices with step 1 only")
            if stop <= start:
                return RecordBatch(b"", 0, self.first_transaction_id + start)
            lo = offsets[start]
            hi = offsets[stop] if stop < n else len(self.data)
            return RecordBatch(memoryview(self.data)[lo:hi], stop - start, self.first_transaction_id + start,
                               array("q", [o - lo for o in islice(offsets, start, stop)]))
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"record {index} of a batch of {n}")
        return self._record_at(offsets[index])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RecordBatch):
            return (self._count == other._count and self.first_transaction_id == other.first_transaction_id
                    and self.data == other.data)
        if isinstance(other, (list, tuple)):
            return len(other) == self._count and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.first_transaction_id, self._count, bytes(self.data)))

    def __repr__(self) -> str:
        return f"RecordBatch({self._count} records from {self.first_transaction_id}, {len(self.data)} bytes)"


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

    def take(self, n: int, field: str) -> int:
        """Skip ``n`` bytes (ProtocolError if fewer are left); return where they start."""
        return self._need(n, field)

    def unpack(self, st: struct.Struct, field: str) -> tuple[Any, ...]:
        return st.unpack_from(self.buf, self._need(st.size, field))

    def i8(self, field: str) -> int:
        v: int = I8.unpack_from(self.buf, self._need(1, field))[0]
        return v

    def bool(self, field: str) -> bool:
        v = self.buf[self._need(1, field)]
        if v > 1:
            raise ProtocolError(f"{self.what}: {field} must be 0 or 1, got {v}")
        return v == 1

    def i32(self, field: str) -> int:
        v: int = I32.unpack_from(self.buf, self._need(4, field))[0]
        return v

    def u32(self, field: str) -> int:
        v: int = U32.unpack_from(self.buf, self._need(4, field))[0]
        return v

    def i64(self, field: str) -> int:
        v: int = I64.unpack_from(self.buf, self._need(8, field))[0]
        return v

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

    def int_array(self, field: builtins.str) -> tuple[int, ...]:
        n = self.count(field, 4)
        pos = self._need(4 * n, field)
        return struct.unpack_from(f">{n}i", self.buf, pos)

    def uuid(self, field: builtins.str) -> uuid.UUID:
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

    def records(self, field: builtins.str) -> tuple[Record, ...]:
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

    def record_batch(self, field: builtins.str) -> RecordBatch:
        """A record batch; only its head is checked here (O(1)): the bytes are a view, walked later."""
        count, first, nbytes = self.unpack(RECORD_BATCH_HEAD, field)
        if count < 0 or nbytes < 0:
            raise ProtocolError(f"{self.what}: {field} has a negative count ({count}) or length ({nbytes})")
        if count * STORED_RECORD_OVERHEAD > nbytes or (count == 0 and nbytes):
            raise ProtocolError(f"{self.what}: {field} claims {count} records in {nbytes} bytes")
        pos = self._need(nbytes, field)
        return RecordBatch(memoryview(self.buf)[pos : pos + nbytes], count, first)

    def record_headers(self, field: builtins.str) -> tuple[RecordHeader, ...]:
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


def w_record_batch(out: list[bytes], batch: RecordBatch) -> None:
    out.append(RECORD_BATCH_HEAD.pack(len(batch), batch.first_transaction_id, batch.nbytes))
    out.append(batch.data)  # type: ignore[arg-type]  # joined with the rest: any bytes-like object


def w_record_header(out: list[bytes], h: RecordHeader) -> None:
    q = h.req_id
    out.append(RECORD_HEADER.pack(h.transaction_id, q.client_id, q.generation, q.partition_id, q.seq_num, h.header))


def w_session_info(out: list[bytes], s: SessionInfo) -> None:
    out.append(struct.pack(">qqq", s.session_id, s.low_water_mark, s.local_low_water_mark))


def check_range(value: int, lo: int, hi: int, field: str) -> None:
    if not lo <= value <= hi:
        raise ProtocolError(f"{field} {value} out of range [{lo}, {hi}]")
