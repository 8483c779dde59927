"""The ``segmented`` storage layout: the original Waltz's control file, ``.seq`` data and ``.idx`` index segments.

Durability rules (what a crash may leave and how opening repairs it):

* appends write the batch with one ``pwrite`` and make it durable with one ``fdatasync`` of
  the data file before returning; index entries are written without a sync and the index is
  fdatasync'ed every ``index_checkpoint_interval`` records, after which the checkpointed entry
  count is written into the index header. On open, only entries below that count are trusted
  (after a plausibility check); records after them are rescanned and re-indexed;
* a record that is short or fails its checksum at the tail of the last segment was never
  acknowledged (its fdatasync did not return): the data file is truncated there;
* a new segment's headers are synced before any record goes in; a segment left with no valid
  header and no records by a crash during creation is removed;
* partition-info structs alternate; a torn one falls back to the other.

Every repair is logged and kept as a :class:`~.layout.Repair` for the node and the disk tools.
Methods block; see :mod:`.layout` for the threading contract.
"""

from __future__ import annotations

import bisect
import fcntl
import json
import logging
import mmap
import operator
import os
import shutil
import sys
import time
import uuid
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ClusterKeyMismatchError, StorageCorruptionError, StorageError
from ..openfiles import keep_free
from ..protocol.wire import Record, RecordBatch, RecordHeader, ReqId
from .files import fsync_dir, pwritev_all, start_writeback
from .files import pwrite_all as _pwrite_all
from .format import (
    CHECKPOINT_OFFSET,
    CONTROL_FILE_NAME,
    DATA_SUFFIX,
    FORMAT_VERSION,
    HEADER_SIZE,
    I32,
    INDEX_SUFFIX,
    INFO_SIZE,
    PARTITION_ENTRY_SIZE,
    RECORD_HEAD,
    RECORD_OVERHEAD,
    ControlHeader,
    PartitionInfo,
    SegmentHeader,
    decode_checkpoint,
    decode_control_header,
    decode_partition_info,
    decode_segment_header,
    encode_checkpoint,
    encode_control_header,
    encode_partition_info,
    encode_segment_header,
    parse_segment_name,
    partition_entry_offset,
    scan_records,
    segment_name,
)
from .layout import Repair

if TYPE_CHECKING:
    from ..config import StorageNodeConfig

log = logging.getLogger("waltz.storage.layout")

REPAIR_LOG_NAME = "waltz-storage-repairs.log"  #: JSON lines, one per repair, shown by `waltz disk`
#: the newest repairs a layout and each partition store keep in memory (``repairs()``): a node whose
#: partitions are reopened after each failed write (a full or failing disk) makes some every 30 s
#: for as long as that lasts; the repair log keeps all of them
REPAIRS_KEPT = 1000

_LITTLE = sys.byteorder == "little"


def _now_ms() -> int:
    return int(time.time() * 1000)


#: with ``lazy_writeback``, batches are gathered in memory up to this many bytes and written with
#: one pwrite: at one record per append, that pwrite was about a fifth of a storage's CPU
#: (docs/performance.md, "Many partitions, and what is left"); per partition, at most
PENDING_WRITE_BYTES = 16 * 1024
#: a tail's index entries are written to its index file (no sync) once this many wait in memory
PENDING_ENTRIES = 8192
#: entries read at a time when an open checks a whole index (512 KiB)
_ENTRIES_PER_CHECK = 65536


#: what a partition leaves of its synced records in the page cache by default ([storage] page_cache_keep_bytes)
DEFAULT_PAGE_CACHE_KEEP_BYTES = 32 * 1024 * 1024
#: the page cache is dropped behind in steps of at least this many bytes (one posix_fadvise each)
DROP_BEHIND_STEP = 4 * 1024 * 1024
_fadvise = getattr(os, "posix_fadvise", None)
_PAGE = mmap.PAGESIZE


def drop_from_page_cache(fd: int, offset: int, nbytes: int) -> None:
    """Drop ``nbytes`` at ``offset`` of a synced file from the page cache (Linux
    ``posix_fadvise(POSIX_FADV_DONTNEED)``; elsewhere nothing). Written once and read rarely, a
    log's old records would otherwise fill the host's memory with pages that reclaim must free
    again; measured, the appends also cost more system time once the cache had grown by a
    gigabyte or two (docs/storage.md, "The page cache")."""
    if _fadvise is not None:
        try:
            _fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
        except OSError as exc:  # advice only: the records are durable either way
            log.debug("posix_fadvise(DONTNEED) failed: %s", exc)


def _pread_exact(fd: int, size: int, offset: int) -> bytes:
    buf = os.pread(fd, size, offset)
    if len(buf) == size:
        return buf
    parts = [buf]
    got = len(buf)
    while got < size:
        more = os.pread(fd, size - got, offset + got)
        if not more:
            break
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def _offsets_to_bytes(values: array[int]) -> bytes:
    """Index entries as big-endian longs."""
    if _LITTLE:
        values = array("q", values)
        values.byteswap()
    return values.tobytes()


def _offsets_from_bytes(raw: bytes) -> array[int]:
    values = array("q")
    values.frombytes(raw[: len(raw) - len(raw) % 8])
    if _LITTLE:
        values.byteswap()
    return values


def _entries_problem(values: array[int], index: int, previous: int | None) -> str | None:
    """Why ``values``, the index entries from ``index`` on (``previous``: the entry before them,
    None for the first), cannot be right. A record's entry is at least RECORD_OVERHEAD after the
    one before; checked in C (``map``), a third of a Python loop's time at millions of entries."""
    if previous is None:
        if values[0] != HEADER_SIZE:
            return f"first entry is {values[0]}, expected {HEADER_SIZE}"
    elif values[0] - previous < RECORD_OVERHEAD:
        return f"entry {index} ({values[0]}) does not follow entry {index - 1} ({previous})"
    if len(values) > 1 and min(map(operator.sub, values[1:], values[:-1])) < RECORD_OVERHEAD:
        for i in range(1, len(values)):  # only to name it
            if values[i] - values[i - 1] < RECORD_OVERHEAD:
                return f"entry {index + i} ({values[i]}) does not follow entry {index + i - 1} ({values[i - 1]})"
    return None


def _last_entry_problem(last: int, data_size: int) -> str | None:
    if last + RECORD_OVERHEAD > data_size:
        return f"last entry {last} points past the end of the data file ({data_size} bytes)"
    return None


# ----------------------------------------------------------------------------------- segment


class Segment:
    """One ``.seq`` + ``.idx`` pair. Its index entries (each record's offset in the data file) are
    read from the index file when needed; only those not written there yet are held in memory, at
    most about :data:`PENDING_ENTRIES` of them. (Held whole, the entries of a full 1 GB segment of
    256-byte transactions took 27 MB, of 16-byte ones 143 MB: per partition, for its tail and for
    each sealed segment kept open for reads.)"""

    __slots__ = ("first", "data_path", "index_path", "data_fd", "index_fd", "pending", "count", "data_end",
                 "checkpointed", "synced", "written")

    def __init__(self, first: int, data_path: Path, index_path: Path) -> None:
        self.first = first
        self.data_path = data_path
        self.index_path = index_path
        self.data_fd = -1
        self.index_fd = -1
        self.count = 0  #: records (index entries) in the segment
        self.pending = array("q")  #: the entries from ``written`` on, not in the index file yet
        self.data_end = HEADER_SIZE
        self.checkpointed = 0  #: index entries counted in the header's checkpoint field
        self.synced = 0  #: index entries made durable by the last index fdatasync
        self.written = 0  #: index entries written to the index file (synced or not)

    def close(self) -> None:
        for fd in (self.data_fd, self.index_fd):
            if fd >= 0:
                os.close(fd)
        self.data_fd = self.index_fd = -1

    # ---------------------------------------------------------------------- index entries
    def offset(self, i: int) -> int:
        """Entry ``i``: where record ``first + i`` starts in the data file."""
        written = self.written
        if i >= written:
            return self.pending[i - written]
        return self.entries(i, i + 1)[0]

    def entries(self, start: int, stop: int) -> array[int]:
        """Entries ``start`` to ``stop - 1``: one read of the index file, and those in memory."""
        written = self.written
        if start >= written:
            return self.pending[start - written : stop - written]
        end = min(stop, written)
        raw = _pread_exact(self.index_fd, 8 * (end - start), HEADER_SIZE + 8 * start)
        if len(raw) < 8 * (end - start):
            raise StorageCorruptionError(f"{self.index_path} is shorter than the {written} entries written to it "
                                         f"(entries {start}..{end - 1} read back {len(raw) // 8})")
        values = _offsets_from_bytes(raw)
        if stop > written:
            values.extend(self.pending[: stop - written])
        return values

    def extend(self, values: array[int]) -> None:
        """Entries of records written after the last one; in memory until :meth:`write_entries`."""
        self.pending.extend(values)
        self.count += len(values)

    def cut(self, keep: int) -> None:
        """Forget the entries from ``keep`` on (the records are gone; the caller sees to the files)."""
        if keep >= self.written:
            del self.pending[keep - self.written :]
        else:
            self.pending = array("q")
            self.written = keep
        self.count = keep

    def replace(self, values: array[int]) -> None:
        """All the entries anew (an index rebuilt from the data file), written to the index file (no sync)."""
        _pwrite_all(self.index_fd, _offsets_to_bytes(values), HEADER_SIZE)
        self.pending = array("q")
        self.count = self.written = len(values)

    def write_checkpoint(self, count: int) -> None:
        _pwrite_all(self.index_fd, encode_checkpoint(count), CHECKPOINT_OFFSET)
        self.checkpointed = count

    def checkpoint_lagging(self) -> None:
        """One fdatasync per interval: sync the entries, then record the count without a sync.

        The count becomes durable with the next checkpoint's fdatasync, so on disk it always
        trails entries that are already durable (never the other way round); an open after a
        crash rescans at most two intervals.
        """
        self.write_entries()
        os.fdatasync(self.index_fd)
        self.synced = self.count
        self.write_checkpoint(self.count)

    def write_entries(self) -> None:
        """Write the in-memory entries to the index file (no sync). Entries past the header's
        checkpoint count are not trusted by an open after a crash, so they may go there before
        their records are durable."""
        if self.pending:
            _pwrite_all(self.index_fd, _offsets_to_bytes(self.pending), HEADER_SIZE + 8 * self.written)
            self.written = self.count
            self.pending = array("q")

    def sync_index(self) -> None:
        """Make every index entry durable and record that in the header."""
        self.write_entries()
        os.fdatasync(self.index_fd)
        self.write_checkpoint(self.count)
        os.fdatasync(self.index_fd)
        self.synced = self.count

    def check_entries(self, count: int, data_size: int, spot_check_every: int = 0) -> str | None:
        """Why the index file's first ``count`` entries cannot be right, or None: read a chunk at
        a time (the memory of a chunk, not of the index), each entry after the one before, the
        last inside the data file; with ``spot_check_every``, the record at every such entry
        (and the last) must be the transaction the entry is for (one data read each)."""
        previous: int | None = None
        for start in range(0, count, _ENTRIES_PER_CHECK):
            stop = min(start + _ENTRIES_PER_CHECK, count)
            raw = _pread_exact(self.index_fd, 8 * (stop - start), HEADER_SIZE + 8 * start)
            values = _offsets_from_bytes(raw)
            if len(values) < stop - start:
                return f"index holds {start + len(values)} entries, {count} expected"
            why = _entries_problem(values, start, previous)
            if why is not None:
                return why
            previous = values[-1]
            if spot_check_every:
                checked = list(range(start + (-start - 1) % spot_check_every, stop, spot_check_every))
                if stop == count and (not checked or checked[-1] != count - 1):
                    checked.append(count - 1)
                for i in checked:
                    raw_id = _pread_exact(self.data_fd, 8, values[i - start])
                    if len(raw_id) < 8 or int.from_bytes(raw_id, "big", signed=True) != self.first + i:
                        return f"entry {i} does not point at transaction {self.first + i}"
        return None if previous is None else _last_entry_problem(previous, data_size)


class SegmentedPartition:
    """A partition directory of segments (implements :class:`~.layout.PartitionStore`)."""

    def __init__(self, directory: Path, partition_id: int, cluster_key: uuid.UUID, *, segment_size_threshold: int,
                 segment_cache_capacity: int, index_checkpoint_interval: int,
                 page_cache_keep_bytes: int = DEFAULT_PAGE_CACHE_KEEP_BYTES,
                 on_repair: Callable[[Repair], None] | None = None) -> None:
        self.partition_id = partition_id
        self._on_repair = on_repair
        self.directory = directory
        self._cluster_key = cluster_key
        self._threshold = segment_size_threshold
        self._capacity = max(1, segment_cache_capacity)
        self._interval = max(1, index_checkpoint_interval)
        self._firsts: list[int] = []
        self._tail: Segment | None = None
        self._cache: OrderedDict[int, Segment] = OrderedDict()  # sealed segments, LRU
        self._repairs: deque[Repair] = deque(maxlen=REPAIRS_KEPT)
        self._closed = False
        self._unsynced = False  #: records written by write_validated and not yet fdatasync'ed
        self._synced_end = (0, 0)  #: (data end, record count) of the tail at its last sync
        self._writeback_end = 0  #: the tail's bytes before this had their writeback started
        self._cache_keep = page_cache_keep_bytes  #: synced bytes of the tail left in the page cache (0: all)
        self._dropped_end = 0  #: the tail's bytes before this were dropped from the page cache
        #: lazily written batches not in the tail's data file yet (they end at ``tail.data_end``)
        self._pending = bytearray()
        directory.mkdir(parents=True, exist_ok=True)
        self._open()

    # ------------------------------------------------------------------------------ opening
    def _repair(self, file: Path | str, action: str, detail: str) -> None:
        rep = Repair(self.partition_id, str(file), action, detail)
        self._repairs.append(rep)
        log.warning("partition %d: %s: %s (%s)", self.partition_id, file, action, detail)
        if self._on_repair is not None:
            self._on_repair(rep)

    def repairs(self) -> list[Repair]:
        return list(self._repairs)

    def _paths(self, first: int) -> tuple[Path, Path]:
        stem = segment_name(first)
        return self.directory / (stem + DATA_SUFFIX), self.directory / (stem + INDEX_SUFFIX)

    def _open(self) -> None:
        firsts = []
        for entry in os.listdir(self.directory):
            first = parse_segment_name(entry)
            if first is not None:
                firsts.append(first)
        firsts.sort()
        known = {segment_name(f) for f in firsts}
        for entry in os.listdir(self.directory):
            if entry.endswith(INDEX_SUFFIX) and entry[: -len(INDEX_SUFFIX)] not in known:
                os.unlink(self.directory / entry)
                self._repair(self.directory / entry, "removed orphan index file", "its data file does not exist")
        self._firsts = firsts
        while self._firsts:
            seg = self._recover_tail(self._firsts[-1])
            if seg is not None:
                self._tail = seg
                break
            self._firsts.pop()

    def _check_header(self, seg: Segment, raw: bytes, what: str) -> None:
        hdr = decode_segment_header(raw)
        if hdr is None:
            raise StorageCorruptionError(f"partition {self.partition_id}: {what} {seg.data_path} has a corrupt header")
        if hdr.first_transaction_id != seg.first or hdr.partition_id != self.partition_id:
            raise StorageCorruptionError(
                f"partition {self.partition_id}: {what} {seg.data_path} header says partition {hdr.partition_id}, "
                f"first transaction {hdr.first_transaction_id}; the file name says {seg.first}")
        if hdr.cluster_key != self._cluster_key:
            raise ClusterKeyMismatchError(
                f"partition {self.partition_id}: segment {seg.data_path} belongs to cluster {hdr.cluster_key}, "
                f"this storage belongs to {self._cluster_key}")

    def _recover_tail(self, first: int) -> Segment | None:
        """Open the last segment for appends, truncating a torn tail and rebuilding the index."""
        data_path, index_path = self._paths(first)
        seg = Segment(first, data_path, index_path)
        keep_free(2)
        seg.data_fd = os.open(data_path, os.O_RDWR)
        try:
            size = os.fstat(seg.data_fd).st_size
            head = _pread_exact(seg.data_fd, HEADER_SIZE, 0)
            if decode_segment_header(head) is None and size <= HEADER_SIZE:
                seg.close()
                os.unlink(data_path)
                if index_path.exists():
                    os.unlink(index_path)
                fsync_dir(self.directory)
                self._repair(data_path, "removed empty segment", "its header was never completely written (crash while creating it)")
                return None
            self._check_header(seg, head, "data file")
            # Index: trust checkpointed entries that pass a plausibility check.
            trusted = 0
            rebuild_reason = ""
            if index_path.exists():
                seg.index_fd = os.open(index_path, os.O_RDWR)
                index_head = _pread_exact(seg.index_fd, HEADER_SIZE, 0)
                if decode_segment_header(index_head) is None:
                    rebuild_reason = "index header is corrupt"
                else:
                    count = decode_checkpoint(index_head)
                    held = max(os.fstat(seg.index_fd).st_size - HEADER_SIZE, 0) // 8
                    if held < count:
                        rebuild_reason = f"index holds {held} entries, its checkpoint says {count}"
                    else:
                        why = seg.check_entries(count, size, spot_check_every=self._interval)
                        if why is not None:
                            rebuild_reason = f"index entries failed validation: {why}"
                        else:
                            trusted = count
            else:
                rebuild_reason = "index file is missing"
            if rebuild_reason:
                if seg.index_fd >= 0:
                    os.close(seg.index_fd)
                    seg.index_fd = -1  # seg.close() after a failure below must not close the number again
                seg.index_fd = self._create_index_file(seg)
            seg.count = seg.written = trusted
            start = HEADER_SIZE
            if trusted:
                last = seg.offset(trusted - 1)
                one = _pread_exact(seg.data_fd, RECORD_HEAD.size, last)
                length = RECORD_HEAD.unpack(one)[6] if len(one) == RECORD_HEAD.size else -1
                start = last + RECORD_OVERHEAD + max(length, 0)
                if length < 0 or start > size:
                    rebuild_reason = "last checkpointed index entry does not point at a record"
                    trusted = seg.count = seg.written = 0
                    start = HEADER_SIZE
            # Scan everything after the trusted entries (mmap: no copy of the data file).
            scanned: list[int] = []
            end = start
            error = None
            if size > start:
                with mmap.mmap(seg.data_fd, 0, access=mmap.ACCESS_READ) as mm:
                    view = memoryview(mm)
                    try:
                        result = scan_records(view, start, size, first + trusted)
                    finally:
                        view.release()
                scanned, end, error = result.offsets, result.end, result.error
            if end < size:
                os.ftruncate(seg.data_fd, end)
                os.fdatasync(seg.data_fd)
                self._repair(data_path, f"truncated {size - end} bytes at offset {end}",
                             f"{error}; the record was never acknowledged")
            if rebuild_reason:
                self._repair(index_path, f"rebuilt index from the data file ({trusted + len(scanned)} entries)",
                             rebuild_reason)
            seg.data_end = end
            # Persist the re-indexed entries (all of them after a rebuild) and checkpoint the index.
            seg.extend(array("q", scanned))
            seg.write_entries()
            os.ftruncate(seg.index_fd, HEADER_SIZE + 8 * seg.count)
            if scanned or rebuild_reason:
                seg.sync_index()
            else:
                seg.checkpointed = seg.synced = seg.count
            return seg
        except BaseException:
            seg.close()
            raise

    def _create_index_file(self, seg: Segment) -> int:
        hdr = SegmentHeader(FORMAT_VERSION, _now_ms(), self._cluster_key, self.partition_id, seg.first)
        fd = os.open(seg.index_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _pwrite_all(fd, encode_segment_header(hdr, checkpoint=0), 0)
            os.fdatasync(fd)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _load_sealed(self, index: int) -> Segment:
        """Open a sealed (not last) segment for reads; rebuild its index if it does not fit."""
        first = self._firsts[index]
        expected = self._firsts[index + 1] - first
        data_path, index_path = self._paths(first)
        seg = Segment(first, data_path, index_path)
        keep_free(2)
        seg.data_fd = os.open(data_path, os.O_RDWR)
        try:
            size = os.fstat(seg.data_fd).st_size
            self._check_header(seg, _pread_exact(seg.data_fd, HEADER_SIZE, 0), "data file")
            why = "index file is missing"
            if index_path.exists():
                seg.index_fd = os.open(index_path, os.O_RDWR)
                held = max(os.fstat(seg.index_fd).st_size - HEADER_SIZE, 0) // 8
                if held < expected:
                    why = f"index holds {held} entries, the segment holds {expected} transactions"
                else:
                    why = seg.check_entries(expected, size)  # type: ignore[assignment]
                if why is None:
                    seg.count = seg.written = expected
                    seg.data_end = size
                    seg.checkpointed = seg.synced = expected
                    return seg
                os.close(seg.index_fd)
                seg.index_fd = -1  # seg.close() after a failure below must not close the number again
            with mmap.mmap(seg.data_fd, 0, access=mmap.ACCESS_READ) as mm:
                view = memoryview(mm)
                try:
                    result = scan_records(view, HEADER_SIZE, size, first, limit=expected)
                finally:
                    view.release()
            if len(result.offsets) != expected:
                raise StorageCorruptionError(
                    f"partition {self.partition_id}: segment {data_path} holds {len(result.offsets)} valid records, "
                    f"expected {expected}: {result.error}")
            seg.index_fd = self._create_index_file(seg)
            seg.replace(array("q", result.offsets))
            seg.data_end = size
            seg.sync_index()
            self._repair(index_path, f"rebuilt index from the data file ({expected} entries)", why)
            return seg
        except BaseException:
            seg.close()
            raise

    def _segment(self, index: int) -> Segment:
        if index == len(self._firsts) - 1:
            assert self._tail is not None
            return self._tail
        first = self._firsts[index]
        seg = self._cache.get(first)
        if seg is not None:
            self._cache.move_to_end(first)
            return seg
        seg = self._load_sealed(index)
        self._cache[first] = seg
        self._evict()
        return seg

    def _evict(self) -> None:
        # The tail counts against the capacity; the most recently used sealed segment always stays.
        while len(self._cache) > max(1, self._capacity - 1):
            _, old = self._cache.popitem(last=False)
            old.close()

    # ------------------------------------------------------------------------------ writing
    @property
    def max_transaction_id(self) -> int:
        tail = self._tail
        return -1 if tail is None else tail.first + tail.count - 1

    def _new_segment(self, first: int) -> Segment:
        data_path, index_path = self._paths(first)
        seg = Segment(first, data_path, index_path)
        hdr = encode_segment_header(SegmentHeader(FORMAT_VERSION, _now_ms(), self._cluster_key, self.partition_id, first))
        keep_free(2)
        seg.data_fd = os.open(data_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _pwrite_all(seg.data_fd, hdr, 0)
            os.fdatasync(seg.data_fd)
            seg.index_fd = self._create_index_file(seg)
            fsync_dir(self.directory)
        except BaseException:
            # Out of descriptors or space: no descriptor may stay open behind the failure (each
            # retry would leak one). The files are left: a reopen's recovery sees to them.
            seg.close()
            raise
        return seg

    def _roll(self) -> None:
        """Seal the tail (index fully durable) and start a segment at the next transaction id."""
        nxt = self.max_transaction_id + 1
        old = self._tail
        if old is not None:
            old.sync_index()
            if self._cache_keep:  # all of it (synced above): a sealed segment's window would stay cached for good
                drop_from_page_cache(old.data_fd, 0, old.data_end)
            self._cache[old.first] = old
            self._evict()
        self._tail = self._new_segment(nxt)
        self._dropped_end = 0
        self._firsts.append(nxt)

    def append(self, records: Sequence[Record]) -> None:
        if not records:
            self._check_open()
            return
        batch = RecordBatch.from_records(records)
        self.append_validated(batch.data, batch.offsets)

    def append_validated(self, records: bytes | memoryview, offsets: array[int]) -> None:
        self.write_validated(records, offsets)
        self.sync_written()

    def write_validated(self, records: bytes | memoryview, offsets: array[int], *,
                        lazy_writeback: bool = False) -> None:
        """Write a batch and start its writeback; durable with :meth:`sync_written`
        (:class:`~.layout.DeferredSyncStore`). With ``lazy_writeback`` (the node journal makes
        the records durable; the data file's sync waits for a checkpoint) small batches are
        gathered in memory and written together once :data:`PENDING_WRITE_BYTES` are reached, or
        before the store is read, synced, truncated or closed, and their writeback starts when
        the node calls :meth:`start_lazy_writeback`."""
        self._check_open()
        if not offsets:
            return
        tail = self._tail
        if tail is None or tail.data_end >= self._threshold:
            if self._unsynced:
                self.sync_written()  # the old tail's records are durable before it is sealed
            self._roll()
            tail = self._tail
            assert tail is not None
        start = tail.data_end
        end = start + len(records)
        pending = self._pending
        if not lazy_writeback:
            self._write_pending()
            _pwrite_all(tail.data_fd, records, start)
            start_writeback(tail.data_fd, start, len(records))
            self._writeback_end = end
        elif len(pending) + len(records) < PENDING_WRITE_BYTES:
            pending += records  # written with the next ones: see PENDING_WRITE_BYTES
        else:
            pwritev_all(tail.data_fd, [pending, records], start - len(pending))
            pending.clear()
        if not self._unsynced:
            self._unsynced = True
            self._synced_end = (start, tail.count)  # where the store goes back to if the sync fails
        tail.data_end = start + len(records)
        tail.extend(array("q", [start + offset for offset in offsets]))
        if len(tail.pending) >= PENDING_ENTRIES:
            tail.write_entries()

    def _write_pending(self) -> None:
        """Write the batches gathered in memory into the tail's data file (before anything reads,
        syncs, truncates or closes it)."""
        pending = self._pending
        if pending:
            tail = self._tail
            assert tail is not None
            _pwrite_all(tail.data_fd, pending, tail.data_end - len(pending))
            pending.clear()

    def start_lazy_writeback(self, min_bytes: int = 0) -> int:
        """Start the writeback of the bytes written into the tail's data file since the last
        start, if there are at least ``min_bytes`` (and not those still gathered in memory): the
        bytes started. A node journal's rounds call it for every partition they wrote, once per
        so many bytes in all, so that a node's writeback comes in steps of the same size whatever
        its number of partitions (docs/performance.md, "Writeback paced by the node")."""
        tail = self._tail
        if tail is None or not self._unsynced:
            return 0  # nothing written since the last sync
        written = tail.data_end - len(self._pending)
        first_unsynced = self._synced_end[0]
        begin = self._writeback_end if first_unsynced <= self._writeback_end <= written else first_unsynced
        nbytes = written - begin
        if nbytes <= 0 or nbytes < min_bytes:
            return 0
        start_writeback(tail.data_fd, begin, nbytes)
        self._writeback_end = written
        return nbytes

    def start_writeback(self) -> None:
        """Start writing what :meth:`sync_written` would make durable, without waiting (a node's
        journal checkpoint starts it for every partition first, so their writes overlap)."""
        tail = self._tail
        if self._unsynced and tail is not None:
            self._write_pending()
            start = self._synced_end[0]
            start_writeback(tail.data_fd, start, tail.data_end - start)

    def sync_written(self) -> None:
        """Make the written records durable: one fdatasync of the data file, then (every
        ``index_checkpoint_interval`` records) the index checkpoint, which never counts records
        that are not durable."""
        if not self._unsynced:
            return
        tail = self._tail
        assert tail is not None
        try:
            self._write_pending()
            self._sync_appended(tail.data_fd)
        except BaseException:
            # Not durable, never acknowledged: the store ends where the last sync left it (as if
            # the write had not happened; the next write goes over it, a reopen rescans the file).
            tail.data_end, count = self._synced_end
            tail.cut(count)
            self._unsynced = False
            self._pending.clear()
            raise
        self._unsynced = False
        if self._cache_keep:
            self._drop_behind(tail)
        # Index entries stay in memory until the checkpoint writes and syncs them in one go: they
        # are rebuilt from the data file after a crash anyway, so per-batch index writes buy nothing.
        if tail.count - tail.synced >= self._interval:
            tail.checkpoint_lagging()

    def _drop_behind(self, tail: Segment) -> None:
        """Drop the tail's synced bytes older than the last ``page_cache_keep_bytes`` from the page
        cache, a few MiB at a time (see DROP_BEHIND_STEP)."""
        end = (tail.data_end - self._cache_keep) // _PAGE * _PAGE  # whole pages: the kernel keeps partial ones
        if end - self._dropped_end >= DROP_BEHIND_STEP:
            # From the start each time: the kernel may keep a page of the last step (measured: the
            # first two of each step stayed cached), and pages read back since then go too. A
            # range without cached pages costs next to nothing.
            drop_from_page_cache(tail.data_fd, 0, end)
            self._dropped_end = end

    def _sync_appended(self, data_fd: int) -> None:
        """Make an appended batch durable before append returns: the one fdatasync per batch.
        A method so that the negative control of :mod:`waltz_core.testing.sabotage` can skip it."""
        os.fdatasync(data_fd)

    def truncate(self, transaction_id: int) -> None:
        self._check_open()
        self.sync_written()
        transaction_id = max(transaction_id, -1)
        if transaction_id >= self.max_transaction_id:
            return
        removed = False
        old_tail = self._tail
        while self._firsts and self._firsts[-1] > transaction_id:
            first = self._firsts.pop()
            seg = self._cache.pop(first, None) or (old_tail if old_tail and old_tail.first == first else None)
            if seg is not None:
                seg.close()
            data_path, index_path = self._paths(first)
            for p in (index_path, data_path):
                if p.exists():
                    os.unlink(p)
            removed = True
        if removed:
            fsync_dir(self.directory)
        self._tail = None
        if not self._firsts:
            return
        first = self._firsts[-1]
        if old_tail is not None and old_tail.first == first:
            seg = old_tail
        else:  # a sealed segment becomes the tail again (its index was synced when it was sealed)
            cached = self._cache.pop(first, None)
            if cached is not None:
                cached.close()
            reopened = self._recover_tail(first)
            if reopened is None:
                self._firsts.pop()
                return self.truncate(transaction_id)
            seg = reopened
        keep = transaction_id - first + 1
        if keep < seg.count:
            new_end = seg.offset(keep)
            seg.cut(keep)
            seg.write_entries()
            os.ftruncate(seg.index_fd, HEADER_SIZE + 8 * keep)
            seg.write_checkpoint(min(seg.checkpointed, keep))
            os.fdatasync(seg.index_fd)
            seg.synced = keep
            os.ftruncate(seg.data_fd, new_end)
            os.fdatasync(seg.data_fd)
            seg.data_end = new_end
        # what was dropped of this segment still is; a reopened one is dropped again from its start
        self._dropped_end = min(self._dropped_end, seg.data_end) if seg is old_tail else 0
        self._tail = seg

    # ------------------------------------------------------------------------------ reading
    def _check_open(self) -> None:
        if self._closed:
            raise StorageError(f"partition {self.partition_id}: store is closed")

    def _read_run(self, transaction_id: int, max_records: int) -> list[Record]:
        """Records from one segment at most (callers loop across segments)."""
        buf, offsets = self._read_raw_run(transaction_id, max_records, -1)
        out = []
        unpack = RECORD_HEAD.unpack_from
        hs = RECORD_HEAD.size
        for off in offsets:
            txn, c, g, p, s, h, length, dcrc = unpack(buf, off)
            out.append(Record(txn, ReqId(c, g, p, s), h, buf[off + hs : off + hs + length], dcrc))
        return out

    def _read_raw_run(self, transaction_id: int, max_records: int, max_bytes: int, *,
                      retry: bool = True) -> tuple[bytes, list[int]]:
        """Stored bytes of consecutive records from one segment at most, checked against their record
        checksums, and each record's offset in them. ``max_bytes`` < 0: no byte limit; else as many
        records as fit (none if the first does not)."""
        index = bisect.bisect_right(self._firsts, transaction_id) - 1
        seg = self._segment(index)
        if self._pending and seg is self._tail:
            self._write_pending()
        slot = transaction_id - seg.first
        n = min(max_records, seg.count - slot)
        if n <= 0:
            return b"", []
        more = slot + n < seg.count
        try:
            offsets = seg.entries(slot, slot + n + 1 if more else slot + n)  # relative to slot from here
        except StorageCorruptionError as exc:  # the index file lost entries since the open
            if not retry:
                raise
            self._rebuild_index(seg, str(exc))
            return self._read_raw_run(transaction_id, max_records, max_bytes, retry=False)
        start = offsets[0]
        end = offsets[n] if more else seg.data_end
        if 0 <= max_bytes < end - start:
            # Records that end within the budget: record i ends where record i + 1 starts.
            n = bisect.bisect_right(offsets, start + max_bytes, 1, n) - 1
            if n <= 0:
                return b"", []
            end = offsets[n]
        buf = _pread_exact(seg.data_fd, max(end - start, 0), start)
        result = scan_records(buf, 0, len(buf), transaction_id, limit=n)
        if len(result.offsets) < n:
            if retry and not self._index_points_at(seg, slot, n, start):
                self._rebuild_index(seg, f"entry for transaction {transaction_id + len(result.offsets)} is wrong")
                return self._read_raw_run(transaction_id, max_records, max_bytes, retry=False)
            bad = transaction_id + len(result.offsets)
            raise StorageCorruptionError(
                f"partition {self.partition_id}: transaction {bad} in {seg.data_path} failed verification: {result.error}")
        if result.end != len(buf):  # the index says the run ends elsewhere than its last record does
            if retry:  # the rebuild rescans the data file and raises if the data is what is wrong
                self._rebuild_index(seg, f"entry for transaction {transaction_id + n} is wrong")
                return self._read_raw_run(transaction_id, max_records, max_bytes, retry=False)
            raise StorageCorruptionError(
                f"partition {self.partition_id}: {len(buf) - result.end} unexpected bytes after transaction "
                f"{transaction_id + n - 1} in {seg.data_path}")
        return buf, result.offsets

    def _index_points_at(self, seg: Segment, slot: int, n: int, start: int) -> bool:
        """True when the index is consistent with a fresh scan of the same range (so the data is bad)."""
        size = os.fstat(seg.data_fd).st_size
        with mmap.mmap(seg.data_fd, 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                result = scan_records(view, HEADER_SIZE, size, seg.first, limit=slot + n)
            finally:
                view.release()
        return list(seg.entries(0, len(result.offsets))) == result.offsets

    def _rebuild_index(self, seg: Segment, why: str) -> None:
        size = seg.data_end
        with mmap.mmap(seg.data_fd, 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                result = scan_records(view, HEADER_SIZE, size, seg.first, limit=seg.count)
            finally:
                view.release()
        if len(result.offsets) != seg.count:
            raise StorageCorruptionError(
                f"partition {self.partition_id}: {seg.data_path} holds {len(result.offsets)} valid records of "
                f"{seg.count}: {result.error}")
        seg.replace(array("q", result.offsets))
        seg.sync_index()
        self._repair(seg.index_path, f"rebuilt index from the data file ({seg.count} entries)", why)

    def read_records(self, transaction_id: int, max_records: int) -> list[Record]:
        self._check_open()
        out: list[Record] = []
        last = self.max_transaction_id
        txn = transaction_id
        if txn < 0:
            return out
        while len(out) < max_records and txn <= last:
            run = self._read_run(txn, max_records - len(out))
            if not run:
                break
            out.extend(run)
            txn += len(run)
        return out

    def read_batch(self, transaction_id: int, max_records: int, max_bytes: int) -> RecordBatch:
        self._check_open()
        chunks: list[bytes] = []
        count = nbytes = 0
        last = self.max_transaction_id
        txn = transaction_id
        while transaction_id >= 0 and count < max_records and txn <= last:
            buf, offsets = self._read_raw_run(txn, max_records - count, max(max_bytes - nbytes, 0))
            if not offsets and not count:  # the first record is served whatever its size
                buf, offsets = self._read_raw_run(txn, 1, -1)
            if not offsets:
                break
            chunks.append(buf)
            count += len(offsets)
            nbytes += len(buf)
            txn += len(offsets)
        return RecordBatch(chunks[0] if len(chunks) == 1 else b"".join(chunks), count, transaction_id)

    def read_record(self, transaction_id: int) -> Record | None:
        recs = self.read_records(transaction_id, 1)
        return recs[0] if recs else None

    def read_header(self, transaction_id: int) -> RecordHeader | None:
        rec = self.read_record(transaction_id)
        return None if rec is None else RecordHeader(rec.transaction_id, rec.req_id, rec.header)

    def read_headers(self, transaction_id: int, max_records: int) -> list[RecordHeader]:
        return [RecordHeader(r.transaction_id, r.req_id, r.header) for r in self.read_records(transaction_id, max_records)]

    def segment_firsts(self) -> list[int]:
        return list(self._firsts)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._tail is not None:
            try:
                if self._unsynced:
                    self._write_pending()
                    self._sync_appended(self._tail.data_fd)  # before the index counts those records
                    self._unsynced = False
                self._tail.sync_index()
            except OSError as exc:  # closing must not fail; the next open rebuilds the index
                log.warning("partition %d: index sync on close failed: %s", self.partition_id, exc)
            self._tail.close()
        for seg in self._cache.values():
            seg.close()
        self._cache.clear()


# ---------------------------------------------------------------------------------- layout


class SegmentedLayout:
    """The storage directory (implements :class:`~.layout.StorageLayout`)."""

    #: the class of the partitions it opens (a subclass may change how they write)
    partition_class: type[SegmentedPartition] = SegmentedPartition
    #: its stores defer syncs, so a node may make their appends durable in its journal
    journal_capable = True

    def __init__(self, directory: str | os.PathLike[str], *, segment_size_threshold: int = 1_000_000_000,
                 segment_cache_capacity: int = 5, index_checkpoint_interval: int = 1000,
                 page_cache_keep_bytes: int = DEFAULT_PAGE_CACHE_KEEP_BYTES) -> None:
        self.directory = str(directory)
        self._root = Path(directory)
        self._threshold = segment_size_threshold
        self._capacity = segment_cache_capacity
        self._interval = index_checkpoint_interval
        self._cache_keep = page_cache_keep_bytes
        self._fd = -1
        self._header: ControlHeader | None = None
        self._current: dict[int, tuple[PartitionInfo, int]] = {}  # partition -> (info, slot it is in)
        self._repairs: deque[Repair] = deque(maxlen=REPAIRS_KEPT)

    @property
    def control_path(self) -> Path:
        return self._root / CONTROL_FILE_NAME

    @property
    def header(self) -> ControlHeader:
        if self._header is None:
            raise StorageError("the storage layout is not open")
        return self._header

    @property
    def open_files_per_partition(self) -> int:
        """The most descriptors an open partition holds: data and index files of its newest
        segment and of the sealed segments it keeps open for reads (``segment_cache_capacity``
        segments in all)."""
        return 2 * max(1, self._capacity)

    def open(self, cluster_key: uuid.UUID, num_partitions: int) -> ControlHeader:
        self._root.mkdir(parents=True, exist_ok=True)
        path = self.control_path
        if not path.exists():
            self._create_control_file(cluster_key, num_partitions)
        fd = os.open(path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StorageError(f"{path} is locked by another storage node process") from None
        header = decode_control_header(_pread_exact(fd, HEADER_SIZE, 0))
        if header is None:
            os.close(fd)
            raise StorageCorruptionError(f"{path}: the control file header fails its checksum")
        if header.cluster_key != cluster_key or header.num_partitions != num_partitions:
            os.close(fd)
            raise ClusterKeyMismatchError(
                f"{path} belongs to cluster key {header.cluster_key} with {header.num_partitions} partitions; "
                f"this node was started for cluster key {cluster_key} with {num_partitions} partitions")
        self._fd = fd
        self._header = header
        return header

    def _create_control_file(self, cluster_key: uuid.UUID, num_partitions: int) -> None:
        header = ControlHeader(FORMAT_VERSION, _now_ms(), cluster_key, num_partitions)
        initial = encode_partition_info(PartitionInfo())
        body = bytearray(encode_control_header(header))
        for pid in range(num_partitions):
            body += I32.pack(pid) + initial + initial
        tmp = self._root / (CONTROL_FILE_NAME + ".tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _pwrite_all(fd, body, 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.control_path)
        fsync_dir(self._root)

    def _check_partition(self, partition_id: int) -> None:
        if not 0 <= partition_id < self.header.num_partitions:
            raise StorageError(f"partition {partition_id} is outside 0..{self.header.num_partitions - 1}")

    def read_partition_info(self, partition_id: int) -> PartitionInfo:
        self._check_partition(partition_id)
        cached = self._current.get(partition_id)
        if cached is not None:
            return cached[0]
        raw = _pread_exact(self._fd, PARTITION_ENTRY_SIZE, partition_entry_offset(partition_id))
        stored_id = I32.unpack_from(raw, 0)[0] if len(raw) >= 4 else None
        a = decode_partition_info(raw, 4)
        b = decode_partition_info(raw, 4 + INFO_SIZE)
        if stored_id != partition_id or (a is None and b is None):
            why = (f"entry holds partition id {stored_id}" if stored_id != partition_id
                   else "both partition-info structs fail their checksums")
            raise StorageCorruptionError(
                f"partition {partition_id}: {why} in {self.control_path}; refusing to open the partition "
                f"(recover it from another replica: `waltz storage recover-partition`)")
        if a is None or b is None:
            good, slot = (b, 1) if a is None else (a, 0)
            assert good is not None
            self._repair_log(partition_id, f"using partition-info struct {slot + 1}",
                             f"struct {2 - slot} fails its checksum (torn write); rolled back to sequence number "
                             f"{good.sequence_number}")
        else:
            good, slot = (b, 1) if b.sequence_number > a.sequence_number else (a, 0)
        self._current[partition_id] = (good, slot)
        return good

    def _repair_log(self, partition_id: int, action: str, detail: str) -> None:
        rep = Repair(partition_id, str(self.control_path), action, detail)
        self._repairs.append(rep)
        log.warning("partition %d: %s: %s (%s)", partition_id, self.control_path, action, detail)
        self._persist_repair(rep)

    def _persist_repair(self, rep: Repair) -> None:
        """Append the repair to the storage directory's repair report (JSON lines), for the disk tools.

        The report is for people: a full disk that cannot take its line must not keep the
        repaired partition from opening (the repair is in the log either way)."""
        line = json.dumps({"time": _now_ms(), "partition": rep.partition_id, "file": rep.file, "action": rep.action,
                           "detail": rep.detail})
        path = self._root / REPAIR_LOG_NAME
        try:
            with open(path, "a", encoding="utf-8") as fh:
                fh.write(line + "\n")
        except OSError as exc:
            log.warning("could not add the repair above to %s: %s", path, exc)

    def write_partition_info(self, partition_id: int, info: PartitionInfo) -> PartitionInfo:
        self._check_partition(partition_id)
        try:
            self.read_partition_info(partition_id)
            current, slot = self._current[partition_id]
        except StorageCorruptionError:
            current, slot = PartitionInfo(sequence_number=0), 1  # both bad: an admin re-initialises
        target = 1 - slot
        new = PartitionInfo(info.session_id, info.low_water_mark, info.local_low_water_mark, info.flags,
                            (current.sequence_number + 1) & 0x7FFFFFFF)
        offset = partition_entry_offset(partition_id) + 4 + target * INFO_SIZE
        _pwrite_all(self._fd, encode_partition_info(new), offset)
        os.fdatasync(self._fd)
        self._current[partition_id] = (new, target)
        return new

    def partition_directory(self, partition_id: int) -> Path:
        return self._root / str(partition_id)

    def open_partition(self, partition_id: int) -> SegmentedPartition:
        self._check_partition(partition_id)
        return self.partition_class(self.partition_directory(partition_id), partition_id, self.header.cluster_key,
                                    segment_size_threshold=self._threshold, segment_cache_capacity=self._capacity,
                                    index_checkpoint_interval=self._interval, page_cache_keep_bytes=self._cache_keep,
                                    on_repair=self._on_partition_repair)

    def _on_partition_repair(self, rep: Repair) -> None:
        self._repairs.append(rep)
        self._persist_repair(rep)

    def delete_partition_files(self, partition_id: int) -> None:
        self._check_partition(partition_id)
        path = self.partition_directory(partition_id)
        if path.exists():
            shutil.rmtree(path)
            fsync_dir(self._root)

    def quarantine(self, partition_id: int | None, into: Path, *, copy: bool = False) -> list[str]:
        from .recovery import quarantine_paths

        if partition_id is None:
            if self._fd >= 0 and not copy:
                raise StorageError(f"{self.control_path} is open: move it aside before open()")
            paths = [self.control_path, self._root / REPAIR_LOG_NAME]
        else:
            self._check_partition(partition_id)
            if not copy:
                self._current.pop(partition_id, None)
            paths = [self.partition_directory(partition_id)]
        moved = quarantine_paths(paths, Path(into), copy=copy)
        fsync_dir(self._root)
        return moved

    def repairs(self) -> list[Repair]:
        return list(self._repairs)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # releases the flock
            self._fd = -1


def segmented_factory(config: StorageNodeConfig, options: None = None) -> SegmentedLayout:
    """Registry factory, ``factory(config, options)``: the layout on ``config.directory``, sized by
    the node's ``[storage]`` keys (the layout has no options table)."""
    return SegmentedLayout(config.directory, segment_size_threshold=config.segment_size_threshold,
                           segment_cache_capacity=config.segment_cache_capacity,
                           index_checkpoint_interval=config.index_checkpoint_interval,
                           page_cache_keep_bytes=config.page_cache_keep_bytes)
