"""Feeds of a partition (server/partition.py): a commit posts its feed records itself to the
clients whose feed is idle, caught up and writable; other feeds are woken to read the feed
cache. Either way every client gets every transaction once, in order."""

from __future__ import annotations

from typing import Any

import pytest

import waltz_core.server.partition as partition_module
from waltz_core.protocol import client as m
from waltz_core.protocol.checksum import crc32
from waltz_core.protocol.wire import ReqId

from .conftest import Link, append, settle

pytestmark = pytest.mark.timeout(30)


async def _append_n(partition: Any, link: Any, first_seq: int, n: int) -> None:
    for i in range(n):
        await partition.submit(append(first_seq + i, f"t{first_seq + i}".encode()), link)
    await settle()


async def test_a_commit_feeds_an_idle_caught_up_client_itself(mounted: Any) -> None:
    store, partition, link = mounted
    await _append_n(partition, link, 1, 5)
    store.commit(4)
    assert link.fed == [0, 1, 2, 3, 4], "posted inside the commit, with no feed task step"
    await _append_n(partition, link, 6, 3)
    store.commit(5)
    store.commit(7)
    assert link.fed == list(range(8))
    await settle()
    assert link.fed == list(range(8)), "the feed task posts nothing twice"


async def test_a_client_that_is_not_writable_is_fed_by_its_task_then_by_commits_again(mounted: Any) -> None:
    store, partition, link = mounted
    await _append_n(partition, link, 1, 4)
    link.writable = False
    store.commit(3)
    assert link.fed == [], "a client with too much unsent data is left to its feed task"
    await settle()
    assert link.fed == [0, 1, 2, 3]  # the task read the feed cache (this link's wait_writable returns at once)
    link.writable = True
    await _append_n(partition, link, 5, 2)
    store.commit(5)
    assert link.fed == list(range(6))


async def test_a_restarted_feed_resends_from_the_clients_mark_without_duplicates(mounted: Any) -> None:
    store, partition, link = mounted
    await _append_n(partition, link, 1, 8)
    store.commit(5)
    assert link.fed == list(range(6))
    await partition.submit(m.FeedRequest(ReqId(1, 1, 0, 10), 2), link)  # the client asks again from 3
    store.commit(7)  # at once: the new feed task has not run yet, the old one is cancelled
    await settle()
    assert link.fed == list(range(6)) + [3, 4, 5, 6, 7]
    await _append_n(partition, link, 11, 1)
    store.commit(8)
    assert link.fed == list(range(6)) + [3, 4, 5, 6, 7, 8]


async def test_commit_latency_is_summarised_again_only_after_commits_and_a_while(
        mounted: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    store, partition, link = mounted
    sorts: list[int] = []
    real_sorted = sorted
    monkeypatch.setattr(partition_module, "sorted", lambda values: (sorts.append(len(values)), real_sorted(values))[1],
                        raising=False)
    await _append_n(partition, link, 1, 3)
    store.commit(2)
    first = partition.commit_latency
    assert first[0] > 0 and first[1] >= first[0] and sorts == [3]
    assert partition.commit_latency is first and sorts == [3], "no commit since: the summary is reused"
    await _append_n(partition, link, 4, 2)
    store.commit(4)
    assert partition.commit_latency is first and sorts == [3], "commits since, but the summary is recent"
    monkeypatch.setattr(partition_module, "LATENCY_SUMMARY_MAX_AGE", 0.0)
    assert partition.commit_latency is not first and sorts == [3, 5]


async def test_a_commit_of_ids_that_are_not_consecutive_is_taken_run_by_run(mounted: Any,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    store, partition, link = mounted
    one_by_one: list[int] = []
    slow = partition._take_committed_runs
    monkeypatch.setattr(partition, "_take_committed_runs", lambda hwm: (one_by_one.append(hwm), slow(hwm))[1])
    await _append_n(partition, link, 1, 3)  # ids 0..2
    store.commit(2)
    assert one_by_one == [] and partition._data_cache.get(2) == (b"t3", crc32(b"t3"))
    await _append_n(partition, link, 4, 2)  # ids 3, 4
    store.appended.extend([b""] * 5)  # the next id is 10: a gap, which a session never leaves
    await _append_n(partition, link, 6, 2)  # ids 10, 11
    store.commit(11)
    assert one_by_one == [11] and not partition._pending and partition.high_water_mark == 11
    # Each run cached as far as the caches go: the data cache starts again at the gap.
    assert partition._data_cache.get(4) is None
    assert [partition._data_cache.get(t) for t in (10, 11)] == [(b"t6", crc32(b"t6")), (b"t7", crc32(b"t7"))]
    assert len(partition._latencies) == 7


async def test_a_mount_whose_connection_closed_while_it_waited_leaves_no_client_behind(mounted: Any) -> None:
    """A mount waits for the appends queued before it to commit. If its connection closes
    meanwhile, the server's disconnect() runs first; the mount must not add the client after it
    (a slot that stayed until the partition closed, its feed lag growing with every commit)."""
    store, partition, link = mounted
    await _append_n(partition, link, 1, 3)  # uncommitted: a mount behind them waits for them
    gone = Link()
    await partition.submit(m.MountRequest(ReqId(2, 1, 0, 0), -1, 1), gone)
    await settle()
    assert 2 not in partition._clients, "still waiting behind the appends"
    gone.closed = True
    partition.disconnect(gone)  # what the server does when the connection ends
    store.commit(2)
    await settle()
    assert set(partition._clients) == {1}
    assert gone.of(m.MountResponse) == []
    await _append_n(partition, link, 4, 1)
    store.commit(3)
    assert partition.max_feed_lag == 0
