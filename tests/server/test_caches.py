"""The server's cache budgets: one per kind for the whole server, shared by its partitions.

Checked: the bytes charged never exceed the budget after a commit batch settles and always equal
what the caches hold; the globally oldest entries go first, and only as many as needed; emptied
caches give their bytes back; oversize data is not cached; removed config keys say what replaced them.
"""

from __future__ import annotations

from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from waltz_core.config import ServerProcessConfig, load
from waltz_core.errors import ConfigError
from waltz_core.server import caches
from waltz_core.server.caches import (
    DATA_CHUNK,
    DATA_ENTRY_OVERHEAD,
    FIFO_ENTRY_COST,
    FRAME_COST,
    SKIPPED_DATA_COST,
    CacheBudget,
    DataCache,
    FeedCache,
)

F, E = FRAME_COST, FIFO_ENTRY_COST


def fill(cache: FeedCache, first: int, count: int) -> None:
    for txn in range(first, first + count):
        cache.add(txn, b"f%d" % txn)
    cache.settle()


def held(cache: FeedCache) -> list[int]:
    """Transaction ids the feed cache holds, oldest first."""
    out = []
    txn = 0
    while True:
        frames = cache.get(txn, 1 << 30)
        if frames is not None:
            return list(range(txn, txn + len(frames)))
        if cache.nbytes == 0 or txn > 10_000:
            return out
        txn += 1


def test_partitions_share_one_budget_and_the_globally_oldest_go_first() -> None:
    budget = CacheBudget(10 * F + 2 * E)  # 10 frames and two FIFO entries
    a, b = FeedCache(budget), FeedCache(budget)
    fill(a, 0, 6)  # a: 0..5
    fill(b, 0, 3)  # b: 0..2 (9 frames in all)
    assert budget.used == 9 * F + 2 * E
    fill(b, 3, 4)  # 13 frames (b's batches share its FIFO entry): the 3 oldest go, all of them a's
    assert held(a) == [3, 4, 5]
    assert held(b) == list(range(7))
    assert budget.used == 10 * F + 2 * E == a.nbytes + b.nbytes + budget.fifo_bytes
    fill(a, 6, 1)  # one frame and a new FIFO entry over: two frames go (enough to cover both), not all of a
    assert held(a) == [5, 6]
    assert budget.used <= budget.limit


def test_a_hot_partition_may_use_the_whole_budget_and_an_emptied_one_gives_it_back() -> None:
    budget = CacheBudget(100 * F + 2 * E)
    idle, hot = FeedCache(budget), FeedCache(budget)
    fill(idle, 0, 10)
    fill(hot, 0, 500)
    assert idle.nbytes == 0 and hot.nbytes == 100 * F
    hot.reset(500)  # a session reset or a closed partition
    assert budget.used == budget.fifo_bytes  # only hot's stale FIFO entry is left
    fill(idle, 10, 5)
    fill(hot, 500, 99)  # over by 4 frames and an entry: the stale entry is skipped, idle's 4 oldest go
    assert held(idle) == [14] and held(hot) == list(range(500, 599))
    assert budget.used == 100 * F + 2 * E


def test_data_cache_charges_data_plus_overhead_and_skips_oversize_entries() -> None:
    budget = CacheBudget(4 * (100 + DATA_ENTRY_OVERHEAD) + E)
    cache = DataCache(budget)
    cache.put(0, b"x" * 100, 1)
    cache.put(1, b"y" * (budget.limit // 4 + 1), 2)  # bigger than a quarter of the budget
    cache.settle()
    assert cache.get(0) == (b"x" * 100, 1) and cache.get(1) is None
    assert budget.used == 100 + DATA_ENTRY_OVERHEAD + SKIPPED_DATA_COST + E
    for txn in range(2, 8):
        cache.put(txn, b"z" * 100, txn)
    cache.settle()
    assert [t for t in range(8) if cache.get(t) is not None] == [4, 5, 6, 7]
    cache.clear()
    assert budget.used == budget.fifo_bytes


def test_a_zero_budget_caches_nothing() -> None:
    budget = CacheBudget(0)
    cache = FeedCache(budget)
    fill(cache, 0, 5)
    assert budget.used == 0 and cache.get(0, 5) is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 40), st.booleans()), max_size=60),
       st.integers(0, 50))
def test_the_budget_is_never_exceeded_and_always_adds_up(ops: list[tuple[int, int, bool]], frames: int) -> None:
    budget = CacheBudget(frames * F)
    caches = [FeedCache(budget) for _ in range(3)]
    next_txn = [0, 0, 0]
    for which, count, reset in ops:
        cache = caches[which]
        if reset:
            cache.reset(next_txn[which])
        fill(cache, next_txn[which], count)
        next_txn[which] += count
        assert budget.used <= budget.limit
        assert budget.used == sum(c.nbytes for c in caches) + budget.fifo_bytes
        ids = held(cache)
        assert ids == list(range(next_txn[which] - len(ids), next_txn[which]))  # newest kept, contiguous


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2 * DATA_CHUNK + 3), st.booleans(), st.booleans()), max_size=25),
       st.integers(0, 3 * DATA_CHUNK), st.sampled_from([caches.DATA_CHUNK_BYTES, 100]))
def test_data_cache_holds_the_newest_contiguous_entries_across_chunks(
        batches: list[tuple[int, bool, bool]], room: int, chunk_bytes: int) -> None:
    """Against a model: after each settled batch the cache holds the newest entries that fit the
    budget, contiguous by id, with their data and checksums, over chunk boundaries (chunks closed
    by entry count, or by bytes when ``chunk_bytes`` is small) and restarts."""
    with mock.patch.object(caches, "DATA_CHUNK_BYTES", chunk_bytes):
        _data_cache_against_a_model(batches, room)


def _data_cache_against_a_model(batches: list[tuple[int, bool, bool]], room: int) -> None:
    size = 8
    budget = CacheBudget(room * (size + DATA_ENTRY_OVERHEAD) + FIFO_ENTRY_COST)
    cache = DataCache(budget)
    model: dict[int, tuple[bytes, int]] = {}
    next_id = 0
    for count, restart, oversize in batches:
        if restart and count:  # a new store session: ids go on from elsewhere (seen at its first put)
            next_id += 1000
            model.clear()
        for txn in range(next_id, next_id + count):
            data = b"x" * (budget.limit // 4 + 1) if oversize and txn % 7 == 0 else b"%08d" % (txn % 10**8)
            cache.put(txn, data, txn * 3)
            if len(data) <= budget.limit // 4:
                model[txn] = (data, txn * 3)
        next_id += count
        cache.settle()
        assert budget.used <= budget.limit
        assert budget.used == cache.nbytes + budget.fifo_bytes
        held = [t for t in range(next_id - 3 * DATA_CHUNK - 10, next_id + 2) if cache.get(t) is not None]
        assert held == [t for t in sorted(model) if t >= (held[0] if held else next_id)]
        for t in held:
            assert cache.get(t) == model[t]
        assert [t for t in range(next_id - 3 * DATA_CHUNK - 10, next_id + 2) if cache.holds(t)] == held
        if held:  # a run from the oldest held entry is the held entries in order, bounded by count and bytes
            data, sums, size = cache.get_run(held[0], len(held) + 5, 1 << 30, 3)
            run = held[:len(data)]
            assert run == list(range(held[0], held[0] + len(data)))  # contiguous up to the first gap
            assert data == [model[t][0] for t in run] and sums == [model[t][1] for t in run]
            assert size == sum(len(d) + 3 for d in data)
            assert len(data) == len(held) or held[len(data)] != held[0] + len(data)
            one, _, _ = cache.get_run(held[0], 99, 1, 0)
            assert one == [model[held[0]][0]]  # the first always, however big
            two, _, size2 = cache.get_run(held[0], 99, len(data[0]) + len(data[-1]) + 8, 4)
            assert (len(two) <= 2 and size2 <= len(data[0]) + len(data[-1]) + 8) or len(two) == 1
        if held:  # nothing newer than the oldest held entry was evicted
            assert all(t in held for t in model if t > held[0])


@pytest.mark.parametrize(("old", "new"), [("feed_cache_size", "server.feed_cache_budget"),
                                          ("transaction_data_cache_size", "server.data_cache_budget"),
                                          ("min_fetch_size", "delete the line"),
                                          ("realtime_threshold", "delete the line")])
def test_removed_keys_say_what_replaced_them(tmp_path, old: str, new: str) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "server.toml"
    path.write_text(f"[server]\n{old} = 100\n")
    with pytest.raises(ConfigError, match=f"server.toml: server.{old}: removed in 0.2.*{new}"):
        load(ServerProcessConfig, path, environ={})
    with pytest.raises(ConfigError, match=f"WALTZ_SERVER_{old.upper()}: removed in 0.2.*{new}"):
        load(ServerProcessConfig, None, environ={f"WALTZ_SERVER_{old.upper()}": "100"})


def _chunks(cache: DataCache) -> list[tuple[int, bytes, list[int], list[int]]]:
    return [(c.first, bytes(c.data), list(c.ends), list(c.checksums)) for c in cache._chunks if c is not None]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, DATA_CHUNK + 3), st.integers(0, 60), st.booleans(), st.booleans()),
                max_size=12),
       st.integers(1, 3 * DATA_CHUNK), st.sampled_from([caches.DATA_CHUNK_BYTES, 100, 1000]))
def test_put_many_leaves_the_cache_as_puts_one_at_a_time_do(batches: list[tuple[int, int, bool, bool]], room: int,
                                                            chunk_bytes: int) -> None:
    """The same chunks (cut by entry count or bytes at the same entries), budget, eviction and
    contents, with entries of mixed sizes, oversize ones and restarts."""
    with mock.patch.object(caches, "DATA_CHUNK_BYTES", chunk_bytes):
        limit = room * (30 + DATA_ENTRY_OVERHEAD) + FIFO_ENTRY_COST
        one, many = DataCache(CacheBudget(limit)), DataCache(CacheBudget(limit))
        next_id = 0
        for count, size, restart, oversize in batches:
            if restart and count:
                next_id += 1000
            data = [b"x" * (limit // 4 + 1) if oversize and t % 5 == 0 else bytes([t % 251]) * ((t * size) % 61)
                    for t in range(next_id, next_id + count)]
            sums = [t * 3 for t in range(next_id, next_id + count)]
            for i in range(count):
                one.put(next_id + i, data[i], sums[i])
            many.put_many(next_id, data, sums)
            one.settle()
            many.settle()
            next_id += count
            assert _chunks(many) == _chunks(one)
            assert (many._head, many._next, many._firsts[many._start:]) == (one._head, one._next,
                                                                          one._firsts[one._start:])
            assert many.nbytes == one.nbytes and many.budget.used == one.budget.used
            assert [many.get(t) for t in range(next_id - count - 2, next_id)] == \
                [one.get(t) for t in range(next_id - count - 2, next_id)]
