"""The node journal: one fdatasync per I/O-thread round for the appends of every partition in it.

Without a journal every partition's append batch costs one fdatasync of its own data file, so a
node serving 4 partitions syncs 4 times as often as one serving 1 partition at the same rate, and
each fdatasync costs about 50-60 microseconds of CPU on top of its wait (docs/performance.md).
With the journal (``storage.journal``) an I/O thread writes each partition's batch to the
partition's data file *without* syncing it, appends the round's batches to its journal file with
one write and makes them durable with one fdatasync; the appends are acknowledged then. The data
files are synced later, at a *checkpoint* (every ``journal_checkpoint_bytes`` of journal, before a
truncate, a file deletion or a close), after which the journal starts a new generation.

What a journal has to get right, and how this one does:

* **Acknowledged records exist only in the journal** until the next checkpoint. A crash before it
  is repaired by :func:`replay_journals` when the directory is opened again (the node at start,
  and every offline tool that opens a storage directory): each entry's records are put back into
  the partition's files where they are missing or differ, and each partition's files are synced
  before the journal is emptied.
* **Replay is idempotent.** Within one generation a partition's entries are consecutive (each
  starts where the previous one ended: truncations end the generation first), so replaying them
  again, after a crash in the middle of a replay, leaves the same records.
* **Truncations are ordered with appends** by ending the generation before them: the journal
  never holds an append older than a truncate of its partition.
* **Stale bytes are never replayed.** Every entry carries the generation and a CRC-32 of its
  header and records; a checkpoint switches the file header to the next generation (two header
  slots, written alternately, so a torn header write leaves the other one valid), and reading
  stops at the first entry that is torn, fails its CRC or belongs to an older generation. The
  file is overwritten from the start after a checkpoint, so steady-state syncs do not change
  its size.
* **The rounds overwrite blocks that already exist.** An fdatasync of a file that grew must
  also write the allocation of its new blocks (ext4 without a journal: each bitmap and extent
  buffer synchronously; with one, a commit): a fresh journal's fdatasync took 1.5 to 2.5 times
  as long (docs/performance.md, "A fresh journal's fdatasync"). So the journal writes zeros ahead
  of its rounds (:meth:`NodeJournal.preallocate`, after a round's replies are out), a step of
  256 KiB growing to 1 MiB at a time: a node that journals little keeps a small file. Zeros read
  as generation 0, the end of any generation.
* **A failed journal write or checkpoint** leaves the journal in doubt: the I/O thread refuses
  appends and truncates from then on (reads go on), and a restart replays it. A replay that
  fails for the machine's reason (a disk still full) stops the start and keeps the journal.

File format (little endian): two 32-byte header slots at 0 and 32 (magic ``WZJ1``, version,
generation, CRC-32), entries from byte 512: a 32-byte head (CRC-32 of the rest of the head and the
records, generation, partition id, first transaction id, record count, byte count) followed by the
records in the stored layout (what storage appends carry).
"""

from __future__ import annotations

import errno
import logging
import os
import random
import struct
import zlib
from array import array
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import attrs

from ..errors import ProtocolError, StorageCorruptionError, StorageError
from ..protocol.checksum import crc32 as fast_crc32
from ..protocol.wire import RecordBatch
from .files import fsync_dir, pwrite_all, pwritev_all, start_writeback
from .format import FLAG_AVAILABLE, PartitionInfo
from .layout import DeferredSyncStore, PartitionStore, Repair, StorageLayout

log = logging.getLogger("waltz.storage.journal")

#: the journal files of a storage directory live here, one per I/O thread
JOURNAL_DIRECTORY = "journal"
JOURNAL_SUFFIX = ".wal"
MAGIC = b"WZJ1"
VERSION = 1
#: a header slot: magic, version, reserved, generation, CRC-32 of the fields before it
_SLOT = struct.Struct("<4sHHQI")
_SLOT_BODY = struct.Struct("<4sHHQ")
_SLOT_SIZE = 32
#: where entries start (the header slots fit in one sector)
ENTRIES_START = 512
#: an entry's head: CRC-32, generation, partition id, first transaction id, record count, byte count
_HEAD = struct.Struct("<IQiqII")
_HEAD_AFTER_CRC = struct.Struct("<QiqII")
_CRC = struct.Struct("<I")
#: bytes an entry adds to its records (the write of a round: see perf/diskfloor.py)
ENTRY_HEAD_SIZE = _HEAD.size
#: the largest entry a reader believes (a head claiming more is garbage, not a record batch)
_MAX_ENTRY_BYTES = 1 << 30
#: zeros written ahead of the rounds at a time, while a journal grows (a new node's first
#: generation). The three replicas of a partition write them at the same moments; steps of 1 MiB
#: made the next rounds' fdatasyncs wait behind 3 MiB of writes on a shared disk (an open loop's
#: p99.9 of 13.9 against 10.8 ms, docs/performance.md, "Writeback paced by the node").
PREALLOCATE_STEP = 256 * 1024
#: errnos that mean "no room": the operator frees space (other OSErrors: the operator fixes the cause)
_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})
_ZEROS = bytes(64 * 1024)  #: a step is written as this buffer repeated (one pwritev)


@attrs.frozen(slots=True)
class JournalEntry:
    """One partition's append batch as the journal holds it."""

    partition_id: int
    first_transaction_id: int
    count: int
    data: bytes

    @property
    def last_transaction_id(self) -> int:
        return self.first_transaction_id + self.count - 1


def _encode_slot(generation: int) -> bytes:
    body = _SLOT_BODY.pack(MAGIC, VERSION, 0, generation)
    return (body + _CRC.pack(zlib.crc32(body))).ljust(_SLOT_SIZE, b"\0")


def _decode_slot(raw: bytes) -> int | None:
    """The slot's generation, None if it is torn or not a journal header."""
    if len(raw) < _SLOT.size:
        return None
    magic, version, _reserved, generation, crc = _SLOT.unpack_from(raw)
    if magic != MAGIC or version != VERSION or zlib.crc32(raw[: _SLOT.size - 4]) != crc:
        return None
    return int(generation)


def _read_generation(fd: int, path: Path) -> tuple[int, int]:
    """(generation, slot holding it) of an existing journal file."""
    raw = os.pread(fd, 2 * _SLOT_SIZE, 0)
    slots = [_decode_slot(raw[:_SLOT_SIZE]), _decode_slot(raw[_SLOT_SIZE:])]
    valid = [(g, i) for i, g in enumerate(slots) if g is not None]
    if not valid and not raw.startswith(MAGIC) and raw[_SLOT_SIZE:_SLOT_SIZE + 4] != MAGIC:
        raise StorageCorruptionError(
            f"{path}: not a Waltz node journal (no journal header); if it is one, it may hold acknowledged records "
            f"that are not in the partition files yet: move the journal directory aside and recover every "
            f"partition of this node from other replicas (docs/operations.md, \"A corrupt node journal\")")
    if not valid:
        raise StorageCorruptionError(
            f"{path}: both journal header slots fail their checksums; the journal may hold acknowledged records "
            f"that are not in the partition files yet. Move the journal directory aside and recover every "
            f"partition of this node from other replicas (`waltz storage recover-partition`; docs/operations.md, "
            f"\"A corrupt node journal\")")
    return max(valid)


def create_journal_file(path: Path) -> None:
    """Create an empty journal (generation 1 in both slots), durable with its directory entry."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        slot = _encode_slot(1)
        pwrite_all(fd, slot + slot + bytes(ENTRIES_START - 2 * _SLOT_SIZE), 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def read_journal(path: Path) -> tuple[list[JournalEntry], str | None]:
    """The entries of the journal's current generation, in order, and why reading stopped
    before the end of the file (None: at the end, or at stale bytes of an older generation).

    StorageCorruptionError when both header slots are torn, or when a partition's entries are
    not consecutive (the writer never does that: the file is not what it wrote)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        generation, _slot = _read_generation(fd, path)
        size = os.fstat(fd).st_size
        entries: list[JournalEntry] = []
        next_of: dict[int, int] = {}
        offset = ENTRIES_START
        stop: str | None = None
        while offset + _HEAD.size <= size:
            head = os.pread(fd, _HEAD.size, offset)
            crc, gen, pid, first, count, nbytes = _HEAD.unpack(head)
            if gen != generation:
                break  # an older generation's bytes (or zeros): the end of this one
            if nbytes > _MAX_ENTRY_BYTES or offset + _HEAD.size + nbytes > size or count == 0:
                stop = f"entry at byte {offset} is torn (claims {nbytes} bytes, {count} records)"
                break
            data = os.pread(fd, nbytes, offset + _HEAD.size)
            if zlib.crc32(data, zlib.crc32(head[4:])) != crc:
                stop = f"entry at byte {offset} fails its checksum (a torn last write)"
                break
            expected = next_of.get(pid)
            if expected is not None and first != expected:
                raise StorageCorruptionError(
                    f"{path}: partition {pid}'s entry at byte {offset} starts at transaction {first}, the previous "
                    f"one ended before {expected}")
            next_of[pid] = first + count
            entries.append(JournalEntry(pid, first, count, data))
            offset += _HEAD.size + nbytes
        return entries, stop
    finally:
        os.close(fd)


def journal_generation(path: Path) -> int:
    """The generation a journal file is in (each checkpoint, and each opening, starts the next)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return _read_generation(fd, path)[0]
    finally:
        os.close(fd)


def journal_paths(directory: str | os.PathLike[str]) -> list[Path]:
    """The journal files of a storage directory, in name order."""
    root = Path(directory) / JOURNAL_DIRECTORY
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.suffix == JOURNAL_SUFFIX and p.is_file())


class NodeJournal:
    """One I/O thread's journal file, open for appending (see the module documentation).

    Only its thread calls it. Open it on a directory whose journals were replayed
    (:func:`replay_journals`): it starts a new generation, so whatever the file held is gone.
    """

    def __init__(self, path: Path, checkpoint_bytes: int) -> None:
        self.path = path
        self.checkpoint_bytes = checkpoint_bytes
        if not path.exists():
            create_journal_file(path)
        self._fd = os.open(path, os.O_RDWR)
        try:
            self.generation, self._slot = _read_generation(self._fd, path)
            self._position = ENTRIES_START
            #: the file's size: what lies between the position and it was written before (old
            #: entries or zeros), so the rounds' writes there allocate nothing
            self._allocated = os.fstat(self._fd).st_size
            self._ahead = PREALLOCATE_STEP // 2  #: room wanted below this many bytes of zeros ahead
            self.reset()
        except BaseException:
            os.close(self._fd)
            raise

    @property
    def position(self) -> int:
        """Bytes of the current generation (header included)."""
        return self._position

    @property
    def full(self) -> bool:
        """Time for a checkpoint: past a point drawn between half and all of ``checkpoint_bytes``
        anew for each generation, so that the replicas of a partition, which journal the same
        bytes, do not checkpoint (and stall) at the same moment."""
        return self._position >= self._limit

    @property
    def wants_room(self) -> bool:
        """The rounds' writes are within half a step of the file's end, and this generation may
        still go past it: time to :meth:`preallocate`."""
        return self._allocated - self._position < self._ahead and self._allocated < self._limit

    def preallocate(self) -> None:
        """Write one step of zeros after the end of the file (or after the position, if a round
        wrote past the end), not beyond this generation's checkpoint point, and start their
        writeback: their blocks are allocated then, not in a round's fdatasync. Nothing depends
        on it: after an OSError (a full disk) the entries are as they were, and the next rounds
        extend the file themselves."""
        start = max(self._allocated, self._position)
        nbytes = min(PREALLOCATE_STEP, self._limit - start)
        if nbytes <= 0:
            return
        chunks, rest = divmod(nbytes, len(_ZEROS))
        pwritev_all(self._fd, [_ZEROS] * chunks + ([memoryview(_ZEROS)[:rest]] if rest else []), start)
        start_writeback(self._fd, start, nbytes)
        self._allocated = start + nbytes

    def append(self, entries: Sequence[tuple[int, int, int, bytes | memoryview]]) -> None:
        """Write ``(partition id, first transaction id, count, records)`` entries with one write
        and make them durable with one fdatasync."""
        gen = self.generation
        buffers: list[bytes | memoryview] = []
        pack, pack_crc = _HEAD_AFTER_CRC.pack, _CRC.pack
        crc32 = fast_crc32  # the same values as zlib's; isal's when installed (0.38 against 2.9 µs at 19 KB)
        for pid, first, count, data in entries:
            rest = pack(gen, pid, first, count, len(data))
            buffers.append(pack_crc(crc32(data, crc32(rest))) + rest)
            buffers.append(data)
        position = self._position = self._position + pwritev_all(self._fd, buffers, self._position)
        os.fdatasync(self._fd)
        if position > self._allocated:
            self._allocated = position

    def reset(self) -> None:
        """Start the next generation (after the partition files were synced): everything in the
        file becomes stale at once, with one header write and one fdatasync."""
        target = 1 - self._slot
        os.pwrite(self._fd, _encode_slot(self.generation + 1), target * _SLOT_SIZE)
        os.fdatasync(self._fd)
        self.generation += 1
        self._slot = target
        self._position = ENTRIES_START
        self._limit = ENTRIES_START + int(random.uniform(0.5, 1.0) * self.checkpoint_bytes)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _apply(store: PartitionStore, entry: JournalEntry) -> bool:
    """Make ``store`` hold the entry's records as its last ones (idempotent); True if it wrote."""
    first, last = entry.first_transaction_id, entry.last_transaction_id
    have = store.max_transaction_id
    if have < first - 1:
        raise StorageCorruptionError(
            f"partition {entry.partition_id}: the journal holds transactions {first}..{last} but the partition "
            f"files end at {have}: records that were synced are missing")
    if have >= last:
        stored = store.read_batch(first, entry.count, len(entry.data))
        if len(stored) == entry.count and bytes(stored.data) == entry.data:
            return False  # already there, byte for byte
    batch = RecordBatch(entry.data, entry.count, first)
    offsets = array("q")
    try:
        batch.validate_into(offsets)
    except ProtocolError as exc:  # its CRC passed: the writer journaled bad records (never does)
        raise StorageCorruptionError(f"partition {entry.partition_id}: journal entry {first}..{last}: {exc}") from None
    if have >= first:
        store.truncate(first - 1)
    if isinstance(store, DeferredSyncStore):  # one fdatasync per partition, by replay_journals
        store.write_validated(entry.data, offsets)
    else:
        store.append_validated(entry.data, offsets)
    return True


def _group(entries: list[JournalEntry]) -> dict[int, list[JournalEntry]]:
    by_partition: dict[int, list[JournalEntry]] = {}
    for e in entries:
        by_partition.setdefault(e.partition_id, []).append(e)
    return by_partition


def replay_journals(directory: str | os.PathLike[str], open_partition: Callable[[int], PartitionStore],
                    on_failure: Callable[[int, StorageError], None]) -> list[Repair]:
    """Put every journaled record back into its partition's files, then empty the journals.

    Called with the directory's layout open and no partition store open (the node before it
    loads its partitions; the offline tools after ``layout.open``). ``open_partition`` opens a
    partition's store; a partition whose records cannot be put back (its files lost synced
    records, or cannot be opened) is handed to ``on_failure``, which must keep it from being
    served as it is (the node makes it unavailable: it needs offline recovery). Returns what was
    repaired, one entry per partition that needed records back.

    An ``OSError`` (a full disk, a file it may not open) is the machine's, not the data's: the
    replay stops with a StorageError that says so and leaves every journal as it was, so the
    next start, once the cause is fixed, replays it. (Handing the partition to ``on_failure``
    would empty the journal: its acknowledged records would then have to come back from
    another replica.)
    """
    repairs: list[Repair] = []
    for path in journal_paths(directory):
        entries, stop = read_journal(path)
        if stop is not None:
            log.info("%s: %s; the entries before it are replayed", path, stop)
        for pid, own in _group(entries).items():
            store: PartitionStore | None = None
            try:
                store = open_partition(pid)
                written = sum(_apply(store, e) for e in own)
                if isinstance(store, DeferredSyncStore):
                    store.sync_written()  # durable before the journal's bytes become stale
            except StorageError as exc:
                on_failure(pid, exc)
                continue
            except OSError as exc:
                where = Path(directory)
                raise StorageError(
                    f"partition {pid}: the node journal {path} cannot be replayed into the partition's files: {exc}. "
                    f"Nothing was lost: the journal is kept as it is; "
                    f"{'free space on the filesystem of ' + str(where) if exc.errno in _NO_SPACE else 'fix that'} "
                    f"and start again") from exc
            finally:
                if store is not None:
                    store.close()
            if written:
                records = sum(e.count for e in own)
                repairs.append(Repair(pid, str(path), "replayed journal",
                                      f"{written} of {len(own)} journaled batches ({records} records, transactions "
                                      f"{own[0].first_transaction_id}..{own[-1].last_transaction_id}) were put back "
                                      f"into the partition files after an unclean stop"))
        # Every partition's records are durable in its files now: the journal's bytes become stale.
        journal = NodeJournal(path, checkpoint_bytes=1 << 62)
        journal.close()
    return repairs


def replay_into_layout(layout: StorageLayout) -> list[Repair]:
    """:func:`replay_journals` for an open layout, as every opener of a storage directory does
    (the node at start, ``recover-partition`` and ``validate`` on a stopped node's directory).

    A partition whose journaled records cannot be put back is made unavailable (its acknowledged
    records are not all in its files: serving it would serve a hole) until it is recovered from
    another replica with ``waltz storage recover-partition``; the returned repairs say so."""
    repairs: list[Repair] = []

    def unavailable(partition_id: int, exc: StorageError) -> None:
        detail = (f"{exc}; the partition was made unavailable: recover it from another replica "
                  f"(`waltz storage recover-partition`)")
        try:
            info = layout.read_partition_info(partition_id)
            layout.write_partition_info(partition_id, PartitionInfo(
                info.session_id, info.low_water_mark, info.local_low_water_mark, info.flags & ~FLAG_AVAILABLE))
        except StorageError as info_exc:  # its control data is broken too: it does not open anyway
            detail += f" (its partition info could not be written: {info_exc})"
        log.error("partition %d: journal replay failed: %s", partition_id, detail)
        repairs.append(Repair(partition_id, str(Path(layout.directory) / JOURNAL_DIRECTORY), "journal replay failed",
                              detail))

    replayed = replay_journals(layout.directory, layout.open_partition, unavailable)
    for rep in replayed:
        log.warning("partition %d: %s: %s", rep.partition_id, rep.action, rep.detail)
    return replayed + repairs


def iter_entries(directory: str | os.PathLike[str]) -> Iterator[tuple[Path, JournalEntry]]:
    """Every journaled entry of a storage directory (the disk tools show them)."""
    for path in journal_paths(directory):
        for entry in read_journal(path)[0]:
            yield path, entry
