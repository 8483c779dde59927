"""Conformance kit for lock-table strategies.

Subclass :class:`LockTableConformance` and override the ``make_table`` fixture::

    class TestMyTable(LockTableConformance):
        @pytest.fixture
        def make_table(self):
            return lambda high_water_mark: MyTable(high_water_mark=high_water_mark)

The kit checks the semantics every strategy owes the server: the three lock kinds, reset, the
in-flight (BUSY) serialisation, and, with Hypothesis, that the strategy never reports "safe"
where the exact model reports a conflict. It uses a handful of distinct lock hashes and expects
a strategy to tell that many locks apart (any useful one does).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ...locks.base import Begin, LockRequest, LockTable
from ...locks.exact import ExactLockTable

MakeTable = Callable[[int], LockTable]

X, Y, Z = 101, -7, 2_000_000_011  # arbitrary lock hashes


def W(*locks: int) -> LockRequest:
    return LockRequest(write_locks=locks)


def R(*locks: int) -> LockRequest:
    return LockRequest(read_locks=locks)


def A(*locks: int) -> LockRequest:
    return LockRequest(append_locks=locks)


def commit(table: LockTable, request: LockRequest, txn_id: int) -> None:
    assert table.begin(request) is Begin.OK
    table.commit(request, txn_id)


class LockTableConformance:
    """Behaviour every :class:`~waltz_core.locks.base.LockTable` must have."""

    @pytest.fixture
    def make_table(self) -> MakeTable:
        raise NotImplementedError("override the make_table fixture: high_water_mark -> LockTable")

    # ------------------------------------------------------------------------ initial state

    def test_every_lock_starts_at_the_high_water_mark(self, make_table: MakeTable) -> None:
        table = make_table(41)
        assert table.estimate(W(X)) == 41
        assert table.estimate(R(Y)) == 41
        assert table.check(W(X), 41) is None
        assert table.check(W(X), 40) == 41
        assert table.in_flight == 0

    def test_request_without_checked_locks_is_always_safe(self, make_table: MakeTable) -> None:
        table = make_table(100)
        assert table.estimate(LockRequest()) == -1
        assert table.check(LockRequest(), -1) is None
        assert table.check(A(X), -1) is None  # append locks are never checked
        assert table.begin(LockRequest()) is Begin.OK
        table.commit(LockRequest(), 101)
        assert table.in_flight == 0

    # ---------------------------------------------------------------------------- write locks

    def test_write_lock_conflicts_with_a_later_write(self, make_table: MakeTable) -> None:
        table = make_table(-1)
        commit(table, W(X), 5)
        assert table.check(W(X), 4) == 5
        assert table.check(W(X), 5) is None
        assert table.check(W(X), 9) is None

    def test_write_lock_leaves_other_locks_alone(self, make_table: MakeTable) -> None:
        table = make_table(-1)
        commit(table, W(X), 5)
        assert table.check(W(Y), -1) is None
        assert table.check(R(Z), -1) is None

    def test_estimate_is_the_maximum_over_write_and_read_locks(self, make_table: MakeTable) -> None:
        table = make_table(-1)
        commit(table, W(X), 3)
        commit(table, W(Y), 8)
        request = LockRequest(write_locks=(X,), read_locks=(Y,))
        assert table.estimate(request) == 8
        assert table.check(request, 7) == 8
        assert table.check(request, 8) is None
        assert table.check(LockRequest(write_locks=(X, Z)), 2) == 3

    # ----------------------------------------------------------------------------- read locks

    def test_read_lock_is_checked_against_writes(self, make_table: MakeTable) -> None:
        table = make_table(-1)
        commit(table, W(X), 5)
        assert table.check(R(X), 4) == 5
        assert table.check(R(X), 5) is None

    def test_read_lock_commit_does_not_advance(self, make_table: MakeTable) -> None:
        table = make_table(-1)
        commit(table, W(X), 2)
        commit(table, R(X), 3)  # a reader commits as txn 3
        # readers never fail each other, and a writer that saw txn 2 is still safe
        assert table.check(R(X), 2) is None
        assert table.check(W(X), 2) is None

    # --------------------------------------------------------------------------- append locks

    def test_append_lock_is_not_checked(self, make_table: MakeTable) -> None:
        table = make_table(-1)
        commit(table, W(X), 5)
        assert table.check(A(X), 0) is None

    def test_append_lock_commit_advances_readers_and_writers(self, make_table: MakeTable) -> None:
        # the original's hierarchical scenario: modify a child, invalidate reads of the parent
        table = make_table(-1)
        parent, child = X, Y
        commit(table, LockRequest(write_locks=(child,), append_locks=(parent,)), 4)
        assert table.check(A(parent), 0) is None  # other appenders never fail
        assert table.check(R(parent), 3) == 4
        assert table.check(W(parent), 3) == 4
        assert table.check(R(parent), 4) is None

    # --------------------------------------------------------------------------------- reset

    def test_reset_moves_every_lock_to_the_new_high_water_mark(self, make_table: MakeTable) -> None:
        table = make_table(-1)
        commit(table, W(X), 5)
        assert table.begin(W(Y)) is Begin.OK
        table.reset(10)
        assert table.in_flight == 0
        assert table.estimate(W(X)) == 10
        assert table.estimate(W(Z)) == 10
        assert table.check(W(X), 9) == 10
        assert table.begin(W(Y)) is Begin.OK  # the forgotten in-flight request no longer blocks

    # --------------------------------------------------------------------------- in flight

    def test_in_flight_write_makes_writers_readers_and_appenders_busy(self, make_table: MakeTable) -> None:
        table = make_table(-1)
        assert table.begin(W(X)) is Begin.OK
        assert table.in_flight == 1
        assert table.begin(W(X)) is Begin.BUSY
        assert table.begin(R(X)) is Begin.BUSY
        assert table.in_flight == 1  # BUSY changes nothing
        assert table.begin(W(Y)) is Begin.OK
        assert table.in_flight == 2

    def test_in_flight_append_makes_readers_busy(self, make_table: MakeTable) -> None:
        table = make_table(-1)
        assert table.begin(A(X)) is Begin.OK
        assert table.begin(R(X)) is Begin.BUSY
        assert table.begin(W(X)) is Begin.BUSY

    def test_in_flight_reader_blocks_nobody(self, make_table: MakeTable) -> None:
        table = make_table(-1)
        assert table.begin(R(X)) is Begin.OK
        assert table.begin(R(X)) is Begin.OK
        assert table.begin(W(X)) is Begin.OK

    def test_commit_and_abort_end_the_in_flight_state(self, make_table: MakeTable) -> None:
        table = make_table(-1)
        assert table.begin(W(X)) is Begin.OK
        table.commit(W(X), 0)
        assert table.in_flight == 0
        assert table.begin(W(X)) is Begin.OK
        table.abort(W(X))
        assert table.in_flight == 0
        assert table.estimate(W(X)) == 0  # abort advanced nothing
        assert table.begin(R(X)) is Begin.OK

    def test_conflicts_with_in_flight_appends_serialise(self, make_table: MakeTable) -> None:
        """Two clients at the same high-water mark write X; the second waits for the first."""
        table = make_table(9)
        first, second = W(X), W(X)
        assert table.begin(first) is Begin.OK
        assert table.check(first, 9) is None  # accepted, handed to storage
        # the table alone still says "safe" for the second: deciding now would be wrong
        assert table.begin(second) is Begin.BUSY
        table.commit(first, 10)  # the server waited for in-flight commits
        assert table.begin(second) is Begin.OK
        assert table.check(second, 9) == 10  # now decided on fresh data: a lock failure
        table.abort(second)
        assert table.in_flight == 0

    def test_pipelined_appends_on_distinct_locks_are_not_busy(self, make_table: MakeTable) -> None:
        table = make_table(-1)
        requests = [W(X), LockRequest(write_locks=(Y,), append_locks=(Z,)), R(X + 1)]
        for request in requests:
            assert table.begin(request) is Begin.OK
        assert table.in_flight == 3
        for txn, request in enumerate(requests):
            table.commit(request, txn)
        assert table.in_flight == 0
        assert table.check(W(X), -1) == 0
        assert table.check(W(Z), 0) == 1

    # ------------------------------------------------------------------ never a false "safe"

    def test_never_safe_where_the_exact_model_conflicts(self, make_table: MakeTable) -> None:
        # Hypothesis runs inside the test so that every subclass gets its own executor.
        @settings(max_examples=200, deadline=None)
        @given(data=st.data())
        def run(data: st.DataObject) -> None:
            _compare_with_exact_model(make_table, data)

        run()


def _compare_with_exact_model(make_table: MakeTable, data: st.DataObject) -> None:
    locks = st.sampled_from([X, Y, Z, 0, 1, -1, 2**31 - 1, -(2**31)])
    requests = st.builds(
        LockRequest,
        st.lists(locks, max_size=3).map(tuple),
        st.lists(locks, max_size=3).map(tuple),
        st.lists(locks, max_size=2).map(tuple),
    )
    start = data.draw(st.integers(-1, 1000), label="high_water_mark")
    table, model = make_table(start), ExactLockTable(start)
    head = start
    for request in data.draw(st.lists(requests, min_size=1, max_size=40), label="requests"):
        client = data.draw(st.integers(start - 1, head), label="client_high_water_mark")
        exact = model.check(request, client)
        got = table.check(request, client)
        if exact is not None:
            assert got is not None and got >= exact, (request, client, exact, got)
        assert table.estimate(request) >= model.estimate(request)
        assert table.begin(request) is Begin.OK  # nothing in flight between commits
        if data.draw(st.booleans(), label="commit"):
            head += 1
            table.commit(request, head)
            model.begin(request)
            model.commit(request, head)
        else:
            table.abort(request)
