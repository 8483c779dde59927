"""Hypothesis stateful test: the segmented layout against an in-memory list of records."""

from __future__ import annotations

import shutil
import tempfile
import uuid
import zlib
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from waltz_core.protocol.wire import Record, RecordHeader, ReqId
from waltz_core.storage.segmented import SegmentedLayout, SegmentedPartition


def _record(txn: int, data: bytes) -> Record:
    return Record(txn, ReqId(txn % 7, 3, 0, txn), txn * 31 & 0x7FFFFFFF, data, zlib.crc32(data))


class LayoutMachine(RuleBasedStateMachine):
    """Appends, truncates, reopens and reads; the model is the list of acknowledged records."""

    @initialize()
    def setup(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="waltz-layout-"))
        self.key = uuid.uuid4()
        self.model: list[Record] = []
        self.layout = self._layout()
        self.store = self.layout.open_partition(0)

    def _layout(self) -> SegmentedLayout:
        # Tiny segments and checkpoints so rolls, checkpoints and rebuilds all happen.
        layout = SegmentedLayout(self.tmp, segment_size_threshold=600, segment_cache_capacity=2,
                                 index_checkpoint_interval=4)
        layout.open(self.key, 1)
        return layout

    @rule(sizes=st.lists(st.integers(0, 120), min_size=1, max_size=12))
    def append(self, sizes: list[int]) -> None:
        start = len(self.model)
        batch = [_record(start + i, bytes([(start + i) % 251]) * n) for i, n in enumerate(sizes)]
        self.store.append(batch)
        self.model.extend(batch)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        keep_to = data.draw(st.integers(-1, len(self.model) - 1), label="truncate to")
        self.store.truncate(keep_to)
        del self.model[keep_to + 1 :]

    @rule()
    def restart(self) -> None:
        self.store.close()
        self.layout.close()
        self.layout = self._layout()
        self.store = self.layout.open_partition(0)
        assert self.store.repairs() == [], "a clean close needs no repair"

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def read_one(self, data: st.DataObject) -> None:
        txn = data.draw(st.integers(0, len(self.model) - 1), label="txn")
        assert self.store.read_record(txn) == self.model[txn]
        r = self.model[txn]
        assert self.store.read_header(txn) == RecordHeader(r.transaction_id, r.req_id, r.header)

    @rule(data=st.data())
    def read_range(self, data: st.DataObject) -> None:
        start = data.draw(st.integers(-2, len(self.model) + 2), label="start")
        count = data.draw(st.integers(0, 40), label="count")
        expected = self.model[start : start + count] if start >= 0 else []
        assert self.store.read_records(start, count) == expected
        assert [h.transaction_id for h in self.store.read_headers(start, count)] == [r.transaction_id for r in expected]

    @invariant()
    def max_transaction_id(self) -> None:
        if hasattr(self, "store"):
            assert self.store.max_transaction_id == len(self.model) - 1
            assert self.store.read_record(len(self.model)) is None

    def teardown(self) -> None:
        if hasattr(self, "store"):
            self.store.close()
            self.layout.close()
            shutil.rmtree(self.tmp, ignore_errors=True)


TestLayoutMachine = LayoutMachine.TestCase
TestLayoutMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_segment_files_follow_the_seed_names(tmp_path: Path) -> None:
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
