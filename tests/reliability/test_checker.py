"""The history checker on hand-made histories: a good one passes, each kind of bad one is named."""

from __future__ import annotations

from pathlib import Path

from waltz_core.testing.checker import BankModel, LogEntry, check
from waltz_core.testing.history import History, HistoryWriter


def _history(tmp_path: Path, ops: list[tuple], feeds: list[tuple] = (), events: list[dict] = ()) -> History:
    """ops: (process, op, partition, req, hwm, locks, t_invoke, t_complete, outcome, txn, data)."""
    w = HistoryWriter(tmp_path / "h.jsonl")
    for process, op, partition, req, hwm, locks, t0, t1, outcome, txn, data in ops:
        w.invoke(process, op, partition, req, hwm, write_locks=locks, data=data, now=t0)
        if outcome is not None:
            w.complete(process, op, outcome, txn, now=t1)
    for process, partition, first, reqs in feeds:
        w.feed(process, partition, first, reqs)
    for e in events:
        w.event(**e)
    w.close()
    return History.load(w.path)


def _log(*reqs: str) -> list[LogEntry]:
    return [LogEntry(i, r, 0) for i, r in enumerate(reqs)]


GOOD = [
    (1, 1, 0, "a", -1, (7,), 0.0, 1.0, "ok", 0, None),
    (2, 1, 0, "b", -1, (7,), 0.5, 1.1, "fail", None, None),  # lock failure: stale on lock 7
    (2, 2, 0, "c", 0, (7,), 1.2, 2.0, "ok", 1, None),
    (1, 2, 0, "d", 0, (8,), 1.5, None, "unknown", None, None),  # committed after all
    (1, 3, 0, "e", 2, (9,), 3.0, 3.5, "unknown", None, None),  # never committed: fine
]


def test_good_history_passes(tmp_path: Path) -> None:
    h = _history(tmp_path, GOOD, feeds=[(1, 0, 0, ["a", "c", "d"]), (2, 0, 0, ["a", "c"])])
    v = check(h, {0: _log("a", "c", "d")}, {0: {"s0": _log("a", "c", "d", "x"), "s1": _log("a", "c", "d")}})
    assert v.ok, v.report()
    assert v.stats["ok"] == 2 and v.stats["failed"] == 1 and v.stats["unknown"] == 2
    assert v.stats["lock_checked"] == 3


def test_lost_acknowledged_append(tmp_path: Path) -> None:
    v = check(_history(tmp_path, GOOD), {0: _log("c", "d")})
    assert "lost" in v.kinds(), v.report()


def test_duplicate_gap_phantom_and_failed_committed(tmp_path: Path) -> None:
    h = _history(tmp_path, GOOD)
    assert "duplicate" in check(h, {0: _log("a", "c", "d", "d")}).kinds()
    assert "phantom" in check(h, {0: _log("a", "c", "zz")}).kinds()
    assert "failed-committed" in check(h, {0: _log("a", "c", "b")}).kinds()
    gap = [LogEntry(0, "a", 0), LogEntry(2, "c", 0)]
    assert "dense" in check(h, {0: gap}).kinds()


def test_real_time_order(tmp_path: Path) -> None:
    # c was acknowledged (t=2.0) before e was invoked (t=3.0): e may not precede c.
    h = _history(tmp_path, [(1, 1, 0, "c", -1, (), 1.0, 2.0, "ok", 1, None),
                            (1, 2, 0, "e", -1, (), 3.0, 3.5, "ok", 0, None)])
    v = check(h, {0: _log("e", "c")})
    assert "real-time" in v.kinds(), v.report()
    # Overlapping operations may commit in either order.
    h2 = _history(tmp_path / "2", [(1, 1, 0, "c", -1, (), 1.0, 2.0, "ok", 1, None),
                                   (2, 1, 0, "e", -1, (), 1.5, 2.5, "ok", 0, None)])
    assert check(h2, {0: _log("e", "c")}).ok


def test_lock_safety(tmp_path: Path) -> None:
    # Both read lock 7 at hwm -1; the second commit wrote over the first without seeing it.
    h = _history(tmp_path, [(1, 1, 0, "a", -1, (7,), 0.0, 1.0, "ok", 0, None),
                            (2, 1, 0, "b", -1, (7, 9), 0.1, 1.1, "ok", 1, None)])
    v = check(h, {0: _log("a", "b")})
    assert v.kinds() == {"lock"}, v.report()
    # Disjoint locks at the same stale mark are fine.
    h2 = _history(tmp_path / "2", [(1, 1, 0, "a", -1, (7,), 0.0, 1.0, "ok", 0, None),
                                   (2, 1, 0, "b", -1, (8,), 0.1, 1.1, "ok", 1, None)])
    assert check(h2, {0: _log("a", "b")}).ok


def test_consumers_must_agree_with_the_log(tmp_path: Path) -> None:
    h = _history(tmp_path, GOOD, feeds=[(2, 0, 0, ["a", "d"])])
    assert "consumer" in check(h, {0: _log("a", "c", "d")}).kinds()
    h2 = _history(tmp_path / "2", GOOD, feeds=[(2, 0, 0, ["a", "c", "d", "e"])])
    assert "consumer" in check(h2, {0: _log("a", "c", "d")}).kinds()
    h3 = _history(tmp_path / "3", GOOD, events=[{"process": 1, "what": "client-ahead", "partition": 0, "hwm": 9}])
    assert "client-ahead" in check(h3, {0: _log("a", "c", "d")}).kinds()


def test_replicas_must_hold_identical_committed_prefixes(tmp_path: Path) -> None:
    h = _history(tmp_path, GOOD)
    log = _log("a", "c", "d")
    short = {0: {"s0": log, "s1": log[:2]}}
    assert "replica" in check(h, {0: log}, short).kinds()
    corrupt = [LogEntry(0, "a", 0), LogEntry(1, "c", 0, b"x"), LogEntry(2, "d", 0)]
    assert "replica" in check(h, {0: log}, {0: {"s0": [LogEntry(e.transaction_id, e.req_id, 0, b"") for e in log],
                                                "s1": corrupt}}).kinds()
    forked = {0: {"s0": log, "s1": _log("a", "d", "c")}}
    assert "replica" in check(h, {0: log}, forked).kinds()


def test_bank_conservation(tmp_path: Path) -> None:
    bank = BankModel(accounts=2, initial=10)
    good = _history(tmp_path, [(1, 1, 0, "a", -1, (1, 2), 0.0, 1.0, "ok", 0, {"a": 0, "b": 1, "amt": 3, "na": 7, "nb": 13}),
                               (2, 1, 0, "b", 0, (1, 2), 1.1, 2.0, "ok", 1, {"a": 1, "b": 0, "amt": 13, "na": 0, "nb": 20})])
    assert check(good, {0: _log("a", "b")}, bank=bank).ok
    # The second transfer computed from the initial balances (a lost update): money is created.
    bank3 = BankModel(accounts=3, initial=10)
    bad = _history(tmp_path / "2", [(1, 1, 0, "a", -1, (), 0.0, 1.0, "ok", 0, {"a": 0, "b": 1, "amt": 3, "na": 7, "nb": 13}),
                                    (2, 1, 0, "b", -1, (), 0.1, 2.0, "ok", 1, {"a": 1, "b": 2, "amt": 5, "na": 5, "nb": 15})])
    v = check(bad, {0: _log("a", "b")}, bank=bank3)
    assert v.kinds() == {"bank"}, v.report()


def test_torn_last_history_line_is_ignored(tmp_path: Path) -> None:
    h = _history(tmp_path, GOOD[:1])
    with open(tmp_path / "h.jsonl", "a") as f:
        f.write('{"type": "invoke", "proc')
    assert len(History.load(tmp_path / "h.jsonl").operations) == 1 and h.operations[0].outcome == "ok"
