"""Both built-in storage layouts pass the storage-layout kit; a cluster runs on the ``memory`` layout.

``segmented`` declares every durability capability (crash points, torn tails, index rebuild,
control-file twins) and loses no kit test. ``memory`` declares none: the kit removes those tests
from its class (listed in ``TestMemoryLayout.not_applicable``), it never skips them.
"""

from __future__ import annotations

import struct
from pathlib import Path
from types import MappingProxyType

import pytest

from waltz_core.client import AsyncWaltzClient, Transaction, TransactionContext, WaltzClientCallbacks
from waltz_core.client.api import TransactionBuilder
from waltz_core.storage import memory, segmented
from waltz_core.storage.format import (
    CONTROL_FILE_NAME,
    HEADER_SIZE,
    INFO_SIZE,
    decode_partition_info,
    partition_entry_offset,
)
from waltz_core.storage.layout import StorageLayout
from waltz_core.testing.cluster import ClusterSpec, InProcessCluster
from waltz_core.testing.conformance.storage_layout import CAPABILITIES, StorageLayoutConformance


class TestSegmentedLayout(StorageLayoutConformance):
    layout_name = "segmented"
    # Segments of a few records and frequent index checkpoints: the kit's scenarios roll segments.
    node_config = MappingProxyType({"segment_size_threshold": 700, "segment_cache_capacity": 2,
                                    "index_checkpoint_interval": 3})
    capabilities = CAPABILITIES

    def damage_index(self, directory: Path, partition_id: int, how: str) -> None:
        indexes = sorted((directory / str(partition_id)).glob("*.idx"))
        assert len(indexes) > 1, "the kit's records should span several segments"
        for path in indexes:
            if how == "lost":
                path.unlink()
            else:
                raw = bytearray(path.read_bytes())
                struct.pack_into(">q", raw, HEADER_SIZE, 999_999_999)  # the first entry points nowhere
                path.write_bytes(bytes(raw))

    def damage_control_copy(self, directory: Path, partition_id: int, which: str) -> None:
        path = directory / CONTROL_FILE_NAME
        raw = bytearray(path.read_bytes())
        entry = partition_entry_offset(partition_id) + 4
        valid = [(info.sequence_number, slot) for slot in (0, 1)
                 if (info := decode_partition_info(raw, entry + slot * INFO_SIZE)) is not None]
        _, slot = max(valid) if which == "newest" else min(valid)
        raw[entry + slot * INFO_SIZE + 3] ^= 0x5A
        path.write_bytes(bytes(raw))


class TestSegmentedLayoutIndexInSteps(TestSegmentedLayout):
    """The same kit with a tail's index entries written to its file every 2 and an open's check
    of an index 3 entries at a time: reads, truncations and crashes meet entries in the file,
    past the index's checkpoint, and in memory (tests/storage/test_segment_index.py)."""

    @pytest.fixture(autouse=True)
    def _small_index_steps(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(segmented, "PENDING_ENTRIES", 2)
        monkeypatch.setattr(segmented, "_ENTRIES_PER_CHECK", 3)


class TestMemoryLayout(StorageLayoutConformance):
    layout_name = "memory"

    def forget(self, layout: StorageLayout) -> None:
        memory.discard(layout.directory)  # its data outlives the closed layout, by design


def test_only_the_memory_layout_is_spared_the_durability_tests() -> None:
    assert TestSegmentedLayout.not_applicable == {} and TestSegmentedLayoutIndexInSteps.not_applicable == {}
    assert set(TestMemoryLayout.not_applicable) == {
        "test_every_crash_point_leaves_a_state_the_operation_allows", "test_a_torn_append_is_repaired_at_open",
        "test_an_index_that_is_lost_or_wrong_is_rebuilt", "test_a_damaged_partition_info_copy_falls_back_to_the_other",
        "test_both_partition_info_copies_damaged_refuse_only_that_partition"}
    assert TestMemoryLayout.test_a_torn_append_is_repaired_at_open is None  # type: ignore[comparison-overlap]


def test_an_unknown_capability_is_refused() -> None:
    with pytest.raises(TypeError, match="unknown storage-layout capabilities \\['fsync'\\]"):
        type("TestTypo", (StorageLayoutConformance,), {"layout_name": "segmented", "capabilities": frozenset({"fsync"})})


# ------------------------------------------------------------------------- a cluster on memory


class Recorder(WaltzClientCallbacks):
    """Keeps every applied transaction's data, per partition."""

    def __init__(self) -> None:
        self.applied: dict[int, list[tuple[int, bytes]]] = {}

    def client_high_water_mark(self, partition_id: int) -> int:
        return len(self.applied.get(partition_id, [])) - 1

    async def apply_transaction(self, transaction: Transaction) -> None:
        data = await transaction.fetch_data()
        self.applied.setdefault(transaction.partition_id, []).append((transaction.transaction_id, data))


class Put(TransactionContext):
    def __init__(self, partition: int, data: bytes) -> None:
        super().__init__()
        self.partition = partition
        self.data = data

    def partition_id(self, num_partitions: int) -> int:
        return self.partition % num_partitions

    def execute(self, builder: TransactionBuilder) -> bool:
        builder.set_transaction_data(self.data)
        return True


@pytest.mark.timeout(90)
async def test_a_cluster_commits_on_the_memory_layout(tmp_path: Path) -> None:
    spec = ClusterSpec(tmp_path / "cluster", num_partitions=2, num_storages=3, num_servers=1,
                       storage_overrides={"layout": "memory"})
    sent = {0: [f"p0-{i}".encode() for i in range(6)], 1: [f"p1-{i}".encode() for i in range(4)]}
    app = Recorder()
    try:
        async with InProcessCluster(spec) as cluster:
            assert spec.storage_config(0).storage.layout == "memory"
            async with AsyncWaltzClient(app, spec.client_config()) as client:
                for pid, payloads in sent.items():
                    for data in payloads:
                        await client.submit(Put(pid, data))
                await client.flush()
                assert [await client.high_water_mark(pid) for pid in (0, 1)] == [5, 3]
            # A storage node restarted in the process finds its partitions (the volume outlives the node).
            await cluster.stop_storage(0)
            await cluster.start_storage(0)
        assert {pid: [data for _, data in app.applied[pid]] for pid in (0, 1)} == sent
        key, num_partitions = await spec.store_params()
        for i in range(spec.num_storages):
            replica = spec.read_replica(i, key, num_partitions)
            assert {pid: [r.data for r in records] for pid, records in replica.items()} == sent, f"storage-{i}"
            directory = Path(spec.storage_config(i).storage.directory)
            assert not directory.exists() or not any(directory.iterdir()), "the memory layout wrote files"
    finally:
        for i in range(len(spec.storages)):
            memory.discard(spec.storage_config(i).storage.directory)
