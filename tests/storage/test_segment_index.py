"""What a segmented store keeps in memory: not its segments' index entries, which live in the
index files, and only the newest of its repairs.

Each record has an 8-byte entry (its offset in the data file). Held whole in memory, the entries
of a full 1 GB segment took 27 MB at 256-byte transactions and 143 MB at 16-byte ones, per
partition, for its tail and for each sealed segment kept open for reads, and an open walked them
all in a Python loop. Now only the entries not yet written to the index file are held (at most
about ``PENDING_ENTRIES``), reads take theirs from the file, and an open checks the index a chunk
at a time. (The storage-layout kit runs the same layout with tiny steps in
test_layout_conformance.py, ``TestSegmentedLayoutIndexInSteps``.)
"""

from __future__ import annotations

import struct
import tracemalloc
import uuid
import zlib
from pathlib import Path

import pytest

from waltz_core.protocol.wire import Record, RecordBatch, ReqId
from waltz_core.storage import segmented
from waltz_core.storage.format import HEADER_SIZE
from waltz_core.storage.segmented import SegmentedLayout, SegmentedPartition

KEY = uuid.UUID(int=7)


def _records(first: int, count: int, data: bytes = b"d" * 40) -> RecordBatch:
    return RecordBatch.from_records(Record(t, ReqId(1, 1, 0, t), 0, data + t.to_bytes(4, "big"),
                                           zlib.crc32(data + t.to_bytes(4, "big"))) for t in range(first, first + count))


def _open(directory: Path, **kw: int) -> tuple[SegmentedLayout, SegmentedPartition]:
    layout = SegmentedLayout(directory, **kw)
    layout.open(KEY, 1)
    store = layout.open_partition(0)
    assert isinstance(store, SegmentedPartition)
    return layout, store


def _write(store: SegmentedPartition, count: int, per_batch: int = 500, *, lazy: bool = True) -> None:
    """Appends as a node with a journal makes them: written, synced only at the end (a checkpoint)."""
    first = store.max_transaction_id + 1
    for start in range(first, first + count, per_batch):
        batch = _records(start, min(per_batch, first + count - start))
        store.write_validated(batch.data, batch.offsets, lazy_writeback=lazy)
    store.sync_written()


def _check_reads(store: SegmentedPartition, count: int, step: int = 997) -> None:
    for start in list(range(0, count, step)) + [count - 3]:
        got = store.read_batch(start, 3, 1 << 20)
        assert [r.transaction_id for r in got] == list(range(start, min(start + 3, count)))
        assert [bytes(r.data)[-4:] for r in got] == [t.to_bytes(4, "big") for t in range(start, min(start + 3, count))]


def _close(layout: SegmentedLayout, store: SegmentedPartition) -> None:
    store.close()
    layout.close()


def test_a_tail_holds_a_bounded_number_of_entries_while_it_grows(tmp_path: Path) -> None:
    layout, store = _open(tmp_path, index_checkpoint_interval=1_000_000)  # no index checkpoint on the way
    _write(store, 60_000)
    tail = store._tail
    assert tail is not None and tail.count == 60_000
    assert len(tail.pending) < segmented.PENDING_ENTRIES + 500, len(tail.pending)
    assert tail.written + len(tail.pending) == 60_000
    _check_reads(store, 60_000)
    _close(layout, store)


def test_an_open_of_a_large_segment_holds_none_of_its_entries(tmp_path: Path) -> None:
    layout, store = _open(tmp_path)
    _write(store, 200_000, per_batch=2_000)
    _close(layout, store)
    tracemalloc.start()
    try:
        layout, store = _open(tmp_path)
        held, _peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert store.max_transaction_id == 199_999 and store.repairs() == []
    # 200,000 entries are 1.6 MB; what the open keeps is the layout, the store and a few buffers
    assert held < 200_000, held
    _check_reads(store, 200_000)
    _close(layout, store)


def test_a_truncate_into_entries_written_but_not_synced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(segmented, "PENDING_ENTRIES", 50)
    layout, store = _open(tmp_path, index_checkpoint_interval=100_000)
    _write(store, 1_000, per_batch=30)
    tail = store._tail
    assert tail is not None and tail.written > 900  # in the index file, past its checkpoint count
    store.truncate(419)
    assert store.max_transaction_id == 419
    _check_reads(store, 420, step=41)
    _write(store, 200, per_batch=30)  # the ids after 419 again, over the old entries
    _check_reads(store, 620, step=41)
    _close(layout, store)
    layout, store = _open(tmp_path, index_checkpoint_interval=100_000)
    assert store.max_transaction_id == 619 and store.repairs() == []
    _check_reads(store, 620, step=41)
    _close(layout, store)


def test_a_failed_sync_forgets_entries_already_in_the_index_file(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(segmented, "PENDING_ENTRIES", 50)
    layout, store = _open(tmp_path, index_checkpoint_interval=100_000)
    _write(store, 300, per_batch=30)

    def fail(_fd: int) -> None:
        raise OSError(5, "Input/output error")

    batch = _records(300, 200)
    store.write_validated(batch.data, batch.offsets, lazy_writeback=True)
    tail = store._tail
    assert tail is not None and tail.written > 300  # some of the batch's entries reached the file
    monkeypatch.setattr(store, "_sync_appended", fail)
    with pytest.raises(OSError):
        store.sync_written()
    assert store.max_transaction_id == 299 and tail.written <= 300
    monkeypatch.undo()
    _write(store, 100, per_batch=30)
    _check_reads(store, 400, step=37)
    _close(layout, store)


def test_an_index_file_cut_short_while_open_is_rebuilt_by_the_read(tmp_path: Path) -> None:
    layout, store = _open(tmp_path, index_checkpoint_interval=1_000)
    _write(store, 5_000)
    index = next((tmp_path / "0").glob("*.idx"))
    with open(index, "r+b") as f:
        f.truncate(HEADER_SIZE + 8 * 10)
    _check_reads(store, 5_000)
    assert [r.action for r in store.repairs()] == ["rebuilt index from the data file (5000 entries)"]
    assert "is shorter than the 5000 entries written to it" in store.repairs()[0].detail
    _close(layout, store)


def _entry(index: Path, i: int) -> int:
    with open(index, "rb") as f:
        f.seek(HEADER_SIZE + 8 * i)
        return int(struct.unpack(">q", f.read(8))[0])


def _set_entry(index: Path, i: int, value: int) -> None:
    with open(index, "r+b") as f:
        f.seek(HEADER_SIZE + 8 * i)
        f.write(struct.pack(">q", value))


@pytest.mark.parametrize(("entry", "how", "why"), [
    (550, "repeat", "entry 550 ({value}) does not follow entry 549 ({value})"),
    (299, "shift", "entry 299 does not point at transaction 299"),
    (0, "shift", "first entry is {value}, expected 128"),
])
def test_an_open_checks_the_whole_index_a_chunk_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          entry: int, how: str, why: str) -> None:
    monkeypatch.setattr(segmented, "_ENTRIES_PER_CHECK", 128)  # 8 chunks: the bad entry is in a later one
    layout, store = _open(tmp_path, index_checkpoint_interval=100)
    _write(store, 1_000)
    _close(layout, store)
    index = next((tmp_path / "0").glob("*.idx"))
    value = _entry(index, entry - 1) if how == "repeat" else _entry(index, entry) + 9  # inside record `entry`
    _set_entry(index, entry, value)
    layout, store = _open(tmp_path, index_checkpoint_interval=100)
    assert [r.action for r in store.repairs()] == ["rebuilt index from the data file (1000 entries)"]
    assert store.repairs()[0].detail == "index entries failed validation: " + why.format(value=value)
    _check_reads(store, 1_000, step=37)
    _close(layout, store)


def test_the_repairs_kept_in_memory_are_the_newest_thousand(tmp_path: Path) -> None:
    """Each failed write reopens the partition, and a reopen may repair: on a full or failing
    disk that goes on for as long as the fault does. Memory keeps the newest; the repair log
    on disk keeps every one."""
    layout, store = _open(tmp_path)
    for i in range(1_200):
        store._repair(f"file-{i}", "test repair", str(i))  # the store tells its layout too
    assert len(store.repairs()) == len(layout.repairs()) == segmented.REPAIRS_KEPT == 1_000
    assert store.repairs()[0].detail == "200" and layout.repairs()[-1].detail == "1199"
    _close(layout, store)
