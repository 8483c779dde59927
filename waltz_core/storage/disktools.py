"""Offline inspection of storage files (``waltz disk ...``): pure functions returning data.

They read files directly, never write them, and work on a stopped node's directory (or on
copies). The command line (:mod:`.cli`) renders the results as tables.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import attrs

from ..errors import ConfigError
from .format import (
    CONTROL_FILE_NAME,
    DATA_SUFFIX,
    HEADER_SIZE,
    INDEX_SUFFIX,
    INFO_SIZE,
    RECORD_HEAD,
    RECORD_OVERHEAD,
    U32,
    ControlHeader,
    PartitionInfo,
    SegmentHeader,
    crc32,
    decode_checkpoint,
    decode_control_header,
    decode_partition_info,
    decode_segment_header,
    partition_entry_offset,
)
from .segmented import REPAIR_LOG_NAME, _offsets_from_bytes


@attrs.frozen
class RecordInfo:
    transaction_id: int
    offset: int
    client_id: int
    generation: int
    partition_id: int
    seq_num: int
    header: int
    length: int
    data_checksum_ok: bool
    record_checksum_ok: bool
    data: bytes


@attrs.frozen
class SegmentReport:
    path: str
    header: SegmentHeader | None
    records: list[RecordInfo]
    failures: list[str]  #: every problem found, in file order
    index_entries: int
    index_checkpoint: int
    trailing_bytes: int  #: bytes after the last readable record


def _data_path(path: str | Path) -> Path:
    p = Path(path)
    if p.suffix == INDEX_SUFFIX:
        p = p.with_suffix(DATA_SUFFIX)
    if p.suffix != DATA_SUFFIX:
        raise ConfigError(f"{path}: not a segment file (expected a {DATA_SUFFIX} or {INDEX_SUFFIX} file)")
    if not p.exists():
        raise ConfigError(f"{p}: no such segment file")
    return p


def read_segment(path: str | Path) -> SegmentReport:
    """Parse a segment's data and index files, checking every checksum and index entry."""
    data_path = _data_path(path)
    raw = data_path.read_bytes()
    failures: list[str] = []
    header = decode_segment_header(raw[:HEADER_SIZE])
    if header is None:
        failures.append(f"data file header (first {HEADER_SIZE} bytes) fails its checksum or is short")
        first = int(data_path.stem) if data_path.stem.isdigit() else 0
    else:
        first = header.first_transaction_id
        if data_path.stem.isdigit() and int(data_path.stem) != first:
            failures.append(f"header says first transaction {first}, the file name says {int(data_path.stem)}")
    records: list[RecordInfo] = []
    pos = HEADER_SIZE
    expected = first
    while pos + RECORD_OVERHEAD <= len(raw):
        txn, c, g, p, s, h, length, dcrc = RECORD_HEAD.unpack_from(raw, pos)
        if length < 0 or pos + RECORD_OVERHEAD + length > len(raw):
            failures.append(f"offset {pos}: record {txn} claims {length} data bytes past the end of the file")
            break
        body_end = pos + RECORD_HEAD.size + length
        data = raw[pos + RECORD_HEAD.size : body_end]
        rec_ok = crc32(raw[pos:body_end]) == U32.unpack_from(raw, body_end)[0]
        data_ok = crc32(data) == dcrc
        if txn != expected:
            failures.append(f"offset {pos}: transaction id {txn}, expected {expected}")
        if not rec_ok:
            failures.append(f"offset {pos}: transaction {txn} fails its record checksum")
        if not data_ok:
            failures.append(f"offset {pos}: transaction {txn} fails its data checksum")
        records.append(RecordInfo(txn, pos, c, g, p, s, h, length, data_ok, rec_ok, data))
        pos = body_end + 4
        expected = txn + 1
    trailing = len(raw) - pos
    if trailing:
        failures.append(f"{trailing} trailing bytes at offset {pos} do not form a record (torn write?)")
    index_entries = checkpoint = 0
    index_path = data_path.with_suffix(INDEX_SUFFIX)
    if index_path.exists():
        iraw = index_path.read_bytes()
        if decode_segment_header(iraw[:HEADER_SIZE]) is None:
            failures.append("index file header fails its checksum")
        checkpoint = decode_checkpoint(iraw)
        offsets = _offsets_from_bytes(iraw[HEADER_SIZE:])
        index_entries = len(offsets)
        for i, off in enumerate(offsets):
            if i >= len(records):
                failures.append(f"index entry {i} ({off}) has no record")
                break
            if off != records[i].offset:
                failures.append(f"index entry {i} is {off}, record {first + i} is at {records[i].offset}")
        if index_entries < len(records):
            failures.append(f"index holds {index_entries} entries for {len(records)} records "
                            f"(rebuilt from the last checkpoint when the node opens the segment)")
    else:
        failures.append("index file is missing")
    return SegmentReport(str(data_path), header, records, failures, index_entries, checkpoint, trailing)


@attrs.frozen
class SegmentStats:
    path: str
    records: int
    min_size: int
    max_size: int
    avg_size: float
    median_size: float
    total_data_bytes: int
    file_bytes: int


def segment_stats(path: str | Path) -> SegmentStats:
    report = read_segment(path)
    sizes = [r.length for r in report.records]
    file_bytes = Path(report.path).stat().st_size
    if not sizes:
        return SegmentStats(report.path, 0, 0, 0, 0.0, 0.0, 0, file_bytes)
    return SegmentStats(report.path, len(sizes), min(sizes), max(sizes), sum(sizes) / len(sizes),
                        float(statistics.median(sizes)), sum(sizes), file_bytes)


@attrs.frozen
class PartitionEntry:
    partition_id: int
    stored_partition_id: int
    structs: tuple[PartitionInfo | None, PartitionInfo | None]  #: None = fails its checksum

    @property
    def current(self) -> PartitionInfo | None:
        a, b = self.structs
        if a is None or b is None:
            return a or b
        return b if b.sequence_number > a.sequence_number else a


@attrs.frozen
class ControlFileReport:
    path: str
    header: ControlHeader | None
    partitions: list[PartitionEntry]
    repairs: list[dict[str, Any]]  #: the repair report kept next to the control file


def read_control_file(path: str | Path) -> ControlFileReport:
    p = Path(path)
    if p.is_dir():
        p = p / CONTROL_FILE_NAME
    if p.name != CONTROL_FILE_NAME:
        raise ConfigError(f"{path}: a control file is named {CONTROL_FILE_NAME}")
    if not p.exists():
        raise ConfigError(f"{p}: no such control file")
    raw = p.read_bytes()
    header = decode_control_header(raw[:HEADER_SIZE])
    entries: list[PartitionEntry] = []
    count = header.num_partitions if header else max(0, (len(raw) - HEADER_SIZE) // (4 + 2 * INFO_SIZE))
    for pid in range(count):
        off = partition_entry_offset(pid)
        chunk = raw[off : off + 4 + 2 * INFO_SIZE]
        stored = int.from_bytes(chunk[:4], "big", signed=True) if len(chunk) >= 4 else -1
        entries.append(PartitionEntry(pid, stored, (decode_partition_info(chunk, 4),
                                                    decode_partition_info(chunk, 4 + INFO_SIZE))))
    repairs: list[dict[str, Any]] = []
    log_path = p.parent / REPAIR_LOG_NAME
    if log_path.exists():
        for line in log_path.read_text(encoding="utf-8").splitlines():
            try:
                repairs.append(json.loads(line))
            except json.JSONDecodeError:
                repairs.append({"time": 0, "partition": -1, "file": str(log_path), "action": "unreadable line",
                                "detail": line[:200]})
    return ControlFileReport(str(p), header, entries, repairs)
