"""The replicated store over in-memory replicas: quorum commit, failures, catch-up, recovery."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import pytest

from waltz_core.config import ServerConfig
from waltz_core.coordination.metadata import UNRESOLVED, ReplicaState
from waltz_core.errors import ConnectionClosedError, ProtocolError
from waltz_core.protocol.wire import Record, ReqId, crc32
from waltz_core.server import store as store_module
from waltz_core.server.recovery import Recovery
from waltz_core.server.store import ReplicatedStore
from waltz_core.testing.fake_storage import FakeReplica, MemoryMetadata, StreamingFakeReplica, connector

pytestmark = pytest.mark.timeout(30)


#: the replica class of the running test (set by the ``replica_kind`` fixture)
Replica: type[FakeReplica] = FakeReplica


@pytest.fixture(autouse=True, params=["task", "streaming"])
def replica_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> type[FakeReplica]:
    """Every test runs twice: replica sessions driven by tasks (a replica API that only has the
    async append) and streaming (a client with ``append_nowait``, like the storage client)."""
    kind = FakeReplica if request.param == "task" else StreamingFakeReplica
    monkeypatch.setattr(sys.modules[__name__], "Replica", kind)
    return kind


EPS = ["s1:1", "s2:1", "s3:1"]
CONFIG = ServerConfig(initial_retry_interval=0.01, max_retry_interval=0.05, max_batch_size=10)


class Sink:
    def __init__(self) -> None:
        self.committed = -1
        self.resets: list[int] = []

    def on_committed(self, hwm: int) -> None:
        assert hwm >= self.committed, "commits must arrive in order"
        self.committed = hwm

    def on_session_reset(self, hwm: int) -> None:
        self.resets.append(hwm)
        self.committed = hwm


def make(pid: int = 0, kind: type[FakeReplica] | None = None,
         ) -> tuple[dict[str, FakeReplica], MemoryMetadata, ReplicatedStore, Sink]:
    replicas = {ep: (kind or Replica)(ep) for ep in EPS}
    meta = MemoryMetadata({pid: EPS})
    store = ReplicatedStore(pid, 0, meta, connector(replicas), CONFIG)
    return replicas, meta, store, Sink()


def rec(txn: int, payload: bytes = b"x") -> Record:
    return Record(txn, ReqId(1, 0, 0, txn), 0, payload, crc32(payload))


async def append_n(store: ReplicatedStore, n: int, start: int = 0) -> list[int]:
    ids = []
    for i in range(n):
        await store.wait_writable()
        data = f"t{start + i}".encode()
        ids.append(store.append(ReqId(1, 0, 0, start + i), 0, data, crc32(data)))
    return ids


async def wait_for(predicate, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


async def test_appends_commit_on_a_quorum_of_two() -> None:
    replicas, _, store, sink = make()
    replicas["s3:1"].down = True
    assert await store.open(sink) == -1
    ids = await append_n(store, 25)
    await store.flush()
    assert ids == list(range(25))
    assert sink.committed == 24
    assert [r.transaction_id for r in replicas["s1:1"].log(0)] == ids
    assert replicas["s3:1"].log(0) == []
    await store.close()


async def test_a_replica_failure_starts_a_new_session_and_loses_nothing_committed() -> None:
    replicas, meta, store, sink = make()
    await store.open(sink)
    await append_n(store, 20)
    await store.flush()
    committed_before = sink.committed
    replicas["s2:1"].down = True
    await append_n(store, 5, start=100)  # these may fail with the session; recovery decides
    await wait_for(lambda: store.sessions_started >= 2 and store.healthy)
    assert sink.resets, "the partition must hear about the new session"
    assert sink.committed >= committed_before
    ids = await append_n(store, 10, start=200)
    await store.flush()
    assert sink.committed == ids[-1]
    log1 = replicas["s1:1"].log(0)
    log3 = replicas["s3:1"].log(0)
    assert log1[: sink.committed + 1] == log3[: sink.committed + 1]
    assert [r.transaction_id for r in log1] == list(range(sink.committed + 1))
    assert meta.meta[0].session_id >= 1
    await store.close()


async def _open_with_a_full_replica(monkeypatch: pytest.MonkeyPatch, hold_first: float,
                                    ) -> tuple[dict[str, FakeReplica], ReplicatedStore, Sink]:
    """A store with 10 commits whose replica s2 then refuses every append (a full disk); holds
    start at ``hold_first`` seconds and missing replicas are probed every 20 ms."""
    monkeypatch.setattr(store_module, "REFUSAL_HOLD_FIRST", hold_first)
    monkeypatch.setattr(store_module, "PROBE_INTERVAL", 0.02)
    replicas, _, store, sink = make()
    await store.open(sink)
    await append_n(store, 10)
    await store.flush()
    replicas["s2:1"].refuse_appends = "partition 0: write failed: [Errno 28] No space left on device"
    return replicas, store, sink


async def test_a_replica_that_refuses_writes_is_held_out_of_new_sessions_until_it_takes_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A node that answers but refuses every write (a full disk) must not roll the partition over
    to a new session at the rate of its refusals: it is kept out for a hold that grows."""
    replicas, store, sink = await _open_with_a_full_replica(monkeypatch, hold_first=0.2)
    deadline = asyncio.get_running_loop().time() + 1.5
    n = 10
    while asyncio.get_running_loop().time() < deadline:  # a steady load for 1.5 s, committed on s1 and s3
        await append_n(store, 5, start=n)
        n += 5
        await asyncio.sleep(0.005)
    await store.flush()
    # Held out for 0.2 s, then 0.4, then 0.8: at most 4 refusals, each ending a session. Without
    # the hold each new session took s2 in again at once, and it refused again: about 1,000.
    assert 2 <= replicas["s2:1"].refusals <= 4, replicas["s2:1"].refusals
    assert store._held_out["s2:1"][1] >= 0.4  # the hold grew with the refusals
    assert sink.committed >= n // 2, (sink.committed, n)  # s1 and s3 went on committing
    replicas["s2:1"].refuse_appends = None
    await wait_for(lambda: "s2:1" in (store.session.replicas if store.session else {}) and store.healthy,
                   timeout=10)
    ids = await append_n(store, 5, start=n)
    await store.flush()
    await wait_for(lambda: replicas["s2:1"].log(0)[-1:] == replicas["s1:1"].log(0)[-1:])
    assert sink.committed == ids[-1]
    assert replicas["s2:1"].log(0) == replicas["s1:1"].log(0)
    await store.close()


async def test_a_held_out_replica_that_restarts_comes_back_before_its_hold_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator freed the space and restarted the node: a new connection to it ends the hold."""
    replicas, store, sink = await _open_with_a_full_replica(monkeypatch, hold_first=30.0)
    await append_n(store, 10, start=10)
    await wait_for(lambda: replicas["s2:1"].refusals == 1 and store.healthy
                   and "s2:1" not in store.session.replicas)  # type: ignore[union-attr]
    await asyncio.sleep(0.2)  # ten probes: the same connection stays held out
    assert "s2:1" not in store.session.replicas  # type: ignore[union-attr]
    restarted = Replica("s2:1")  # the same files, a new process: the connector hands out a new client
    restarted.partitions = replicas["s2:1"].partitions
    replicas["s2:1"] = restarted
    await wait_for(lambda: store.session is not None and "s2:1" in store.session.replicas and store.healthy,
                   timeout=5)
    ids = await append_n(store, 5, start=100)
    await store.flush()
    await wait_for(lambda: restarted.log(0)[-1:] == replicas["s1:1"].log(0)[-1:])
    assert sink.committed == ids[-1] and restarted.refusals == 0
    await store.close()


async def test_a_held_out_replica_moved_away_is_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator moves the full node's replica elsewhere instead: the hold, which keeps the
    refusing connection, goes with it."""
    replicas, store, sink = await _open_with_a_full_replica(monkeypatch, hold_first=30.0)
    replicas["s4:1"] = Replica("s4:1")
    await append_n(store, 10, start=10)
    await wait_for(lambda: "s2:1" in store._held_out and store.healthy)
    store.metadata.assignments[0] = ["s1:1", "s3:1", "s4:1"]  # type: ignore[attr-defined]
    store.replicas_assigned(["s1:1", "s3:1", "s4:1"])
    assert "s2:1" not in store._held_out
    await wait_for(lambda: store.session is not None and sorted(store.session.replicas) == ["s1:1", "s3:1", "s4:1"]
                   and store.healthy)
    ids = await append_n(store, 5, start=100)
    await store.flush()
    assert sink.committed == ids[-1]
    await store.close()


async def test_a_replica_assigned_to_a_running_partition_joins_and_one_unassigned_leaves() -> None:
    """The operator moves a replica (``waltz cluster assign-partition`` on the new node, then
    ``unassign-partition`` on the old one): the running session rolls over to one on the new set,
    which catches the new replica up; nothing waits for a failure or the checkpoint interval."""
    replicas, meta, store, sink = make()
    replicas["s4:1"] = Replica("s4:1")
    await store.open(sink)
    await append_n(store, 30)
    await store.flush()
    assert store.sessions_started == 1
    meta.assignments[0] = EPS + ["s4:1"]
    store.replicas_assigned(meta.assignments[0])
    await wait_for(lambda: store.session is not None and "s4:1" in store.session.replicas and store.healthy)
    ids = await append_n(store, 10, start=100)
    await store.flush()
    await wait_for(lambda: len(replicas["s4:1"].log(0)) == ids[-1] + 1)
    assert replicas["s4:1"].log(0) == replicas["s1:1"].log(0)  # caught up from the start
    meta.assignments[0] = ["s2:1", "s3:1", "s4:1"]
    store.replicas_assigned(meta.assignments[0])
    await wait_for(lambda: store.session is not None and sorted(store.session.replicas) == ["s2:1", "s3:1", "s4:1"])
    s1_before = len(replicas["s1:1"].log(0))
    ids = await append_n(store, 10, start=200)
    await store.flush()
    assert sink.committed == ids[-1]
    assert len(replicas["s1:1"].log(0)) == s1_before  # the old replica gets nothing more
    assert replicas["s4:1"].log(0) == replicas["s2:1"].log(0)
    store.replicas_assigned(["s2:1", "s3:1", "s4:1"])  # the same set again: no new session
    await asyncio.sleep(0.05)
    assert sorted(store.session.replicas) == ["s2:1", "s3:1", "s4:1"] and not store.session.rolling_over
    await store.close()


async def test_a_replica_assigned_but_not_yet_held_by_its_node_does_not_churn_sessions(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Assigned in coordination before ``sync-partitions`` gave the node the partition: the node
    answers the recovery with a refusal. It is held out like a node that refuses writes, instead
    of being taken in by every probe (a new session each time), and joins once it holds it."""
    monkeypatch.setattr(store_module, "REFUSAL_HOLD_FIRST", 0.2)
    monkeypatch.setattr(store_module, "PROBE_INTERVAL", 0.02)
    replicas, meta, store, sink = make()
    replicas["s4:1"] = Replica("s4:1")
    replicas["s4:1"].not_holding = {0}
    await store.open(sink)
    await append_n(store, 10)
    await store.flush()
    meta.assignments[0] = EPS + ["s4:1"]
    store.replicas_assigned(meta.assignments[0])
    await asyncio.sleep(1.5)
    # Held 0.2, 0.4, then 0.8 s: at most 4 refused recoveries (without the hold, one per probe:
    # more than 30 in 1.5 s), each its own session.
    assert 1 <= replicas["s4:1"].refusals <= 4, replicas["s4:1"].refusals
    assert store.healthy and store.sessions_started <= 6, store.sessions_started
    replicas["s4:1"].not_holding.clear()  # the operator ran sync-partitions
    await wait_for(lambda: store.session is not None and "s4:1" in store.session.replicas and store.healthy,
                   timeout=10)
    ids = await append_n(store, 5, start=100)
    await store.flush()
    await wait_for(lambda: replicas["s4:1"].log(0) == replicas["s1:1"].log(0))
    assert sink.committed == ids[-1]
    await store.close()


async def test_two_replicas_down_stall_and_resume_when_one_returns() -> None:
    replicas, _, store, sink = make()
    await store.open(sink)
    await append_n(store, 5)
    await store.flush()
    replicas["s2:1"].down = True
    replicas["s3:1"].down = True
    with pytest.raises(TimeoutError):  # no quorum: the appends stall
        await append_n(store, 3, start=10)
        await asyncio.wait_for(store.flush(), 0.3)
    stalled_at = sink.committed
    await asyncio.sleep(0.2)
    assert sink.committed == stalled_at
    replicas["s3:1"].down = False
    await wait_for(lambda: store.healthy, timeout=10)
    ids = await append_n(store, 5, start=20)
    await store.flush()
    assert sink.committed == ids[-1]
    await store.close()


async def test_a_session_does_not_start_with_fewer_replicas_than_its_quorum(monkeypatch: pytest.MonkeyPatch,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    # Recovery counts s1 and s2 (s3 is down), then s2 becomes unreachable before the session
    # connects its replicas. A session of s1 alone could never commit, and no failure of its one
    # replica would end it (a netns smoketest hung so, through every later rollover).
    replicas, _, store, sink = make()
    replicas["s3:1"].down = True
    recover = Recovery.run
    recoveries = 0

    async def recover_then_lose_s2(self: Recovery):  # type: ignore[no-untyped-def]
        nonlocal recoveries
        result = await recover(self)
        recoveries += 1
        if recoveries == 1:
            replicas["s2:1"].down = True
            asyncio.get_running_loop().call_later(0.3, setattr, replicas["s2:1"], "down", False)
        return result

    monkeypatch.setattr(Recovery, "run", recover_then_lose_s2)
    assert await asyncio.wait_for(store.open(sink), 10) == -1
    assert store.session is not None and sorted(store.session.replicas) == ["s1:1", "s2:1"]
    assert recoveries >= 2 and "only 1 of the 2 replicas a commit needs were reachable" in caplog.text
    ids = await append_n(store, 5)
    await asyncio.wait_for(store.flush(), 10)
    assert sink.committed == ids[-1]
    await store.close()


async def test_only_a_session_without_all_its_replicas_probes_for_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """A session's replicas are fixed when it starts, so only one that lacks an assigned replica
    has anything to probe. The supervisor of a partition with all of them waits for a restart
    alone: a timer a second per partition was most of an idle server's CPU at 256 partitions."""
    monkeypatch.setattr(store_module, "PROBE_INTERVAL", 0.02)
    probes: list[int] = []
    probe = ReplicatedStore._probe_missing_replicas

    async def counted(self: ReplicatedStore) -> None:
        probes.append(self.partition_id)
        await probe(self)

    monkeypatch.setattr(ReplicatedStore, "_probe_missing_replicas", counted)
    replicas, _meta, store, sink = make()
    await store.open(sink)
    await append_n(store, 5)
    await store.flush()
    await asyncio.sleep(0.3)
    assert probes == [], f"{len(probes)} probes of a session with all its replicas"  # the code before: about 15

    replicas["s3:1"].down = True  # an append fails on s3 and breaks the session; the next lacks s3, and probes
    await append_n(store, 5, start=100)
    await wait_for(lambda: store.sessions_started >= 2 and store.healthy and store.session is not None
                   and "s3:1" not in store.session.replicas)
    await asyncio.sleep(0.3)
    assert len(probes) >= 5, probes
    replicas["s3:1"].down = False  # a probe finds it: a new session with all three, which probes no more
    await wait_for(lambda: store.healthy and store.session is not None and len(store.session.replicas) == 3)
    await asyncio.sleep(0.05)
    seen = len(probes)
    await asyncio.sleep(0.3)
    assert len(probes) == seen, (seen, len(probes))
    ids = await append_n(store, 5, start=10)
    await store.flush()
    assert sink.committed == ids[-1]
    await store.close()


async def test_a_returning_replica_catches_up_and_is_identical() -> None:
    replicas, _meta, store, sink = make()
    replicas["s3:1"].down = True
    await store.open(sink)
    await append_n(store, 50)
    await store.flush()
    replicas["s3:1"].down = False  # the storage is back: the store brings it in with a new session
    await wait_for(lambda: store.sessions_started >= 2 and store.healthy, timeout=10)
    ids = await append_n(store, 30, start=100)
    await store.flush()
    await wait_for(lambda: len(replicas["s3:1"].log(0)) >= ids[-1] + 1)
    committed = sink.committed
    assert replicas["s3:1"].log(0)[: committed + 1] == replicas["s2:1"].log(0)[: committed + 1]
    await store.close()


async def test_checkpoint_interval_rolls_over_to_a_new_session() -> None:
    replicas = {ep: Replica(ep) for ep in EPS}
    meta = MemoryMetadata({0: EPS})
    config = ServerConfig(initial_retry_interval=0.01, max_batch_size=10, checkpoint_interval=30)
    store = ReplicatedStore(0, 0, meta, connector(replicas), config)
    sink = Sink()
    await store.open(sink)
    ids = await append_n(store, 300)
    await store.flush()
    await wait_for(lambda: store.sessions_started >= 3)
    # A rollover drains first: nothing is lost and every append committed in order.
    assert sink.committed == ids[-1] == 299
    assert meta.meta[0].session_id == store.sessions_started - 1
    for r in replicas.values():
        assert [x.transaction_id for x in r.log(0)] == ids
    await store.close()


# ----------------------------------------------------------------------- recovery scenarios


async def seed_logs(replicas: dict[str, FakeReplica], counts: dict[str, int], session: int = 0) -> None:
    for ep, n in counts.items():
        r = replicas[ep]
        await r.set_low_water_mark(session, 0, -1)
        if n:
            await r.append(session, 0, [rec(i) for i in range(n)])


async def test_recovery_truncates_dirty_transactions_above_the_majority_mark() -> None:
    replicas = {ep: Replica(ep) for ep in EPS}
    await seed_logs(replicas, {"s1:1": 20, "s2:1": 30, "s3:1": 10})  # HA=19, HB=29, HC=9
    states = {ep: ReplicaState(0, UNRESOLVED) for ep in EPS}
    result = await Recovery(0, 1, EPS, states, connector(replicas)).run()
    assert result.high_water_mark == 19
    assert result.clean == {"s1:1", "s2:1"}
    for ep in ("s1:1", "s2:1"):
        r = replicas[ep]
        assert [x.transaction_id for x in r.log(0)] == list(range(20)), "dirty tail removed"
        assert r.partitions[0].info.low_water_mark == 19 and r.partitions[0].info.session_id == 1
        assert result.replica_states[ep] == ReplicaState(1, UNRESOLVED)
    # C is behind; a quorum is clean, so C keeps catching up inside the new session (recovery step 5.iv.3 of the Waltz design).
    assert result.lagging == {"s3:1": 9}
    assert result.replica_states["s3:1"] == ReplicaState(0, 19)


async def test_recovery_with_b_offline_waits_until_c_catches_up_with_a() -> None:
    replicas = {ep: Replica(ep) for ep in EPS}
    await seed_logs(replicas, {"s1:1": 20, "s2:1": 30, "s3:1": 10})
    replicas["s2:1"].down = True
    states = {ep: ReplicaState(0, UNRESOLVED) for ep in EPS}
    recovery = Recovery(0, 1, EPS, states, connector(replicas), retry_interval=0.01)
    result = await recovery.run()
    # Undecidable at first (HA has 1 vote + 1 offline); C catching up with A makes it decidable.
    assert result.high_water_mark == 19
    assert [x.transaction_id for x in replicas["s3:1"].log(0)] == list(range(20))
    # B was not clean: its closing high-water mark is recorded, its session left unchanged (step 6.ii).
    assert result.replica_states["s2:1"] == ReplicaState(0, 19)
    # Next time B is consistent and truncated to that mark, whatever it held.
    replicas["s2:1"].down = False
    states2 = dict(result.replica_states)
    result2 = await Recovery(0, 2, EPS, states2, connector(replicas)).run()
    assert result2.high_water_mark == 19
    assert [x.transaction_id for x in replicas["s2:1"].log(0)] == list(range(20))


async def test_recovery_with_only_one_replica_reachable_waits() -> None:
    replicas = {ep: Replica(ep) for ep in EPS}
    await seed_logs(replicas, {"s1:1": 5, "s2:1": 5, "s3:1": 5})
    replicas["s2:1"].down = replicas["s3:1"].down = True
    recovery = Recovery(0, 1, EPS, {}, connector(replicas), retry_interval=0.01)
    task = asyncio.ensure_future(recovery.run())
    await asyncio.sleep(0.2)
    assert not task.done(), "one of three cannot decide"
    assert recovery.last_vote is not None and not recovery.last_vote.decided
    replicas["s3:1"].down = False
    result = await asyncio.wait_for(task, 5)
    assert result.high_water_mark == 4 or result.high_water_mark == -1


async def test_inconsistent_replica_is_truncated_to_its_own_low_water_mark() -> None:
    replicas = {ep: Replica(ep) for ep in EPS}
    await seed_logs(replicas, {"s1:1": 10, "s2:1": 10, "s3:1": 10}, session=3)
    # s3 holds a restored copy from session 1 with 25 records, low-water mark 4.
    s3 = replicas["s3:1"]
    s3.partitions.clear()
    await s3.append(1, 0, [rec(i, b"old") for i in range(25)])
    s3.partitions[0].info = s3.partitions[0].info.__class__(1, 4, 24)
    states = {ep: ReplicaState(3, UNRESOLVED) for ep in EPS}
    result = await Recovery(0, 4, EPS, states, connector(replicas)).run()
    assert result.high_water_mark == 9
    log3 = s3.log(0)
    assert [r.transaction_id for r in log3] == list(range(5)), "truncated to its own low-water mark 4"
    assert result.lagging == {"s3:1": 4}
    assert result.replica_states["s3:1"] == ReplicaState(3, 9)


async def test_recovery_after_a_replica_was_added_votes_among_the_previous_sessions_replicas() -> None:
    """Session 0 ran on s1, s2, s3 and committed 0..29 on s1 and s2 (its majority); s4 was assigned
    since. A vote among the 4 replicas assigned now would need 3 holders of 29, find 2, rule it out
    and truncate committed transactions to 19. The previous session's replicas vote instead."""
    replicas = {ep: Replica(ep) for ep in EPS + ["s4:1"]}
    await seed_logs(replicas, {"s1:1": 30, "s2:1": 30, "s3:1": 20, "s4:1": 0})
    states = {ep: ReplicaState(0, UNRESOLVED) for ep in EPS}
    recovery = Recovery(0, 1, EPS + ["s4:1"], states, connector(replicas), previous=EPS)
    result = await recovery.run()
    assert result.high_water_mark == 29
    assert [x.transaction_id for x in replicas["s1:1"].log(0)] == list(range(30))
    # A majority of the 4 (3) is clean before the session starts; s4 catches up inside it.
    assert len(result.clean) >= 3 and result.clean <= {"s1:1", "s2:1", "s3:1", "s4:1"}
    # Without the previous session's replicas (metadata of an older release): the old vote.
    replicas = {ep: Replica(ep) for ep in EPS + ["s4:1"]}
    await seed_logs(replicas, {"s1:1": 30, "s2:1": 30, "s3:1": 20, "s4:1": 0})
    assert (await Recovery(0, 1, EPS + ["s4:1"], states, connector(replicas)).run()).high_water_mark == 19


async def test_recovery_after_a_replica_was_taken_out_counts_it_offline() -> None:
    """Session 0 committed 0..29 on s1 and s2; s1 was taken out since. Among s2 and s3 alone, 29
    has one holder of the 2 a majority of 2 needs: ruled out, and lost. Counted as offline, s1
    keeps 29 possible: s3 catches up from s2 and the vote decides 29."""
    replicas = {ep: Replica(ep) for ep in EPS}
    await seed_logs(replicas, {"s1:1": 30, "s2:1": 30, "s3:1": 20})
    states = {ep: ReplicaState(0, UNRESOLVED) for ep in EPS}
    result = await Recovery(0, 1, ["s2:1", "s3:1"], states, connector(replicas), retry_interval=0.01,
                            previous=EPS).run()
    assert result.high_water_mark == 29
    assert [x.transaction_id for x in replicas["s3:1"].log(0)] == list(range(30))


async def test_recovery_waits_while_the_previous_sessions_majority_cannot_be_heard() -> None:
    """s1 was taken out and s2 is down: only s3 of session 0's replicas answers, and 29 may have
    been committed on s1 and s2. The new replica s4 does not vote: recovery waits for s2."""
    replicas = {ep: Replica(ep) for ep in EPS + ["s4:1"]}
    await seed_logs(replicas, {"s1:1": 30, "s2:1": 30, "s3:1": 20, "s4:1": 0})
    replicas["s2:1"].down = True
    states = {ep: ReplicaState(0, UNRESOLVED) for ep in EPS}
    recovery = Recovery(0, 1, ["s2:1", "s3:1", "s4:1"], states, connector(replicas), retry_interval=0.01,
                        previous=EPS)
    task = asyncio.ensure_future(recovery.run())
    await asyncio.sleep(0.3)
    assert not task.done(), "decided without a majority of session 0's replicas"
    # What the server's /readyz says: the vote, and the previous session's replicas it waits for.
    assert recovery.waiting is not None and recovery.waiting.startswith("undecidable")
    assert recovery.waiting.endswith("replicas of the previous session not heard: s1:1, no longer assigned; s2:1)")
    replicas["s2:1"].down = False
    result = await asyncio.wait_for(task, 5)
    assert result.high_water_mark == 29
    assert recovery.waiting is None


async def test_a_store_whose_recovery_waits_says_for_whom_and_the_servers_readyz_gives_it() -> None:
    from types import SimpleNamespace

    from waltz_core.server.server import _not_ready

    replicas, _meta, store, sink = make()
    replicas["s2:1"].down = replicas["s3:1"].down = True
    opening = asyncio.ensure_future(store.open(sink))
    await wait_for(lambda: store.recovery_waiting is not None)
    waiting = store.recovery_waiting
    assert waiting is not None and waiting.startswith("undecidable")
    assert waiting.endswith("(replicas of the previous session not heard: s2:1; s3:1)")
    partition = SimpleNamespace(ready=False, healthy=False, store=store)
    assert _not_ready(partition, {"s1:1"}) == f"is recovering (not open yet): {waiting}"  # type: ignore[arg-type]
    partition.ready = True  # a later session's recovery (the partition was open before)
    assert _not_ready(partition, {"s1:1"}) == (  # type: ignore[arg-type]
        f"has no store session: the recovery of a new one waits: {waiting}")
    replicas["s2:1"].down = False
    await asyncio.wait_for(opening, 5)
    assert store.recovery_waiting is None
    partition.healthy = True
    assert _not_ready(partition, set(EPS)) is None  # type: ignore[arg-type]
    await store.close()


class _Connection:
    """One connection to a fake replica, as the storage client is: a connection the peer closed
    fails every call, while a new connection to the same node works."""

    def __init__(self, replica: FakeReplica) -> None:
        self.replica = replica
        self.closed_by_peer = False
        self.refused = 0  #: calls made after the peer closed it

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.replica, name)
        if not asyncio.iscoroutinefunction(attr):
            return attr

        async def call(*args: Any, **kwargs: Any) -> Any:
            if self.closed_by_peer:
                self.refused += 1
                raise ConnectionClosedError(f"connection to {self.replica.endpoint} was closed by the peer")
            return await attr(*args, **kwargs)
        return call


async def test_a_catch_up_whose_source_connection_died_reconnects_the_source_instead_of_spinning() -> None:
    """s1 (the most advanced) answered the prepare, then its connection died; s2 must catch up
    from it before the vote can decide (s3 is down). The failed read is the source's: the source
    is connected again and the catch-up goes on. Blaming the target instead kept the dead
    connection and retried at once, forever (a smoke test's partition spun 106,000 times in 94 s)."""
    replicas = {ep: Replica(ep) for ep in EPS}
    await seed_logs(replicas, {"s1:1": 30, "s2:1": 20, "s3:1": 10})
    replicas["s3:1"].down = True
    made: dict[str, list[_Connection]] = {ep: [] for ep in EPS}

    async def connect(endpoint: str) -> _Connection | None:
        r = replicas[endpoint]
        if r.down:
            return None
        conn = _Connection(r)
        made[endpoint].append(conn)
        return conn

    states = {ep: ReplicaState(0, UNRESOLVED) for ep in EPS}
    recovery = Recovery(0, 1, EPS, states, connect, retry_interval=0.01)  # type: ignore[arg-type]
    original = Recovery._prepare

    async def prepare_then_lose_s1(self: Recovery, endpoint: str, api: Any) -> int:
        mark = await original(self, endpoint, api)
        if endpoint == "s1:1" and len(made["s1:1"]) == 1:
            api.closed_by_peer = True  # the first connection to s1 dies right after its prepare
        return mark

    recovery._prepare = prepare_then_lose_s1.__get__(recovery)  # type: ignore[method-assign]
    result = await asyncio.wait_for(recovery.run(), 5)
    assert result.high_water_mark == 29
    assert len(made["s1:1"]) >= 2, "the source was connected again"
    assert [x.transaction_id for x in replicas["s2:1"].log(0)] == list(range(30))
    assert made["s1:1"][0].refused == 1, "one failed read over the dead connection, then it was dropped"


async def test_a_replica_taken_out_and_back_before_a_session_went_on_without_it_still_votes() -> None:
    """Session 0 ran on s1-s4 and committed 0..29 on s1, s3 and s4 (3 of 4). s1 is taken out, and
    a session begins but does not finish its recovery; s1 is assigned again. It is still one of
    the replicas whose majority committed, so its state must still say so: pruned, it would be
    taken for inconsistent and truncated to its low-water mark, one holder of 29 fewer."""
    from waltz_core.coordination.metadata import PartitionMetadata, states_kept

    eps = EPS + ["s4:1"]
    replicas = {ep: Replica(ep) for ep in eps}
    await seed_logs(replicas, {"s1:1": 30, "s2:1": 20, "s3:1": 30, "s4:1": 30})
    meta = PartitionMetadata(1, 0, {ep: ReplicaState(0, UNRESOLVED) for ep in eps}, replica_set=eps)
    states = states_kept(meta, ["s2:1", "s3:1", "s4:1"])  # the session that began without s1
    assert states["s1:1"] == ReplicaState(0, UNRESOLVED)
    replicas["s3:1"].down = True
    result = await Recovery(0, 2, eps, states, connector(replicas), retry_interval=0.01, previous=eps).run()
    assert result.high_water_mark == 29
    assert [x.transaction_id for x in replicas["s2:1"].log(0)] == list(range(30))


async def test_closing_a_partition_while_it_recovers_stops_everything() -> None:
    from waltz_core.locks.exact import ExactLockTable
    from waltz_core.server.partition import Partition

    replicas, _meta, store, _ = make()
    replicas["s2:1"].down = replicas["s3:1"].down = True  # one of three: recovery cannot decide
    partition = Partition(0, 0, store, lambda hwm: ExactLockTable(hwm), CONFIG)
    partition.open_task = asyncio.ensure_future(partition.open())
    await asyncio.sleep(0.2)
    assert not partition.open_task.done() and not partition.ready
    await asyncio.wait_for(partition.close(), 5)
    assert partition.open_task.cancelled() or partition.open_task.done()
    assert not partition.ready and store.session is None
    replicas["s2:1"].down = False
    await asyncio.sleep(0.3)
    assert store.session is None, "nothing may start a session after close"


async def test_a_slow_replica_is_buffered_only_up_to_the_partitions_share_then_reads_from_peers() -> None:
    from waltz_core.server.store import ReplicationBudget

    replicas = {ep: Replica(ep) for ep in EPS}
    budget = ReplicationBudget(4096)
    budget.stores = 1  # another partition of the server holds a share: this one gets half
    store = ReplicatedStore(0, 0, MemoryMetadata({0: EPS}), connector(replicas), CONFIG, budget)
    sink = Sink()
    await store.open(sink)
    assert budget.share == 2048
    replicas["s3:1"].delay = 0.05  # in the session, but far slower than the quorum
    peak = 0
    for i in range(40):
        await append_n(store, 10, start=10 * i)
        session = store.session
        assert session is not None
        committed_bytes = sum(len(r) for r in list(session._buffer)[:max(0, session.committed - session.buffer_first + 1)])
        peak = max(peak, committed_bytes)
    await store.flush()
    assert peak <= budget.share, f"{peak} bytes of committed records buffered, share {budget.share}"
    # The slow replica still gets everything: what left the buffer it read from its peers.
    await wait_for(lambda: len(replicas["s3:1"].log(0)) == sink.committed + 1, timeout=20)
    assert replicas["s3:1"].log(0) == replicas["s1:1"].log(0)[: sink.committed + 1]
    await store.close()
    assert budget.stores == 1  # the store gave its share back


async def test_a_joining_replica_counts_for_the_quorum_only_once_the_metadata_says_it_is_engaged() -> None:
    """A replica that catches up inside a session must not help commit a transaction before the
    partition metadata records it as engaged: a recovery would take it for inconsistent, count only
    its low-water mark, and could lose that transaction."""
    from waltz_core.errors import CoordinationError

    class RefusingJoins(MemoryMetadata):
        refuse = True

        async def write_states(self, partition_id, generation, session_id, states,  # type: ignore[no-untyped-def]
                               replica_set=None):
            if self.refuse and states.get("s3:1") == ReplicaState(session_id, UNRESOLVED):
                raise CoordinationError("coordination unreachable")  # the write that records the join
            await super().write_states(partition_id, generation, session_id, states, replica_set)

    replicas = {ep: Replica(ep) for ep in EPS}
    meta = RefusingJoins({0: EPS})
    store = ReplicatedStore(0, 0, meta, connector(replicas), CONFIG)
    sink = Sink()
    replicas["s3:1"].down = True
    await store.open(sink)
    await append_n(store, 10)
    await store.flush()
    replicas["s3:1"].down = False  # it comes back: a new session, where it starts behind and catches up
    await wait_for(lambda: store.sessions_started >= 2 and store.healthy, timeout=10)
    await wait_for(lambda: len(replicas["s3:1"].log(0)) == 10, timeout=10)  # caught up: its join is refused
    replicas["s2:1"].delay = 3600.0  # s2 stops answering: only s1 and s3 could make a quorum
    [txn] = await append_n(store, 1, start=100)
    await wait_for(lambda: len(replicas["s1:1"].log(0)) > txn)
    await asyncio.sleep(0.2)  # s3 may acknowledge it too if it streamed it (the record is what matters)
    assert sink.committed < txn, "committed with a replica the metadata does not know is engaged"
    meta.refuse = False  # the join is recorded: s3 counts, s1 + s3 commit it
    await wait_for(lambda: sink.committed == txn, timeout=10)
    assert meta.meta[0].replicas["s3:1"] == ReplicaState(meta.meta[0].session_id, UNRESOLVED)
    replicas["s2:1"].delay = 0.0
    await store.close()


async def test_a_replica_unassigned_while_down_and_assigned_again_keeps_no_dirty_transactions() -> None:
    """A node goes down holding a dirty tail (appends it wrote that never reached a quorum); the
    operator moves its replica to another node, the log goes on there, then the old node comes
    back and is assigned again. Its old state must not make it look engaged in the last session:
    it would propose its max transaction id and keep the dirty records under ids the log has since
    given to other transactions. The recovery that went on without it resolved its closing
    high-water mark (Waltz step 6, for every replica the metadata knows), so it is truncated to
    that mark before it catches up."""
    replicas, meta, store, sink = make()
    replicas["s4:1"] = Replica("s4:1")
    await store.open(sink)
    await append_n(store, 10)
    await store.flush()
    await store.close()
    s3 = replicas["s3:1"]
    session = s3.partitions[0].max_session_seen
    await s3.append(session, 0, [rec(i, b"dirty") for i in range(10, 15)])  # reached s3 only
    s3.down = True
    meta.assignments[0] = ["s1:1", "s2:1", "s4:1"]
    store = ReplicatedStore(0, 0, meta, connector(replicas), CONFIG)
    await store.open(Sink())
    ids = await append_n(store, 10, start=100)
    await store.flush()
    assert ids == list(range(10, 20))
    await store.close()
    assert meta.meta[0].replicas["s3:1"] == ReplicaState(0, 9)  # resolved: the mark the log went on from
    s3.down = False
    meta.assignments[0] = list(EPS)
    store = ReplicatedStore(0, 0, meta, connector(replicas), CONFIG)
    await store.open(Sink())
    await wait_for(lambda: len(s3.log(0)) >= 20)
    await store.flush()
    assert s3.log(0) == replicas["s1:1"].log(0)
    assert all(r.data != b"dirty" for r in s3.log(0))
    await store.close()


async def test_sessions_that_break_before_committing_start_their_successors_after_a_pause() -> None:
    """A fault that ends every session at its first append (here: the replica links refuse the
    frame) started a new session at once, dozens a second, each writing the partition metadata
    twice. In a row, they now wait a growing pause, up to FRUITLESS_PAUSE_MAX; a session that
    commits ends the pauses."""
    replicas = {ep: Replica(ep) for ep in EPS}
    failing = True

    def refusing(replica: FakeReplica) -> None:
        real = replica.append

        async def append(session_id: int, partition_id: int, records: Any) -> None:
            if failing:
                raise ProtocolError("frame of 35238 bytes exceeds the maximum of 8192")
            await real(session_id, partition_id, records)

        replica.append = append  # type: ignore[method-assign]

    for replica in replicas.values():
        refusing(replica)
    config = ServerConfig(initial_retry_interval=0.1, max_retry_interval=20.0, max_batch_size=10)
    store = ReplicatedStore(0, 0, MemoryMetadata({0: EPS}), connector(replicas), config)
    sink = Sink()
    await store.open(sink)

    async def client() -> None:  # a client retries what failed: an append whenever the store takes one
        seq = 0
        while True:
            await store.wait_writable()
            store.append(ReqId(9, 0, 0, seq), 0, b"x", crc32(b"x"))
            seq += 1
            await asyncio.sleep(0.01)

    retrying = asyncio.get_running_loop().create_task(client())
    await asyncio.sleep(3.0)
    # pauses of 0.05-0.1, 0.1-0.2, 0.2-0.4, 0.4-0.8, 0.8-1.6 s (jittered): at most 7 sessions in 3 s
    assert 3 <= store.sessions_started <= 8, store.sessions_started
    assert sink.committed == -1
    failing = False
    await wait_for(lambda: sink.committed >= 0, 5.0)  # the next session, at most FRUITLESS_PAUSE_MAX later, commits
    retrying.cancel()
    await asyncio.gather(retrying, return_exceptions=True)
    await store.close()
