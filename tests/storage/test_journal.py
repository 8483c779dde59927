"""The node journal: its file format, its replay after an unclean stop, and a node that uses it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import threading
import uuid
from array import array
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from waltz_core.errors import PartitionNotFoundError, StorageCorruptionError, StorageError
from waltz_core.protocol.wire import STORED_RECORD_OVERHEAD, RecordBatch
from waltz_core.storage import node as node_module
from waltz_core.storage import segmented
from waltz_core.storage.client import StorageClient
from waltz_core.storage.format import HEADER_SIZE
from waltz_core.storage.journal import (
    ENTRIES_START,
    JOURNAL_DIRECTORY,
    PREALLOCATE_STEP,
    NodeJournal,
    journal_paths,
    read_journal,
    replay_journals,
)
from waltz_core.storage.layout import PartitionStore
from waltz_core.storage.node import LoopRounds, StorageNode
from waltz_core.storage.segmented import SegmentedLayout
from waltz_core.testing import require
from waltz_core.testing.faults import small_filesystem, small_filesystems_available

from .conftest import NUM_PARTITIONS, NodeHarness, io_thread_blocked, make_record, make_records, write_held_batches


def _batch(first: int, count: int, partition_id: int = 0) -> RecordBatch:
    return RecordBatch.from_records(make_records(first, count, partition_id))


def _entry(first: int, count: int, partition_id: int = 0) -> tuple[int, int, int, bytes]:
    return partition_id, first, count, bytes(_batch(first, count, partition_id).data)


# ------------------------------------------------------------------------------ file format


def test_entries_read_back_in_order_and_a_checkpoint_makes_them_stale(tmp_path: Path) -> None:
    path = tmp_path / "io-0.wal"
    journal = NodeJournal(path, checkpoint_bytes=1 << 20)
    journal.append([_entry(0, 3), _entry(0, 2, partition_id=1)])
    journal.append([_entry(3, 4)])
    entries, stop = read_journal(path)
    assert stop is None
    assert [(e.partition_id, e.first_transaction_id, e.count) for e in entries] == [(0, 0, 3), (1, 0, 2), (0, 3, 4)]
    assert entries[2].data == _entry(3, 4)[3]
    size_before = path.stat().st_size
    journal.reset()
    assert read_journal(path) == ([], None)
    # The next generation overwrites from the start: the older, longer bytes after it are stale.
    journal.append([_entry(7, 1)])
    entries, stop = read_journal(path)
    assert [(e.first_transaction_id, e.count) for e in entries] == [(7, 1)] and stop is None
    assert path.stat().st_size == size_before
    journal.close()


def test_reading_stops_at_a_torn_last_entry(tmp_path: Path) -> None:
    path = tmp_path / "io-0.wal"
    journal = NodeJournal(path, checkpoint_bytes=1 << 20)
    journal.append([_entry(0, 3)])
    end_of_first = journal.position
    journal.append([_entry(3, 5)])
    journal.close()
    with open(path, "r+b") as f:  # a bit of the second entry's records flipped
        f.seek(end_of_first + 40)
        byte = f.read(1)
        f.seek(end_of_first + 40)
        f.write(bytes([byte[0] ^ 0x10]))
    entries, stop = read_journal(path)
    assert [(e.first_transaction_id, e.count) for e in entries] == [(0, 3)]
    assert stop is not None and "checksum" in stop
    os.truncate(path, end_of_first + 20)  # the second entry's head cut short
    entries, stop = read_journal(path)
    assert [(e.first_transaction_id, e.count) for e in entries] == [(0, 3)]


def test_a_torn_header_slot_falls_back_to_the_other_and_two_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "io-0.wal"
    journal = NodeJournal(path, checkpoint_bytes=1 << 20)
    journal.append([_entry(0, 2)])
    current_slot = journal._slot
    journal.close()
    with open(path, "r+b") as f:  # the slot of the current generation is torn: the previous one holds
        f.seek(32 * current_slot)
        f.write(b"\xff" * 8)
    entries, _ = read_journal(path)
    assert entries == []  # the entries carry the newer generation: stale for the older header
    with open(path, "r+b") as f:  # both slots torn after their magic: a damaged journal
        for slot in (0, 32):
            f.seek(slot + 8)
            f.write(b"\xff" * 8)
    with pytest.raises(StorageCorruptionError, match="header slots"):
        read_journal(path)
    with open(path, "r+b") as f:  # no header at all: not a journal
        f.write(b"\xff" * 64)
    with pytest.raises(StorageCorruptionError, match="not a Waltz node journal"):
        read_journal(path)


def test_entries_of_a_partition_that_are_not_consecutive_are_corruption(tmp_path: Path) -> None:
    path = tmp_path / "io-0.wal"
    journal = NodeJournal(path, checkpoint_bytes=1 << 20)
    journal.append([_entry(0, 3), _entry(5, 1)])
    journal.close()
    with pytest.raises(StorageCorruptionError, match="previous one ended"):
        read_journal(path)


def test_the_journal_is_full_at_its_checkpoint_size(tmp_path: Path) -> None:
    journal = NodeJournal(tmp_path / "io-0.wal", checkpoint_bytes=200)  # full somewhere after 100..200 bytes
    assert not journal.full
    journal.append([_entry(0, 1)])  # a head of 32 bytes and one record of 70 or so
    assert not journal.full
    journal.append([_entry(1, 3)])
    assert journal.full and journal.position > ENTRIES_START + 200
    journal.reset()
    assert not journal.full and journal.position == ENTRIES_START
    journal.close()


def test_zeros_are_written_ahead_of_the_rounds_in_steps_and_read_as_the_end(tmp_path: Path) -> None:
    path = tmp_path / "io-0.wal"
    journal = NodeJournal(path, checkpoint_bytes=64 << 20)
    journal.append([_entry(0, 3)])
    assert journal.wants_room and path.stat().st_size == journal.position  # a fresh file ends at its writes
    sizes = []
    for _ in range(4):
        journal.preallocate()
        sizes.append(path.stat().st_size)
    steps = [b - a for a, b in zip([journal.position, *sizes], sizes, strict=False)]
    assert steps == [PREALLOCATE_STEP] * 4  # one size: larger steps are a larger burst on the disk
    assert not journal.wants_room
    # Written, not sparse: the blocks exist, so the rounds' fdatasyncs allocate nothing.
    assert path.stat().st_blocks * 512 >= sizes[-1] - 4096
    journal.append([_entry(3, 2)])  # over the zeros: the file does not grow
    assert path.stat().st_size == sizes[-1]
    entries, stop = read_journal(path)
    assert [(e.first_transaction_id, e.count) for e in entries] == [(0, 3), (3, 2)] and stop is None
    journal.close()


def test_zeros_stop_at_the_generations_checkpoint_point(tmp_path: Path) -> None:
    path = tmp_path / "io-0.wal"
    journal = NodeJournal(path, checkpoint_bytes=4096)  # full somewhere after 2048..4096 bytes
    assert journal.wants_room
    journal.preallocate()
    assert ENTRIES_START + 2048 <= path.stat().st_size <= ENTRIES_START + 4096
    assert not journal.wants_room
    journal.preallocate()  # nothing more to do for this generation
    assert path.stat().st_size <= ENTRIES_START + 4096
    journal.close()


# ----------------------------------------------------------------------------------- replay


def _layout(directory: Path, cluster_key: uuid.UUID) -> SegmentedLayout:
    layout = SegmentedLayout(directory)
    layout.open(cluster_key, NUM_PARTITIONS)
    return layout


def _journaled_writes(directory: Path, cluster_key: uuid.UUID, batches: list[tuple[int, int, int]], *,
                      in_files: bool = True) -> None:
    """Write ``(partition, first, count)`` batches as a journaled node does: into the partition
    stores without syncing them, and durably into the journal; then "crash" (nothing is closed).

    ``in_files``: the stores had written the batches into the partition files (the page cache)
    before the crash, which a power loss may then take (:func:`_lose_unsynced_tail`); else they
    still held them in memory (small batches are gathered before they are written), so the
    crash of the process took them."""
    layout = _layout(directory, cluster_key)
    journal = NodeJournal(directory / JOURNAL_DIRECTORY / "io-0.wal", checkpoint_bytes=1 << 30)
    stores: dict[int, PartitionStore] = {}
    for pid, first, count in batches:
        store = stores.get(pid) or stores.setdefault(pid, layout.open_partition(pid))
        batch = _batch(first, count, pid)
        offsets = array("q")
        batch.validate_into(offsets)
        store.write_validated(batch.data, offsets, lazy_writeback=True)  # type: ignore[attr-defined]
        journal.append([(pid, first, count, bytes(batch.data))])
    for store in stores.values():
        if in_files:
            store.start_writeback()  # type: ignore[attr-defined]
        store._closed = True  # type: ignore[attr-defined]  # a crash: no close-time sync
    journal.close()
    layout.close()


def _data_file_size(directory: Path, partition_id: int) -> int:
    return sum(p.stat().st_size for p in (directory / str(partition_id)).glob("*.seq"))


def test_lazy_writes_are_gathered_in_memory_and_written_before_any_read_sync_or_close(
        tmp_path: Path, cluster_key, monkeypatch: pytest.MonkeyPatch) -> None:
    layout = _layout(tmp_path, cluster_key)
    store = layout.open_partition(0)
    writes: list[int] = []
    real = segmented.pwritev_all

    def counted(fd: int, buffers: Any, offset: int) -> int:
        writes.append(sum(len(b) for b in buffers))
        return real(fd, buffers, offset)

    monkeypatch.setattr(segmented, "pwritev_all", counted)

    def write(first: int, count: int, lazy: bool = True) -> RecordBatch:
        batch = _batch(first, count)
        offsets = array("q")
        batch.validate_into(offsets)
        store.write_validated(batch.data, offsets, lazy_writeback=lazy)  # type: ignore[attr-defined]
        return batch

    small = write(0, 3).nbytes + write(3, 2).nbytes  # well under PENDING_WRITE_BYTES: held in memory
    assert writes == [] and _data_file_size(tmp_path, 0) == HEADER_SIZE
    assert store.read_records(0, 10) == make_records(0, 5)  # a read writes them first
    assert _data_file_size(tmp_path, 0) == HEADER_SIZE + small
    held = write(5, 2).nbytes
    assert store.max_transaction_id == 6 and _data_file_size(tmp_path, 0) == HEADER_SIZE + small
    # Reaching the limit writes what was gathered and the new batch with one pwritev.
    big = write(7, segmented.PENDING_WRITE_BYTES // _batch(0, 1).nbytes + 1)
    assert writes == [held + big.nbytes]
    assert _data_file_size(tmp_path, 0) == HEADER_SIZE + small + held + big.nbytes
    n = 7 + len(big)
    write(n, 1)
    write(n + 1, 1, lazy=False)  # an eager write goes after what was gathered
    assert store.read_records(0, 10_000) == make_records(0, n + 2)
    write(n + 2, 2)
    store.sync_written()  # type: ignore[attr-defined]
    assert _data_file_size(tmp_path, 0) == HEADER_SIZE + _batch(0, n + 4).nbytes
    write(n + 4, 1)
    store.close()  # writes and syncs what it holds
    reopened = layout.open_partition(0)
    assert reopened.read_records(0, 10_000) == make_records(0, n + 5)
    reopened.close()
    layout.close()


def test_a_lazy_store_starts_the_writeback_of_what_it_wrote_since_the_last_start_when_asked(
        tmp_path: Path, cluster_key, monkeypatch: pytest.MonkeyPatch) -> None:
    layout = _layout(tmp_path, cluster_key)
    store: Any = layout.open_partition(0)
    started: list[tuple[int, int]] = []
    monkeypatch.setattr(segmented, "start_writeback", lambda fd, offset, nbytes: started.append((offset, nbytes)))

    def write(first: int, count: int) -> int:
        batch = _batch(first, count)
        offsets = array("q")
        batch.validate_into(offsets)
        store.write_validated(batch.data, offsets, lazy_writeback=True)
        return batch.nbytes

    held = write(0, 3)  # gathered in memory: not in the file yet, nothing to start
    assert store.start_lazy_writeback() == 0 and started == []
    n = 3 + segmented.PENDING_WRITE_BYTES // _batch(0, 1).nbytes + 1
    big = write(3, n - 3)  # written with what was held
    assert started == []  # a write starts nothing by itself
    assert store.start_lazy_writeback(held + big + 1) == 0  # under the minimum: left for later
    assert store.start_lazy_writeback(held + big) == held + big and started == [(HEADER_SIZE, held + big)]
    assert store.start_lazy_writeback() == 0  # nothing new since
    more = write(n, n)
    assert store.start_lazy_writeback() == more and started[-1] == (HEADER_SIZE + held + big, more)
    write(2 * n, 1)
    store.sync_written()
    assert store.start_lazy_writeback() == 0  # synced: nothing to start
    store.close()
    layout.close()


def _lose_unsynced_tail(directory: Path, partition_id: int, keep_records: int, *, written: bool = True) -> None:
    """The power loss: the partition's data file keeps only its first ``keep_records`` records
    (what its files held at the last checkpoint), its index is gone.

    ``written=False``: a copy taken while a node ran, whose recent small batches may still have
    been in its memory: the file may hold fewer records already (nothing to cut then)."""
    part = directory / str(partition_id)
    data = next(p for p in part.iterdir() if p.suffix == ".seq")
    for index in part.glob("*.idx"):
        index.unlink()
    keep = HEADER_SIZE + (len(_batch(0, keep_records, partition_id).data) if keep_records else 0)
    if written:
        assert keep < data.stat().st_size
    if keep < data.stat().st_size:
        os.truncate(data, keep)


def _stored(directory: Path, cluster_key: uuid.UUID, partition_id: int) -> list:
    layout = _layout(directory, cluster_key)
    store = layout.open_partition(partition_id)
    try:
        return store.read_records(0, 1000)
    finally:
        store.close()
        layout.close()


def _replay(directory: Path, cluster_key: uuid.UUID) -> tuple[list, list[tuple[int, str]]]:
    layout = _layout(directory, cluster_key)
    failures: list[tuple[int, str]] = []
    try:
        repairs = replay_journals(directory, layout.open_partition, lambda pid, exc: failures.append((pid, str(exc))))
    finally:
        layout.close()
    return repairs, failures


def test_replay_puts_back_what_a_power_loss_took_from_the_partition_files(tmp_path: Path, cluster_key) -> None:
    _journaled_writes(tmp_path, cluster_key, [(0, 0, 3), (1, 0, 2), (0, 3, 4), (1, 2, 5)])
    _lose_unsynced_tail(tmp_path, 0, keep_records=0)
    _lose_unsynced_tail(tmp_path, 1, keep_records=4)
    repairs, failures = _replay(tmp_path, cluster_key)
    assert failures == []
    assert sorted(r.partition_id for r in repairs) == [0, 1]
    assert all(r.action == "replayed journal" for r in repairs)
    assert _stored(tmp_path, cluster_key, 0) == make_records(0, 7, 0)
    assert _stored(tmp_path, cluster_key, 1) == make_records(0, 7, 1)
    # The journal started a new generation: a second replay finds nothing to do.
    assert [read_journal(p)[0] for p in journal_paths(tmp_path)] == [[]]
    assert _replay(tmp_path, cluster_key) == ([], [])


def test_replay_again_after_a_crash_in_the_middle_of_a_replay_writes_nothing_twice(tmp_path: Path,
                                                                                     cluster_key) -> None:
    _journaled_writes(tmp_path, cluster_key, [(0, 0, 3), (0, 3, 4)])
    saved = tmp_path.parent / (tmp_path.name + "-journal")
    shutil.copytree(tmp_path / JOURNAL_DIRECTORY, saved)
    _lose_unsynced_tail(tmp_path, 0, keep_records=0)
    _replay(tmp_path, cluster_key)
    # As if the replay had died before it started the journal's next generation:
    shutil.rmtree(tmp_path / JOURNAL_DIRECTORY)
    shutil.copytree(saved, tmp_path / JOURNAL_DIRECTORY)
    repairs, failures = _replay(tmp_path, cluster_key)
    assert (repairs, failures) == ([], [])  # every record already there, byte for byte
    assert _stored(tmp_path, cluster_key, 0) == make_records(0, 7, 0)


def test_replay_replaces_records_that_differ_from_the_journal(tmp_path: Path, cluster_key) -> None:
    _journaled_writes(tmp_path, cluster_key, [(0, 0, 3), (0, 3, 4)])
    # The file holds other bytes for transactions 3..6 (say, a torn write the scan accepted).
    layout = _layout(tmp_path, cluster_key)
    store = layout.open_partition(0)
    store.truncate(2)
    other = RecordBatch.from_records(make_records(3, 4, partition_id=3))
    store.append(list(other))
    store.close()
    layout.close()
    repairs, failures = _replay(tmp_path, cluster_key)
    assert failures == [] and [r.partition_id for r in repairs] == [0]
    assert _stored(tmp_path, cluster_key, 0) == make_records(0, 7, 0)


def test_a_partition_that_lost_synced_records_is_handed_to_on_failure(tmp_path: Path, cluster_key) -> None:
    _journaled_writes(tmp_path, cluster_key, [(0, 0, 3), (0, 3, 4), (1, 0, 2)])
    # Simulate a checkpoint that made records 0..2 of partition 0 durable, then a journal with only the rest:
    path = tmp_path / JOURNAL_DIRECTORY / "io-0.wal"
    journal = NodeJournal(path, checkpoint_bytes=1 << 30)
    journal.append([_entry(3, 4), _entry(0, 2, partition_id=1)])
    journal.close()
    _lose_unsynced_tail(tmp_path, 0, keep_records=0)  # ... and the disk lost the synced 0..2
    repairs, failures = _replay(tmp_path, cluster_key)
    assert [pid for pid, _ in failures] == [0]
    assert "synced are missing" in failures[0][1]
    assert [r.partition_id for r in repairs] == []  # partition 1's files held its records already
    assert _stored(tmp_path, cluster_key, 1) == make_records(0, 2, 1)  # the others are replayed


# ------------------------------------------------------------------------------ in the node


@contextlib.asynccontextmanager
async def _journaled_node(directory: Path, cluster_key: uuid.UUID, *assigned: int,
                          **options: Any) -> AsyncIterator[tuple[StorageNode, StorageClient]]:
    """A node with the journal (and ``options``), the ``assigned`` partitions assigned, and a
    data client; stopped cleanly at the end."""
    h = NodeHarness(directory, cluster_key, node_options={"journal": True, **options})
    node = await h.start()
    try:
        if assigned:
            admin = await h.admin()
            await admin.set_assignment(list(assigned), True)
        yield node, await h.client()
    finally:
        await h.stop()


async def _image_at_power_loss(node: StorageNode, live: Path, crashed: Path) -> None:
    """Copy a running node's directory as a power loss would find it once the node had written
    into its partition files (the page cache) what it gathers in memory; the journal is durable."""
    await write_held_batches(node)
    shutil.copytree(live, crashed)


def _record_calls(journal: NodeJournal | None, what: Callable[[list[Any]], Any]) -> list[Any]:
    """Wrap ``journal.append``: what each call was given, as ``what(entries)``."""
    assert journal is not None
    seen: list[Any] = []
    append = journal.append
    journal.append = lambda entries: (seen.append(what(entries)), append(entries))[1]  # type: ignore[method-assign]
    return seen


async def test_a_journaled_node_keeps_acknowledged_records_through_a_power_loss(tmp_path: Path,
                                                                                cluster_key) -> None:
    async with _journaled_node(tmp_path / "live", cluster_key, 0, 1, io_threads=2) as (node, c):
        await c.append(1, 0, make_records(0, 5))
        await c.append(1, 1, make_records(0, 3, 1))
        await c.append(1, 0, make_records(5, 4))
        assert [p.name for p in journal_paths(tmp_path / "live")] == ["io-0.wal", "io-1.wal"]
        assert sum(len(read_journal(p)[0]) for p in journal_paths(tmp_path / "live")) == 3
        # The power loss, taken while the node runs: the journal is durable, the partition files lose their records.
        await _image_at_power_loss(node, tmp_path / "live", tmp_path / "crashed")
    _lose_unsynced_tail(tmp_path / "crashed", 0, keep_records=0)
    _lose_unsynced_tail(tmp_path / "crashed", 1, keep_records=1)
    async with _journaled_node(tmp_path / "crashed", cluster_key) as (node, c):
        assert {r.partition_id for r in node.repairs if r.action == "replayed journal"} == {0, 1}
        assert await c.max_transaction_id(2, 0) == 8
        assert list(await c.record_list(2, 0, 0, 100)) == make_records(0, 9)
        assert list(await c.record_list(2, 1, 0, 100)) == make_records(0, 3, 1)
    # A clean stop leaves every journal empty.
    assert all(read_journal(p)[0] == [] for p in journal_paths(tmp_path / "live"))


async def test_a_node_that_crashed_holding_small_batches_in_memory_gets_them_back_from_its_journal(
        tmp_path: Path, cluster_key) -> None:
    async with _journaled_node(tmp_path / "live", cluster_key, 0, 1) as (node, c):
        await c.append(1, 0, make_records(0, 5))
        await c.append(1, 1, make_records(0, 2, 1))
        await c.append(1, 0, make_records(5, 3))
        # The process dies now: the acknowledged batches were journaled, not written to the files.
        shutil.copytree(tmp_path / "live", tmp_path / "crashed")
    assert _data_file_size(tmp_path / "crashed", 0) == _data_file_size(tmp_path / "crashed", 1) == HEADER_SIZE
    _lose_unsynced_tail(tmp_path / "crashed", 0, keep_records=0, written=False)  # the index goes too
    async with _journaled_node(tmp_path / "crashed", cluster_key) as (node, c):
        assert {r.partition_id for r in node.repairs if r.action == "replayed journal"} == {0, 1}
        assert list(await c.record_list(2, 0, 0, 100)) == make_records(0, 8)
        assert list(await c.record_list(2, 1, 0, 100)) == make_records(0, 2, 1)


async def test_one_round_of_several_partitions_is_one_journal_write_and_no_partition_fdatasync(
        tmp_path: Path, cluster_key) -> None:
    syncs: list[int] = []
    async with _journaled_node(tmp_path, cluster_key, 0, 1, 2, io_threads=1) as (node, c):
        for worker in node.workers[:3]:
            store = worker.store
            assert store is not None
            sync = store.sync_written  # type: ignore[attr-defined]
            store.sync_written = lambda pid=worker.partition_id, sync=sync: (syncs.append(pid), sync())[1]  # type: ignore[attr-defined]
        rounds = _record_calls(node.io_threads[0].journal, lambda entries: [e[0] for e in entries])
        async with io_thread_blocked(node.workers[0]):  # what is queued meanwhile is the next round
            appends = [asyncio.ensure_future(c.append(1, pid, make_records(0, 2, pid))) for pid in (0, 1, 2)]
            await asyncio.sleep(0.1)
            assert not any(a.done() for a in appends)
        await asyncio.gather(*appends)
        assert rounds == [[0, 1, 2]] and syncs == []
        assert node.metrics.counter("storage_append_syncs", labels={"thread": "0"}).value == 1
        for pid in (0, 1, 2):
            assert await c.record_list(1, pid, 0, 10) == tuple(make_records(0, 2, pid))
    assert sorted(syncs) == [0, 1, 2]  # closing the stores synced their files


async def test_the_writeback_of_partitions_filling_together_comes_in_steps_not_all_at_once(
        tmp_path: Path, cluster_key, monkeypatch: pytest.MonkeyPatch) -> None:
    """Partitions that fill at the same rate (any hash-partitioned load) used to start the
    writeback of their files in the same round, each once per 256 KiB of its own: 4 partitions,
    1 MiB at once, and the rounds' fdatasyncs queued behind it (a p99 of 14 ms at 4 x 16 against
    8 ms, docs/performance.md, "Writeback paced by the node"). A node now starts about
    WRITEBACK_STEP bytes at a time in all, the partitions in turn."""
    started: list[tuple[int, int, int]] = []  # (round, fd, bytes)
    rounds: list[int] = []
    monkeypatch.setattr(segmented, "start_writeback", lambda fd, offset, nbytes: started.append((len(rounds), fd, nbytes)))
    per_append, appends = 16, 96  # 16 records of 1 KiB: 1.5 MiB per partition in all
    async with _journaled_node(tmp_path, cluster_key, 0, 1, 2, 3, io_threads=1) as (node, c):
        rounds = _record_calls(node.io_threads[0].journal, len)
        for i in range(appends):
            await asyncio.gather(*(c.append(1, pid, [make_record(per_append * i + k, bytes(1000), pid)
                                                     for k in range(per_append)]) for pid in range(4)))
        fds = {w.store._tail.data_fd for w in node.workers[:4]}  # type: ignore[union-attr]
        by_round: dict[int, int] = {}
        for when, _fd, nbytes in started:
            by_round[when] = by_round.get(when, 0) + nbytes
        written = 4 * appends * per_append * (1000 + STORED_RECORD_OVERHEAD)
        assert {fd for _, fd, _ in started} == fds  # every partition's file, in turn
        assert len(by_round) >= written // (2 * node_module.WRITEBACK_STEP)
        assert max(by_round.values()) <= 2 * node_module.WRITEBACK_STEP, by_round
        assert sum(by_round.values()) >= written - 2 * node_module.WRITEBACK_STEP  # the steps keep up


async def test_a_truncate_starts_a_new_generation_so_no_older_append_is_replayed_over_it(tmp_path: Path,
                                                                                         cluster_key) -> None:
    replaced = make_records(3, 2, partition_id=2)
    async with _journaled_node(tmp_path / "live", cluster_key, 0) as (node, c):
        await c.append(1, 0, make_records(0, 6))
        await c.truncate(2, 0, 2)
        await c.append(2, 0, replaced)
        entries = read_journal(tmp_path / "live" / JOURNAL_DIRECTORY / "io-0.wal")[0]
        assert [(e.first_transaction_id, e.count) for e in entries] == [(3, 2)]
        await _image_at_power_loss(node, tmp_path / "live", tmp_path / "crashed")
    async with _journaled_node(tmp_path / "crashed", cluster_key) as (_, c):
        assert list(await c.record_list(3, 0, 0, 100)) == make_records(0, 3) + replaced


async def test_checkpoints_keep_the_journal_bounded(tmp_path: Path, cluster_key) -> None:
    async with _journaled_node(tmp_path, cluster_key, 0, journal_checkpoint_bytes=4096) as (node, c):
        for first in range(0, 200, 10):
            await c.append(1, 0, make_records(first, 10))
        journal = node.io_threads[0].journal
        assert journal is not None and journal.generation > 3  # it checkpointed several times
        assert journal.position < 4096 + 10_000
        assert list(await c.record_list(1, 0, 0, 1000)) == make_records(0, 200)


async def test_a_failed_journal_write_fails_the_appends_and_the_node_refuses_until_a_restart(
        tmp_path: Path, cluster_key) -> None:
    async with _journaled_node(tmp_path, cluster_key, 0) as (node, c):
        await c.append(1, 0, make_records(0, 2))
        journal = node.io_threads[0].journal
        assert journal is not None

        def broken(entries: object) -> None:
            raise OSError(5, "Input/output error")

        journal.append = broken  # type: ignore[method-assign]
        with pytest.raises(StorageError, match="journal write failed"):
            await c.append(1, 0, make_records(2, 2))
        with pytest.raises(StorageError, match="restart the storage node"):
            await c.max_transaction_id(1, 0)
        # The operator sees it: /readyz says why, the gauge is 1.
        ready, details = node.healthy()
        assert not ready and any("the node journal failed" in r and "restart the storage node" in r
                                 for r in details["reasons"]), details
        assert "waltz_storage_journal_failed 1" in node.metrics.render_prometheus()
    # The restart replays what the journal held: the acknowledged records are there.
    async with _journaled_node(tmp_path, cluster_key) as (node, c):
        assert node.healthy()[0]
        assert "waltz_storage_journal_failed 0" in node.metrics.render_prometheus()
        assert (await c.max_transaction_id(1, 0)) >= 1
        assert list(await c.record_list(1, 0, 0, 2)) == make_records(0, 2)


def test_the_storage_journal_keys_are_in_the_config() -> None:
    from waltz_core.config import StorageNodeConfig

    cfg = StorageNodeConfig()
    assert cfg.journal is True and cfg.journal_checkpoint_bytes == 64 * 1024 * 1024


async def test_a_node_makes_a_partition_that_cannot_be_replayed_unavailable_and_serves_the_others(
        tmp_path: Path, cluster_key) -> None:
    async with _journaled_node(tmp_path / "live", cluster_key, 0, 1, journal_checkpoint_bytes=1 << 30) as (node, c):
        await c.append(1, 0, make_records(0, 3))
        await node.workers[0].call(node.io_threads[0].checkpoint)  # records 0..2 of partition 0 are synced
        await c.append(1, 0, make_records(3, 2))
        await c.append(1, 1, make_records(0, 2, 1))
        await _image_at_power_loss(node, tmp_path / "live", tmp_path / "crashed")
    _lose_unsynced_tail(tmp_path / "crashed", 0, keep_records=0)  # the disk lost synced records too
    _lose_unsynced_tail(tmp_path / "crashed", 1, keep_records=0)
    async with _journaled_node(tmp_path / "crashed", cluster_key) as (node, c):
        failed = [r for r in node.repairs if r.action == "journal replay failed"]
        assert [r.partition_id for r in failed] == [0] and "recover-partition" in failed[0].detail
        with pytest.raises(PartitionNotFoundError, match="not available"):
            await c.max_transaction_id(2, 0)
        assert list(await c.record_list(2, 1, 0, 100)) == make_records(0, 2, 1)


async def test_offline_recovery_opens_a_crashed_directory_with_its_journal_replayed(tmp_path: Path,
                                                                                   cluster_key) -> None:
    from waltz_core.storage.recovery import PartitionRebuild

    async with _journaled_node(tmp_path / "live", cluster_key, 0) as (node, c):
        await c.append(1, 0, make_records(0, 6))
        await _image_at_power_loss(node, tmp_path / "live", tmp_path / "crashed")
    _lose_unsynced_tail(tmp_path / "crashed", 0, keep_records=2)
    rebuild = PartitionRebuild(SegmentedLayout(tmp_path / "crashed"), cluster_key, NUM_PARTITIONS, tmp_path / "aside")
    rebuild.open()
    try:
        assert [(r.partition_id, r.action) for r in rebuild.repairs] == [(0, "replayed journal")]
        store, info, why = rebuild.local(0)
        assert store is not None and info is not None and info.assigned and why == ""
        assert store.read_records(0, 100) == make_records(0, 6)
        store.close()
    finally:
        rebuild.layout.close()


async def test_groups_split_by_max_batch_records_share_the_round_journal_write_until_another_request(
        tmp_path: Path, cluster_key) -> None:
    async with _journaled_node(tmp_path, cluster_key, 0, max_batch_records=2, io_threads=1) as (node, c):
        writes = _record_calls(node.io_threads[0].journal, lambda entries: [(e[1], e[2]) for e in entries])
        async with io_thread_blocked(node.workers[0]):  # what is queued meanwhile is one batch of the next round
            calls = [asyncio.ensure_future(c.append(1, 0, make_records(first, 2))) for first in (0, 2, 4)]
            await asyncio.sleep(0.02)
            calls.append(asyncio.ensure_future(c.max_transaction_id(1, 0)))
            await asyncio.sleep(0.02)
            calls += [asyncio.ensure_future(c.append(1, 0, make_records(first, 2))) for first in (6, 8)]
            await asyncio.sleep(0.1)
        results = await asyncio.gather(*calls)
        # Three groups of 2 (max_batch_records), journaled together before the read; the two after it with the round.
        assert writes == [[(0, 2), (2, 2), (4, 2)], [(6, 2), (8, 2)]]
        assert results[3] == 5  # the read saw the three groups, durable
        assert list(await c.record_list(1, 0, 0, 100)) == make_records(0, 10)


def test_waltz_disk_dump_journal_lists_what_a_start_would_replay(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    path = tmp_path / "io-0.wal"
    journal = NodeJournal(path, checkpoint_bytes=1 << 20)
    journal.append([_entry(0, 3), _entry(0, 2, partition_id=1)])
    end_of_first = journal.position
    journal.append([_entry(3, 4)])
    journal.close()
    with open(path, "r+b") as f:  # the last entry torn
        f.seek(end_of_first + 40)
        f.write(b"\xff\xff")

    def dump(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "waltz_core.cli", "disk", "dump-journal", str(path), *args],
                              capture_output=True, text=True, timeout=60)

    out = dump("--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert [(e["partition"], e["first"], e["last"]) for e in report["entries"]] == [(0, 0, 2), (1, 0, 1)]
    assert "checksum" in report["stopped"] and report["generation"] >= 2
    text = dump()
    assert "2 entries, 5 records" in text.stdout and "reading stopped early" in text.stdout


async def test_rounds_on_the_event_loop_checkpoint_on_a_thread_and_wait_for_it(tmp_path: Path, cluster_key) -> None:
    # A journal of 1 byte is full after every round: each round asks for a checkpoint.
    async with _journaled_node(tmp_path, cluster_key, 0, 1, io_threads=0, journal_checkpoint_bytes=1) as (node, c):
        rounds = node.io_threads[0]
        assert isinstance(rounds, LoopRounds)
        release = threading.Event()
        ran_on: list[threading.Thread] = []
        checkpoint = rounds.checkpoint

        def held_checkpoint() -> None:
            ran_on.append(threading.current_thread())
            assert release.wait(10)
            checkpoint()

        rounds.checkpoint = held_checkpoint  # type: ignore[method-assign]
        await c.append(1, 0, make_records(0, 2))  # answered: durable in the journal before the checkpoint
        for _ in range(500):
            if ran_on:
                break
            await asyncio.sleep(0.01)
        assert ran_on and ran_on[0] is not threading.main_thread()
        assert rounds.round_age() > 0  # /readyz sees the checkpoint as file work under way
        # While it runs, the loop serves (this coroutine runs) but the next round waits for it.
        waiting = asyncio.ensure_future(c.append(1, 1, make_records(0, 3, 1)))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        release.set()
        await asyncio.wait_for(waiting, 10)
        assert list(await c.record_list(1, 0, 0, 100)) == make_records(0, 2)
        assert list(await c.record_list(1, 1, 0, 100)) == make_records(0, 3, 1)
        assert rounds.journal_error is None
    # The stop waited for the last checkpoint: a restart replays nothing and finds every record.
    async with _journaled_node(tmp_path, cluster_key, io_threads=0) as (node, c):
        assert not [r for r in node.repairs if r.action == "replayed journal"]
        assert list(await c.record_list(2, 1, 0, 100)) == make_records(0, 3, 1)


async def test_rounds_on_the_event_loop_journal_and_replay_like_a_thread(tmp_path: Path, cluster_key) -> None:
    async with _journaled_node(tmp_path / "live", cluster_key, 0, 1, io_threads=0) as (node, c):
        assert [type(io).__name__ for io in node.io_threads] == ["LoopRounds"]
        rounds = _record_calls(node.io_threads[0].journal, lambda entries: sorted({e[0] for e in entries}))
        await asyncio.gather(c.append(1, 0, make_records(0, 4)), c.append(1, 1, make_records(0, 3, 1)))
        assert rounds == [[0, 1]]  # both partitions' appends, read in one loop iteration, share a round
        await c.append(1, 0, make_records(4, 2))
        await _image_at_power_loss(node, tmp_path / "live", tmp_path / "crashed")
    _lose_unsynced_tail(tmp_path / "crashed", 0, keep_records=0)
    _lose_unsynced_tail(tmp_path / "crashed", 1, keep_records=0)
    async with _journaled_node(tmp_path / "crashed", cluster_key, io_threads=0) as (node, c):
        assert {r.partition_id for r in node.repairs if r.action == "replayed journal"} == {0, 1}
        assert list(await c.record_list(2, 0, 0, 100)) == make_records(0, 6)
        assert list(await c.record_list(2, 1, 0, 100)) == make_records(0, 3, 1)


@pytest.mark.parametrize("io_threads", [0, 1])
async def test_after_a_round_a_node_writes_zeros_ahead_of_its_journal(tmp_path: Path, cluster_key,
                                                                      io_threads: int) -> None:
    async with _journaled_node(tmp_path, cluster_key, 0, io_threads=io_threads) as (node, c):
        journal = node.io_threads[0].journal
        assert journal is not None
        path = journal.path
        await c.append(1, 0, make_records(0, 3))
        for _ in range(500):  # a thread writes them after posting the round's replies
            if path.stat().st_size > journal.position:
                break
            await asyncio.sleep(0.01)
        # One step, from the header (after a round before the append's) or from the append's end,
        # and not past the generation's checkpoint point.
        ahead = path.stat().st_size
        assert ahead in {min(start + PREALLOCATE_STEP, journal._limit) for start in (ENTRIES_START, journal.position)}
        await c.append(1, 0, make_records(3, 2))  # over the zeros: no room wanted yet
        await asyncio.sleep(0.05)
        assert path.stat().st_size == ahead and not journal.wants_room
        assert list(await c.record_list(1, 0, 0, 100)) == make_records(0, 5)


async def test_zeros_that_cannot_be_written_leave_the_appends_alone_and_are_tried_again_after_a_checkpoint(
        tmp_path: Path, cluster_key, caplog: pytest.LogCaptureFixture) -> None:
    async with _journaled_node(tmp_path, cluster_key, 0, io_threads=0) as (node, c):
        rounds = node.io_threads[0]
        journal = rounds.journal
        assert journal is not None
        tries: list[int] = []

        def full_disk() -> None:
            tries.append(journal.position)
            raise OSError(28, "No space left on device")

        journal.preallocate = full_disk  # type: ignore[method-assign]
        journal._ahead = 1 << 40  # room wanted after every round from now on
        with caplog.at_level("WARNING", logger="waltz.storage.node"):
            await c.append(1, 0, make_records(0, 3))
            await c.append(1, 0, make_records(3, 3))
        assert len(tries) == 1  # not every round: once, until the next checkpoint
        assert [r for r in caplog.records if "could not write zeros ahead" in r.getMessage()]
        assert list(await c.record_list(1, 0, 0, 100)) == make_records(0, 6)
        rounds.checkpoint()
        await c.append(1, 0, make_records(6, 1))
        assert len(tries) == 2


async def test_a_node_restarted_on_a_still_full_disk_refuses_to_start_and_keeps_its_journal(
        tmp_path: Path, cluster_key) -> None:
    """A full disk puts the journal in doubt; a restart before space is freed cannot replay it.
    It must say so and keep the journal (not make the partition unavailable and empty the
    journal, which would leave its acknowledged records only on the other replicas); the start
    after space was freed replays every acknowledged record."""
    require(small_filesystems_available(), "root and mount (a tmpfs of a fixed size: a real full disk)")
    with small_filesystem(tmp_path / "small", 4 << 20) as disk:
        directory = disk.path / "node"
        acknowledged = 0
        async with _journaled_node(directory, cluster_key, 0) as (node, c):
            disk.fill(leave=64 * 1024)
            with pytest.raises(StorageError):  # small batches, gathered in memory, until the disk is full
                while True:
                    await c.append(1, 0, make_records(acknowledged, 10))
                    acknowledged += 10
            assert acknowledged > 0
        journaled = [e for p in journal_paths(directory) for e in read_journal(p)[0]]
        assert journaled, "the acknowledged batches are in the journal"
        with pytest.raises(StorageError, match=r"No space left on device\. Nothing was lost.*free space on the "
                                               r"filesystem of .* and start again"):
            await NodeHarness(directory, cluster_key, node_options={"journal": True}).start()
        assert [e for p in journal_paths(directory) for e in read_journal(p)[0]] == journaled
        disk.free()
        async with _journaled_node(directory, cluster_key, 0) as (node, c):
            assert node.healthy()[0], node.healthy()
            assert list(await c.record_list(2, 0, 0, acknowledged + 10)) == make_records(0, acknowledged)
