"""The hashed table against the exact oracle, the original's slot function, and the server pipeline."""

from __future__ import annotations

import ctypes
from collections import deque

import attrs
import pytest
from hypothesis import Phase, event, given, settings
from hypothesis import strategies as st

from waltz_core.config import InvalidValue, ServerConfig
from waltz_core.errors import BackendNotFoundError, ConfigError
from waltz_core.locks import (
    Begin,
    ExactLockTable,
    HashedLockTable,
    LockRequest,
    open_lock_table,
)
from waltz_core.locks import hashed as hashed_module
from waltz_core.locks.hashed import slot_indices
from waltz_core.protocol.client import AppendRequest, ReqId
from waltz_core.runtime import Runtime

REGISTRIES = Runtime.load(autoload=False).registries


def java_slots(lock_hash: int, size: int, count: int) -> list[int]:
    """Locks.java with Java int semantics emulated by ctypes.c_int32 (wrapping signed multiply)."""
    h = ctypes.c_int32(lock_hash).value
    out = []
    for _ in range(count):
        h = ctypes.c_int32(h * 1103515245 + 12345).value
        out.append((h & 0x3FFFFFFF) % size)
    return out


@pytest.mark.parametrize("lock", [0, 1, -1, 12345, -1177318867, 2**31 - 1, -(2**31)])
def test_slots_are_the_originals(lock: int) -> None:
    assert list(slot_indices(lock, 30_000, 3)) == java_slots(lock, 30_000, 3)
    assert list(slot_indices(lock, 7, 5)) == java_slots(lock, 7, 5)


def test_first_slot_of_zero_is_the_lcg_adder() -> None:
    assert slot_indices(0, 30_000, 1) == (12345,)


@given(st.integers(-(2**31), 2**31 - 1), st.integers(1, 100_000), st.integers(1, 5))
def test_slots_match_java_for_any_hash(lock: int, size: int, count: int) -> None:
    assert list(slot_indices(lock, size, count)) == java_slots(lock, size, count)


def test_collisions_give_false_conflicts_and_spurious_busy() -> None:
    table, exact = HashedLockTable(size=1, hash_count=3, high_water_mark=-1), ExactLockTable(-1)
    for t in (table, exact):
        t.begin(LockRequest((1,)))
        t.commit(LockRequest((1,)), 5)
    assert exact.check(LockRequest((2,)), 0) is None
    assert table.check(LockRequest((2,)), 0) == 5  # a false conflict, never a false safe
    assert table.begin(LockRequest((1,))) is Begin.OK
    assert table.begin(LockRequest((2,))) is Begin.BUSY  # shares the only slot


def test_slot_cache_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hashed_module, "SLOT_CACHE_SIZE", 8)
    table = HashedLockTable(size=1000, hash_count=3, high_water_mark=-1)
    for lock in range(100):
        assert table.slots(lock) == slot_indices(lock, 1000, 3)
        assert len(table._slot_cache) <= 8


# ------------------------------------------------------------------- hashed vs exact (serial)

# A small lock universe in tables this small collides all the time; a wide one exercises hashing.
lock_universes = st.one_of(
    st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=200, unique=True),
    st.lists(st.integers(0, 64), min_size=1, max_size=20, unique=True),
)


@settings(max_examples=500, deadline=None)
@given(
    size=st.sampled_from([1, 2, 3, 17, 64, 1000, 30_000]),
    hash_count=st.integers(1, 4),
    universe=lock_universes,
    data=st.data(),
)
def test_hashed_never_safe_where_exact_conflicts(
    size: int, hash_count: int, universe: list[int], data: st.DataObject
) -> None:
    locks = st.sampled_from(universe)
    step = st.tuples(
        st.builds(
            LockRequest,
            st.lists(locks, max_size=3).map(tuple),
            st.lists(locks, max_size=3).map(tuple),
            st.lists(locks, max_size=2).map(tuple),
        ),
        st.integers(0, 2**16),  # how far behind the commit head the client is (mod the history)
        st.booleans(),  # commit it?
        st.integers(0, 60),  # 0: reset the tables to a new high-water mark
    )
    start = data.draw(st.integers(-1, 50), label="high_water_mark")
    hashed, exact = HashedLockTable(size, hash_count, start), ExactLockTable(start)
    head = start
    for request, behind, commits, reset in data.draw(st.lists(step, min_size=1, max_size=150), label="steps"):
        client = head - behind % (head - start + 2)  # in [start - 1, head]
        want, got = exact.check(request, client), hashed.check(request, client)
        if want is not None:
            assert got is not None and got >= want
        if got is None:
            assert want is None
        event("conflict" if want is not None else "false conflict" if got is not None else "safe")
        assert hashed.estimate(request) >= exact.estimate(request)
        if commits:
            head += 1
            for t in (hashed, exact):
                assert t.begin(request) is Begin.OK
                t.commit(request, head)
        if reset == 0:
            start = head = head + behind % 3
            hashed.reset(head)
            exact.reset(head)


# ------------------------------------------------------ the server's pipeline (in-flight appends)


@attrs.frozen
class Committed:
    txn_id: int
    request: LockRequest
    client_high_water_mark: int


def assert_optimistic_locking_holds(history: list[Committed]) -> None:
    """OCC safety: no committed txn strictly between a txn's client HWM and itself advanced a lock it checked."""
    for i, t in enumerate(history):
        checked = set(t.request.write_locks) | set(t.request.read_locks)
        for u in history[:i]:
            if u.txn_id > t.client_high_water_mark:
                advanced = set(u.request.write_locks) | set(u.request.append_locks)
                assert not (checked & advanced), (
                    f"txn {t.txn_id} (client hwm {t.client_high_water_mark}) missed txn {u.txn_id}"
                )


class IgnoresInFlight(ExactLockTable):
    """A broken strategy for the negative control: begin() never reports BUSY."""

    __slots__ = ()

    def begin(self, request: LockRequest) -> Begin:
        self._in_flight += 1
        return Begin.OK


@pytest.mark.parametrize(("make", "sound"), [
    pytest.param(lambda hwm: HashedLockTable(30_000, 3, hwm), True, id="hashed-30000x3"),
    pytest.param(lambda hwm: HashedLockTable(8, 2, hwm), True, id="hashed-8x2"),
    pytest.param(lambda hwm: ExactLockTable(hwm), True, id="exact"),
    pytest.param(lambda hwm: IgnoresInFlight(hwm), False, id="negative-control-never-busy"),
])
def test_pipelined_appends_decide_as_if_serial(make, sound: bool) -> None:  # type: ignore[no-untyped-def]
    """Drive a table as the append task does, with up to 5 appends in flight and out-of-date clients:
    every committed transaction satisfies optimistic locking, and BUSY only happens when
    something is in flight (waiting then resolves it). A table that ignores in-flight appends
    must be caught."""

    # The negative control stops at its first counterexample (no shrinking, no database).
    extra = {} if sound else {"phases": [Phase.generate], "database": None}

    @settings(max_examples=100, deadline=None, **extra)
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        table = make(-1)
        locks = st.sampled_from(range(6))
        in_flight: deque[tuple[LockRequest, int]] = deque()
        history: list[Committed] = []
        head = -1  # last committed id
        next_id = 0

        def resolve_oldest() -> None:
            nonlocal head, next_id
            request, client = in_flight.popleft()
            if data.draw(st.integers(0, 9)) == 0:  # the store failed this append
                table.abort(request)
                return
            table.commit(request, next_id)
            history.append(Committed(next_id, request, client))
            head, next_id = next_id, next_id + 1

        for _ in range(data.draw(st.integers(1, 60))):
            request = LockRequest(
                data.draw(st.lists(locks, max_size=2).map(tuple)),
                data.draw(st.lists(locks, max_size=2).map(tuple)),
                data.draw(st.lists(locks, max_size=1).map(tuple)),
            )
            client = data.draw(st.integers(-1, head))  # a client never sees past the commit head
            while table.begin(request) is Begin.BUSY:
                assert in_flight, "BUSY with nothing in flight"
                event("busy")
                resolve_oldest()  # "flush": wait for in-flight commits, then retry
            if table.check(request, client) is not None:
                event("lock failure")
                table.abort(request)
            else:
                in_flight.append((request, client))
            while len(in_flight) > 5 or (in_flight and data.draw(st.booleans())):
                resolve_oldest()
            assert table.in_flight == len(in_flight)
        while in_flight:
            resolve_oldest()
        assert table.in_flight == 0
        assert_optimistic_locking_holds(history)

    if sound:
        run()
    else:
        with pytest.raises(AssertionError, match="missed txn"):
            run()


def test_the_occ_checker_catches_a_table_that_ignores_in_flight_appends() -> None:
    """Negative control: without BUSY, a second writer at the same client HWM commits stale."""
    table = ExactLockTable(-1)
    first, second = LockRequest((1,)), LockRequest((1,))
    table.begin(first)
    assert table.check(first, -1) is None
    # a broken server skips begin() for the second and decides on stale data
    assert table.check(second, -1) is None
    table.commit(first, 0)
    history = [Committed(0, first, -1), Committed(1, second, -1)]
    with pytest.raises(AssertionError, match="missed txn 0"):
        assert_optimistic_locking_holds(history)


# --------------------------------------------------------------------- registry and options


def test_both_strategies_are_registered_with_the_common_factory_signature() -> None:
    registry = REGISTRIES.lock_table
    assert {"hashed", "exact"} <= set(registry.names())
    assert registry.get("hashed").config_cls is None and registry.get("exact").config_cls is None
    # factory(config, options): a new table, nothing committed; the server resets it to its high-water mark
    table = registry.get("hashed").factory(ServerConfig(lock_table_size=10, lock_hash_count=2), None)
    assert isinstance(table, HashedLockTable) and table.size == 10 and table.estimate(LockRequest((1,))) == -1


def test_open_lock_table_takes_the_server_keys() -> None:
    table = open_lock_table(ServerConfig(lock_table_size=1234, lock_hash_count=2), 99, REGISTRIES)
    assert isinstance(table, HashedLockTable)
    assert (table.size, table.hash_count) == (1234, 2)
    assert table.check(LockRequest((5,)), 98) == 99
    exact = open_lock_table(ServerConfig(lock_table="exact"), 3, REGISTRIES)
    assert isinstance(exact, ExactLockTable) and exact.estimate(LockRequest((5,))) == 3


def test_bad_options_are_config_errors() -> None:
    # The config refuses a size of 0 where it is read, before any lock table is built.
    with pytest.raises(InvalidValue, match="lock_table_size: must be 1 or more, got 0"):
        ServerConfig(lock_table_size=0)
    with pytest.raises(ValueError, match="size >= 1"):
        HashedLockTable(size=0)
    with pytest.raises(ValueError, match="hash_count >= 1"):
        HashedLockTable(hash_count=0)
    with pytest.raises(BackendNotFoundError, match="installed: exact, hashed"):
        open_lock_table(ServerConfig(lock_table="bloom"), -1, REGISTRIES)
    # [server.hashed] is the strategy's options table, and the built-ins take none
    with pytest.raises(ConfigError, match=r"server\.hashed: this backend takes no options"):
        open_lock_table(ServerConfig(options={"hashed": {"size": 5}}), -1, REGISTRIES)


def test_lock_request_from_append_request() -> None:
    append = AppendRequest(ReqId(1, 2, 3, 4), 10, (1, 2), (3,), (4,), 0, b"x", 0)
    request = LockRequest.from_append(append)
    assert request == LockRequest((1, 2), (3,), (4,))
    assert request.write_locks is append.write_locks  # no copy on the hot path
    assert not request.is_empty and LockRequest().is_empty
    assert type(request) is LockRequest and hash(request) == hash(LockRequest((1, 2), (3,), (4,)))
    # An append built in process with lists (not decoded from the wire) still gets tuples.
    listed = LockRequest.from_append(attrs.evolve(append, write_locks=[1, 2], read_locks=[3], append_locks=[4]))
    assert listed == request and type(listed.write_locks) is tuple
