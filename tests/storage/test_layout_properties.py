"""What only the segmented layout promises: its files are named as the original Waltz names them.

(Its appends, truncations, reopens and reads against a list model run in the storage-layout kit,
``test_random_operations_match_a_list_model`` in test_layout_conformance.py, with tiny segments.)
"""

from __future__ import annotations

import uuid
import zlib
from pathlib import Path

from waltz_core.protocol.wire import Record, ReqId
from waltz_core.storage.segmented import SegmentedLayout, SegmentedPartition


def _record(txn: int, data: bytes) -> Record:
    return Record(txn, ReqId(txn % 7, 3, 0, txn), txn * 31 & 0x7FFFFFFF, data, zlib.crc32(data))


def test_segment_files_follow_the_original_names(tmp_path: Path) -> None:
    layout = SegmentedLayout(tmp_path, segment_size_threshold=300)
    layout.open(uuid.uuid4(), 1)
    store = layout.open_partition(0)
    assert isinstance(store, SegmentedPartition)
    for t in range(20):
        store.append([_record(t, b"x" * 50)])
    names = sorted(p.name for p in (tmp_path / "0").iterdir())
    firsts = store.segment_firsts()
    assert len(firsts) > 1
    assert names == sorted([f"{f:019d}.seq" for f in firsts] + [f"{f:019d}.idx" for f in firsts])
    assert (tmp_path / "waltz-storage.ctl").stat().st_size == 128 + 76
    store.close()
    layout.close()
