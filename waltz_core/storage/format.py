"""On-disk structures of the ``segmented`` layout (Waltz design, "On Disk Data Structures"), sans-IO.

Pure encode/decode of the byte formats; the layout (:mod:`.segmented`) and the offline disk
tools both use these, so what the node writes is exactly what the tools read. Big-endian.

Control file ``waltz-storage.ctl``::

    header (128 B): int version, long creation time (ms), UUID cluster key, int number of
                    partitions, int CRC-32 of the preceding 32 bytes, reserved
    body: per partition 76 B: int partition id + 2 x partition-info struct (36 B):
          long session id, long low-water mark, long local low-water mark, int flags,
          int sequence number, int CRC-32 of the preceding 32 bytes

Segment data file ``<first txn id %019d>.seq`` and index file ``.idx``::

    header (128 B): int version, long creation time (ms), UUID cluster key, int partition id,
                    long first transaction id, int CRC-32 of the preceding 40 bytes,
                    [index only] long checkpointed entry count, int CRC-32 of that long, reserved
    data body: records: long txn id, ReqId (4 ints), int header, int data length,
               int data checksum (the client's CRC-32 of data), data,
               int record checksum = CRC-32(36-byte record head + data)
    index body: long record offset per transaction (slot = txn id - first txn id)

The record layout is :data:`waltz_core.protocol.wire.STORED_RECORD_HEAD`: storage appends carry
records in it (:class:`~waltz_core.protocol.wire.RecordBatch`), so a node writes them unchanged.

The header CRCs and the index checkpoint count live in the original format's "reserved" bytes.
"""

from __future__ import annotations

import struct
import uuid
from typing import Final

import attrs

from ..protocol.checksum import crc32 as crc32  # the fastest implementation installed (re-exported)
from ..protocol.wire import STORED_RECORD_HEAD, STORED_RECORD_OVERHEAD

FORMAT_VERSION: Final = 1
HEADER_SIZE: Final = 128
CONTROL_FILE_NAME: Final = "waltz-storage.ctl"
DATA_SUFFIX: Final = ".seq"
INDEX_SUFFIX: Final = ".idx"

# ----------------------------------------------------------------------------- control file
CONTROL_HEADER: Final = struct.Struct(">iq16si")  # 32 bytes, then CRC
U32: Final = struct.Struct(">I")
INFO_BODY: Final = struct.Struct(">qqqii")  # 32 bytes, then CRC
INFO_SIZE: Final = INFO_BODY.size + 4  # 36
PARTITION_ENTRY_SIZE: Final = 4 + 2 * INFO_SIZE  # 76
I32: Final = struct.Struct(">i")

FLAG_AVAILABLE: Final = 1  #: original PartitionInfo.Flags.PARTITION_IS_AVAILABLE
FLAG_ASSIGNED: Final = 4  #: original PartitionInfo.Flags.PARTITION_IS_ASSIGNED

# --------------------------------------------------------------------------------- segments
SEGMENT_HEADER: Final = struct.Struct(">iq16siq")  # 40 bytes, then CRC at 40
CHECKPOINT: Final = struct.Struct(">qI")  # index header at offset 48: checkpointed count, CRC
CHECKPOINT_OFFSET: Final = 48
#: txn id, ReqId(client, generation, partition, seq), header, data length, data checksum
RECORD_HEAD: Final = STORED_RECORD_HEAD
RECORD_OVERHEAD: Final = STORED_RECORD_OVERHEAD  # 36-byte head + 4-byte record checksum
INDEX_ENTRY: Final = struct.Struct(">q")
_TXN_AND_LENGTH: Final = struct.Struct(">q20xi")  # txn id and data length out of a record head



def segment_name(first_transaction_id: int) -> str:
    return f"{first_transaction_id:019d}"


def parse_segment_name(name: str) -> int | None:
    """First transaction id from ``0000000000000000042.seq``; None for other files."""
    stem, dot, suffix = name.partition(".")
    if dot and "." + suffix == DATA_SUFFIX and len(stem) == 19 and stem.isdigit():
        return int(stem)
    return None


# ------------------------------------------------------------------------------- data types


@attrs.frozen(slots=True)
class ControlHeader:
    version: int
    creation_time: int  #: milliseconds since the epoch
    cluster_key: uuid.UUID
    num_partitions: int


@attrs.frozen(slots=True)
class PartitionInfo:
    """One partition-info struct of the control file."""

    session_id: int = -1
    low_water_mark: int = -1
    local_low_water_mark: int = -1
    flags: int = 0
    sequence_number: int = 0

    @property
    def assigned(self) -> bool:
        return bool(self.flags & FLAG_ASSIGNED)

    @property
    def available(self) -> bool:
        return bool(self.flags & FLAG_AVAILABLE)


@attrs.frozen(slots=True)
class SegmentHeader:
    version: int
    creation_time: int
    cluster_key: uuid.UUID
    partition_id: int
    first_transaction_id: int


# ---------------------------------------------------------------------------- encode/decode


def encode_control_header(h: ControlHeader) -> bytes:
    body = CONTROL_HEADER.pack(h.version, h.creation_time, h.cluster_key.bytes, h.num_partitions)
    return (body + U32.pack(crc32(body))).ljust(HEADER_SIZE, b"\0")


def decode_control_header(buf: bytes) -> ControlHeader | None:
    """The header, or None if it is short or fails its checksum."""
    if len(buf) < HEADER_SIZE:
        return None
    n = CONTROL_HEADER.size
    if crc32(buf[:n]) != U32.unpack_from(buf, n)[0]:
        return None
    version, ctime, key, num = CONTROL_HEADER.unpack_from(buf, 0)
    return ControlHeader(version, ctime, uuid.UUID(bytes=key), num)


def encode_partition_info(info: PartitionInfo) -> bytes:
    body = INFO_BODY.pack(info.session_id, info.low_water_mark, info.local_low_water_mark, info.flags,
                          info.sequence_number)
    return body + U32.pack(crc32(body))


def decode_partition_info(buf: bytes | memoryview, offset: int = 0) -> PartitionInfo | None:
    """A partition-info struct, or None if it fails its checksum (torn or corrupt)."""
    if len(buf) < offset + INFO_SIZE:
        return None
    body = bytes(buf[offset : offset + INFO_BODY.size])
    if crc32(body) != U32.unpack_from(buf, offset + INFO_BODY.size)[0]:
        return None
    return PartitionInfo(*INFO_BODY.unpack(body))


def partition_entry_offset(partition_id: int) -> int:
    return HEADER_SIZE + partition_id * PARTITION_ENTRY_SIZE


def encode_segment_header(h: SegmentHeader, checkpoint: int | None = None) -> bytes:
    body = SEGMENT_HEADER.pack(h.version, h.creation_time, h.cluster_key.bytes, h.partition_id, h.first_transaction_id)
    out = body + U32.pack(crc32(body))
    out = out.ljust(CHECKPOINT_OFFSET, b"\0")
    if checkpoint is not None:
        out += encode_checkpoint(checkpoint)
    return out.ljust(HEADER_SIZE, b"\0")


def decode_segment_header(buf: bytes | memoryview) -> SegmentHeader | None:
    if len(buf) < HEADER_SIZE:
        return None
    n = SEGMENT_HEADER.size
    if crc32(buf[:n]) != U32.unpack_from(buf, n)[0]:
        return None
    version, ctime, key, pid, first = SEGMENT_HEADER.unpack_from(buf, 0)
    return SegmentHeader(version, ctime, uuid.UUID(bytes=bytes(key)), pid, first)


def encode_checkpoint(count: int) -> bytes:
    return CHECKPOINT.pack(count, crc32(INDEX_ENTRY.pack(count)))


def decode_checkpoint(buf: bytes | memoryview) -> int:
    """Entries of the index known durable (0 when the field is torn or was never written)."""
    if len(buf) < CHECKPOINT_OFFSET + CHECKPOINT.size:
        return 0
    count, crc = CHECKPOINT.unpack_from(buf, CHECKPOINT_OFFSET)
    if count < 0 or crc != crc32(INDEX_ENTRY.pack(count)):
        return 0
    return int(count)


# ------------------------------------------------------------------------------ record scan


@attrs.frozen(slots=True)
class ScanResult:
    """What :func:`scan_records` found: offsets of valid records and where validity ended."""

    offsets: list[int]
    end: int  #: byte offset just past the last valid record
    error: str | None  #: why scanning stopped before the end of the buffer, None if it reached it


def scan_records(buf: bytes | memoryview, pos: int, end: int, first_transaction_id: int,
                 limit: int | None = None) -> ScanResult:
    """Validate consecutive records in ``buf[pos:end]`` starting with ``first_transaction_id``.

    Stops at the first record that is short, out of sequence or fails its record checksum (a
    torn tail or corruption), or after ``limit`` records. Pure: the caller owns the buffer.
    """
    offsets: list[int] = []
    append = offsets.append
    unpack = _TXN_AND_LENGTH.unpack_from  # only the fields the scan needs: one unpack per record
    unpack_crc = U32.unpack_from
    crc = crc32
    head_size = RECORD_HEAD.size
    overhead = RECORD_OVERHEAD
    expected = first_transaction_id
    max_count = -1 if limit is None else limit
    error: str | None = None
    while pos < end:
        if len(offsets) == max_count:
            break
        if end - pos < overhead:
            error = f"{end - pos} bytes at offset {pos} are too short for a record (torn write)"
            break
        txn, length = unpack(buf, pos)
        if txn != expected:
            error = f"record at offset {pos} has transaction id {txn}, expected {expected}"
            break
        body_end = pos + head_size + length
        if length < 0 or body_end + 4 > end:
            error = f"record {txn} at offset {pos} claims {length} data bytes past the end of the file (torn write)"
            break
        if crc(buf[pos:body_end]) != unpack_crc(buf, body_end)[0]:
            error = f"record {txn} at offset {pos} fails its record checksum"
            break
        append(pos)
        pos = body_end + 4
        expected += 1
    return ScanResult(offsets, pos, error)
