"""A partition as its owning server runs it (Waltz design, "Partition Object").

One append task per partition takes appends, flushes and mounts from a bounded queue in
arrival order (ordering is what makes mounts and flushes meaningful), checks the lock table,
hands accepted appends to the store and, on commit, fills the feed and data caches, commits
the locks and advances the high-water mark. Feeds are one task per mounted client: they
stream headers (never data) from the cache or, when behind it, from storage.

Appends whose locks collide with an append still in flight *serialize*: they are decided once
that append committed, never on a table the commit is about to change. The original flushes the
store partition, which drains the whole pipeline for one conflict; here the colliding append
waits in a side list while the appends behind it go on, so a conflict does not break the batch
that carries it. Flushes and mounts wait for that list as for the appends in flight.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol, final

import attrs

from ..config import ServerConfig
from ..errors import TooManyLocksError, TransactionTooLargeError, WaltzError, wire_code
from ..inbox import Inbox
from ..locks.base import NO_LOCKS, Begin, LockRequest, LockTable
from ..metrics import Histogram
from ..protocol import client as m
from ..protocol.client import DATA_RANGE_ITEM_OVERHEAD, encode_feed_data, encode_feed_data_run
from ..protocol.framing import DEFAULT_MAX_FRAME_SIZE
from ..protocol.wire import Record, RecordHeader, ReqId
from .caches import CacheBudget, DataCache, FeedCache
from .link import ClientLink

log = logging.getLogger("waltz.server.partition")
_monotonic = time.monotonic
_AppendRequest = m.AppendRequest  #: looked up once per message in offer()

FEED_BATCH = 256  # headers per feed write; bounded so one busy feed cannot starve others
#: Caps of one TransactionDataRangeResponse, whatever the client asks for (bytes: also at most
#: a quarter of the transport's max frame size).
DATA_RANGE_MAX_COUNT = 1024
DATA_RANGE_MAX_BYTES = 4 * 1024 * 1024
#: Seconds a partition's commit-latency summary (the p50/p99 gauges) is kept before commits
#: since make the metrics sort its window again.
LATENCY_SUMMARY_MAX_AGE = 10.0


class StoreSink(Protocol):
    """What a store session tells its partition (called on the event loop, in transaction order)."""

    def on_committed(self, high_water_mark: int) -> None: ...

    def on_session_reset(self, high_water_mark: int) -> None: ...

    def on_frame_limit(self, max_frame_size: int) -> None: ...


class Store(Protocol):
    """The replicated store of one partition, as the partition uses it (see :mod:`.store`)."""

    high_water_mark: int

    async def open(self, sink: StoreSink) -> int:
        """Start a store session (recovery included) and return the committed high-water mark."""

    def append(self, req_id: ReqId, header: int, data: bytes, checksum: int) -> int:
        """Assign the next transaction id and start replicating it; commits arrive via the sink."""

    def append_if_writable(self, req_id: ReqId, header: int, data: bytes, checksum: int) -> int | None:
        """:meth:`append` when :attr:`writable`, else None (nothing changed): the check and the
        append in one call, once per transaction."""

    @property
    def writable(self) -> bool:
        """True when :meth:`wait_writable` would return at once."""

    async def wait_writable(self) -> None:
        """Wait while too many appends are in flight (back pressure)."""

    async def flush(self) -> None:
        """Wait until every append handed over so far is committed or failed."""

    async def read_headers(self, first: int, max_count: int) -> Sequence[RecordHeader]: ...

    async def read_record(self, transaction_id: int) -> Record | None: ...

    async def read_records(self, first: int, max_count: int) -> Sequence[Record]:
        """Records ``first, first + 1, ...`` (at most ``max_count``, maybe fewer) in one storage read."""

    async def close(self) -> None: ...

    @property
    def healthy(self) -> bool: ...

    @property
    def buffered_bytes(self) -> int:
        """Bytes the store keeps for its replicas (the server's replication budget)."""


#: An append handed to the store, until it commits: a plain tuple (one per transaction, so no
#: object with attributes): (transaction id, req id, header, data, checksum, locks, monotonic
#: time of the hand-off).
_Pending = tuple[int, ReqId, int, bytes, int, LockRequest, float]


@attrs.define(slots=True)
class _ClientSlot:
    """The current stream connection of one client id for this partition."""

    seq_num: int
    link: ClientLink
    feed: asyncio.Task[None] | None = None
    position: int = -1  #: highest transaction id fed to this client
    #: the feed task waits for the next commit, caught up and past its mount: a commit may post
    #: its frames itself (no task wake-up), see Partition._wake_feeds
    idle: bool = False


@final  # so that `type(item) is _Barrier` tells a type checker what item is otherwise
@attrs.define(slots=True)
class _Barrier:
    """A flush or mount queued behind the appends before it."""

    msg: m.FlushRequest | m.MountRequest
    link: ClientLink


class Partition:
    def __init__(self, partition_id: int, generation: int, store: Store, lock_table_factory: Any,
                 config: ServerConfig, commit_latency: Histogram | None = None, *,
                 max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
                 budgets: tuple[CacheBudget, CacheBudget] | None = None) -> None:
        self.partition_id = partition_id
        self.generation = generation
        self.store = store
        self._lock_table_factory = lock_table_factory
        self.locks: LockTable | None = None
        self.config = config
        # A range response must stay well under the frame size the transport accepts.
        self._range_max_bytes = max(1, min(DATA_RANGE_MAX_BYTES, max_frame_size // 4))
        self._max_frame_size = max_frame_size
        #: the most data a record may carry (more, and no link to a replica could take it), and
        #: whose frame limit sets it, for the refusal's message
        self._max_record_data, self._record_bound = 0, ""
        self.on_frame_limit(max_frame_size)
        self._max_locks = config.max_locks_per_transaction
        self.refused = 0  #: appends refused (too large, too many locks) since the partition opened here
        self.high_water_mark = -1
        self.ready = False
        #: appends, flushes and mounts in arrival order; connection readers wait while it is full
        self._inbox: Inbox[tuple[m.AppendRequest, ClientLink] | _Barrier] = Inbox(config.append_queue_size)
        self._pending: deque[_Pending] = deque()
        #: appends whose locks collided with an append in flight, oldest first: retried after commits
        self._blocked: deque[tuple[m.AppendRequest, ClientLink, LockRequest]] = deque()
        self._commits = 0  #: commit batches (and session resets) seen; blocked appends retry when it moves
        self._retried = 0  #: the value of _commits at the last retry of the blocked appends
        # The server's budgets (feed, data), shared with its other partitions; a budget of our own
        # when the partition stands alone (tests).
        feed_budget, data_budget = budgets or (CacheBudget(config.feed_cache_budget),
                                               CacheBudget(config.data_cache_budget))
        self._feed_cache = FeedCache(feed_budget)
        self._data_cache = DataCache(data_budget)
        self._clients: dict[int, _ClientSlot] = {}
        self._committed = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._append_task: asyncio.Task[None] | None = None
        #: the append task waits for an arrival (nothing queued, nothing blocked): offer() may decide
        #: an append itself, as the task would, without waking it
        self._append_idle = False
        self.open_task: asyncio.Task[Any] | None = None  #: the task running open(); cancelled by close()
        self._closed = False
        # metrics
        self.appends = 0
        self.lock_failures = 0
        self._latencies: deque[float] = deque(maxlen=2048)
        #: (high-water mark, monotonic time, (p50, p99)) of the last commit_latency summary
        self._latency_summary: tuple[int, float, tuple[float, float]] = (-2, 0.0, (0.0, 0.0))
        self._histogram = commit_latency

    # ------------------------------------------------------------------------------ lifecycle

    async def open(self) -> None:
        """Recover the store, then accept appends."""
        hwm = await self.store.open(self)
        if self._closed:  # the partition moved away while it was recovering
            return
        self.high_water_mark = hwm
        self._feed_cache.reset(hwm + 1)
        self.locks = self._lock_table_factory(hwm)
        self.ready = True
        self._append_task = asyncio.get_running_loop().create_task(self._append_loop(), name=f"append-p{self.partition_id}")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.ready = False
        if self.open_task is not None and self.open_task is not asyncio.current_task() and not self.open_task.done():
            self.open_task.cancel()  # still recovering: stop it (its store session is fenced anyway)
            await asyncio.gather(self.open_task, return_exceptions=True)
        tasks = [t for t in (self._append_task,) if t] + [s.feed for s in self._clients.values() if s.feed] + list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._inbox.clear()  # a reader waiting for room must not wait for a closed partition
        self._blocked.clear()
        for slot in self._clients.values():
            slot.link.post(m.FeedSuspended(ReqId(0, self.generation, self.partition_id, 0)))
        self._clients.clear()
        await self.store.close()
        self._feed_cache.reset(0)  # give the server's cache budgets back at once
        self._data_cache.clear()
        self._wake_feeds()

    # -------------------------------------------------------------------------- message entry

    async def submit(self, msg: Any, link: ClientLink) -> None:
        """Called by the connection reader for a message of this partition. May wait (back pressure)."""
        full = self.offer(msg, link)
        if full is not None:
            await full

    def offer(self, msg: Any, link: ClientLink) -> asyncio.Future[None] | None:
        """:meth:`submit` without a coroutine: returns a future to await while the inbox is full."""
        t = type(msg)
        if t is _AppendRequest:
            if len(msg.data) > self._max_record_data:
                self._refuse(msg, link, TransactionTooLargeError(
                    f"{len(msg.data)} bytes of data, over the {self._max_record_data} a record may carry with "
                    f"{self._record_bound}; the client's max_frame_size must not be above the servers' and "
                    f"storage nodes'"))
                return None
            # An append without locks while the append task is idle (so nothing is queued ahead
            # of it: every put below clears the flag) is decided here, in the reader's call: one
            # task wake-up less per partition and burst of appends, and the order is the task's.
            # Appends with locks always go through the task: deciding them as they arrived halved
            # the records per fdatasync at a lock pool of 128 (49 -> 23) and cost 45 % more CPU
            # per transaction (docs/performance.md, "Many partitions, and what is left").
            if self._append_idle and not self._blocked and not (msg.write_locks or msg.read_locks or msg.append_locks):
                try:
                    if self._append_now(msg, link):
                        return None
                except WaltzError as exc:  # as the task does: logged, and the reader goes on
                    log.warning("partition %d: %s", self.partition_id, exc)
                    return None
                except Exception:  # a bug must not end the client's connection
                    log.exception("partition %d: unexpected error deciding an append", self.partition_id)
                    return None
            locks = len(msg.write_locks) + len(msg.read_locks) + len(msg.append_locks)
            if locks > self._max_locks:
                self._refuse(msg, link, TooManyLocksError(
                    f"{locks} locks, over the server's max_locks_per_transaction = {self._max_locks}"))
                return None
            self._append_idle = False  # the task is woken for it (and clears the flag itself too)
            link.inbound_added()
            return self._inbox.put((msg, link))
        if t is m.MountRequest or t is m.FlushRequest:
            self._append_idle = False
            link.inbound_added()
            return self._inbox.put(_Barrier(msg, link))
        if t is m.FeedRequest:
            self._restart_feed(msg, link)
        elif t is m.TransactionDataRequest:
            self._spawn(self._serve_data(msg, link))
        elif t is m.TransactionDataRangeRequest:
            self._serve_data_range(msg, link)
        elif t is m.HighWaterMarkRequest:
            link.post(m.HighWaterMarkResponse(msg.req_id, self.high_water_mark))
        else:
            log.warning("partition %d: unexpected %s from %s", self.partition_id, t.__name__, link.peer)
        return None

    def _refuse(self, req: m.AppendRequest, link: ClientLink, error: WaltzError) -> None:
        """Never take ``req``: a record no replica link could carry would stop the partition at
        every recovery, and too many locks hold up the server. The client library checks the
        size against its own and (protocol 4) the server's frame size before sending, so a large
        one comes from an older client with a larger ``transport.max_frame_size``, or not ours. A
        protocol-4 client hears why and fails the transaction; an older one is not told (its
        flush rule fails the append, and it retries)."""
        self.refused += 1
        if link.refusals:
            link.post(m.AppendRefused(req.req_id, wire_code(error), str(error)))
        if self.refused & (self.refused - 1) == 0:  # the 1st, 2nd, 4th, 8th, ...
            log.warning("partition %d: append of client %d from %s refused (%s): %s (%d refused so far)",
                        self.partition_id, req.req_id.client_id, link.peer,
                        "answered" if link.refusals else "dropped: its protocol is older than 4", error, self.refused)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _is_current(self, req_id: ReqId, link: ClientLink) -> bool:
        """Stale-connection and stale-generation rejection."""
        if req_id.generation != self.generation:
            return False
        slot = self._clients.get(req_id.client_id)
        return slot is not None and slot.link is link

    # ---------------------------------------------------------------------------- append task

    async def _append_loop(self) -> None:
        inbox = self._inbox
        queued = inbox.items  # tested without a call, once per item
        while True:
            try:
                if self._blocked and self._retried != self._commits:
                    self._retry_blocked()
                if not queued:
                    self._append_idle = not self._blocked
                    try:
                        await inbox.wait()  # returns on an arrival, or on a commit while appends are blocked
                    finally:
                        self._append_idle = False
                    continue
                item = inbox.popleft()
                if type(item) is _Barrier:
                    item.link.inbound_done()
                    await self._barrier(item)
                    continue
                req, link = item
                link.inbound_done()
                if not self._append_now(req, link):
                    await self._append(req, link)
            except asyncio.CancelledError:
                raise
            except WaltzError as exc:
                log.warning("partition %d: %s", self.partition_id, exc)
            except Exception:  # a bug must not kill the partition's only append task
                log.exception("partition %d: unexpected error in the append task", self.partition_id)

    def _append_now(self, req: m.AppendRequest, link: ClientLink) -> bool:
        """An append decided without awaiting: the store is writable and the append's locks, if
        any, do not collide with an append in flight (the usual case); a stale one is ignored.
        False when :meth:`_append` must handle it; nothing was changed then. An append without
        locks (most transactions, and every one :meth:`offer` decides) is handed to the store in
        this call, without :meth:`_decide`."""
        q = req.req_id  # _is_current inlined: once per append
        if q.generation != self.generation:
            return True  # stale generation: ignored, as the original does
        slot = self._clients.get(q.client_id)
        if slot is None or slot.link is not link:
            return True  # stale connection: ignored, as the original does
        if not (req.write_locks or req.read_locks or req.append_locks):
            header, data, checksum = req.header, req.data, req.checksum
            txn = self.store.append_if_writable(q, header, data, checksum)
            if txn is None:
                return False
            self._pending.append((txn, q, header, data, checksum, NO_LOCKS, _monotonic()))
            self.appends += 1
            return True
        if not self.store.writable:
            return False
        request = LockRequest.from_append(req)
        if self.locks.begin(request) is not Begin.OK:  # type: ignore[union-attr]
            if not self._pending:
                return False  # nothing in flight to wait for: stale marks, the awaiting path resets
            self._blocked.append((req, link, request))  # decided once the collision committed
            return True
        self._decide(req, link, request)
        return True

    async def _append(self, req: m.AppendRequest, link: ClientLink) -> None:
        if not self._is_current(req.req_id, link):
            return  # stale connection or generation: ignored, as the original does
        locks = self.locks
        assert locks is not None
        request = NO_LOCKS
        if req.write_locks or req.read_locks or req.append_locks:
            request = LockRequest.from_append(req)
        while True:
            await self.store.wait_writable()
            if request is NO_LOCKS or locks.begin(request) is Begin.OK:
                break
            if self._pending:  # collides with an append in flight: decided once that one committed
                self._blocked.append((req, link, request))
                return
            locks.reset(self.high_water_mark)  # nothing in flight: stale marks (as the original)
        self._decide(req, link, request)

    def _retry_blocked(self) -> None:
        """Decide the blocked appends that no longer collide, oldest first, without awaiting; the
        others keep their order. Stops at a store that is not writable (the next commit retries)."""
        self._retried = self._commits
        locks = self.locks
        assert locks is not None
        blocked, still = self._blocked, deque[tuple[m.AppendRequest, ClientLink, LockRequest]]()
        while blocked:
            if not self.store.writable:
                still.extend(blocked)
                break
            req, link, request = item = blocked.popleft()
            if not self._is_current(req.req_id, link):
                continue  # its connection or generation went stale while it waited: ignored
            if locks.begin(request) is not Begin.OK:
                if self._pending:
                    still.append(item)
                    continue
                locks.reset(self.high_water_mark)  # nothing in flight: stale marks (as the original)
                if locks.begin(request) is not Begin.OK:  # a table must accept after a reset
                    raise WaltzError(f"partition {self.partition_id}: lock table busy after a reset")
            self._decide(req, link, request)
        self._blocked = still

    def _decide(self, req: m.AppendRequest, link: ClientLink, request: LockRequest) -> None:
        """After a successful begin(): a lock failure, or the hand-off to the store. Called without
        awaiting since begin(), so the decision and the hand-off see the same store session and
        the same committed locks."""
        if request is not NO_LOCKS:
            locks = self.locks
            assert locks is not None
            conflict = locks.check(request, req.client_high_water_mark)
            if conflict is not None:
                locks.abort(request)
                self.lock_failures += 1
                link.post(m.LockFailure(req.req_id, conflict))
                return
        q, header, data, checksum = req.req_id, req.header, req.data, req.checksum
        self._pending.append((self.store.append(q, header, data, checksum), q, header, data, checksum, request,
                              _monotonic()))
        self.appends += 1

    async def _barrier(self, item: _Barrier) -> None:
        # Every append before the barrier is decided first: the blocked ones too, which the
        # commits they wait for (or a session reset) let through.
        await self.store.flush()
        while self._blocked:
            await self.store.wait_writable()
            self._retry_blocked()
            await self.store.flush()
        msg = item.msg
        if type(msg) is m.FlushRequest:
            if msg.req_id.generation == self.generation:
                item.link.post(m.FlushResponse(msg.req_id, self.high_water_mark))
            return
        self._mount(msg, item.link)  # type: ignore[arg-type]

    # --------------------------------------------------------------------------- store events

    def on_committed(self, high_water_mark: int) -> None:
        first, frames = self._take_committed(high_water_mark)
        self._feed_cache.settle()  # charge the server's budgets once per commit batch
        self._data_cache.settle()
        previous = self.high_water_mark
        if high_water_mark > previous:
            self.high_water_mark = high_water_mark
        self._commits += 1
        if self._blocked:
            self._inbox.nudge()  # the append task retries them (never from inside the store's callback)
        # The batch's frames, if they are exactly the transactions after the previous high-water mark
        self._wake_feeds(frames if frames and first == previous + 1 and first + len(frames) - 1 == high_water_mark
                         else None)

    def _take_committed(self, high_water_mark: int) -> tuple[int, list[bytes]]:
        """Take the appends up to ``high_water_mark`` from the pending ones (see
        :meth:`_commit_run`). Returns the first transaction id of the last run of consecutive
        ids and that run's feed frames.

        A commit batch is one run (a session assigns consecutive ids): each step is taken for
        all of its appends at once, not a pass of every step per append."""
        pending = self._pending
        if not pending:
            return 0, []
        first = pending[0][0]
        n = min(len(pending), high_water_mark - first + 1)
        if n <= 0:
            return first, []
        if pending[n - 1][0] != first + n - 1:
            return self._take_committed_runs(high_water_mark)
        if n == len(pending):
            batch = list(pending)
            pending.clear()
        else:
            popleft = pending.popleft
            batch = [popleft() for _ in range(n)]
        return first, self._commit_run(batch)

    def _take_committed_runs(self, high_water_mark: int) -> tuple[int, list[bytes]]:
        """:meth:`_take_committed` for pending ids that are not consecutive (never seen: kept
        for safety): a run of consecutive ids at a time."""
        pending = self._pending
        popleft = pending.popleft
        first, frames = 0, []
        while pending and pending[0][0] <= high_water_mark:
            first = expected = pending[0][0]
            run = []
            while pending and pending[0][0] == expected and expected <= high_water_mark:
                run.append(popleft())
                expected += 1
            frames = self._commit_run(run)
        return first, frames

    def _commit_run(self, batch: list[_Pending]) -> list[bytes]:
        """Commit pending appends of consecutive ids: record their latencies, cache their feed
        frames and data, commit their locks. Returns their feed frames."""
        first = batch[0][0]
        now = _monotonic()
        latencies = [now - e[6] for e in batch]
        self._latencies.extend(latencies)
        if self._histogram is not None:
            self._histogram.observe_many(latencies)
        frames = encode_feed_data_run(batch)
        self._feed_cache.add_many(first, frames)
        self._data_cache.put_many(first, [e[3] for e in batch], [e[4] for e in batch])
        locks = self.locks
        if locks is not None:
            no_locks = NO_LOCKS
            for e in batch:
                if e[5] is not no_locks:
                    locks.commit(e[5], e[0])
        return frames

    def on_frame_limit(self, max_frame_size: int) -> None:
        """The store's replicas take frames of at most ``max_frame_size`` (a storage node's limit
        below the server's): records that would not fit are refused from now on."""
        frame = min(max_frame_size, self._max_frame_size)
        self._max_record_data = frame - m.TRANSACTION_FRAME_HEADROOM
        self._record_bound = (f"transport.max_frame_size = {self._max_frame_size} on the server"
                              if frame == self._max_frame_size else
                              f"transport.max_frame_size = {frame} on a storage node of the partition")

    def on_session_reset(self, high_water_mark: int) -> None:
        """A new store session recovered ``high_water_mark``: commit what it kept, fail the rest."""
        self.on_committed(high_water_mark)
        locks = self.locks
        while self._pending:
            request = self._pending.popleft()[5]
            if request is not NO_LOCKS and locks is not None:
                locks.abort(request)
        self.high_water_mark = high_water_mark

    def _wake_feeds(self, frames: list[bytes] | None = None) -> None:
        """Feed the commit to every client: ``frames`` (the feed records of every transaction
        after the previous high-water mark, or None) go straight to the links of idle feeds that
        are caught up and writable; the other feed tasks are woken to read the feed cache."""
        wake = True
        if frames:
            wake = False
            first = self.high_water_mark - len(frames) + 1
            for slot in self._clients.values():
                link = slot.link
                if slot.idle and slot.position + 1 == first and link.writable:
                    link.post_frames(frames)
                    slot.position = self.high_water_mark
                else:
                    wake = True
        if wake:
            self._committed.set()
            self._committed = asyncio.Event()

    # ---------------------------------------------------------------------------------- feeds

    def _mount(self, msg: m.MountRequest, link: ClientLink) -> None:
        q = msg.req_id
        if link.closed:
            # The connection closed while the mount waited behind the appends before it: its
            # disconnect() has run already, so a slot made now would stay until the partition
            # closes, with a feed task that ended at once and a lag that only grows.
            return
        if q.generation != self.generation or not self.ready:
            link.post(m.MountResponse(q, m.PartitionState.NOT_READY))
            return
        slot = self._clients.get(q.client_id)
        if slot is not None and msg.seq_num < slot.seq_num:
            return  # a mount from an older network client of this client: stale
        if slot is not None and slot.feed is not None:
            slot.feed.cancel()
        if msg.client_high_water_mark > self.high_water_mark:
            self._clients.pop(q.client_id, None)
            link.post(m.MountResponse(q, m.PartitionState.CLIENT_AHEAD))
            return
        slot = _ClientSlot(msg.seq_num, link)
        self._clients[q.client_id] = slot
        slot.feed = asyncio.get_running_loop().create_task(
            self._feed(slot, q, msg.client_high_water_mark, mount_until=self.high_water_mark),
            name=f"feed-p{self.partition_id}-c{q.client_id}",
        )

    def _restart_feed(self, msg: m.FeedRequest, link: ClientLink) -> None:
        q = msg.req_id
        slot = self._clients.get(q.client_id)
        if slot is None or slot.link is not link or q.generation != self.generation:
            link.post(m.FeedSuspended(q))
            return
        if slot.feed is not None:
            slot.feed.cancel()
        slot.idle = False  # at once: no commit may feed this slot before the new task set its position
        slot.feed = asyncio.get_running_loop().create_task(self._feed(slot, q, msg.client_high_water_mark, None))

    async def _feed(self, slot: _ClientSlot, req_id: ReqId, client_hwm: int, mount_until: int | None) -> None:
        """Stream headers after ``client_hwm``; answer the mount once the feed reached ``mount_until``."""
        link = slot.link
        slot.position = client_hwm
        try:
            while not link.closed:
                hwm = self.high_water_mark
                next_id = slot.position + 1  # a commit may have fed this client while the task waited
                if next_id <= hwm:
                    count = min(FEED_BATCH, hwm - next_id + 1)
                    frames = self._feed_cache.get(next_id, count)
                    if frames is None:  # behind the cache: read the headers from storage
                        headers = await self.store.read_headers(next_id, count)
                        if not headers:
                            raise WaltzError(f"storage returned no headers from {next_id} (high-water mark {hwm})")
                        frames = [encode_feed_data(h.req_id, h.transaction_id, h.header) for h in headers]
                    link.post_frames(frames)
                    slot.position = next_id + len(frames) - 1
                    await link.wait_writable()
                    continue
                if mount_until is not None:
                    link.post(m.MountResponse(req_id, m.PartitionState.READY))
                    mount_until = None
                slot.idle = True
                try:
                    await self._committed.wait()
                finally:
                    slot.idle = False
        except asyncio.CancelledError:
            raise
        except WaltzError as exc:
            log.warning("partition %d: feed to %s stopped: %s", self.partition_id, link.peer, exc)
            link.post(m.FeedSuspended(req_id))

    # -------------------------------------------------------------------------------- data rpc

    async def _serve_data(self, msg: m.TransactionDataRequest, link: ClientLink) -> None:
        txn = msg.transaction_id
        if not self.ready:
            link.post(m.TransactionDataResponse(msg.req_id, txn, None, 0, "partition not ready"))
            return
        if txn > self.high_water_mark or txn < 0:
            link.post(m.TransactionDataResponse(msg.req_id, txn, None, 0,
                                                f"transaction {txn} is not committed (high-water mark {self.high_water_mark})"))
            return
        cached = self._data_cache.get(txn)
        if cached is not None:
            link.post(m.TransactionDataResponse(msg.req_id, txn, cached[0], cached[1], None))
            return
        try:
            record = await self.store.read_record(txn)
        except WaltzError as exc:
            link.post(m.TransactionDataResponse(msg.req_id, txn, None, 0, f"storage read failed: {exc}"))
            return
        if record is None:
            link.post(m.TransactionDataResponse(msg.req_id, txn, None, 0, f"transaction {txn} not found in storage"))
            return
        link.post(m.TransactionDataResponse(msg.req_id, txn, record.data, record.checksum, None))

    def _serve_data_range(self, msg: m.TransactionDataRangeRequest, link: ClientLink) -> None:
        """Committed transactions from ``first_transaction_id`` on, capped in count and bytes: the
        prefix the data cache holds is answered at once; the rest, if any, with one storage read."""
        q, first = msg.req_id, msg.first_transaction_id
        hwm = self.high_water_mark
        error = None
        if not self.ready:
            error = "partition not ready"
        elif msg.max_count < 1 or msg.max_bytes < 1:
            error = f"max_count ({msg.max_count}) and max_bytes ({msg.max_bytes}) must be positive"
        elif first < 0 or first > hwm:
            error = f"transaction {first} is not committed (high-water mark {hwm})"
        if error is not None:
            link.post(m.TransactionDataRangeResponse(q, first, (), (), error))
            return
        end = first + min(msg.max_count, DATA_RANGE_MAX_COUNT, hwm - first + 1)  # exclusive
        budget = min(msg.max_bytes, self._range_max_bytes)
        data, checksums, size = self._data_cache.get_run(first, end - first, budget, DATA_RANGE_ITEM_OVERHEAD)
        next_id = first + len(data)
        if next_id < end and data and self._data_cache.holds(next_id):
            end = next_id  # cached, but it would not fit: the response ends here
        if next_id >= end or size >= budget:  # complete, or nothing more would fit
            link.post(m.TransactionDataRangeResponse(q, first, tuple(data), tuple(checksums), None))
            return
        self._spawn(self._serve_data_range_from_storage(q, first, next_id, end, budget - size, data, checksums, link))

    async def _serve_data_range_from_storage(self, q: ReqId, first: int, next_id: int, end: int, budget: int,
                                             data: list[bytes], checksums: list[int], link: ClientLink) -> None:
        """The part of a range the data cache did not hold (``next_id`` to ``end``, exclusive)."""
        error = None
        try:
            records = await self.store.read_records(next_id, end - next_id)
        except WaltzError as exc:
            records = []
            error = f"storage read failed: {exc}"
        for record in records:
            if record.transaction_id != next_id or next_id >= end:
                break  # not the next one (never expected), or more than asked for
            budget -= len(record.data) + DATA_RANGE_ITEM_OVERHEAD
            if budget < 0 and data:
                break
            data.append(record.data)
            checksums.append(record.checksum)
            next_id += 1
        if not data and error is None:
            error = f"transaction {next_id} not found in storage"
        link.post(m.TransactionDataRangeResponse(q, first, tuple(data), tuple(checksums), error))

    # -------------------------------------------------------------------------------- status

    @property
    def healthy(self) -> bool:
        return self.ready and self.store.healthy

    def disconnect(self, link: ClientLink) -> None:
        """A client connection closed: drop its feeds."""
        for cid, slot in list(self._clients.items()):
            if slot.link is link:
                if slot.feed is not None:
                    slot.feed.cancel()
                del self._clients[cid]

    @property
    def commit_latency(self) -> tuple[float, float]:
        """(p50, p99) seconds from hand-off to commit over the recent appends (0 when none).

        Sorting the window (up to 2,048 values, 0.1-0.2 ms) happens only when commits changed it,
        and at most every :data:`LATENCY_SUMMARY_MAX_AGE` seconds: the metrics ask every partition
        each second, and at 256 busy partitions a sort per partition and second took 1.4 % of the
        server's samples (py-spy)."""
        mark, at, summary = self._latency_summary
        if mark == self.high_water_mark:
            return summary
        now = _monotonic()
        if mark != -2 and now - at < LATENCY_SUMMARY_MAX_AGE:
            return summary
        values = sorted(self._latencies)
        if values:
            summary = (values[len(values) // 2], values[min(len(values) - 1, int(len(values) * 0.99))])
        else:
            summary = (0.0, 0.0)
        self._latency_summary = (self.high_water_mark, now, summary)
        return summary

    @property
    def max_feed_lag(self) -> int:
        return max((self.high_water_mark - s.position for s in self._clients.values()), default=0)

    @property
    def queue_size(self) -> int:
        return len(self._inbox)

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    @property
    def blocked_count(self) -> int:
        """Appends waiting for a colliding append in flight to commit."""
        return len(self._blocked)
