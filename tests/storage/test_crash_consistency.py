"""Crash consistency: torn tails at every byte, torn partition-info structs, corrupt index entries."""

from __future__ import annotations

import os
import struct
import uuid
from pathlib import Path

import pytest

from waltz_core.errors import StorageCorruptionError
from waltz_core.protocol.wire import Record, RecordBatch
from waltz_core.storage.format import HEADER_SIZE, INFO_SIZE, partition_entry_offset
from waltz_core.storage.segmented import REPAIR_LOG_NAME, SegmentedLayout

from .conftest import NodeHarness, make_record, make_records


def _fresh(tmp: Path, key: uuid.UUID, interval: int = 5) -> SegmentedLayout:
    layout = SegmentedLayout(tmp, index_checkpoint_interval=interval)
    layout.open(key, 2)
    return layout


def _crash_copy(src: Path, dst: Path) -> None:
    """Copy a storage directory whose store is still open: what a killed process leaves on disk."""
    for path in src.rglob("*"):
        target = dst / path.relative_to(src)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path.read_bytes())


def _segment(tmp: Path, suffix: str = ".seq") -> Path:
    (path,) = sorted((tmp / "0").glob("*" + suffix))
    return path


def test_torn_last_record_at_every_byte_offset(tmp_path: Path) -> None:
    key = uuid.uuid4()
    src = tmp_path / "src"
    layout = _fresh(src, key)
    store = layout.open_partition(0)
    acknowledged = make_records(0, 12)
    store.append(acknowledged)
    last = make_records(12, 1)[0]
    before = _segment(src).stat().st_size
    store.append([last])
    after = _segment(src).stat().st_size
    _crash_copy(src, tmp_path / "killed")  # no close: the index tail is not checkpointed
    store.close()
    layout.close()
    src = tmp_path / "killed"
    full = _segment(src).read_bytes()
    index = _segment(src, ".idx").read_bytes()
    assert after - before == 40 + len(last.data)

    for cut in range(before, after):  # every byte offset inside the last record
        work = tmp_path / f"cut{cut}"
        (work / "0").mkdir(parents=True)
        (work / "waltz-storage.ctl").write_bytes((src / "waltz-storage.ctl").read_bytes())
        _segment(src).with_name(_segment(src).name)
        (work / "0" / _segment(src).name).write_bytes(full[:cut])
        (work / "0" / _segment(src, ".idx").name).write_bytes(index)
        layout = SegmentedLayout(work, index_checkpoint_interval=5)
        layout.open(key, 2)
        store = layout.open_partition(0)
        assert store.max_transaction_id == 11, f"cut at {cut}"
        assert store.read_records(0, 100) == acknowledged, f"cut at {cut}"
        if cut > before:
            assert any("truncated" in r.action and str(cut - before) in r.action for r in store.repairs()), cut
        # The repaired log accepts the next record again.
        store.append([last])
        assert store.read_record(12) == last
        store.close()
        layout.close()


def test_corrupt_byte_in_tail_record_is_truncated_and_reported(tmp_path: Path) -> None:
    key = uuid.uuid4()
    live = tmp_path / "live"
    layout = _fresh(live, key, interval=1000)
    store = layout.open_partition(0)
    recs = make_records(0, 8)
    store.append(recs)
    _crash_copy(live, tmp_path / "killed")
    store.close()
    layout.close()
    tmp_path = tmp_path / "killed"
    seg = _segment(tmp_path)
    raw = bytearray(seg.read_bytes())
    raw[-10] ^= 0xFF  # inside the data of the last record (never acknowledged: its sync did not return)
    seg.write_bytes(bytes(raw))
    layout = _fresh(tmp_path, key, interval=1000)
    store = layout.open_partition(0)
    assert store.read_records(0, 100) == recs[:7]
    (repair,) = [r for r in store.repairs() if "truncated" in r.action]
    assert "record 7" in repair.detail and "checksum" in repair.detail
    assert "truncated" in (tmp_path / REPAIR_LOG_NAME).read_text()
    # Records after the repaired point are accepted again.
    store.append(recs[7:])
    assert store.read_records(0, 100) == recs
    store.close()
    layout.close()


def _corrupt_info(tmp: Path, partition_id: int, struct_no: int) -> None:
    path = tmp / "waltz-storage.ctl"
    raw = bytearray(path.read_bytes())
    offset = partition_entry_offset(partition_id) + 4 + struct_no * INFO_SIZE + 3
    raw[offset] ^= 0x5A
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("torn", [0, 1])
def test_torn_partition_info_struct_falls_back_to_the_other(tmp_path: Path, torn: int) -> None:
    key = uuid.uuid4()
    layout = _fresh(tmp_path, key)
    from waltz_core.storage.format import PartitionInfo

    first = layout.write_partition_info(0, PartitionInfo(5, 10, 10, 5))  # goes to struct 2 (index 1)
    second = layout.write_partition_info(0, PartitionInfo(6, 20, 20, 5))  # struct 1 (index 0)
    layout.close()
    _corrupt_info(tmp_path, 0, torn)
    layout = _fresh(tmp_path, key)
    info = layout.read_partition_info(0)
    survivor = second if torn == 1 else first
    assert (info.session_id, info.low_water_mark) == (survivor.session_id, survivor.low_water_mark)
    (repair,) = layout.repairs()
    assert f"struct {torn + 1} fails its checksum" in repair.detail
    # The next write goes over the torn struct; the good one stays as the fallback.
    layout.write_partition_info(0, PartitionInfo(7, 30, 30, 5))
    layout.close()
    layout = _fresh(tmp_path, key)
    assert layout.read_partition_info(0).session_id == 7
    assert layout.repairs() == []
    layout.close()


async def test_both_structs_bad_refuses_only_that_partition(tmp_path: Path, cluster_key: uuid.UUID) -> None:
    h = NodeHarness(tmp_path, cluster_key)
    await h.start()
    admin = await h.admin()
    await admin.set_assignment([0, 1], True)
    c = await h.client()
    await c.append(1, 1, make_records(0, 3, 1))
    await h.stop()
    _corrupt_info(tmp_path, 0, 0)
    _corrupt_info(tmp_path, 0, 1)
    node = await h.start()
    c = await h.client()
    with pytest.raises(StorageCorruptionError, match="both partition-info structs fail their checksums"):
        await c.max_transaction_id(1, 0)
    assert await c.max_transaction_id(1, 1) == 2  # the other partition is served
    healthy, details = node.healthy()
    assert not healthy and 0 in details["broken_partitions"]
    await h.stop()


def test_corrupt_index_entries_are_rebuilt_and_reported(tmp_path: Path) -> None:
    key = uuid.uuid4()
    layout = _fresh(tmp_path, key, interval=10)
    store = layout.open_partition(0)
    recs = make_records(0, 35)
    store.append(recs)
    store.close()
    layout.close()
    idx = _segment(tmp_path, ".idx")
    raw = bytearray(idx.read_bytes())
    struct.pack_into(">q", raw, HEADER_SIZE + 8 * 4, 999_999)  # garbage entry inside the checkpointed part
    idx.write_bytes(bytes(raw))
    layout = _fresh(tmp_path, key, interval=10)
    store = layout.open_partition(0)
    assert store.read_records(0, 100) == recs
    assert any("rebuilt index" in r.action and "entry 5" in r.detail for r in store.repairs()), store.repairs()
    store.close()
    layout.close()


def test_subtly_wrong_index_entry_is_caught_when_read(tmp_path: Path) -> None:
    key = uuid.uuid4()
    layout = _fresh(tmp_path, key, interval=1000)
    store = layout.open_partition(0)
    recs = make_records(0, 30)
    store.append(recs)
    store.close()
    layout.close()
    idx = _segment(tmp_path, ".idx")
    raw = bytearray(idx.read_bytes())
    (entry,) = struct.unpack_from(">q", raw, HEADER_SIZE + 8 * 7)
    struct.pack_into(">q", raw, HEADER_SIZE + 8 * 7, entry + 1)  # still plausible, points one byte off
    idx.write_bytes(bytes(raw))
    layout = _fresh(tmp_path, key, interval=1000)
    store = layout.open_partition(0)
    assert store.read_record(7) == recs[7]
    assert any("rebuilt index" in r.action for r in store.repairs())
    store.close()
    layout.close()


def test_corrupt_record_in_the_middle_is_never_served(tmp_path: Path) -> None:
    key = uuid.uuid4()
    layout = _fresh(tmp_path, key, interval=5)
    store = layout.open_partition(0)
    recs = make_records(0, 20)
    store.append(recs)
    store.close()
    layout.close()
    seg = _segment(tmp_path)
    raw = bytearray(seg.read_bytes())
    idx = _segment(tmp_path, ".idx").read_bytes()
    (off,) = struct.unpack_from(">q", idx, HEADER_SIZE + 8 * 3)
    raw[off + 40] ^= 0x01  # a data byte of transaction 3 (bit rot in the checkpointed part)
    seg.write_bytes(bytes(raw))
    layout = _fresh(tmp_path, key, interval=5)
    store = layout.open_partition(0)
    assert store.read_record(2) == recs[2]
    with pytest.raises(StorageCorruptionError, match="transaction 3"):
        store.read_record(3)
    with pytest.raises(StorageCorruptionError):
        store.read_records(0, 10)
    store.close()
    layout.close()


def test_segment_left_empty_by_a_crash_during_creation_is_removed(tmp_path: Path) -> None:
    key = uuid.uuid4()
    layout = _fresh(tmp_path, key)
    store = layout.open_partition(0)
    store.append(make_records(0, 5))
    store.close()
    layout.close()
    (tmp_path / "0" / f"{5:019d}.seq").write_bytes(b"\0" * 50)  # torn header
    layout = _fresh(tmp_path, key)
    store = layout.open_partition(0)
    assert store.max_transaction_id == 4
    assert any("removed empty segment" in r.action for r in store.repairs())
    assert not (tmp_path / "0" / f"{5:019d}.seq").exists()
    store.close()
    layout.close()


def test_unsynced_index_tail_is_rebuilt_after_a_kill(tmp_path: Path) -> None:
    """Simulate a process kill: no close, index entries past the checkpoint are zeros."""
    key = uuid.uuid4()
    layout = _fresh(tmp_path, key, interval=10)
    store = layout.open_partition(0)
    recs = make_records(0, 25)
    for r in recs:
        store.append([r])
    idx = _segment(tmp_path, ".idx")
    raw = bytearray(idx.read_bytes())
    raw[HEADER_SIZE + 8 * 20 :] = b"\0" * (len(raw) - HEADER_SIZE - 8 * 20)  # lost page-cache writes
    os.truncate(idx, 0)
    idx.write_bytes(bytes(raw))
    layout2 = SegmentedLayout(tmp_path / "copy", index_checkpoint_interval=10)
    (tmp_path / "copy" / "0").mkdir(parents=True)
    for p in [tmp_path / "waltz-storage.ctl", *(tmp_path / "0").iterdir()]:
        dst = tmp_path / "copy" / p.relative_to(tmp_path)
        dst.write_bytes(p.read_bytes())
    layout2.open(key, 2)
    store2 = layout2.open_partition(0)
    assert store2.read_records(0, 100) == recs
    store2.close()
    layout2.close()
    store.close()
    layout.close()


def test_a_failed_sync_leaves_the_store_where_its_last_sync_did(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """write_validated then a sync_written whose fdatasync fails: the records were never durable
    and never acknowledged, so the store ends where it was and the next write takes their ids and
    their place. A reopen finds what was synced; bytes of the failed write that the next one did
    not cover may still scan as records after it (never acknowledged: the server's recovery
    truncates what no quorum holds, as after a crash between a write and its fdatasync)."""
    def records(start: int, count: int, tag: str) -> list[Record]:
        return [make_record(t, data=f"{tag} {t}".encode()) for t in range(start, start + count)]

    key = uuid.uuid4()
    layout = _fresh(tmp_path, key)
    store = layout.open_partition(0)
    first = RecordBatch.from_records(make_records(0, 4))
    store.append_validated(first.data, first.offsets)
    lost = RecordBatch.from_records(records(4, 3, 'lost'))
    store.write_validated(lost.data, lost.offsets)  # type: ignore[attr-defined]
    assert store.max_transaction_id == 6

    def failing(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(store, "_sync_appended", failing)
    with pytest.raises(OSError, match="Input/output"):
        store.sync_written()  # type: ignore[attr-defined]
    monkeypatch.undo()
    assert store.max_transaction_id == 3
    kept = RecordBatch.from_records(records(4, 2, 'kept'))
    store.append_validated(kept.data, kept.offsets)
    assert store.read_records(0, 10) == make_records(0, 4) + records(4, 2, 'kept')
    store.close()
    layout.close()
    layout = _fresh(tmp_path, key)
    store = layout.open_partition(0)
    assert store.read_records(0, 6) == make_records(0, 4) + records(4, 2, 'kept')
    assert store.read_records(6, 10) in ([], records(6, 1, 'lost'))
    store.close()
    layout.close()
