"""The server's per-partition gauges: looked up once, refreshed in slices, never brought back."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from waltz_core.metrics import MetricsRegistry
from waltz_core.server import server as server_module
from waltz_core.server.server import PartitionGauges


class FakePartition:
    """What the gauges read of a partition."""

    def __init__(self, pid: int) -> None:
        self.high_water_mark = pid * 10
        self.queue_size = 1
        self.pending_count = 2
        self.generation = 3
        self.healthy = True
        self.commit_latency = (0.004, 0.009)
        self.max_feed_lag = 5


def gauge_values(registry: MetricsRegistry, name: str) -> dict[str, float]:
    return {row["labels"]["partition"]: row["value"]  # type: ignore[index]
            for row in registry.snapshot().get(f"waltz_server_{name}", [])}


async def test_the_gauges_show_each_partition_and_are_looked_up_once(monkeypatch: pytest.MonkeyPatch) -> None:
    registry = MetricsRegistry(prefix="waltz_server")
    lookups = 0
    get = registry._get

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal lookups
        lookups += 1
        return get(*args, **kwargs)

    monkeypatch.setattr(registry, "_get", counted)
    partitions: dict[int, Any] = {pid: FakePartition(pid) for pid in range(256)}
    gauges = PartitionGauges(registry)
    await gauges.refresh(partitions)
    assert lookups == 8 * 256
    hwm = gauge_values(registry, "high_water_mark")
    assert len(hwm) == 256 and hwm["7"] == 70
    assert gauge_values(registry, "commit_latency_p99_seconds")["255"] == 0.009
    partitions[7].high_water_mark = 71
    await gauges.refresh(partitions)
    assert lookups == 8 * 256, "the second refresh looked gauges up again"  # the code before: 4,096
    assert gauge_values(registry, "high_water_mark")["7"] == 71


async def test_a_partition_closed_while_a_refresh_yields_keeps_no_gauges(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server closes a partition (pops it, then drops its metrics) while a refresh is between
    two slices: the refresh must not make that partition's gauges again."""
    monkeypatch.setattr(server_module, "METRICS_SLICE", 0.0)  # a yield after every partition
    registry = MetricsRegistry(prefix="waltz_server")
    partitions: dict[int, Any] = {pid: FakePartition(pid) for pid in range(8)}
    gauges = PartitionGauges(registry)
    refresh = asyncio.get_running_loop().create_task(gauges.refresh(partitions))
    await asyncio.sleep(0)  # the refresh did partition 0 and yielded
    assert not refresh.done()
    del partitions[5]  # _close_partition: pop, close, then remove its metrics
    registry.remove({"partition": "5"})
    await refresh
    assert sorted(gauge_values(registry, "high_water_mark"), key=int) == ["0", "1", "2", "3", "4", "6", "7"]

    partitions[5] = FakePartition(5)  # opened again: a new partition object gets gauges in the registry
    partitions[5].high_water_mark = 99
    await gauges.refresh(partitions)
    assert gauge_values(registry, "high_water_mark")["5"] == 99
    partitions[6] = FakePartition(6)  # replaced without a pass in between: its gauges are made again
    registry.remove({"partition": "6"})
    await gauges.refresh(partitions)
    assert gauge_values(registry, "high_water_mark")["6"] == 60


async def test_a_partition_opened_again_before_its_old_gauges_were_removed_gets_them_back() -> None:
    """``_close_partition`` pops the partition, awaits its close, then removes its metrics. If the
    partition is opened again meanwhile and a refresh makes its gauges, the removal takes those
    too: ``forget`` (called with the removal) makes the next refresh register them again."""
    registry = MetricsRegistry(prefix="waltz_server")
    partitions: dict[int, Any] = {3: FakePartition(3)}
    gauges = PartitionGauges(registry)
    await gauges.refresh(partitions)
    del partitions[3]  # closing: popped
    partitions[3] = FakePartition(3)  # opened again while the close was awaited
    await gauges.refresh(partitions)
    registry.remove({"partition": "3"})  # the close ends: its metrics go, the new partition's with them
    gauges.forget(3)
    await gauges.refresh(partitions)
    assert gauge_values(registry, "high_water_mark") == {"3": 30}
