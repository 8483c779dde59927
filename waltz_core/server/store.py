"""The replicated store of one partition: store sessions, replica sessions, quorum commit.

A *store session* has a session id taken from the partition metadata by compare-and-set, runs
recovery (:mod:`.recovery`) and then streams appends to every replica of the partition through
one *replica session* each. Each replica session sends everything appended since its last
acknowledgement in one storage append (adaptive group commit: one round trip and one fdatasync
per batch on the storage, no fixed wait), so batches grow exactly when load does. A transaction
commits when a majority of replicas acknowledged it; commits are reported to the partition in
transaction-id order.

A replica that fails leaves the session, and the store starts a new session with recovery (the
Waltz design: no rejoin; pending appends are resolved by the recovery's high-water mark). A replica that
is behind when the session starts catches up inside the session, reading from a peer what the
session no longer buffers, and is recorded as engaged once it reached the session's start.
Every ``checkpoint_interval`` transactions the store rolls over to a new session after draining,
which bounds the work of a later recovery. A replica whose node *refused* the session's writes (a
full disk, the partition taken offline there) is kept out of the next sessions for a while, as if
it were unreachable (:data:`REFUSAL_HOLD_FIRST`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from bisect import bisect_right
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from itertools import islice
from typing import Protocol, TypeVar

import attrs

from ..config import ServerConfig
from ..coordination.metadata import UNRESOLVED, ReplicaState
from ..errors import (
    CasConflictError,
    GenerationMismatchError,
    OutOfOrderAppendError,
    PartitionNotReadyError,
    PluginError,
    StaleSessionError,
    StorageError,
    WaltzError,
)
from ..protocol import storage as sm
from ..protocol.framing import DEFAULT_MAX_FRAME_SIZE
from ..protocol.wire import Record, RecordBatch, RecordHeader, ReqId, encode_stored_record
from ..retry import RetryPolicy
from ..timeouts import wait_for
from .recovery import Recovery
from .replica import ReplicaApi
from .vote import quorum_of

log = logging.getLogger("waltz.server.store")

_R = TypeVar("_R")


@attrs.frozen(slots=True)
class SessionStart:
    """What :meth:`MetadataAccess.begin_session` took and read."""

    session_id: int
    states: dict[str, ReplicaState]  #: replica states of the replicas assigned now and of the previous session's
    assigned: list[str]  #: the replicas assigned now: the new session's
    #: the replicas of the last session that finished its recovery (None: not recorded)
    previous_replicas: list[str] | None = None


class MetadataAccess(Protocol):
    """Partition metadata operations the store needs (backed by the coordination recipes)."""

    async def begin_session(self, partition_id: int, generation: int) -> SessionStart:
        """Take a new session id by CAS; return it with the replica states, the assigned replicas
        and the replica set of the last session that finished its recovery.

        The states of replicas neither assigned nor of the previous session leave the metadata in
        the same CAS (see :func:`~waltz_core.coordination.metadata.states_kept`). Raises
        GenerationMismatchError when the metadata carries a newer generation (we are stale).
        """

    async def write_states(self, partition_id: int, generation: int, session_id: int,
                           states: Mapping[str, ReplicaState], replica_set: Sequence[str] | None = None) -> None:
        """Update the given replica states (others unchanged) by CAS, only while ``session_id`` is
        still the partition's session (GenerationMismatchError when stale, CasConflictError when
        another session was started meanwhile). ``replica_set``, when given, is recorded as the
        replicas of a session that finished its recovery (:attr:`SessionStart.previous_replicas`
        of the next one)."""


class StoreSink(Protocol):
    def on_committed(self, high_water_mark: int) -> None: ...

    def on_session_reset(self, high_water_mark: int) -> None: ...

    def on_frame_limit(self, max_frame_size: int) -> None: ...


ReplicaConnector = Callable[[str], Awaitable[ReplicaApi | None]]

#: Seconds between attempts to reach replicas that are not in the current session.
PROBE_INTERVAL = 1.0
#: Longest pause before a new session after sessions in a row broke without committing anything
#: (a persistent fault: each session costs two compare-and-sets on the coordination service).
FRUITLESS_PAUSE_MAX = 2.0
#: Seconds a replica whose node refused the session's writes is kept out of new sessions, doubled
#: at each refusal that follows within REFUSAL_HOLD_MAX seconds of the last hold, up to that. Its
#: node answers, so without the hold every new session would take it in again, it would refuse
#: again, and the partition would start session after session (each a recovery and a pause of
#: its appends) as fast as the node refuses: a full disk made 10 sessions in 0.3 s. A new
#: connection to the node (it was restarted, after its disk was freed) ends the hold.
REFUSAL_HOLD_FIRST = 1.0
REFUSAL_HOLD_MAX = 30.0


def refused_by_storage(exc: BaseException) -> bool:
    """The node answered and refused the write: not a lost connection, not the fence of a newer
    session, not an append out of order (a new session's recovery settles those)."""
    return isinstance(exc, StorageError) and not isinstance(exc, StaleSessionError | OutOfOrderAppendError)



class ReplicationBudget:
    """Bytes of committed records the stores of one server keep for replicas that are behind
    (``server.replication_buffer_budget``), shared evenly by the stores open: a replica further
    behind than its partition's share reads from its peers instead (Waltz design, "falling behind").
    Records not yet committed are always kept: the in-flight window bounds them."""

    __slots__ = ("limit", "stores")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.stores = 0

    @property
    def share(self) -> int:
        return self.limit // max(1, self.stores)


class StreamPump:
    """Store sessions with new records for their streaming replicas, pumped together: one loop
    callback per loop step for every partition of a server, instead of one per partition and
    batch (at 64 partitions x 1 transaction, a callback per partition-round)."""

    __slots__ = ("_sessions", "_scheduled")

    def __init__(self) -> None:
        self._sessions: list[StoreSession] = []
        self._scheduled = False

    def schedule(self, session: StoreSession) -> None:
        """Pump ``session`` after the appends of this loop step (they come in bursts)."""
        self._sessions.append(session)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._run)

    def _run(self) -> None:
        self._scheduled = False
        sessions, self._sessions = self._sessions, []
        #: the clients that may hold appends for one message to their node (ReplicaApi.send_appends)
        senders: dict[int, Callable[[], None]] = {}
        for session in sessions:
            try:
                session.pump()
                for replica in session.streamers:
                    send = replica.send_appends
                    if send is not None:
                        senders[id(replica.api)] = send
            except Exception:  # one partition's bug must not leave the others' records unsent
                log.exception("partition %d: sending its replicas their batches failed", session.partition_id)
        for send in senders.values():
            try:
                send()
            except Exception:  # one client's bug must not keep the other nodes' appends from them
                log.exception("sending the appends of several partitions failed")


class _ReplicaSession:
    """Streams the session's records to one storage replica.

    Two modes. A task (:meth:`run`) catches a replica up: joining the session late, reading
    from a peer what the session no longer buffers. Once the replica is clean and what it needs
    next is buffered, and its client can append without awaiting (``append_nowait``), it
    *streams*: the session sends the next batch when records arrive (one loop callback for all
    the session's replicas) and the acknowledgement's callback sends the one after it; no task
    wakes per batch. Both modes keep one append outstanding.
    """

    def __init__(self, session: StoreSession, endpoint: str, api: ReplicaApi, start_mark: int, clean: bool) -> None:
        self.session = session
        self.endpoint = endpoint
        self.api = api
        self.acked = start_mark  #: highest transaction id this replica holds
        self.clean = clean  #: at or beyond the session's start with its low-water mark set
        self.task: asyncio.Task[None] | None = None
        #: the client's append that does not await, if it has one (streaming needs it)
        self._append_nowait: Callable[[int, int, RecordBatch, Callable[[WaltzError | None], None]], None] | None = (
            getattr(api, "append_nowait", None))
        self._sending = -1  #: last transaction id of the append outstanding while streaming; -1: none
        #: sends the appends the client holds to send several partitions' in one message, if it does
        self.send_appends: Callable[[], None] | None = getattr(api, "send_appends", None)

    @property
    def streaming(self) -> bool:
        """Sent batches by the session's callbacks, not by its task (see :meth:`stream`)."""
        return self in self.session.streamers

    def start_task(self) -> None:
        """Run :meth:`run`: catching up, then streaming when the client allows it."""
        self.task = asyncio.get_running_loop().create_task(
            self.run(), name=f"replica-p{self.session.partition_id}-{self.endpoint}")

    async def run(self) -> None:
        s = self.session
        sid, pid = s.session_id, s.partition_id
        max_batch = s.config.max_batch_size
        try:
            while True:
                if not self.clean and self.acked == s.start_high_water_mark:
                    # Caught up to the session start: join it (recovery step 6 of the Waltz design, for a late replica). Its
                    # acknowledgements count only once the partition metadata says it is engaged in
                    # this session: recovery takes a replica it does not find there for inconsistent
                    # and counts only its low-water mark, so a commit it had helped make could be lost.
                    await self.api.set_low_water_mark(sid, pid, s.start_high_water_mark)
                    await s.record_engaged(self.endpoint)
                    self.clean = True
                    s.on_ack()
                cursor = self.acked + 1
                if self.clean and self._append_nowait is not None and cursor >= s.buffer_first and not s.stopped:
                    s.streamers.append(self)  # from here on the session's callbacks send (see stream)
                    self.stream()
                    return
                if cursor > s.last_assigned:
                    await s.wait_for_records(cursor)
                    continue
                batch = s.buffered(cursor, max_batch)
                if batch is None:
                    # Older than the session's buffer (behind, or fell behind): copy from a peer.
                    limit = min(max_batch * 5, s.buffer_first - cursor)
                    if not self.clean:
                        limit = min(limit, s.start_high_water_mark - self.acked)
                    batch = await s.read_from_peer(self, cursor, limit)
                await self.api.append(sid, pid, batch)
                self.acked = acked = batch.last_transaction_id
                if acked > s.committed:  # else this ack cannot move the commit (see on_ack)
                    s.on_ack()
        except asyncio.CancelledError:
            raise
        except WaltzError as exc:
            s.replica_failed(self, exc)
        except Exception as exc:  # a bug in one replica session must reset the session, not hang it
            log.exception("partition %d: replica session %s crashed", pid, self.endpoint)
            s.replica_failed(self, exc)

    def stream(self) -> None:
        """Streaming: send what is buffered after the acknowledgement, unless an append is out."""
        s = self.session
        if self._sending >= 0 or s.stopped:
            return
        cursor = self.acked + 1
        if cursor > s.last_assigned:
            return  # idle: the session's next append schedules the pump
        batch = s.buffered(cursor, s.config.max_batch_size)
        if batch is None:
            # Fell behind what the session buffers (a slow replica beyond its budget share):
            # catch up from a peer in a task, then stream again.
            s.streamers.remove(self)
            self.start_task()
            return
        self._sending = batch.last_transaction_id
        assert self._append_nowait is not None
        try:
            self._append_nowait(s.session_id, s.partition_id, batch, self._appended)
        except WaltzError as exc:
            self._sending = -1
            self.leave(exc)

    def leave(self, exc: BaseException) -> None:
        """A streaming replica failed: it sends nothing more in this session."""
        if self.streaming:
            self.session.streamers.remove(self)
        self.session.replica_failed(self, exc)

    def _appended(self, error: WaltzError | None) -> None:
        s = self.session
        acked, self._sending = self._sending, -1
        if s.stopped:
            return
        if error is not None:
            self.leave(error)
            return
        try:
            self.acked = acked
            if acked > s.committed:  # else this ack cannot move the commit (see on_ack)
                s.on_ack()
            self.stream()
        except Exception as exc:  # as in run(): a bug resets the session instead of hanging it
            log.exception("partition %d: replica session %s crashed", s.partition_id, self.endpoint)
            self.leave(exc)


def _backoff(config: ServerConfig) -> RetryPolicy:
    """The store's retry timing: ``initial_retry_interval`` doubling up to ``max_retry_interval``,
    jittered so that the partitions hit by one failure do not retry in lock step."""
    return RetryPolicy(initial=config.initial_retry_interval, maximum=config.max_retry_interval)


def _fenced(exc: BaseException) -> bool:
    """A newer session wrote the partition metadata, or the partition moved to a newer generation.

    Both are retriable for a client (re-read, go to the new owner), which is why the flags cannot
    decide here: for the session that got them they are final."""
    return isinstance(exc, CasConflictError | GenerationMismatchError)


class StoreSession:
    """One store session of one partition."""

    def __init__(self, store: ReplicatedStore, session_id: int, start_hwm: int, assigned: list[str]) -> None:
        self.store = store
        self.partition_id = store.partition_id
        self.config = store.config
        self.session_id = session_id
        self.start_high_water_mark = start_hwm
        self.assigned = list(assigned)
        #: acknowledgements that commit a transaction: the store's commit rule (the majority unless
        #: a plugin's waltz_commit_quorum says otherwise), decided once per session
        self.quorum = store.commit_quorum(len(assigned))
        if not 1 <= self.quorum <= len(assigned):
            raise PluginError(f"partition {self.partition_id}: the commit rule asks for {self.quorum} of "
                              f"{len(assigned)} replicas; it must be 1 to {len(assigned)}")
        self.committed = start_hwm
        self.last_assigned = start_hwm
        self.replicas: dict[str, _ReplicaSession] = {}
        #: records after buffer_first - 1, in order, each encoded once in the stored layout: every
        #: replica session sends slices of the same bytes (storage appends carry this layout)
        self._buffer: deque[bytes] = deque()
        self._buffer_bytes = 0
        self.buffer_first = start_hwm + 1
        #: the last batch built by buffered(), shared by the replica sessions that ask for the
        #: same records (in lock step they all do): the bytes of a transaction id never change
        #: within a session, so a batch stays valid for it
        self._last_batch: RecordBatch | None = None
        self._records_event = asyncio.Event()
        self._records_set = False  #: mirrors _records_event.is_set() (checked once per append)
        self._broken: BaseException | None = None
        #: a replica left the session (``_broken`` says why): it takes no more appends. An
        #: attribute, not a property: the partition reads it once per transaction
        self.broken = False
        self.rolling_over = False  #: draining before a checkpoint rollover to a new session
        self.streamers: list[_ReplicaSession] = []  #: replicas in streaming mode
        self._pump_scheduled = False
        self.stopped = False
        #: bytes of records one append to a replica carries at most: records streamed together
        #: (several large transactions in flight) must not make a frame the link refuses, which
        #: would end the session, and the next, for ever (at least one record always goes). The
        #: server's frame, lowered to the smallest limit of the session's replicas once they are
        #: known (ReplicatedStore._apply_frame_limit)
        self.max_batch_bytes = store.max_frame_size - sm.APPEND_BATCH_HEADROOM

    # ----------------------------------------------------------------------------- appending

    def append(self, req_id: ReqId, header: int, data: bytes, checksum: int) -> int:
        txn = self.last_assigned + 1
        self.last_assigned = txn
        record = encode_stored_record(txn, req_id, header, data, checksum)
        self._buffer.append(record)
        self._buffer_bytes += len(record)
        if not self._records_set:
            self._records_set = True
            self._records_event.set()
        if not self._pump_scheduled and self.streamers:
            # After the appends of this loop step (they come in bursts): one batch per replica.
            self._pump_scheduled = True
            self.store.stream_pump.schedule(self)
        return txn

    def pump(self) -> None:
        """Each streaming replica sends what it has not been sent (:class:`StreamPump`)."""
        self._pump_scheduled = False
        for r in tuple(self.streamers):  # stream() may take a replica out of the list
            try:
                r.stream()
            except Exception as exc:  # a bug resets the session instead of hanging it
                log.exception("partition %d: replica session %s crashed", self.partition_id, r.endpoint)
                r.leave(exc)

    async def wait_for_records(self, cursor: int) -> None:
        while self.last_assigned < cursor:
            self._records_set = False
            self._records_event.clear()
            await self._records_event.wait()

    def buffered(self, first: int, max_count: int) -> RecordBatch | None:
        """Up to ``max_count`` buffered records from ``first`` (at least one is), None if no longer buffered."""
        start = first - self.buffer_first
        if start < 0:
            return None
        buf = self._buffer
        end = min(len(buf), start + max_count)
        last = self._last_batch
        if last is not None and last.first_transaction_id == first and len(last) == end - start:
            return last
        data = b"".join(islice(buf, start, end))
        limit = self.max_batch_bytes
        if len(data) > limit:  # rare: large records in flight together; a joined batch is cheaper than sizing each
            size, stop = len(buf[start]), start + 1
            while stop < end and size + len(buf[stop]) <= limit:
                size += len(buf[stop])
                stop += 1
            end = stop
            data = b"".join(islice(buf, start, end))
        self._last_batch = batch = RecordBatch(data, end - start, first)
        return batch

    async def read_from_peer(self, reader: _ReplicaSession, first: int, max_count: int) -> RecordBatch:
        for peer in self.replicas.values():
            if peer is not reader and peer.clean and peer.acked >= first:
                records = await peer.api.record_list(self.session_id, self.partition_id, first, max_count)
                if records:
                    batch = RecordBatch.of(records)  # a storage client's list is a batch already: no re-encoding
                    if batch.nbytes > self.max_batch_bytes and len(batch) > 1:
                        # The peer bounds its list by its own frame limit; the append must fit the
                        # session's. offsets[k] is the size of the first k records.
                        batch = batch[:max(1, bisect_right(batch.offsets, self.max_batch_bytes) - 1)]
                    return batch
        raise PartitionNotReadyError(f"partition {self.partition_id}: no replica can serve records from {first}")

    # ------------------------------------------------------------------------------- commits

    def on_ack(self) -> None:
        """A replica's acknowledgement moved (or it became clean): commit what a quorum holds.

        Between calls the quorum-th highest clean acknowledgement is at most ``committed``, so a
        replica whose acknowledgement is still at most ``committed`` need not call this."""
        acks = [r.acked for r in self.replicas.values() if r.clean]
        quorum = self.quorum
        if len(acks) < quorum:
            return
        acks.sort(reverse=True)
        candidate = acks[quorum - 1]
        if candidate > self.committed:
            self.committed = candidate
            self._trim()
            self.store.session_committed(self, candidate)

    def _trim(self) -> None:
        # Keep what a streaming replica still needs, within this partition's share of the
        # server's replication budget: a replica further behind is "falling behind" and catches
        # up from its peers instead (Waltz design, "Store Partition Object"). Uncommitted records stay.
        low = min((r.acked for r in self.replicas.values() if r.clean), default=self.committed)
        share = self.store.replication_budget.share
        buf = self._buffer
        first, nbytes = self.buffer_first, self._buffer_bytes
        while buf and (first <= low or (nbytes > share and first <= self.committed)):
            nbytes -= len(buf.popleft())
            first += 1
        self.buffer_first, self._buffer_bytes = first, nbytes

    async def record_engaged(self, endpoint: str) -> None:
        """Record in the partition metadata that ``endpoint`` (and every clean replica) is engaged
        in this session; retried until it lands. A conflict means a newer session or generation
        exists: this one is over, and the error ends the replica session."""

        async def write() -> None:
            # the clean replicas are read again on every attempt: more may have caught up meanwhile
            states = {ep: ReplicaState(self.session_id, UNRESOLVED)
                      for ep, r in self.replicas.items() if r.clean or ep == endpoint}
            await self.store.metadata.write_states(self.partition_id, self.store.generation, self.session_id, states)

        def retrying(exc: BaseException, delay: float) -> None:
            log.info("partition %d session %d: could not record %s as engaged yet: %s (retry in %.1fs)",
                     self.partition_id, self.session_id, endpoint, exc, delay)

        # Every other Waltz failure (coordination unreachable, session lost, ...) is retried until
        # it lands, retriable flag or not: the session cannot go on without this record.
        await _backoff(self.config).call(
            write, retry_if=lambda exc: isinstance(exc, WaltzError) and not _fenced(exc), on_retry=retrying)

    def replica_failed(self, replica: _ReplicaSession, exc: BaseException) -> None:
        log.warning("partition %d session %d: replica %s left the session: %s",
                    self.partition_id, self.session_id, replica.endpoint, exc)
        if refused_by_storage(exc):
            self.store.hold_out(replica.endpoint, replica.api)
        if self._broken is None:
            self._broken = exc
            self.broken = True
            self.store.session_broken(self, exc)

    async def stop(self) -> None:
        self.stopped = True  # streaming replicas send nothing more; late acknowledgements are ignored
        self.streamers.clear()
        tasks = [r.task for r in self.replicas.values() if r.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def buffered_bytes(self) -> int:
        return self._buffer_bytes


class ReplicatedStore:
    """Implements the partition's ``Store`` protocol over store sessions."""

    def __init__(self, partition_id: int, generation: int, metadata: MetadataAccess, connect: ReplicaConnector,
                 config: ServerConfig, replication_budget: ReplicationBudget | None = None,
                 commit_quorum: Callable[[int], int] = quorum_of, stream_pump: StreamPump | None = None, *,
                 max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        self.partition_id = partition_id
        self.max_frame_size = max_frame_size
        #: the smallest frame limit of the replicas of the last session begun (the server's own
        #: when every node takes as much); the partition takes no record above it
        self.frame_limit = max_frame_size
        #: replicas -> acknowledgements that commit (the server asks waltz_commit_quorum once)
        self.commit_quorum = commit_quorum
        #: the server's, shared with its other partitions; one of our own when standing alone (tests)
        self.replication_budget = replication_budget or ReplicationBudget(config.replication_buffer_budget)
        #: the server's, shared with its other partitions (one of our own when standing alone)
        self.stream_pump = stream_pump or StreamPump()
        self._budgeted = False
        self.generation = generation
        self.metadata = metadata
        self._connect = connect
        self.config = config
        self.high_water_mark = -1
        self.session: StoreSession | None = None
        self.recovery: Recovery | None = None  #: the recovery of the session being started, while it runs
        self._sink: StoreSink | None = None
        #: set (and dropped) at every change of session or commit; made only while someone waits:
        #: commits come once per batch and partition, waiters rarely
        self._changed: asyncio.Event | None = None
        self._epoch = 0  # bumped on every session reset: flush() waiters stop waiting then
        self._supervisor: asyncio.Task[None] | None = None
        self._restart = asyncio.Event()
        self._closed = False
        self._window = max(4 * config.max_batch_size, 64)
        self.sessions_started = 0
        #: pauses before the next session while sessions break without committing (None: none broke so)
        self._fruitless: Iterator[float] | None = None
        self.last_error: str = ""
        #: replicas whose nodes refused writes -> (kept out of new sessions until, the hold's length,
        #: the connection that refused: a new one, after the node's restart, ends the hold)
        self._held_out: dict[str, tuple[float, float, object]] = {}
        #: the replicas the coordination service assigns now (replicas_assigned), if it said
        self._assigned_now: list[str] | None = None

    # ------------------------------------------------------------------------- lifecycle

    async def open(self, sink: StoreSink) -> int:
        self._sink = sink
        self.replication_budget.stores += 1
        self._budgeted = True
        await self._start_session_with_retry()
        if self._closed:
            raise PartitionNotReadyError(f"partition {self.partition_id} was closed while it was recovering")
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise(), name=f"store-p{self.partition_id}")
        return self.high_water_mark

    async def close(self) -> None:
        self._closed = True
        if self._budgeted:
            self._budgeted = False
            self.replication_budget.stores -= 1
        if self._supervisor is not None:
            self._supervisor.cancel()
            await asyncio.gather(self._supervisor, return_exceptions=True)
        if self.session is not None:
            await self.session.stop()
            self.session = None
        self._notify()

    async def _supervise(self) -> None:
        while not self._closed:
            try:
                await wait_for(self._restart.wait(), self._probe_interval())
            except TimeoutError:
                await self._probe_missing_replicas()
                continue
            self._restart.clear()
            old = self.session
            self.session = None
            if old is not None:
                await old.stop()
                await self._pause_if_fruitless(old)
            try:
                await self._start_session_with_retry()
            except GenerationMismatchError as exc:
                log.warning("partition %d: %s; giving the partition up", self.partition_id, exc)
                self.last_error = str(exc)
                return

    async def _pause_if_fruitless(self, old: StoreSession) -> None:
        """Sessions that break before they commit anything, in a row, start their successors
        after a growing pause (up to :data:`FRUITLESS_PAUSE_MAX`): a fault that ends every session
        at once would otherwise start dozens a second, each writing the partition metadata twice."""
        if not old.broken or old.committed > old.start_high_water_mark:
            self._fruitless = None
            return
        if self._fruitless is None:
            self._fruitless = RetryPolicy(initial=self.config.initial_retry_interval,
                                          maximum=min(self.config.max_retry_interval, FRUITLESS_PAUSE_MAX)).delays()
        delay = next(self._fruitless)
        log.info("partition %d: session %d broke before it committed anything; the next starts in %.2fs",
                 self.partition_id, old.session_id, delay)
        await asyncio.sleep(delay)

    def replicas_assigned(self, endpoints: Sequence[str]) -> None:
        """The partition's replica assignment changed (``waltz cluster assign-partition`` /
        ``unassign-partition``): a session on another set of replicas drains and rolls over to a
        new one, whose recovery takes the new replicas in (and catches them up) and leaves the
        others. A session that starts meanwhile is checked when it opens."""
        self._assigned_now = sorted(endpoints)
        for endpoint in self._held_out.keys() - set(endpoints):  # a hold keeps the refusing connection
            del self._held_out[endpoint]
        self._roll_over_if_reassigned()

    def _roll_over_if_reassigned(self) -> None:
        s = self.session
        if s is None or s.broken or s.rolling_over or self._assigned_now is None:
            return
        if sorted(s.assigned) == self._assigned_now:
            return
        log.info("partition %d: its replicas are now %s (session %d has %s); rolling over to a new session",
                 self.partition_id, self._assigned_now, s.session_id, sorted(s.assigned))
        s.rolling_over = True
        if s.last_assigned == s.committed:
            self._restart.set()
        self._notify()

    def _recovery_error(self, endpoint: str, api: object, exc: WaltzError) -> None:
        # A node that answers the recovery with a refusal (it does not hold the partition yet:
        # assigned in coordination, not on the node; a full disk) would otherwise be taken in by
        # the next probe, a second later, and refuse again: a new session every second.
        if refused_by_storage(exc):
            self.hold_out(endpoint, api)

    def hold_out(self, endpoint: str, api: object) -> None:
        """Keep ``endpoint`` out of new sessions for a while: its node refused a session's writes
        through ``api`` (see :data:`REFUSAL_HOLD_FIRST`)."""
        now = time.monotonic()
        until, length, _api = self._held_out.get(endpoint, (0.0, 0.0, None))
        length = min(2 * length, REFUSAL_HOLD_MAX) if length and now - until < REFUSAL_HOLD_MAX else REFUSAL_HOLD_FIRST
        self._held_out[endpoint] = (now + length, length, api)
        log.warning("partition %d: replica %s refused writes; it is kept out of new sessions for %.1fs, or until it "
                    "is restarted", self.partition_id, endpoint, length)

    async def _connect_replica(self, endpoint: str) -> ReplicaApi | None:
        """The connector, except for a replica held out after a refusal: None (unreachable) then,
        unless the connector has a new connection to it (the operator restarted the node)."""
        held = self._held_out.get(endpoint)
        api = await self._connect(endpoint)
        if held is not None and time.monotonic() < held[0]:
            if api is None or api is held[2]:
                return None
            self._held_out[endpoint] = (time.monotonic(), held[1], None)  # a new connection: the hold is over
        return api

    def _probe_interval(self) -> float | None:
        """How long the supervisor waits for a restart before it probes: :data:`PROBE_INTERVAL`
        while the session lacks an assigned replica, else no limit. A session's replicas are
        fixed when it starts (one that leaves breaks it, which sets ``_restart``), so a
        partition with all of them has nothing to probe; a timer a second for each of hundreds
        of such partitions was most of an idle server's CPU."""
        s = self.session
        if s is None or s.broken or s.rolling_over or len(s.replicas) >= len(s.assigned):
            return None
        return PROBE_INTERVAL

    async def _probe_missing_replicas(self) -> None:
        """A replica outside the session that is reachable again gets in through a new session
        (no rejoin of a running session): drain, then roll over, as for a checkpoint."""
        s = self.session
        if s is None or s.broken or s.rolling_over:
            return
        for endpoint in s.assigned:
            if endpoint not in s.replicas and await self._connect_replica(endpoint) is not None:
                log.info("partition %d: replica %s is reachable again; rolling over to a new session",
                         self.partition_id, endpoint)
                s.rolling_over = True
                if s.last_assigned == s.committed:
                    self._restart.set()
                self._notify()
                return

    async def _start_session_with_retry(self) -> None:
        # Retried whatever the Waltz failure (a CAS conflict means another session began: begin a
        # newer one), except a generation mismatch: the partition moved, this server gives it up.
        for delay in _backoff(self.config).delays():
            if self._closed:
                return
            try:
                await self._start_session()
                self.last_error = ""
                return
            except GenerationMismatchError:
                raise
            except WaltzError as exc:
                self.last_error = str(exc)
                log.warning("partition %d: store session failed to start: %s (retry in %.1fs)", self.partition_id, exc, delay)
                await asyncio.sleep(delay)

    async def _start_session(self) -> None:
        pid = self.partition_id
        start = await self.metadata.begin_session(pid, self.generation)
        session_id, assigned = start.session_id, start.assigned
        if not assigned:
            raise PartitionNotReadyError(f"partition {pid} has no replicas assigned")
        recovery = Recovery(pid, session_id, assigned, start.states, self._connect_replica,
                            self.config.initial_retry_interval, min(self.config.max_retry_interval, 2.0),
                            on_replica_error=self._recovery_error, previous=start.previous_replicas)
        self.recovery = recovery
        try:
            result = await recovery.run()
        finally:
            self.recovery = None
        # From here this session may commit, on a majority of its replicas: the next recovery votes among them.
        await self.metadata.write_states(pid, self.generation, session_id, result.replica_states, replica_set=assigned)
        session = StoreSession(self, session_id, result.high_water_mark, assigned)
        for endpoint in assigned:
            api = await self._connect_replica(endpoint) if endpoint in result.clean or endpoint in result.lagging else None
            if api is None:
                continue
            clean = endpoint in result.clean
            mark = result.high_water_mark if clean else result.lagging[endpoint]
            rs = _ReplicaSession(session, endpoint, api, mark, clean)
            session.replicas[endpoint] = rs
        if len(session.replicas) < session.quorum:
            # A replica recovery counted became unreachable before the session connected it. With
            # fewer replicas than the quorum the session could never commit, and no replica of it
            # would fail to end it: begin another session instead (the caller retries).
            raise PartitionNotReadyError(
                f"partition {pid}: only {len(session.replicas)} of the {session.quorum} replicas a commit needs "
                f"were reachable when session {session_id} started ({sorted(session.replicas)})")
        if self._closed:
            return  # closed while recovering: start nothing
        self._apply_frame_limit(session)
        for rs in session.replicas.values():
            rs.start_task()
        self.high_water_mark = result.high_water_mark
        self.session = session
        self.sessions_started += 1
        self._epoch += 1
        log.info("partition %d: session %d open at high-water mark %d (clean %s, lagging %s)", pid, session_id,
                 result.high_water_mark, sorted(result.clean), sorted(result.lagging))
        if self.sessions_started > 1 and self._sink is not None:
            self._sink.on_session_reset(result.high_water_mark)
        self._notify()
        self._roll_over_if_reassigned()  # the assignment changed while this session was recovering

    def _apply_frame_limit(self, session: StoreSession) -> None:
        """Bound the session's appends by the smallest frame limit of its replicas' nodes (storage
        protocol 5 tells it): a frame over a node's limit makes it close the connection, and
        every partition's appends on that connection fail. The partition hears of a change: it
        refuses records no replica of the session could take, instead of stopping on them."""
        limits = {endpoint: limit for endpoint, rs in session.replicas.items()
                  if (limit := getattr(rs.api, "max_frame_size", None)) is not None and limit < self.max_frame_size}
        frame = min(limits.values(), default=self.max_frame_size)
        session.max_batch_bytes = frame - sm.APPEND_BATCH_HEADROOM
        if frame != self.frame_limit:
            self.frame_limit = frame
            if limits:
                log.warning("partition %d: storage node(s) %s take frames of at most %s bytes, less than this "
                            "server's transport.max_frame_size = %d: transactions are limited to the smallest",
                            self.partition_id, ", ".join(sorted(limits)), frame, self.max_frame_size)
            if self._sink is not None:
                self._sink.on_frame_limit(frame)

    # ---------------------------------------------------------------------- session events

    def session_committed(self, session: StoreSession, hwm: int) -> None:
        if session is not self.session:
            return
        self.high_water_mark = hwm
        assert self._sink is not None
        self._sink.on_committed(hwm)
        if hwm - session.start_high_water_mark >= self.config.checkpoint_interval and not session.rolling_over:
            # Drain (wait_writable holds new appends back), then roll over to a new session.
            log.info("partition %d: checkpoint interval reached; rolling over to a new session", self.partition_id)
            session.rolling_over = True
        if session.rolling_over and session.last_assigned == hwm:
            self._restart.set()
        self._notify()

    def session_broken(self, session: StoreSession, exc: BaseException) -> None:
        if session is self.session and not self._closed:
            self._restart.set()
            self._notify()

    def _notify(self) -> None:
        changed = self._changed
        if changed is not None:
            self._changed = None
            changed.set()

    def _next_change(self) -> asyncio.Event:
        changed = self._changed
        if changed is None:
            changed = self._changed = asyncio.Event()
        return changed

    # ------------------------------------------------------------------- the Store protocol

    def append(self, req_id: ReqId, header: int, data: bytes, checksum: int) -> int:
        session = self.session
        if session is None or session.broken:
            raise PartitionNotReadyError(f"partition {self.partition_id}: no store session")
        return session.append(req_id, header, data, checksum)

    @property
    def recovery_waiting(self) -> str | None:
        """Why the recovery under way cannot decide yet (its vote, and the replicas of the previous
        session it did not hear), None when no recovery waits."""
        recovery = self.recovery
        return recovery.waiting if recovery is not None else None

    def _session_with_room(self) -> StoreSession | None:
        """The session, if it takes appends now: open, not broken or rolling over, and fewer than
        the window of appends in flight."""
        s = self.session
        if (self._closed or s is None or s.broken or s.rolling_over
                or s.last_assigned - s.committed >= self._window):
            return None
        return s

    def append_if_writable(self, req_id: ReqId, header: int, data: bytes, checksum: int) -> int | None:
        """:meth:`append` when :attr:`writable`, else None: the partition's no-await path, once
        per transaction (:meth:`_session_with_room`'s test inline, a call less)."""
        s = self.session
        if (self._closed or s is None or s.broken or s.rolling_over
                or s.last_assigned - s.committed >= self._window):
            return None
        return s.append(req_id, header, data, checksum)

    @property
    def writable(self) -> bool:
        """True when :meth:`wait_writable` would return at once."""
        return self._session_with_room() is not None

    async def wait_writable(self) -> None:
        while not self._closed:
            if self._session_with_room() is not None:
                return
            await self._next_change().wait()
        raise PartitionNotReadyError(f"partition {self.partition_id} is closed")

    async def flush(self) -> None:
        s = self.session
        if s is None:
            await self.wait_writable()
            return
        target, epoch = s.last_assigned, self._epoch
        while not self._closed and self._epoch == epoch and self.high_water_mark < target:
            await self._next_change().wait()

    def _read_replicas(self, needed: int) -> list[_ReplicaSession]:
        s = self.session
        if s is None:
            return []
        return [r for r in s.replicas.values() if r.clean and r.acked >= needed]

    async def read_headers(self, first: int, max_count: int) -> Sequence[RecordHeader]:
        return await self._read(first, lambda r, sid: r.api.record_header_list(sid, self.partition_id, first, max_count))

    async def read_record(self, transaction_id: int) -> Record | None:
        records = await self._read(transaction_id, lambda r, sid: r.api.record_list(sid, self.partition_id, transaction_id, 1))
        return records[0] if records else None

    async def read_records(self, first: int, max_count: int) -> Sequence[Record]:
        """Records ``first, first + 1, ...`` in one storage read: at most ``max_count``, fewer when
        the replica's answer is bounded (its frame size) or it holds fewer. The replica's batch as
        it came: each Record is decoded only when iterated."""
        return await self._read(first, lambda r, sid: r.api.record_list(sid, self.partition_id, first, max_count))

    async def _read(self, needed: int, call: Callable[[_ReplicaSession, int], Awaitable[_R]]) -> _R:
        last: Exception | None = None
        for _ in range(3):
            s = self.session
            for r in self._read_replicas(needed):
                try:
                    assert s is not None
                    return await call(r, s.session_id)
                except WaltzError as exc:
                    last = exc
            await self.wait_writable()
        raise PartitionNotReadyError(f"partition {self.partition_id}: no replica could serve transaction {needed}: {last}")

    @property
    def healthy(self) -> bool:
        s = self.session
        return s is not None and not s.broken

    @property
    def buffered_bytes(self) -> int:
        """Bytes of encoded records the current session keeps for its replicas."""
        s = self.session
        return s.buffered_bytes if s is not None else 0
