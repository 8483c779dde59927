"""The segmented layout drops a partition's older synced records from the page cache.

A log is written once and seldom read back, so without this every byte appended stays cached
until memory runs out (docs/storage.md, "The page cache"). Two kinds of test: which ranges the
layout advises away (a recorder in place of the system call), and what the kernel then holds
(``mincore`` over a mapping of the data file; Linux, as the whole suite).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import mmap
import uuid
import zlib
from pathlib import Path

import pytest

from waltz_core.config import StorageNodeConfig
from waltz_core.protocol.wire import Record, RecordBatch, ReqId
from waltz_core.storage import segmented
from waltz_core.storage.format import HEADER_SIZE
from waltz_core.storage.segmented import SegmentedLayout, SegmentedPartition, segmented_factory

KIB = 1024
DATA = b"d" * 4000  # a record of about 4 KB: one page per record, give or take


def _batch(first: int, count: int) -> RecordBatch:
    return RecordBatch.from_records(Record(t, ReqId(1, 1, 0, t), 0, DATA, zlib.crc32(DATA))
                                    for t in range(first, first + count))


def _open(tmp_path: Path, keep: int, **kw: int) -> tuple[SegmentedLayout, SegmentedPartition]:
    layout = SegmentedLayout(tmp_path, page_cache_keep_bytes=keep, **kw)
    layout.open(uuid.uuid4(), 1)
    store = layout.open_partition(0)
    return layout, store


def _write(store: SegmentedPartition, first: int, batches: int, per_batch: int = 4) -> int:
    for i in range(batches):
        batch = _batch(first + i * per_batch, per_batch)
        store.write_validated(batch.data, batch.offsets)
        store.sync_written()
    return first + batches * per_batch


@pytest.fixture
def drops(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """The (offset, length) of every drop, in a small step (64 KiB) instead of the real one."""
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(segmented, "DROP_BEHIND_STEP", 64 * KIB)
    monkeypatch.setattr(segmented, "drop_from_page_cache", lambda fd, offset, n: calls.append((offset, n)))
    return calls


def test_synced_records_older_than_the_window_are_dropped_in_steps(tmp_path: Path,
                                                                   drops: list[tuple[int, int]]) -> None:
    layout, store = _open(tmp_path, keep=128 * KIB)
    _write(store, 0, 40)  # 160 records of ~4 KB: about 650 KB
    end = store._tail.data_end  # type: ignore[union-attr]
    assert len(drops) >= 5, drops
    ends = [offset + n for offset, n in drops]
    assert all(offset == 0 for offset, _ in drops)  # from the start each time (see _drop_behind)
    assert all(e % mmap.PAGESIZE == 0 for e in ends)  # whole pages
    assert all(b - a >= 64 * KIB for a, b in itertools.pairwise(ends))  # in steps, not per batch
    assert end - 128 * KIB - 64 * KIB < ends[-1] <= end - 128 * KIB  # the window stays cached
    store.close()
    layout.close()


def test_nothing_is_dropped_with_a_window_of_zero(tmp_path: Path, drops: list[tuple[int, int]]) -> None:
    layout, store = _open(tmp_path, keep=0)
    _write(store, 0, 40)
    assert drops == []
    store.close()
    layout.close()


def test_a_new_segment_and_a_truncate_start_the_window_again(tmp_path: Path, drops: list[tuple[int, int]]) -> None:
    layout, store = _open(tmp_path, keep=64 * KIB, segment_size_threshold=300 * KIB)
    nxt = _write(store, 0, 30)  # ~490 KB: at least one roll at 300 KB
    assert len(store.segment_firsts()) == 2
    # at the roll the sealed segment was dropped whole (past 300 KB, window included); the new
    # tail's window starts at its own beginning: its first drop is one step from 0
    ends = [offset + n for offset, n in drops]
    restart = next(i for i in range(1, len(ends)) if ends[i] < ends[i - 1])
    assert ends[restart - 1] >= 300 * KIB and ends[restart - 2] < 300 * KIB - 64 * KIB, ends
    assert 64 * KIB <= ends[restart] < 64 * KIB + 64 * KIB + 8 * KIB, ends
    drops.clear()
    store.truncate(nxt - 40)  # back into the tail, below what was dropped: what was dropped beyond the new end is forgotten
    end = store._tail.data_end  # type: ignore[union-attr]
    assert store._dropped_end <= end
    nxt = _write(store, nxt - 39, 10)  # 160 KB more, in the same segment
    assert drops and drops[0][1] <= store._tail.data_end - 64 * KIB  # type: ignore[union-attr]
    store.close()
    layout.close()


def test_the_node_config_key_reaches_the_layout(tmp_path: Path, drops: list[tuple[int, int]]) -> None:
    layout = segmented_factory(StorageNodeConfig(directory=str(tmp_path), page_cache_keep_bytes=64 * KIB))
    layout.open(uuid.uuid4(), 1)
    store = layout.open_partition(0)
    _write(store, 0, 20)
    assert drops and drops[-1][0] + drops[-1][1] <= store._tail.data_end - 64 * KIB  # type: ignore[union-attr]
    store.close()
    layout.close()


def _resident_pages(path: Path) -> list[bool]:
    """Per page of ``path``: is it in the page cache (``mincore`` over a private mapping)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    size = path.stat().st_size
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mapping:
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
        if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        result = [bool(v & 1) for v in vec]
        del address
    return result


def test_the_kernel_no_longer_caches_the_dropped_pages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(segmented, "DROP_BEHIND_STEP", 256 * KIB)
    layout, store = _open(tmp_path, keep=512 * KIB)
    _write(store, 0, 200)  # 800 records: about 3.2 MB
    data_file = next((tmp_path / "0").glob("*.seq"))
    resident = _resident_pages(data_file)
    page = mmap.PAGESIZE
    dropped_end = store._dropped_end
    assert dropped_end >= 2 * 1024 * KIB
    # the pages wholly before the dropped end are gone (the header page may be read back: skip it);
    # the last 512 KiB (the window) are still cached
    first_full = (HEADER_SIZE + page - 1) // page
    gone = resident[first_full : dropped_end // page]
    # the kernel may keep the page or two of the last step it just saw written (the next step drops them)
    assert len(gone) > 500 and sum(gone) <= 2, f"{sum(gone)} of {len(gone)} dropped pages still cached"
    window = resident[-(512 * KIB // page) + 1 : -1]
    assert window and all(window), f"{window.count(False)} of {len(window)} pages of the window not cached"
    store.close()
    layout.close()
