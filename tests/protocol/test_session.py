"""The client side of a partition session (waltz_core.protocol.session): the state table, the
rules of mounts, feed, flushes and append fates, and a Hypothesis model of a server that loses
links, drops appends and answers late, against which no append is ever decided wrongly."""

from __future__ import annotations

import itertools
from collections import deque
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from waltz_core.errors import ProtocolError
from waltz_core.protocol import client as m
from waltz_core.protocol.session import (
    APPLY_RETRY_INITIAL,
    APPLY_RETRY_MAX,
    MOUNTED,
    NOT_READY_RETRY,
    SEQ_MASK,
    TRANSITIONS,
    ClientAhead,
    LockFailed,
    Refused,
    RemountLater,
    Session,
    SessionEvent,
    SessionState,
    SessionStateError,
)
from waltz_core.protocol.wire import ReqId

S = SessionState
ME = 7
OTHER = 8
PID = 3


def mounted(hwm: int = -1, generation: int = 1) -> Session[str]:
    """A READY session."""
    s: Session[str] = Session(ME, PID, hwm)
    s.bind(generation)
    req = s.mount(1)
    assert s.receive(m.MountResponse(req.req_id, m.PartitionState.READY)) is MOUNTED
    return s


def in_state(state: SessionState) -> Session[str]:
    s: Session[str] = Session(ME, PID, 5)
    s.bind(1)
    if state is S.UNMOUNTED:
        return s
    req = s.mount(1)
    if state is S.READY:
        s.receive(m.MountResponse(req.req_id, m.PartitionState.READY))
    elif state is S.AHEAD:
        s.receive(m.MountResponse(req.req_id, m.PartitionState.CLIENT_AHEAD))
    elif state is S.INACTIVE:
        s.deactivate()
    assert s.state is state
    return s


def feed(s: Session[str], client_id: int, seq: int, tid: int) -> Any:
    return s.on_feed(client_id, seq, tid)


# ------------------------------------------------------------------------------- the table

LOCAL_EVENTS = {
    SessionEvent.BIND: lambda s: s.bind(2),
    SessionEvent.MOUNT: lambda s: s.mount(9),
    SessionEvent.LINK_LOST: lambda s: s.link_lost(),
    SessionEvent.APPLY_FAILED: lambda s: s.apply_failed(),
    SessionEvent.DEACTIVATE: lambda s: s.deactivate(),
    SessionEvent.FEED_SUSPENDED: lambda s: s.receive(m.FeedSuspended(ReqId(0, 1, PID, 0))),
}


@pytest.mark.parametrize("state", list(SessionState))
@pytest.mark.parametrize("event", list(LOCAL_EVENTS))
def test_local_events_follow_the_table(state: SessionState, event: SessionEvent) -> None:
    s = in_state(state)
    expected = TRANSITIONS.get((state, event))
    if expected is None and event is SessionEvent.FEED_SUSPENDED:
        assert LOCAL_EVENTS[event](s) is None and s.state is state  # a server message: ignored
    elif expected is None:
        with pytest.raises(SessionStateError, match=event.value):
            LOCAL_EVENTS[event](s)
        assert s.state is state
    else:
        LOCAL_EVENTS[event](s)
        assert s.state is expected
    if s.state is not S.MOUNTING:
        assert s.mount_req is None  # only a mount in flight has a request to answer


@pytest.mark.parametrize("answer, state, action", [
    (m.PartitionState.READY, S.READY, MOUNTED),
    (m.PartitionState.NOT_READY, S.UNMOUNTED, RemountLater(NOT_READY_RETRY, "the server does not own the partition yet")),
    (m.PartitionState.CLIENT_AHEAD, S.AHEAD, ClientAhead(5)),
])
def test_mount_answers(answer: m.PartitionState, state: SessionState, action: object) -> None:
    s = in_state(S.MOUNTING)
    req = s.mount_req
    assert req is not None
    assert s.receive(m.MountResponse(req, answer)) == action
    assert s.state is state and s.mount_req is None
    assert s.receive(m.MountResponse(req, m.PartitionState.READY)) is None  # answered already


@pytest.mark.parametrize("state", [S.UNMOUNTED, S.READY, S.AHEAD, S.INACTIVE])
def test_a_mount_answer_outside_mounting_is_stale(state: SessionState) -> None:
    s = in_state(state)
    for answer in m.PartitionState:
        assert s.receive(m.MountResponse(ReqId(ME, 1, PID, 1), answer)) is None
        assert s.state is state


def test_a_superseded_mount_is_ignored() -> None:
    s: Session[str] = Session(ME, PID)
    s.bind(4)
    first = s.mount(1)
    s.link_lost()
    second = s.mount(2)
    assert second.req_id.seq_num > first.req_id.seq_num
    assert s.receive(m.MountResponse(first.req_id, m.PartitionState.READY)) is None
    assert s.state is S.MOUNTING
    assert s.receive(m.MountResponse(second.req_id, m.PartitionState.READY)) is MOUNTED


def test_the_mount_request_carries_the_client_high_water_mark_and_the_generation() -> None:
    s: Session[str] = Session(ME, PID, 41)
    s.bind(6)
    s.hwm = 44  # the application applied more meanwhile
    req = s.mount(12)
    assert req == m.MountRequest(ReqId(ME, 6, PID, req.req_id.seq_num), 44, 12)
    assert s.flush().req_id.generation == 6


# ------------------------------------------------------------------------------- the feed

def test_own_commit_is_recognised_by_its_request_id_and_fails_older_pending_appends() -> None:
    s = mounted()
    seqs = [s.append(f"t{i}", 1, float(i)) for i in range(5)]
    assert feed(s, OTHER, seqs[2], 0) is None  # another client's request with the same seq number
    entry = feed(s, ME, seqs[2], 1)
    assert entry is not None and entry.item == "t2" and entry.seq == seqs[2]
    assert [e.item for e in s.take_failed()] == ["t0", "t1"]  # skipped by the server: failed
    assert s.take_failed() == []
    assert [e.item for e in s.pending()] == ["t3", "t4"]
    assert feed(s, ME, seqs[2], 1) is None  # delivered again after a re-mount: decided already
    assert s.received == 1 and s.hwm == -1  # the driver advances hwm as it applies


def test_appends_committing_in_order_fail_nothing() -> None:
    s = mounted()
    seqs = [s.append(str(i), 1, 0.0) for i in range(3)]
    for tid, seq in enumerate(seqs):
        assert feed(s, ME, seq, tid).item == str(tid)
        assert not s.failed
    assert len(s) == 0


def test_a_gap_in_the_feed_is_a_protocol_error_and_changes_nothing() -> None:
    s = mounted(hwm=4)
    seq = s.append("x", 1, 0.0)
    assert feed(s, OTHER, 1, 5) is None
    with pytest.raises(ProtocolError, match="jumped from transaction 5 to 7"):
        feed(s, ME, seq, 7)
    assert s.received == 5 and len(s) == 1
    assert feed(s, OTHER, 9, 3) is None  # below: a redelivery, fine
    assert s.received == 5


# ------------------------------------------------------------------------------ mounts and fates

def test_ready_fails_every_append_sent_before_the_mount_not_those_seen_in_its_feed() -> None:
    s = mounted()
    _, b, _ = (s.append(x, 1, 0.0) for x in "abc")
    s.link_lost()
    assert len(s) == 3  # still unknown: the next mount decides
    req = s.mount(2)
    assert feed(s, ME, b, 0).item == "b"  # committed before the link broke
    assert [e.item for e in s.take_failed()] == ["a"]  # older than b: skipped
    assert s.receive(m.MountResponse(req.req_id, m.PartitionState.READY)) is MOUNTED
    assert [e.item for e in s.take_failed()] == ["c"]  # sent before the mount, not in the feed
    d = s.append("d", 1, 0.0)
    assert d > req.req_id.seq_num and len(s) == 1


def test_a_new_generation_mounts_again_and_the_answer_decides() -> None:
    s = mounted(generation=1)
    s.append("a", 1, 0.0)
    s.bind(2)
    assert s.state is S.UNMOUNTED and len(s) == 1
    req = s.mount(3)
    assert req.req_id.generation == 2
    s.receive(m.MountResponse(req.req_id, m.PartitionState.READY))
    assert [e.item for e in s.take_failed()] == ["a"]


def test_lock_failure_decides_only_that_append() -> None:
    s = mounted(hwm=10)
    a, b = s.append("a", 1, 0.0), s.append("b", 2, 0.0)
    decision = s.receive(m.LockFailure(ReqId(ME, 1, PID, b), 9))
    assert isinstance(decision, LockFailed)
    assert decision.entry.item == "b" and decision.entry.attempts == 2
    assert decision.transaction_id == 9 and decision.applied  # 9 <= hwm 10: retry at once
    assert s.receive(m.LockFailure(ReqId(ME, 1, PID, b), 9)) is None  # decided already
    assert s.receive(m.LockFailure(ReqId(OTHER, 1, PID, a), 9)) is None  # not ours
    waiting = s.receive(m.LockFailure(ReqId(ME, 1, PID, a), 11))
    assert isinstance(waiting, LockFailed) and not waiting.applied  # wait until 11 is applied
    assert len(s) == 0 and not s.failed


def test_a_refused_append_is_decided_alone_and_for_good() -> None:
    s = mounted(hwm=10)
    a, b, c = s.append("a", 1, 0.0), s.append("b", 1, 0.0), s.append("c", 1, 0.0)
    decision = s.receive(m.AppendRefused(ReqId(ME, 1, PID, b), 706, "5 locks"))
    assert isinstance(decision, Refused)
    assert (decision.entry.item, decision.error_code, decision.message) == ("b", 706, "5 locks")
    assert s.receive(m.AppendRefused(ReqId(ME, 1, PID, b), 706, "5 locks")) is None  # decided already
    assert s.receive(m.AppendRefused(ReqId(OTHER, 1, PID, a), 705, "")) is None  # not ours
    assert [e.item for e in s.pending()] == ["a", "c"] and not s.failed
    assert s.on_feed(ME, c, 11).item == "c"  # a later commit fails the older "a", not the refused "b"
    assert [e.item for e in s.take_failed()] == ["a"]


def test_feed_suspended_for_this_generation_mounts_again() -> None:
    s = mounted(generation=3)
    assert s.receive(m.FeedSuspended(ReqId(0, 2, PID, 0))) is None  # an older generation's
    assert s.state is S.READY
    action = s.receive(m.FeedSuspended(ReqId(0, 3, PID, 0)))
    assert isinstance(action, RemountLater) and action.delay == NOT_READY_RETRY
    assert s.state.value == "unmounted"
    s = mounted(generation=3)
    assert isinstance(s.receive(m.FeedSuspended(ReqId(0, 0, PID, 0))), RemountLater)  # the partition closed


def test_apply_failures_back_off_and_reset() -> None:
    s = mounted()
    delays = []
    for _ in range(12):
        delays.append(s.apply_failed())
        s.mount(2)
    assert delays[:3] == [APPLY_RETRY_INITIAL, 2 * APPLY_RETRY_INITIAL, 4 * APPLY_RETRY_INITIAL]
    assert max(delays) == APPLY_RETRY_MAX and delays == sorted(delays)
    s.apply_succeeded()
    assert s.apply_failed() == APPLY_RETRY_INITIAL
    assert s.state is S.UNMOUNTED


def test_abandon_returns_every_pending_append_oldest_first() -> None:
    s = mounted()
    for x in "abc":
        s.append(x, 1, 0.0)
    s.flush()
    assert [e.item for e in s.abandon()] == ["a", "b", "c"]
    assert len(s) == 0 and not s.flushing


# ---------------------------------------------------------------------------------- flushes

def test_flush_decides_once_the_feed_reached_its_answer() -> None:
    s = mounted()
    s.append("a", 1, 0.0)
    b = s.append("b", 1, 0.0)
    flush = s.flush()
    c = s.append("c", 1, 0.0)
    assert s.flushing and not s.flush_done(flush.req_id.seq_num)
    s.receive(m.FlushResponse(flush.req_id, 1))  # the server's high-water mark after a and b
    assert not s.failed and s.flushing  # the feed has not reached 1 yet
    assert feed(s, OTHER, 1, 0) is None
    assert feed(s, ME, b, 1).item == "b"
    assert [e.item for e in s.take_failed()] == ["a"]
    assert s.take_flushed() == [flush.req_id.seq_num] and s.flush_done(flush.req_id.seq_num)
    assert [e.seq for e in s.pending()] == [c]  # sent after the flush: undecided


def test_flush_answer_at_or_below_what_was_received_decides_at_once() -> None:
    s = mounted(hwm=3)
    s.append("a", 1, 0.0)
    flush = s.flush()
    s.receive(m.FlushResponse(flush.req_id, 3))
    assert [e.item for e in s.take_failed()] == ["a"]
    assert s.take_flushed() == [flush.req_id.seq_num]
    s.receive(m.FlushResponse(flush.req_id, 3))  # answered twice: nothing more
    assert not s.failed and not s.flushed


def test_ready_settles_flushes_sent_before_the_mount() -> None:
    s = mounted()
    s.append("a", 1, 0.0)
    f1 = s.flush()
    s.receive(m.FlushResponse(f1.req_id, 5))  # waiting for the feed to reach 5...
    f2 = s.flush()
    s.link_lost()  # ...which this connection will not deliver
    req = s.mount(2)
    s.receive(m.MountResponse(req.req_id, m.PartitionState.READY))
    assert sorted(s.take_flushed()) == [f1.req_id.seq_num, f2.req_id.seq_num]
    assert [e.item for e in s.take_failed()] == ["a"]
    assert not s.flushing
    for tid in range(6):
        feed(s, OTHER, 1, tid)
    assert not s.flushed  # the settled flush is not decided twice


def test_wants_flush_and_oldest() -> None:
    s = mounted()
    assert not s.wants_flush() and s.oldest() is None
    s.append("a", 1, 10.0)
    s.append("b", 1, 12.0)
    assert s.oldest() == 10.0
    assert s.wants_flush()
    assert not s.wants_flush(now=14.0, threshold=5.0)
    assert s.wants_flush(now=15.5, threshold=5.0)
    s.flush()
    assert not s.wants_flush(now=100.0, threshold=5.0)  # one in flight is enough
    s2 = in_state(S.MOUNTING)
    s2.append("x", 1, 0.0)
    assert not s2.wants_flush()  # only a mounted session flushes


def _after_wrap(s: Session[str]) -> None:
    s._last = SEQ_MASK - 2  # as after 2**31 - 2 requests: the next ones wrap on the wire


def test_sequence_numbers_stay_within_the_wire_range() -> None:
    s = mounted()
    _after_wrap(s)
    assert s.append("a", 1, 0.0) == SEQ_MASK - 1
    assert s.append("b", 1, 0.0) == SEQ_MASK
    assert s.append("c", 1, 0.0) == 0
    assert s.append("d", 1, 0.0) == 1


def test_fates_are_decided_across_a_wrap_of_the_sequence_numbers() -> None:
    """Sent before is still "before" when the wire number wrapped in between: a commit after the
    wrap fails the appends it skipped, and a flush after the wrap decides what was sent before it.
    (Comparing wire numbers left the appends sent before the wrap pending for ever.)"""
    s = mounted()
    _after_wrap(s)
    seqs = [s.append(x, 1, 0.0) for x in "abcd"]
    assert seqs == [SEQ_MASK - 1, SEQ_MASK, 0, 1]
    c = seqs[2]
    entry = s.on_feed(ME, c, 0)  # a and b were lost; c committed
    assert entry is not None and entry.item == "c"
    assert [e.item for e in s.take_failed()] == ["a", "b"]
    flush = s.flush()
    assert flush.req_id.seq_num == 2
    s.receive(m.FlushResponse(flush.req_id, 0))  # d never reached the log
    assert s.flush_done(flush.req_id.seq_num)
    assert [e.item for e in s.take_failed()] == ["d"]
    assert s.take_flushed() == [2]
    assert len(s) == 0


def test_lock_failures_and_mounts_across_a_wrap() -> None:
    s = mounted()
    _after_wrap(s)
    s.append("a", 1, 0.0)
    s.append("b", 1, 0.0)
    c = s.append("c", 1, 0.0)  # wire number 0
    action = s.receive(m.LockFailure(s.req_id(c), 4))
    assert isinstance(action, LockFailed) and action.entry.item == "c"
    s.link_lost()
    req = s.mount(2)  # wire number 1: sent after a and b
    assert req.req_id.seq_num == 1
    assert s.receive(m.MountResponse(req.req_id, m.PartitionState.READY)) is MOUNTED
    assert [e.item for e in s.take_failed()] == ["a", "b"]


# ------------------------------------------------------------------ a model of the server

class ServerModel:
    """One partition of a server, as far as one client can tell: requests processed in arrival
    order; appends commit, are lost (a store session that failed) or fail their lock check; a
    mount streams the feed from the client's high-water mark, then answers READY; a flush answers
    the high-water mark after what came before it. As on the real server, the feed of commits
    after the mount is streamed by a task of its own (:meth:`stream`), so answers may overtake
    it. Messages to a connection that is gone are lost."""

    def __init__(self) -> None:
        self.log: list[tuple[int, int]] = []  # (client id, seq) per transaction id
        self.inbound: deque[tuple[int, object]] = deque()  # (connection, request), arrival order
        self.outbound: deque[object] = deque()  # to the current connection, in order
        self.connection = 0  # the live connection (0: none)
        self.fed = 0  # the connection whose feed is streaming (its mount was processed)
        self.feed_position = -1  # the last transaction the feed task posted to ``fed``
        self.ready = True

    def record(self, tid: int) -> m.FeedData:
        client_id, seq = self.log[tid]
        return m.FeedData(ReqId(client_id, 1, PID, seq), tid, 0)

    def stream(self, count: int) -> None:
        """The feed task posts up to ``count`` records."""
        while count and self.feed_position < len(self.log) - 1:
            self.feed_position += 1
            count -= 1
            if self.fed and self.fed == self.connection:
                self.outbound.append(self.record(self.feed_position))

    def commit(self, client_id: int, seq: int) -> None:
        self.log.append((client_id, seq))

    def process(self, fate: str) -> None:
        conn, req = self.inbound.popleft()
        reply = self.connection == conn
        if isinstance(req, m.MountRequest):
            if not self.ready:
                if reply:
                    self.outbound.append(m.MountResponse(req.req_id, m.PartitionState.NOT_READY))
                return
            self.fed = conn
            if reply:
                for tid in range(req.client_high_water_mark + 1, len(self.log)):
                    self.outbound.append(self.record(tid))
                self.outbound.append(m.MountResponse(req.req_id, m.PartitionState.READY))
            self.feed_position = len(self.log) - 1
        elif isinstance(req, m.FlushRequest):
            if reply:
                self.outbound.append(m.FlushResponse(req.req_id, len(self.log) - 1))
        elif isinstance(req, tuple) and self.fed == conn:  # an append of the mounted connection
            _, seq = req
            if fate == "commit":
                self.commit(ME, seq)
            elif fate == "lock" and reply:
                self.outbound.append(m.LockFailure(ReqId(ME, 1, PID, seq), len(self.log) - 1))
            # "lost": the store dropped it; it never commits
        # an append of a connection that is not mounted (stale): ignored, as the server does


class SessionAgainstServer(RuleBasedStateMachine):
    """A session driven the way the client library and the probe drive theirs, against the model.

    Safety: an append decided COMMITTED is in the log, one decided FAILED or LOCK-FAILED never
    gets there; each append is decided at most once; READY leaves nothing older than the mount
    pending. Liveness: after a clean mount and a flush, every append is decided, and exactly the
    log's appends of this client were COMMITTED.
    """

    def __init__(self) -> None:
        super().__init__()
        self.server = ServerModel()
        self.s: Session[int] = Session(ME, PID)
        self.s.bind(1)
        self.connections = itertools.count(1)
        self.items = itertools.count()
        self.fate: dict[int, str] = {}  # seq -> committed / failed / lock-failed
        self.seq_of: dict[int, int] = {}  # item -> seq
        self.last_ready_mount = 0

    @initialize()
    def mounted(self) -> None:
        """Start READY (most steps are about what happens then)."""
        self.connect_and_mount()
        self.server.process("commit")
        self.deliver(1)

    # -- what the client does
    @rule()
    def connect_and_mount(self) -> None:
        if self.server.connection == 0:
            self.server.connection = next(self.connections)
            self.server.outbound.clear()
        if self.s.state is S.UNMOUNTED:
            self.server.inbound.append((self.server.connection, self.s.mount(self.server.connection)))

    @precondition(lambda self: self.s.state is S.READY)
    @rule(count=st.integers(1, 4))
    def append(self, count: int) -> None:
        for _ in range(count):
            item = next(self.items)
            seq = self.s.append(item, 1, 0.0)
            self.seq_of[item] = seq
            if self.server.connection:
                self.server.inbound.append((self.server.connection, (ME, seq)))
            # else: the link dropped between the decision and the send; the next READY decides it

    @precondition(lambda self: self.s.state is S.READY and self.server.connection)
    @rule()
    def flush(self) -> None:
        self.server.inbound.append((self.server.connection, self.s.flush()))

    @rule(arrived=st.integers(0, 5))
    def lose_link(self, arrived: int) -> None:
        """The connection breaks: requests beyond the first ``arrived`` never reached the server,
        and whatever it had not yet delivered to us is lost."""
        conn = self.server.connection
        if not conn:
            return
        mine = [i for i, (c, _) in enumerate(self.server.inbound) if c == conn]
        for i in reversed(mine[arrived:]):
            del self.server.inbound[i]
        self.server.connection = 0
        self.server.outbound.clear()
        if self.s.state is not S.INACTIVE:
            self.s.link_lost()

    # -- what the server does
    @precondition(lambda self: self.server.inbound)
    @rule(fates=st.lists(st.sampled_from(["commit", "commit", "commit", "lost", "lock"]), min_size=1, max_size=6))
    def server_processes(self, fates: list[str]) -> None:
        for fate in fates:
            if self.server.inbound:
                self.server.process(fate)

    @rule()
    def another_client_commits(self) -> None:
        self.server.commit(OTHER, 1)

    @rule(count=st.integers(1, 8))
    def server_streams_the_feed(self, count: int) -> None:
        self.server.stream(count)

    @rule(ready=st.sampled_from([True, True, False]))
    def server_readiness(self, ready: bool) -> None:
        self.server.ready = ready

    @precondition(lambda self: self.server.outbound)
    @rule(count=st.integers(1, 8))
    def deliver(self, count: int = 1) -> None:
        for _ in range(count):
            if self.server.outbound:
                self.receive(self.server.outbound.popleft())

    def receive(self, msg: object) -> None:
        if isinstance(msg, m.FeedData):
            q = msg.req_id
            entry = self.s.on_feed(q.client_id, q.seq_num, msg.transaction_id)
            if msg.transaction_id > self.s.hwm:
                self.s.hwm = msg.transaction_id  # applied at once, as the probe does
            if entry is not None:
                self.decide(entry.seq, "committed")
        else:
            action = self.s.receive(msg)
            if isinstance(action, LockFailed):
                self.decide(action.entry.seq, "lock-failed")
            if isinstance(msg, m.MountResponse) and action is MOUNTED:
                self.last_ready_mount = msg.req_id.seq_num
        for entry in self.s.take_failed():
            self.decide(entry.seq, "failed")
        self.s.take_flushed()

    def decide(self, seq: int, fate: str) -> None:
        assert seq not in self.fate, f"append {seq} decided twice: {self.fate[seq]} then {fate}"
        self.fate[seq] = fate

    # -- what must hold
    @invariant()
    def decisions_agree_with_the_log(self) -> None:
        in_log = {seq for client_id, seq in self.server.log if client_id == ME}
        for seq, fate in self.fate.items():
            assert (seq in in_log) == (fate == "committed"), f"append {seq} decided {fate}; in the log: {seq in in_log}"

    @invariant()
    def ready_leaves_nothing_older_pending(self) -> None:
        if self.s.state is S.READY:
            assert all(e.seq > self.last_ready_mount for e in self.s.pending())

    @invariant()
    def received_is_the_feed_position(self) -> None:
        assert self.s.received <= len(self.server.log) - 1

    def settle(self) -> None:
        """The server commits everything queued and streams it; every answer reaches the session."""
        server = self.server
        while server.inbound or server.outbound:
            while server.inbound:
                server.process("commit")
            server.stream(len(server.log))
            while server.outbound:
                self.receive(server.outbound.popleft())

    def teardown(self) -> None:
        """Settle everything: the server processes what it has, a clean link mounts, a flush
        completes. Then every append is decided, and COMMITTED is exactly what the log holds."""
        server = self.server
        for _ in range(3):
            self.settle()
            if server.connection and self.s.state is S.READY:
                break
            self.lose_link(0)
            server.ready = True
            self.connect_and_mount()
        assert self.s.state is S.READY
        self.flush()
        self.settle()
        assert len(self.s) == 0, f"undecided after a flush: {list(self.s.pending())}"
        assert not self.s.flushing, "the flush was answered and the feed reached its answer"
        assert set(self.fate) == set(self.seq_of.values())
        in_log = {seq for client_id, seq in server.log if client_id == ME}
        assert {seq for seq, fate in self.fate.items() if fate == "committed"} == in_log
        self.decisions_agree_with_the_log()


TestSessionAgainstServer = SessionAgainstServer.TestCase
TestSessionAgainstServer.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)


@given(st.lists(st.tuples(st.sampled_from([ME, OTHER]), st.integers(1, 40)), max_size=60))
def test_feed_commits_each_own_append_once_and_fails_only_older_ones(records: list[tuple[int, int]]) -> None:
    """Whatever the feed says, an append is decided once, and FAILED only when a newer one of
    ours committed (the server processes a connection's appends in order)."""
    s = mounted()
    seqs = [s.append(str(i), 1, 0.0) for i in range(40)]
    decided: dict[int, str] = {}
    for tid, (client_id, index) in enumerate(records):
        seq = seqs[index - 1]
        entry = s.on_feed(client_id, seq, tid)
        if entry is not None:
            assert client_id == ME and entry.seq == seq and seq not in decided
            decided[seq] = "committed"
            for failed in s.take_failed():
                assert failed.seq < seq and failed.seq not in decided
                decided[failed.seq] = "failed"
    assert not s.failed
    assert set(decided) | {e.seq for e in s.pending()} == set(seqs)
    assert not set(decided) & {e.seq for e in s.pending()}
