"""The storage node: serves the ten storage requests and the admin port over a layout.

Threading: connection handlers run on the event loop; file operations run in rounds on the
event loop itself (``io_threads = 0``, the default, :class:`LoopRounds`: no hand-off per round;
journal checkpoints go to a thread) or on one of ``io_threads`` I/O threads, each partition
always on the same one (partition id modulo the thread count), so one partition's requests are
handled in arrival order, by one thread. A connection handler puts a decoded
request straight into its partition's queue (no task in between) and rings the partition's I/O
thread; the thread takes everything queued for every partition that rang and handles it as one
round (group commit, no fixed wait: the batch is whatever arrived while the previous round ran).
With the node journal (``journal``, :mod:`.journal`) every partition's appends of the round are
written into its files and made durable by one journal write and fdatasync; without it each
partition's appends get one fdatasync of their own. The replies of a round go back to the loop in one hand-off, shared by every
thread that finished in the meantime (one loop wake-up, not one per batch), and the responses of
one connection go out with one write. Fewer threads than partitions: every thread switch and
GIL hand-off costs more CPU than the parallel fdatasyncs of many threads gain (measured in
docs/performance.md), and a node with hundreds of partitions does not run hundreds of threads.
Each partition queue is bounded (``queue_size``); a connection whose partition queue is full
stops being read (back pressure).

Fencing (seed 001 "Waltz Storage", original ``Partition.checkPermissions``): each partition
remembers the highest store session id it has seen; a request with a lower one fails with
:class:`~waltz_core.errors.StaleSessionError`, a higher one becomes the new highest. Normal
requests need the partition assigned and available; offline-recovery requests (``offline``
flag) need it assigned and *unavailable* and must carry the stored session id.

Every refused request gets a ``FailureResponse(error_code=wire_code(exc), message)`` (the
numeric code of its :mod:`waltz_core.errors` class; anything outside that tree travels as
:class:`~waltz_core.errors.StorageError`) and the connection keeps being served; bytes that do not decode get a failure with sequence
number -1 and that connection (only) is closed.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import queue
import threading
import time
import uuid
from array import array
from collections import deque
from collections.abc import Callable
from operator import attrgetter
from pathlib import Path
from typing import Any, Final, cast

import attrs

from ..errors import (
    ClusterKeyMismatchError,
    ConnectionClosedError,
    OutOfOrderAppendError,
    PartitionNotFoundError,
    ProtocolError,
    StaleSessionError,
    StorageCorruptionError,
    StorageError,
    TransportError,
    WaltzError,
    wire_code,
)
from ..metrics import MetricsRegistry
from ..openfiles import FILES_PER_PARTITION, explain, hint, storage_shortfall
from ..protocol import ADMIN, STORAGE
from ..protocol import admin as am
from ..protocol import storage as sm
from ..protocol.framing import MIN_MAX_FRAME_SIZE
from ..protocol.wire import INT32_MAX, RECORD_HEADER, Record, RecordBatch, SessionInfo
from ..timeouts import wait_for
from ..transport.base import Connection
from ..transport.channel import MessageChannel
from .format import FLAG_ASSIGNED, FLAG_AVAILABLE, PartitionInfo
from .journal import JOURNAL_DIRECTORY, JOURNAL_SUFFIX, NodeJournal, replay_into_layout
from .layout import DeferredSyncStore, PartitionStore, Repair, StorageLayout

log = logging.getLogger("waltz.storage.node")

#: Largest record list served in one response; a larger max_records is served in several calls.
MAX_LIST_RECORDS = 10_000
#: A round of file work (writes, fdatasyncs, a checkpoint) running longer than this makes the
#: node not ready (``/readyz``): its partitions' requests are waiting on the disk.
IO_ROUND_STALL_NOT_READY: Final = 5.0
#: A partition whose files could not be opened for a reason of the machine's (a full disk, a
#: file it may not open) is tried again at a request at most this often, so it comes back by
#: itself once the operator freed the space or fixed the files.
OPEN_RETRY_INTERVAL: Final = 1.0
#: Seconds between log lines of a partition whose appends keep failing the same way.
WRITE_FAILURE_LOG_INTERVAL: Final = 30.0
#: With the node journal, the rounds start the writeback of what they wrote into the partitions'
#: files once per this many bytes journaled, in all: a node's writeback then comes in steps of this
#: size whatever its number of partitions. Per file, partitions that fill at the same rate (any
#: hash-partitioned load) started theirs in the same round, N times this size at once, and the
#: rounds' fdatasyncs queued behind it (docs/performance.md, "Writeback paced by the node").
WRITEBACK_STEP: Final = 256 * 1024
#: A partition with fewer bytes than this not yet started at a step waits for a later one, or for
#: the checkpoint (at many partitions a step would otherwise be a system call per partition).
WRITEBACK_MIN: Final = 16 * 1024
_ROLE = "waltz-storage"


def _filesystem_bytes(directory: str, *, free: bool) -> float:
    """Free (for an unprivileged process) or total bytes of the filesystem holding ``directory``."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return float("nan")
    return float((st.f_bavail if free else st.f_blocks) * st.f_frsize)


class _Item:
    """A queued unit of partition work: a storage request, or a callable (admin work).

    ``reply`` is called on the event loop with the response (or the callable's result or exception).
    ``read_budget``: bytes a record or header list may take in the answer, from the frame limit of
    the connection that asked (0: half the node's own)."""

    __slots__ = ("work", "reply", "read_budget")

    def __init__(self, work: Any, reply: Callable[[Any], None], read_budget: int = 0) -> None:
        self.work = work
        self.reply = reply
        self.read_budget = read_budget


#: what an I/O thread hands back to the loop: (reply, response) pairs
Replies = list[tuple[Callable[[Any], None], Any]]


class _AppendGroup:
    """Appends validated for one group commit: their bytes, replies and the records' offsets."""

    __slots__ = ("items", "chunks", "offsets", "count", "nbytes", "started", "first", "joined")

    def __init__(self) -> None:
        self.items: list[_Item] = []
        self.chunks: list[bytes | memoryview] = []
        self.offsets = array("q")  #: start of each record, relative to the group's first byte
        self.count = 0
        self.nbytes = 0
        self.started = 0.0  #: perf_counter when its write began (a written group waiting for its sync)
        self.first = -1  #: transaction id of its first record, once written
        self.joined: bytes | memoryview = b""  #: its bytes as written (what the node journal gets)

    def add(self, item: _Item, batch: RecordBatch) -> None:
        self.items.append(item)
        self.chunks.append(batch.data)
        self.count += len(batch)
        self.nbytes += batch.nbytes

    def data(self) -> bytes | memoryview:
        return self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)

    def clear(self) -> None:
        self.items.clear()
        self.chunks.clear()
        del self.offsets[:]
        self.count = self.nbytes = 0


def failure_for(req: Any, exc: BaseException) -> sm.FailureResponse:
    return sm.FailureResponse(req.session_id, req.seq_num, req.partition_id, wire_code(exc), str(exc))


class _Inbox:
    """A partition's bounded queue: the event loop puts, the partition's I/O thread takes.

    ``put_nowait`` and ``put`` run on the loop; :meth:`take` on the I/O thread, which takes
    everything queued (it was rung: see :class:`IoThread`). When the queue holds ``maxsize``
    items, ``put`` waits until the thread took them (back pressure). A waiting ``put`` registers
    its future before checking the size again and the thread looks for waiters after taking
    items, so a wake-up cannot be missed.
    """

    __slots__ = ("_q", "maxsize", "_waiters", "_loop")

    def __init__(self, maxsize: int, loop: asyncio.AbstractEventLoop) -> None:
        self._q: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self.maxsize = maxsize
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._loop = loop

    def qsize(self) -> int:
        """Items waiting for the thread (not those it is working on)."""
        return self._q.qsize()

    def put_nowait(self, item: _Item) -> bool:
        """Queue ``item`` unless the queue is full (False: :meth:`put` it)."""
        if self._q.qsize() >= self.maxsize:
            return False
        self._q.put(item)
        return True

    async def put(self, item: _Item) -> None:
        """Queue ``item``, waiting while the queue is full."""
        q = self._q
        while q.qsize() >= self.maxsize:
            fut = self._loop.create_future()
            self._waiters.append(fut)
            try:
                if q.qsize() >= self.maxsize:  # checked again: the thread may have taken items meanwhile
                    await fut
            finally:
                if fut in self._waiters:
                    self._waiters.remove(fut)
        q.put(item)

    def take(self) -> list[_Item]:
        """I/O thread: every item queued now (maybe none)."""
        q = self._q
        items = [q.get_nowait() for _ in range(q.qsize())]
        if self._waiters:
            try:
                self._loop.call_soon_threadsafe(self._wake)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass
        return items

    def _wake(self) -> None:
        """Loop: the thread took items; every waiting ``put`` checks for room again."""
        waiters, self._waiters = self._waiters, deque()
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)


class IoThread:
    """One thread doing the file work of a set of partitions, a round at a time.

    A partition with queued work *rings* its thread (puts itself on the doorbell queue, once
    until the thread gets to it); the thread blocks on the doorbell (without the GIL), then
    takes what every partition that rang has queued, handles each partition's items in order
    and posts all the replies of the round to the loop at once. Lost wake-ups cannot happen: the
    loop queues an item before it looks at the partition's ``rung`` flag, and the thread clears
    the flag before it takes the items, so an item is either taken in this round or rings again.
    """

    def __init__(self, node: StorageNode, index: int) -> None:
        self.node = node
        self.index = index
        self.name = f"storage-io-{index}"
        self._doorbell: queue.SimpleQueue[PartitionWorker | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        #: the thread's node journal (``storage.journal``): opened by StorageNode.start
        self.journal: NodeJournal | None = None
        #: why the journal is in doubt (a failed write or checkpoint): appends and truncates are refused
        self.journal_error: BaseException | None = None
        #: partitions with journaled records not yet synced in their own files
        self.dirty: set[PartitionWorker] = set()
        #: bytes journaled since the rounds last started the writeback of the partitions' files
        self._unstarted = 0
        #: where the next writeback step starts among the dirty partitions (by partition id)
        self._writeback_next = 0
        #: writing zeros ahead of the journal failed (a full disk?): not tried again until a checkpoint
        self._preallocation_failed = False
        #: time.monotonic() at the start of the round under way, 0.0 between rounds (read by health())
        self.round_started = 0.0
        m, labels = node.metrics, {"thread": str(index)}
        m.gauge("storage_io_round_seconds", "Seconds the I/O thread's round of file work under way has run (0 "
                                            "between rounds): grows while a slow or hung disk holds it.", labels,
                fn=self.round_age)
        self.m_syncs = m.counter("storage_append_syncs", "fdatasyncs that made appends durable: one per partition "
                                                         "batch without the node journal, one per round with it.",
                                 labels)
        self._m_checkpoint = m.histogram("storage_journal_checkpoint_seconds", "Journal checkpoints: the time to "
                                                                             "sync the partition files and start the "
                                                                             "journal over (the round waits).", labels)
        m.gauge("storage_journal_bytes", "Bytes in the I/O thread's node journal since its last checkpoint "
                                         "(0 without a journal).", labels,
                fn=lambda: self.journal.position if self.journal is not None else 0)

    def ring(self, worker: PartitionWorker) -> None:
        """Loop: ``worker`` has queued work (called after queueing it)."""
        if not worker.rung:
            worker.rung = True
            self._doorbell.put(worker)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._main, name=self.name, daemon=True)
            self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None

    async def stop(self) -> None:
        """End the thread after the rounds rung so far (the partitions' work is done by then)."""
        thread = self._thread
        if thread is None:
            return
        self._doorbell.put(None)
        await asyncio.get_running_loop().run_in_executor(None, thread.join)
        self._thread = None

    def _main(self) -> None:
        doorbell = self._doorbell
        post = self.node.post_replies
        while True:
            rang = [doorbell.get()]
            rang.extend(doorbell.get_nowait() for _ in range(doorbell.qsize()))
            replies, stop = self.run_round(rang)
            post(replies)
            self.make_room()
            if stop:
                self._close_journal()
                return

    def run_round(self, rang: list[PartitionWorker | None]) -> tuple[Replies, bool]:
        """One round over the partitions that rang (None: stop after it): their replies, and
        whether the thread stops."""
        self.round_started = time.monotonic()
        try:
            return self._run_round(rang)
        finally:
            self.round_started = 0.0

    def round_age(self, now: float | None = None) -> float:
        """Seconds the round under way has run; 0.0 between rounds."""
        started = self.round_started
        return ((time.monotonic() if now is None else now) - started) if started else 0.0

    def _run_round(self, rang: list[PartitionWorker | None]) -> tuple[Replies, bool]:
        replies: Replies = []
        written: dict[PartitionWorker, list[_AppendGroup]] = {}
        stop = False
        for worker in rang:
            if worker is None:
                stop = True
                continue
            if worker in written:  # it rang again during the round: its write is made durable first
                self.finish([(worker, group) for group in written.pop(worker)], replies)
            worker.rung = False  # before take(): an item queued after it rings again
            items = worker.queue.take()
            if items:
                groups = worker.run(items, replies)
                if groups:
                    written[worker] = groups
        # The last append group of each partition was written, not synced: the fdatasyncs of the
        # round come after every write, so the writeback of all of them is under way.
        if written:
            self.finish([(worker, group) for worker, groups in written.items() for group in groups], replies)
        return replies, stop

    def finish(self, groups: list[tuple[PartitionWorker, _AppendGroup]], replies: Replies) -> None:
        """Make written groups durable and answer their appends: one journal write and fdatasync
        for all of them, or without a journal one fdatasync per partition."""
        journal = self.journal
        if journal is None:
            for worker, group in groups:
                worker.finish(group, replies)
            return
        if self.journal_error is not None:
            err = self.journal_failure()
            for worker, group in groups:
                worker.refuse_group(group, err, replies)
            return
        try:
            journal.append([(w.partition_id, g.first, g.count, g.joined) for w, g in groups])
            self.m_syncs.inc()
        except Exception as exc:  # noqa: BLE001 - an I/O failure: the journal is in doubt from now on
            self.fail_journal(exc)
            for worker, group in groups:
                worker.refuse_group(group, StorageError(f"partition {worker.partition_id}: journal write failed: "
                                                        f"{exc}"), replies)
            return
        journaled = 0
        for worker, group in groups:
            self.dirty.add(worker)
            journaled += len(group.joined)
            worker.journaled(group, replies)
        self._unstarted += journaled
        if self._unstarted >= WRITEBACK_STEP:
            self._start_writeback()
        if journal.full:
            self.checkpoint_due()

    def _start_writeback(self) -> None:
        """Start the writeback of about :data:`WRITEBACK_STEP` bytes that the rounds wrote into
        the dirty partitions' files, so a checkpoint has little left to write: partitions in
        turn, from where the last step stopped, each with at least :data:`WRITEBACK_MIN` not yet
        started. Partitions that fill at the same rate reach that minimum in the same round; all
        of them at once would be the burst the steps are there to avoid."""
        self._unstarted = 0
        workers = sorted(self.dirty, key=attrgetter("partition_id"))
        started, n = 0, len(workers)
        first = self._writeback_next % n if n else 0
        for k in range(n):
            start = getattr(workers[(first + k) % n].store, "start_lazy_writeback", None)
            if start is not None:
                started += start(WRITEBACK_MIN)
                if started >= WRITEBACK_STEP:
                    self._writeback_next = first + k + 1
                    return

    def make_room(self) -> None:
        """After a round's replies are out: write zeros ahead of the journal's rounds when they
        near the end of its file (:meth:`NodeJournal.preallocate`), so that their fdatasyncs
        overwrite blocks instead of allocating them."""
        journal = self.journal
        if journal is None or self.journal_error is not None or self._preallocation_failed or not journal.wants_room:
            return
        try:
            journal.preallocate()
        except OSError as exc:
            self._preallocation_failed = True
            log.warning("%s: could not write zeros ahead of the node journal %s (%s); its rounds extend the file "
                        "themselves, each fdatasync syncing the new blocks' allocation too", self.name, journal.path,
                        exc)

    def checkpoint_due(self) -> None:
        """The journal is full: checkpoint now, in the round (the thread's rounds wait for it)."""
        try:
            self.checkpoint()
        except StorageError:
            pass  # logged and remembered by fail_journal; the records journaled are durable there

    def checkpoint(self) -> None:
        """Sync every partition with journaled records in its own files, then start the
        journal's next generation (StorageError if the journal is in doubt or this fails)."""
        journal = self.journal
        if journal is None:
            return
        if self.journal_error is not None:
            raise self.journal_failure()
        started = time.perf_counter()
        try:
            dirty = list(self.dirty)
            for worker in dirty:  # every file's writes under way before the first fdatasync waits
                start = getattr(worker.store, "start_writeback", None)
                if start is not None:
                    start()
            for worker in dirty:
                worker.sync_store()
            journal.reset()
            self._unstarted = 0
            self._preallocation_failed = False
            self._m_checkpoint.observe(time.perf_counter() - started)
        except Exception as exc:
            self.fail_journal(exc)
            raise StorageError(f"journal checkpoint failed: {exc}") from exc

    def journal_failure(self, partition_id: int | None = None) -> StorageError:
        """What every append (and, from a partition's check, every request) gets once the journal is in doubt."""
        where = f"partition {partition_id}: " if partition_id is not None else ""
        return StorageError(f"{where}the node journal failed ({self.journal_error}); restart the storage node to "
                            f"replay it")

    def fail_journal(self, exc: BaseException) -> None:
        if self.journal_error is None:
            log.error("%s: the node journal %s failed; appends and truncates are refused until the storage node "
                      "is restarted (which replays it): %r", self.name, self.journal.path if self.journal else "?",
                      exc)
            self.journal_error = exc

    def _close_journal(self) -> None:
        """At stop, after every store was closed (synced): the journal holds nothing needed."""
        journal = self.journal
        if journal is None:
            return
        try:
            if self.journal_error is None and not self.dirty:
                journal.reset()
        except OSError as exc:
            log.warning("%s: could not empty the journal at stop (it is replayed at start): %s", self.name, exc)
        journal.close()


class LoopRounds(IoThread):
    """``io_threads = 0`` (the default): the rounds run on the event loop itself, no I/O thread.

    A partition that rings schedules one round for the loop's next iteration, which takes what
    every partition that rang has queued, like a thread's round, and answers at once. This saves
    the hand-offs between the loop and a thread (a wake-up each way and the GIL) per round: about
    1.5 µs of CPU per transaction over 3 nodes at 64 in flight (docs/performance.md). The price is
    that the loop does nothing else while a round writes and waits for its fdatasync, so a slow
    or hung disk also stalls this node's network handling and admin port (the HTTP endpoint has
    a thread of its own: ``/metrics`` and the probes answer, and say the loop is late).

    The journal's checkpoints (syncing every dirty partition's files, 10-25 ms every few seconds
    under load) do not run on the loop: a round that fills the journal hands the checkpoint to
    a thread when it ends, and the next round waits for it, as a thread's rounds would. The
    loop goes on reading and queueing requests meanwhile.
    """

    def __init__(self, node: StorageNode, index: int) -> None:
        super().__init__(node, index)
        self.name = "storage-loop-rounds"
        self._scheduled = False
        self._running = False
        self._checkpoint_wanted = False  #: a round filled the journal: checkpoint when it ends
        self._checkpointing: asyncio.Future[None] | None = None  #: the checkpoint under way on a thread

    def ring(self, worker: PartitionWorker) -> None:
        if not worker.rung:
            worker.rung = True
            self._doorbell.put(worker)
            if not self._scheduled and self._checkpointing is None:
                self._scheduled = True
                asyncio.get_running_loop().call_soon(self._round)

    def _round(self) -> None:
        self._scheduled = False
        if self._checkpointing is not None:
            return  # the checkpoint's end runs the round
        doorbell = self._doorbell
        rang = [doorbell.get_nowait() for _ in range(doorbell.qsize())]
        if rang:
            replies, _stop = self.run_round(rang)
            self.node.deliver(replies)
        if self._checkpoint_wanted:
            self._checkpoint_wanted = False
            self._start_checkpoint()
        elif self.journal is not None and self.journal.wants_room:
            # After the round's replies: the writer tasks they woke are ahead in the loop's queue.
            asyncio.get_running_loop().call_soon(self._make_room)

    def _make_room(self) -> None:
        if self._checkpointing is None:  # a checkpoint is starting the journal over: no room needed
            self.make_room()

    def checkpoint_due(self) -> None:
        # Not now: the round is still using the stores; _round starts it on a thread at its end.
        self._checkpoint_wanted = True

    def _start_checkpoint(self) -> None:
        loop = asyncio.get_running_loop()
        self.round_started = time.monotonic()  # file work under way: /readyz sees a hung checkpoint
        # IoThread.checkpoint_due: the checkpoint as a thread's round runs it, failures logged and remembered
        self._checkpointing = fut = loop.run_in_executor(None, super().checkpoint_due)
        fut.add_done_callback(self._checkpoint_done)

    def _checkpoint_done(self, fut: asyncio.Future[None]) -> None:
        self._checkpointing = None
        self.round_started = 0.0
        if not fut.cancelled() and fut.exception() is not None:  # a bug: the journal is in doubt
            log.error("%s: journal checkpoint failed", self.name, exc_info=fut.exception())
            self.fail_journal(fut.exception())  # type: ignore[arg-type]
        if self._doorbell.qsize() and not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._round)

    def start(self) -> None:
        self._running = True

    @property
    def running(self) -> bool:
        return self._running

    async def stop(self) -> None:
        if self._running:
            if self._checkpointing is not None:
                await asyncio.wait([self._checkpointing])
            self._round()  # what rang since the last one
            if self._checkpointing is not None:
                await asyncio.wait([self._checkpointing])
            self._running = False
            self._close_journal()


class PartitionWorker:
    """One partition: its state, its queue and its thread. State is touched only on the thread."""

    def __init__(self, node: StorageNode, partition_id: int) -> None:
        self.node = node
        self.partition_id = partition_id
        self.queue = _Inbox(node.queue_size, asyncio.get_running_loop())
        self.io = node.io_thread_for(partition_id)
        self.rung = False  #: on the doorbell of its I/O thread (see IoThread)
        self._deferred_sync = False  #: the store writes a batch now and syncs it with finish()
        self._journaled = False  #: its appends are made durable by the I/O thread's journal
        self.info: PartitionInfo | None = None
        self.error: StorageError | None = None  #: why the partition cannot be served (corrupt control data)
        self.store: PartitionStore | None = None
        #: why the store of an assigned partition could not be opened (an OSError: a full disk, a
        #: file it may not open); unlike ``error`` it is tried again (:data:`OPEN_RETRY_INTERVAL`)
        self.open_error: StorageError | None = None
        self._open_tried = 0.0  #: time.monotonic() of the last failed open
        #: why the last append group could not be written (None once one is): /readyz says it
        self.write_error: str | None = None
        self._write_failures = 0  #: failed groups since the last one logged with its traceback
        self._write_error_logged = 0.0  #: time.monotonic() of that log line
        self.max_session_id = -1
        m = node.metrics
        labels = {"partition": str(partition_id)}
        self._m_requests = {name: m.counter("storage_requests", "Storage requests by type.", {**labels, "type": name})
                            for name in ("open", "last_session_info", "set_low_water_mark", "truncate", "append",
                                         "record_header", "record", "max_transaction_id", "record_header_list",
                                         "record_list")}
        self._m_appends = self._m_requests["append"]
        self._m_failures = m.counter("storage_failures", "Requests answered with a failure.", labels)
        self._m_records = m.counter("storage_appended_records", "Records appended.", labels)
        self._m_syncs = m.counter("storage_append_batches", "Append batches (a partition's group commits; "
                                                            "storage_append_syncs counts their fdatasyncs).", labels)
        self._m_latency = m.histogram("storage_append_batch_seconds", "Time to write and fdatasync a batch.", labels)
        m.gauge("storage_queue_size", "Requests waiting in the partition queue.", labels, fn=lambda: self.queue.qsize())
        m.gauge("storage_max_transaction_id", "Highest stored transaction id.", labels,
                fn=lambda: self.store.max_transaction_id if self.store is not None else -1)
        m.gauge("storage_session_id", "Highest store session id seen.", labels, fn=lambda: self.max_session_id)
        m.gauge("storage_low_water_mark", "Low-water mark of the last session.", labels,
                fn=lambda: self.info.low_water_mark if self.info else -1)
        m.gauge("storage_local_low_water_mark", "Local low-water mark of the last session.", labels,
                fn=lambda: self.info.local_low_water_mark if self.info else -1)
        m.gauge("storage_partition_flags", "Partition flags (1 available, 4 assigned).", labels,
                fn=lambda: self.info.flags if self.info else 0)

    # ------------------------------------------------------------------------- lifecycle
    def load(self) -> list[Repair]:
        """Read the partition info and open the store if assigned (worker thread)."""
        layout = self.node.layout
        try:
            self.info = layout.read_partition_info(self.partition_id)
        except StorageCorruptionError as exc:
            self.error = exc
            log.error("%s", exc)
            return []
        self.max_session_id = self.info.session_id
        if self.info.assigned:
            self._open_store()
        return self.store.repairs() if self.store is not None else []

    def load_on_thread(self) -> asyncio.Future[list[Repair]]:
        """Run :meth:`load` on the partition's I/O thread; :meth:`StorageNode.start` gathers these."""
        return asyncio.ensure_future(self.call(self.load))

    def _open_store(self) -> None:
        try:
            self.store = self.node.layout.open_partition(self.partition_id)
            if self.open_error is not None:
                log.warning("partition %d: its files opened again (they could not be: %s)", self.partition_id,
                            self.open_error)
                self.open_error = None
            self._deferred_sync = isinstance(self.store, DeferredSyncStore)
            self._journaled = self._deferred_sync and self.io.journal is not None
            if self.io.journal is not None and not self._deferred_sync:
                log.warning("partition %d: the layout's store cannot defer syncs; its appends are synced one by "
                            "one, without the node journal", self.partition_id)
        except StorageError as exc:
            self.error = exc
            log.error("partition %d cannot be opened: %s", self.partition_id, exc)
        except OSError as exc:  # the machine's, not the files' content: tried again by _reopen_if_due
            err = StorageError(f"partition {self.partition_id}: its files cannot be opened ({explain(exc)}); tried "
                               f"again at its next request")
            if self.open_error is None or str(err) != str(self.open_error):
                log.error("%s", err)
            self.open_error = err
            self._open_tried = time.monotonic()

    def _reopen_if_due(self) -> PartitionStore:
        """A request reached an assigned partition without a store: open it again, unless the
        last try was less than :data:`OPEN_RETRY_INTERVAL` ago (StorageError then, and if it
        fails again)."""
        if self.open_error is not None and time.monotonic() - self._open_tried >= OPEN_RETRY_INTERVAL:
            self._open_store()
        if self.store is None:
            raise self.open_error or PartitionNotFoundError(
                f"partition {self.partition_id} has no open store on this storage node")
        return self.store

    async def stop(self) -> None:
        """Finish what is queued and close the store (the node then ends the I/O threads)."""
        if self.io.running:
            await self.call(self._close_store)

    def _close_store(self) -> None:
        self.open_error = None
        if self.store is not None:
            if self in self.io.dirty:
                try:
                    self.sync_store()
                except Exception as exc:  # noqa: BLE001 - its records stay in the journal, for a replay
                    self.io.fail_journal(exc)
            self.store.close()
            self.store = None

    def sync_store(self) -> None:
        """I/O thread: make the journaled records durable in the partition's own files."""
        if self.store is not None:
            cast(DeferredSyncStore, self.store).sync_written()
        self.io.dirty.discard(self)

    def _checkpoint_first(self, what: str) -> None:
        """Before a truncate or a file deletion: no journaled append of this partition may be
        replayed over it, so the thread's journal starts a new generation first."""
        if self.io.journal is not None:
            try:
                self.io.checkpoint()
            except StorageError as exc:
                raise StorageError(f"partition {self.partition_id}: cannot {what}: {exc}") from None

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the partition thread, in order with the partition's requests."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

        def reply(result: Any) -> None:
            if fut.done():
                return
            if isinstance(result, BaseException):
                fut.set_exception(result)
            else:
                fut.set_result(result)

        item = _Item(fn, reply)
        if not self.queue.put_nowait(item):
            await self.queue.put(item)
        self.io.ring(self)
        return await fut

    def run(self, items: list[_Item], replies: Replies) -> list[_AppendGroup]:
        """I/O thread: handle the items taken from the queue, in order, as one batch, adding
        their replies to ``replies``. Returns the append groups that were written but not made
        durable yet: with the node journal every group since the batch's last other request, else
        the batch's last group when the store defers syncs. The I/O thread makes them durable
        and answers them (:meth:`IoThread.finish`) after the other partitions of the round
        wrote theirs."""
        out: Replies = []
        try:
            groups = self._process(items, out)
        except Exception as exc:  # a bug: answer every request of the batch, keep the thread
            log.exception("partition %d: a batch of %d requests failed", self.partition_id, len(items))
            replies.extend(self._failed(items, StorageError(f"internal error: {exc!r}")))
            return []
        replies.extend(out)
        return groups

    def finish(self, group: _AppendGroup, replies: Replies) -> None:
        """I/O thread: make a written group durable (one fdatasync) and answer its appends."""
        store = self.store
        try:
            if store is None:
                raise StorageError(f"partition {self.partition_id}: the store was closed before its sync")
            cast(DeferredSyncStore, store).sync_written()
        except Exception as exc:  # noqa: BLE001 - an I/O failure: fail the group, reopen to repair the tail
            self._append_failed(group, exc, replies)
        else:
            self._append_succeeded(group, replies)

    def _append_failed(self, group: _AppendGroup, exc: BaseException, out: Replies) -> None:
        self._log_write_failure(group, exc)
        err = StorageError(f"partition {self.partition_id}: write failed: "
                           f"{explain(exc) if isinstance(exc, OSError) else exc}")
        for item in group.items:
            self._m_failures.inc()
            out.append((item.reply, failure_for(item.work, err)))
        self._reopen_after_failure()

    def _log_write_failure(self, group: _AppendGroup, exc: BaseException) -> None:
        """Log a failed append group: with its traceback when the failure is new, then (a full
        disk fails every append until it is freed) once per WRITE_FAILURE_LOG_INTERVAL."""
        why = repr(exc) + hint(exc)
        now = time.monotonic()
        if why != self.write_error:
            log.error("partition %d: append of %d records failed: %s", self.partition_id, group.count, why,
                      exc_info=exc)
        elif now - self._write_error_logged >= WRITE_FAILURE_LOG_INTERVAL:
            log.error("partition %d: appends still fail: %d more groups since the last report: %s",
                      self.partition_id, self._write_failures, why)
        else:
            self._write_failures += 1
            return
        self.write_error = why
        self._write_failures = 0
        self._write_error_logged = now

    def _append_succeeded(self, group: _AppendGroup, out: Replies) -> None:
        if self.write_error is not None:
            log.warning("partition %d: appends are written again (they failed: %s)", self.partition_id,
                        self.write_error)
            self.write_error = None
        self._m_latency.observe(time.perf_counter() - group.started)
        self._m_syncs.inc()
        if not self._journaled:
            self.io.m_syncs.inc()
        self._m_records.inc(group.count)
        success = sm.success_response
        for item in group.items:
            req = item.work
            out.append((item.reply, success(req.session_id, req.seq_num, req.partition_id)))

    def journaled(self, group: _AppendGroup, out: Replies) -> None:
        """I/O thread: the group is durable in the journal; answer its appends."""
        self._append_succeeded(group, out)
        group.joined = b""

    def refuse_group(self, group: _AppendGroup, err: StorageError, out: Replies) -> None:
        """I/O thread: the group was written but not made durable: fail its appends. The store
        is reopened, so it ends where its files end (the unacknowledged records may stay, as
        after a crash: a new store session's recovery decides about them)."""
        for item in group.items:
            self._m_failures.inc()
            out.append((item.reply, failure_for(item.work, err)))
        self._reopen_after_failure()

    @staticmethod
    def _failed(items: list[_Item], err: StorageError) -> Replies:
        replies: Replies = []
        for item in items:
            try:
                replies.append((item.reply, err if callable(item.work) else failure_for(item.work, err)))
            except Exception:  # not a request with a head: nobody to answer
                log.debug("no failure response for %r", item.work, exc_info=True)
        return replies

    # ------------------------------------------------------------------ worker thread
    def _process(self, batch: list[_Item], out: Replies) -> list[_AppendGroup]:
        group = _AppendGroup()
        #: with the node journal: groups written, to be journaled with the round (or before the
        #: batch's next request that is not an append: nothing else may see them undurable)
        written: list[_AppendGroup] = []
        limit = self.node.max_batch_records
        journaled = self._journaled

        def flush(last: bool = False) -> bool:
            """Write the group; durable and answered at once, unless it is the batch's ``last``
            and the store defers syncs (True: written, :meth:`finish` syncs it)."""
            if not group.items:
                return False
            group.started = time.perf_counter()
            store = self.store
            try:
                assert store is not None
                if last and self._deferred_sync:
                    cast(DeferredSyncStore, store).write_validated(group.data(), group.offsets)
                    return True
                store.append_validated(group.data(), group.offsets)
            except Exception as exc:  # noqa: BLE001 - an I/O failure: fail the batch, reopen to repair the tail
                self._append_failed(group, exc, out)
            else:
                self._append_succeeded(group, out)
            group.clear()
            return False

        def write_journaled(last: bool = False) -> None:
            """Journal mode: write the group into the partition's files; the journal makes it
            durable. A new group follows unless it is the batch's ``last``."""
            nonlocal group
            if not group.items:
                return
            group.started = time.perf_counter()
            store = self.store
            try:
                assert store is not None
                if self.io.journal_error is not None:
                    raise self.io.journal_failure()
                group.first = store.max_transaction_id + 1
                group.joined = data = group.data()
                cast(DeferredSyncStore, store).write_validated(data, group.offsets, lazy_writeback=True)
            except Exception as exc:  # noqa: BLE001 - an I/O failure: fail the group, reopen to repair the tail
                self._append_failed(group, exc, out)
                group.clear()
                return
            written.append(group)
            if not last:
                group = _AppendGroup()

        def settle() -> None:
            """Before anything but an append: every append before it is durable and answered."""
            if not journaled:
                flush()
                return
            write_journaled()
            if written:
                self.io.finish([(self, g) for g in written], out)
                written.clear()

        for item in batch:
            work = item.work
            if callable(work):
                settle()
                try:
                    out.append((item.reply, work()))
                except Exception as exc:  # noqa: BLE001 - the request's reply
                    out.append((item.reply, exc))
                continue
            try:
                if type(work) is sm.StorageAppendRequest:
                    self._m_appends.inc()
                    self._check(work, work.offline)
                    if group.count and group.count + len(work.records) > limit:
                        if journaled:
                            write_journaled()
                        else:
                            flush()
                    self._check_append(work, group)
                    group.add(item, work.records)
                    continue
                settle()
                response = self._handle(work, item.read_budget or self.node.max_frame_size // 2)
            except WaltzError as exc:
                self._m_failures.inc()
                response = failure_for(work, exc)
            except Exception as exc:  # a bug must not take the partition down: answer and log it
                log.exception("partition %d: %s failed", self.partition_id, type(work).__name__)
                self._m_failures.inc()
                response = failure_for(work, StorageError(f"internal error: {exc!r}"))
            out.append((item.reply, response))
        if journaled:
            write_journaled(last=True)
            return written
        return [group] if flush(last=True) else []

    def _reopen_after_failure(self) -> None:
        self._close_store()
        self._open_store()

    def _check(self, req: Any, offline: bool) -> PartitionStore:
        pid = self.partition_id
        if self.error is not None:
            raise type(self.error)(str(self.error))
        if self.io.journal_error is not None:
            # A checkpoint may have failed half-way: what the store holds in memory is in doubt.
            raise self.io.journal_failure(pid)
        info = self.info
        if info is None or not info.assigned:
            raise PartitionNotFoundError(f"partition {pid} is not assigned to this storage node")
        if offline:
            if info.available:
                raise StorageError(f"partition {pid} is available; offline recovery requests need it made "
                                   f"unavailable first (waltz storage availability --offline)")
            if req.session_id != info.session_id:
                raise StaleSessionError(f"partition {pid}: offline request carries session {req.session_id}, "
                                        f"the partition's stored session is {info.session_id}")
        else:
            if not info.available:
                raise PartitionNotFoundError(f"partition {pid} is not available on this storage node "
                                             f"(taken offline by an admin)")
            if req.session_id < self.max_session_id:
                raise StaleSessionError(f"partition {pid}: session {req.session_id} is fenced by the newer "
                                        f"session {self.max_session_id}")
            self.max_session_id = req.session_id
        if self.store is None:
            return self._reopen_if_due()
        return self.store

    def _check_append(self, req: sm.StorageAppendRequest, group: _AppendGroup) -> None:
        """Validate an append against the partition and the group before it, filling the group's offsets.

        The first id must be the next one (OutOfOrderAppendError, the store session's concern);
        then one pass over the bytes checks contiguous ids, lengths, each record checksum
        (ProtocolError: corrupted bytes never reach the disk) and each data checksum
        (ChecksumError). A refused batch leaves the group as it was.
        """
        assert self.store is not None
        batch = req.records
        expected = self.store.max_transaction_id + 1 + group.count
        if len(batch) and batch.first_transaction_id != expected:
            raise OutOfOrderAppendError(
                f"partition {self.partition_id}: transaction out of order: record 0 of the batch has id "
                f"{batch.first_transaction_id}, the next id must be {expected}")
        try:
            batch.validate_into(group.offsets, group.nbytes)
        except ProtocolError as exc:
            raise type(exc)(f"partition {self.partition_id}: {exc}") from None

    def _handle(self, req: Any, read_budget: int) -> Any:
        """The answer to a request other than an append; lists take at most ``read_budget`` bytes."""
        t = type(req)
        head = (req.session_id, req.seq_num, req.partition_id)
        if t is sm.RecordRequest:
            self._m_requests["record"].inc()
            store = self._check(req, False)
            return sm.RecordResponse(*head, store.read_record(req.transaction_id))
        if t is sm.RecordListRequest:
            self._m_requests["record_list"].inc()
            store = self._check(req, False)
            # The stored bytes as they are (checked against their record checksums on the way).
            return sm.RecordListResponse(*head, store.read_batch(
                req.transaction_id, self._list_size(req.max_records), read_budget))
        if t is sm.RecordHeaderRequest:
            self._m_requests["record_header"].inc()
            store = self._check(req, False)
            return sm.RecordHeaderResponse(*head, store.read_header(req.transaction_id))
        if t is sm.RecordHeaderListRequest:
            self._m_requests["record_header_list"].inc()
            store = self._check(req, False)
            # within half a frame, as a record list (the caller asks again for the rest)
            fit = max(1, read_budget // RECORD_HEADER.size)
            return sm.RecordHeaderListResponse(*head, tuple(store.read_headers(
                req.transaction_id, min(self._list_size(req.max_records), fit))))
        if t is sm.MaxTransactionIdRequest:
            self._m_requests["max_transaction_id"].inc()
            store = self._check(req, req.offline)
            return sm.MaxTransactionIdResponse(*head, store.max_transaction_id)
        if t is sm.LastSessionInfoRequest:
            self._m_requests["last_session_info"].inc()
            self._check(req, req.offline)
            info = self.info
            assert info is not None
            return sm.LastSessionInfoResponse(*head, SessionInfo(info.session_id, info.low_water_mark,
                                                                 info.local_low_water_mark))
        if t is sm.TruncateRequest:
            self._m_requests["truncate"].inc()
            store = self._check(req, req.offline)
            if req.transaction_id < -1:
                raise StorageError(f"partition {self.partition_id}: cannot truncate to transaction {req.transaction_id}")
            if req.transaction_id < store.max_transaction_id:
                self._checkpoint_first(f"truncate to transaction {req.transaction_id}")
            store.truncate(req.transaction_id)
            return sm.SuccessResponse(*head)
        if t is sm.SetLowWaterMarkRequest:
            self._m_requests["set_low_water_mark"].inc()
            store = self._check(req, req.offline)
            max_id = store.max_transaction_id
            if req.low_water_mark < max_id:
                raise StorageError(f"partition {self.partition_id}: low-water mark {req.low_water_mark} is below the "
                                   f"max transaction id {max_id}; truncate first")
            info = self.info
            assert info is not None
            self.info = self.node.layout.write_partition_info(self.partition_id, PartitionInfo(
                req.session_id, req.low_water_mark, max_id, info.flags))
            self.max_session_id = max(self.max_session_id, req.session_id)
            return sm.SuccessResponse(*head)
        raise ProtocolError(f"{t.__name__} is not a request a storage node serves")

    @staticmethod
    def _list_size(max_records: int) -> int:
        if max_records < 0:
            raise StorageError(f"max_records must not be negative, got {max_records}")
        return min(max_records, MAX_LIST_RECORDS)

    def _bounded(self, records: list[Record], budget: int) -> list[Record]:
        """Trim a record list to about ``budget`` bytes, so its response fits in a frame (the
        caller asks again for the rest; the first record always goes)."""
        total = 0
        for i, r in enumerate(records):
            total += len(r.data) + 64
            if total > budget and i:
                return records[:i]
        return records

    # -------------------------------------------------------------- admin (worker thread)
    def assign(self, assigned: bool, delete_files: bool) -> None:
        layout = self.node.layout
        info = self.info if self.error is None and self.info is not None else PartitionInfo()
        if assigned:
            if self.error is not None or not info.assigned:
                self.info = layout.write_partition_info(self.partition_id, PartitionInfo(
                    info.session_id, info.low_water_mark, info.local_low_water_mark, FLAG_ASSIGNED | FLAG_AVAILABLE))
                self.error = None
            if self.store is None:
                self._open_store()
                self.node.check_open_files()
                if self.error is not None:
                    raise self.error
                if self.open_error is not None:
                    raise self.open_error
            return
        self._close_store()
        if delete_files:
            self._checkpoint_first("delete its files")
            layout.delete_partition_files(self.partition_id)
            info = PartitionInfo()
        self.info = layout.write_partition_info(self.partition_id, PartitionInfo(
            info.session_id, info.low_water_mark, info.local_low_water_mark, 0))
        self.error = None
        self.max_session_id = self.info.session_id

    def set_available(self, available: bool) -> None:
        if self.error is not None:
            raise type(self.error)(str(self.error))
        info = self.info
        if info is None or not info.assigned:
            raise PartitionNotFoundError(f"partition {self.partition_id} is not assigned to this storage node")
        flags = (info.flags | FLAG_AVAILABLE) if available else (info.flags & ~FLAG_AVAILABLE)
        if flags != info.flags:
            self.info = self.node.layout.write_partition_info(self.partition_id, PartitionInfo(
                info.session_id, info.low_water_mark, info.local_low_water_mark, flags))

    def export_records(self, transaction_id: int, max_records: int, budget: int = 0) -> list[Record]:
        """Records for offline recovery: the partition must be assigned; availability does not
        matter. ``budget``: bytes the list may take (0: half this node's frame limit)."""
        if self.error is not None:
            raise type(self.error)(str(self.error))
        store = self.store
        if store is None:
            if self.info is None or not self.info.assigned:
                raise PartitionNotFoundError(f"partition {self.partition_id} is not assigned to this storage node")
            store = self._reopen_if_due()
        return self._bounded(store.read_records(transaction_id, self._list_size(max_records)),
                             budget or self.node.max_frame_size // 2)

    def session_info(self) -> SessionInfo:
        if self.error is not None:
            raise type(self.error)(str(self.error))
        info = self.info
        if info is None or not info.assigned:
            raise PartitionNotFoundError(f"partition {self.partition_id} is not assigned to this storage node")
        return SessionInfo(info.session_id, info.low_water_mark, info.local_low_water_mark)


class StorageNode:
    """A storage node over one layout. Independent of coordination: the caller passes the cluster key.

    :param layout: the opened-or-not storage layout (the node opens it in :meth:`start`)
    :param cluster_key: the cluster's UUID; open requests must carry it
    :param num_partitions: the cluster's partition count; open requests must carry it
    """

    def __init__(self, layout: StorageLayout, cluster_key: uuid.UUID, num_partitions: int, *, queue_size: int = 100,
                 max_batch_records: int = 100, max_frame_size: int = 16 * 1024 * 1024, io_threads: int = 0,
                 journal: bool = True, journal_checkpoint_bytes: int = 64 * 1024 * 1024,
                 metrics: MetricsRegistry | None = None, name: str = "storage") -> None:
        if io_threads < 0:
            raise ValueError(f"io_threads must be 0 (rounds on the event loop) or more, got {io_threads}")
        if journal_checkpoint_bytes < 1:
            raise ValueError(f"journal_checkpoint_bytes must be at least 1, got {journal_checkpoint_bytes}")
        self.journal = journal
        self.journal_checkpoint_bytes = journal_checkpoint_bytes
        self.layout = layout
        self.cluster_key = cluster_key
        self.num_partitions = num_partitions
        self.queue_size = queue_size
        self.max_batch_records = max_batch_records
        self.max_frame_size = max_frame_size
        self.metrics = metrics or MetricsRegistry()
        self.name = name
        self.workers: list[PartitionWorker] = []
        self.io_threads: list[IoThread] = (
            [LoopRounds(self, 0)] if io_threads == 0
            else [IoThread(self, i) for i in range(min(io_threads, max(1, num_partitions)))])
        self.repairs: list[Repair] = []
        #: "starting" until :meth:`start` opened every partition, "serving", then "stopping" from :meth:`close`
        self.state = "starting"
        self._connections: set[asyncio.Task[Any]] = set()
        self.metrics.gauge("storage_connections", "Open data and admin connections.",
                           fn=lambda: len(self._connections))
        self.metrics.gauge("storage_num_partitions", "Partitions of the cluster.", fn=lambda: self.num_partitions)
        self.metrics.gauge("storage_failed_partitions", "Partitions this node cannot serve: corrupt control data, or "
                           "files it cannot open (a full disk?; tried again at their requests).",
                           fn=lambda: sum(1 for w in self.workers if w.error is not None or w.open_error is not None))
        self.metrics.gauge("storage_journal_failed", "1 while a node journal is in doubt after a failed write, "
                           "fdatasync or checkpoint: appends and truncates are refused until a restart replays it.",
                           fn=lambda: float(any(io.journal_error is not None for io in self.io_threads)))
        directory = getattr(layout, "directory", None)
        if directory:
            self.metrics.gauge("storage_filesystem_free_bytes", "Bytes free for the node on the filesystem of its "
                               "storage directory.", fn=functools.partial(_filesystem_bytes, directory, free=True))
            self.metrics.gauge("storage_filesystem_size_bytes", "Size of the filesystem of the storage directory.",
                               fn=functools.partial(_filesystem_bytes, directory, free=False))
        self._loop: asyncio.AbstractEventLoop | None = None
        #: reply lists posted by partition threads, delivered on the loop by _deliver_replies
        self._replies: deque[Replies] = deque()
        self._delivery_scheduled = False
        self._files_short = False  #: check_open_files warned, and the partitions still do not fit

    def io_thread_for(self, partition_id: int) -> IoThread:
        """The I/O thread that does every file operation of ``partition_id``."""
        return self.io_threads[partition_id % len(self.io_threads)]

    def post_replies(self, replies: Replies) -> None:
        """I/O thread: hand a round's replies to the loop.

        Threads that finish while a delivery is already scheduled add to it: one loop wake-up
        (one self-pipe write) for all of them. A thread appends before it reads the flag and the
        loop clears the flag before it takes the lists, so no list is left behind.
        """
        if not replies:
            return
        self._replies.append(replies)
        if not self._delivery_scheduled:
            self._delivery_scheduled = True
            assert self._loop is not None
            try:
                self._loop.call_soon_threadsafe(self._deliver_replies)
            except RuntimeError:  # the loop is closed: there is nobody left to answer
                self._delivery_scheduled = False

    def _deliver_replies(self) -> None:
        self._delivery_scheduled = False
        pending = self._replies
        while pending:
            self.deliver(pending.popleft())

    @staticmethod
    def deliver(replies: Replies) -> None:
        """Loop: hand each response to its reply sink."""
        for reply, response in replies:
            try:
                reply(response)
            except Exception:  # a reply sink of a closed connection; nothing to deliver to
                log.debug("dropping a reply", exc_info=True)

    async def start(self) -> None:
        """Open the layout and every assigned partition (repairing torn tails), start the workers."""
        loop = self._loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, self.layout.open, self.cluster_key, self.num_partitions)
        except OSError as exc:  # the machine's (a read-only or full filesystem, a path through a file): one line
            where = getattr(self.layout, "directory", "") or type(self.layout).__name__
            why = "it is a file, not a directory" if isinstance(exc, FileExistsError) else exc.strerror or str(exc)
            raise StorageError(f"cannot open the storage directory {where}: {why}"
                               f"{' (' + str(exc.filename) + ')' if exc.filename and str(exc.filename) != str(where) else ''}"
                               ) from exc
        self.repairs.extend(self.layout.repairs())
        try:
            # Before any partition is opened: records acknowledged from a journal go back into their files.
            self.repairs.extend(await loop.run_in_executor(None, self._replay_and_open_journals))
        except BaseException:
            # Not started (a disk still full): let the directory go, so a start after the fix can take it.
            for io in self.io_threads:
                if io.journal is not None:
                    io.journal.close()
            self.layout.close()
            raise
        self.workers = [PartitionWorker(self, pid) for pid in range(self.num_partitions)]
        for io in self.io_threads:
            io.start()
        # Open partitions on their I/O threads: recovery of many partitions runs on all of them.
        results = await asyncio.gather(*(w.load_on_thread() for w in self.workers))
        for reps in results:
            self.repairs.extend(reps)
        self.repairs.extend(r for r in self.layout.repairs() if r not in self.repairs)
        self.check_open_files()
        self.state = "serving"

    def check_open_files(self) -> None:
        """Warn when the partitions assigned here need more files open than the process may open
        (once, and again after they fitted): past that, partitions cannot open their files."""
        assigned = sum(1 for w in self.workers if w.info is not None and w.info.assigned)
        short = storage_shortfall(assigned, getattr(self.layout, "open_files_per_partition", FILES_PER_PARTITION))
        if short is not None and not self._files_short:
            log.warning("%s: %s", self.name, short)
        self._files_short = short is not None

    def _replay_and_open_journals(self) -> list[Repair]:
        layout = self.layout
        repairs = replay_into_layout(layout)
        if self.journal and getattr(layout, "journal_capable", False):
            root = Path(layout.directory) / JOURNAL_DIRECTORY
            for io in self.io_threads:
                io.journal = NodeJournal(root / f"io-{io.index}{JOURNAL_SUFFIX}", self.journal_checkpoint_bytes)
        return repairs

    async def close(self) -> None:
        self.state = "stopping"
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        await asyncio.gather(*(w.stop() for w in self.workers), return_exceptions=True)
        await asyncio.gather(*(io.stop() for io in self.io_threads), return_exceptions=True)
        self.layout.close()

    def healthy(self) -> tuple[bool, dict[str, Any]]:
        """Ready (``/readyz``): serving, no partition refused to open or cannot open its files, no
        node journal in doubt and no round of file work under way for more than
        IO_ROUND_STALL_NOT_READY seconds; ``reasons`` say why not."""
        broken = {w.partition_id: str(w.error or w.open_error) for w in self.workers
                  if w.error is not None or w.open_error is not None}
        reasons = [] if self.state == "serving" else [f"storage node is {self.state}"]
        reasons += [f"partition {w.partition_id} is broken: {w.error}" if w.error is not None else str(w.open_error)
                    for w in self.workers if w.error is not None or w.open_error is not None]
        reasons += [f"partition {w.partition_id}: its last append could not be written: {w.write_error}"
                    for w in self.workers if w.write_error is not None]
        reasons += [f"{io.name}: {io.journal_failure()}" for io in self.io_threads if io.journal_error is not None]
        now = time.monotonic()
        reasons += [f"{io.name} has been in one round of file work for {age:.1f}s (a slow or hung disk?); its "
                    f"partitions' requests wait" for io in self.io_threads
                    if (age := io.round_age(now)) > IO_ROUND_STALL_NOT_READY]
        return not reasons, {"partitions": len(self.workers), "broken_partitions": broken, "reasons": reasons}

    def _worker(self, partition_id: int) -> PartitionWorker:
        if not 0 <= partition_id < len(self.workers):
            raise PartitionNotFoundError(
                f"partition {partition_id} does not exist (this cluster has partitions 0..{self.num_partitions - 1})")
        return self.workers[partition_id]

    def _check_key(self, cluster_key: uuid.UUID, num_partitions: int) -> None:
        if cluster_key != self.cluster_key:
            raise ClusterKeyMismatchError(f"cluster key {cluster_key} does not match this storage node's cluster key "
                                          f"{self.cluster_key}")
        if num_partitions != self.num_partitions:
            raise ClusterKeyMismatchError(f"{num_partitions} partitions requested; this storage node's cluster has "
                                          f"{self.num_partitions}")

    def _track(self) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    # ------------------------------------------------------------------------ data port
    async def serve_data(self, conn: Connection) -> None:
        """Connection handler for the data port (pass to ``transport.listen``)."""
        self._track()
        try:
            channel = await MessageChannel.open(conn, STORAGE, _ROLE)
        except WaltzError as exc:
            log.warning("data connection from %s refused: %s", conn.peer, exc)
            await conn.close()
            return
        outbox = _Outbox()
        writer: asyncio.Task[None] | None = None
        send_nowait = getattr(conn, "send_nowait", None)
        if send_nowait is not None:
            # Each reply straight to the transport, which writes all of a loop turn's replies at once:
            # no writer task to wake per round. Replies are bounded by the requests read, as the
            # outbox's are.
            encode = channel.family.encode

            def send(response: Any) -> None:
                try:
                    send_nowait(encode(response))
                except TransportError:
                    pass  # closed: nobody left to answer, and the read loop ends on its own
                except ProtocolError as exc:  # over our frame limit: the request fails, not the connection
                    send_nowait(encode(_too_large(response, exc, conn.peer)))
        else:
            send = outbox.put
            writer = asyncio.get_running_loop().create_task(_write_loop(channel, outbox))
        opened = False
        served = _SERVED
        read_budget = 0  # half our frame limit, unless the peer's is smaller (LimitedOpenRequest)
        try:
            while True:
                try:
                    msg = await channel.recv()
                except (ConnectionClosedError, asyncio.IncompleteReadError):
                    break
                except ProtocolError as exc:
                    log.warning("closing data connection from %s: %s", conn.peer, exc)
                    send(sm.FailureResponse(-1, -1, -1, wire_code(exc), str(exc)))
                    break
                except TransportError as exc:
                    log.info("data connection from %s failed: %s", conn.peer, exc)
                    break
                t = type(msg)
                if t is sm.OpenRequest or t is sm.LimitedOpenRequest:
                    try:
                        self._check_key(msg.cluster_key, msg.num_partitions)
                        if t is sm.LimitedOpenRequest:
                            read_budget = self._read_budget(msg.max_frame_size)
                    except (ClusterKeyMismatchError, ProtocolError) as exc:
                        log.warning("open from %s refused: %s", conn.peer, exc)
                        send(failure_for(msg, exc))
                        continue
                    opened = True
                    if t is sm.LimitedOpenRequest:  # our limit: the server sends no frame above it
                        send(sm.OpenResponse(msg.session_id, msg.seq_num, msg.partition_id,
                                             min(self.max_frame_size, INT32_MAX)))
                    else:
                        send(sm.SuccessResponse(msg.session_id, msg.seq_num, msg.partition_id))
                    continue
                if t not in served:
                    send(failure_for(msg, ProtocolError(f"{t.__name__} is a response; a storage node serves requests")))
                elif not opened:
                    send(failure_for(msg, StorageError("the connection is not open: send an OpenRequest with the "
                                                       "cluster key first")))
                elif t is sm.StorageAppendManyRequest:
                    # Each append as if it had come alone; one answer once every partition answered its own.
                    reply = _ManyAnswer(send, msg.seq_num, len(msg.appends)).reply
                    for part in msg.appends:
                        await self._queue(part, reply)
                else:
                    await self._queue(msg, send, read_budget)
        finally:
            await _drain_and_close(channel, outbox, writer)

    def _read_budget(self, peer_max_frame_size: int) -> int:
        """Bytes a list in an answer may take on a connection whose peer takes frames of at most
        ``peer_max_frame_size``: half the smaller limit (0: half ours, the default)."""
        if peer_max_frame_size < MIN_MAX_FRAME_SIZE:
            raise ProtocolError(f"a max_frame_size of {peer_max_frame_size} bytes is below the smallest allowed "
                                f"({MIN_MAX_FRAME_SIZE})")
        return peer_max_frame_size // 2 if peer_max_frame_size < self.max_frame_size else 0

    async def _queue(self, request: Any, reply: Callable[[Any], None], read_budget: int = 0) -> None:
        """Queue ``request`` on its partition, whose round answers it through ``reply`` (at once
        for a partition that does not exist)."""
        try:
            worker = self._worker(request.partition_id)
        except WaltzError as exc:
            reply(failure_for(request, exc))
            return
        item = _Item(request, reply, read_budget)
        if not worker.queue.put_nowait(item):
            await worker.queue.put(item)  # waits while the queue is full: back pressure
        worker.io.ring(worker)

    # ----------------------------------------------------------------------- admin port
    async def serve_admin(self, conn: Connection) -> None:
        """Connection handler for the admin port."""
        self._track()
        try:
            channel = await MessageChannel.open(conn, ADMIN, _ROLE + "-admin")
        except WaltzError as exc:
            log.warning("admin connection from %s refused: %s", conn.peer, exc)
            await conn.close()
            return
        opened = False
        read_budget = 0  # half our frame limit, unless the tool's is smaller (LimitedAdminOpenRequest)
        try:
            while True:
                try:
                    msg = await channel.recv()
                except (ConnectionClosedError, asyncio.IncompleteReadError):
                    break
                except ProtocolError as exc:
                    log.warning("closing admin connection from %s: %s", conn.peer, exc)
                    await channel.send(am.AdminFailureResponse(-1, wire_code(exc), str(exc)))
                    break
                except TransportError:
                    break
                try:
                    t = type(msg)
                    if t is am.AdminOpenRequest or t is am.LimitedAdminOpenRequest:
                        self._check_key(msg.cluster_key, msg.num_partitions)
                        if t is am.LimitedAdminOpenRequest:
                            read_budget = self._read_budget(msg.max_frame_size)
                        opened = True
                        response: Any = am.AdminSuccessResponse(msg.seq_num)
                    elif not opened:
                        raise StorageError("the admin connection is not open: send an AdminOpenRequest first")
                    else:
                        response = await self._admin(msg, read_budget)
                except WaltzError as exc:
                    response = am.AdminFailureResponse(msg.seq_num, wire_code(exc), str(exc))
                except Exception as exc:
                    log.exception("admin request %s failed", type(msg).__name__)
                    response = am.AdminFailureResponse(msg.seq_num, wire_code(exc), f"internal error: {exc!r}")
                try:
                    await channel.send(response)
                except TransportError:
                    break
        finally:
            await channel.close()

    async def _admin(self, msg: Any, read_budget: int = 0) -> Any:
        """The answer to an admin request; record exports take at most ``read_budget`` bytes
        (0: half this node's frame limit)."""
        t = type(msg)
        if t is am.PartitionAssignmentRequest:
            for pid in msg.partition_ids:
                worker = self._worker(pid)
                await worker.call(functools.partial(worker.assign, msg.assigned, msg.delete_storage_files))
            return am.AdminSuccessResponse(msg.seq_num)
        if t is am.PartitionAvailableRequest:
            for pid in msg.partition_ids:
                worker = self._worker(pid)
                await worker.call(functools.partial(worker.set_available, msg.available))
            return am.AdminSuccessResponse(msg.seq_num)
        if t is am.AdminRecordListRequest:
            worker = self._worker(msg.partition_id)
            records = await worker.call(lambda: worker.export_records(msg.transaction_id, msg.max_records,
                                                                      read_budget))
            return am.AdminRecordListResponse(msg.seq_num, msg.partition_id, tuple(records))
        if t is am.AdminLastSessionInfoRequest:
            worker = self._worker(msg.partition_id)
            return am.AdminLastSessionInfoResponse(msg.seq_num, msg.partition_id, await worker.call(worker.session_info))
        if t is am.MetricsRequest:
            return am.MetricsResponse(msg.seq_num, json.dumps(self.metrics.snapshot(), indent=2, default=str))
        if t is am.AssignedPartitionStatusRequest:
            # Available: it would serve a store session (not taken offline, its files open, its journal sound).
            statuses = tuple((w.partition_id, bool(w.info and w.info.available and w.error is None
                                                   and w.open_error is None and w.io.journal_error is None))
                             for w in self.workers if w.info is not None and w.info.assigned)
            return am.AssignedPartitionStatusResponse(msg.seq_num, statuses)
        raise ProtocolError(f"{t.__name__} is not a request the admin port serves")


class _ManyAnswer:
    """The answers of a StorageAppendManyRequest's appends, gathered on the loop: one
    AppendManyResponse, listing the refused ones by index (their sequence number), once the last is in."""

    __slots__ = ("send", "seq_num", "left", "failures")

    def __init__(self, send: Callable[[Any], None], seq_num: int, count: int) -> None:
        self.send = send
        self.seq_num = seq_num
        self.left = count
        self.failures: list[tuple[int, int, str]] = []
        if not count:
            send(sm.AppendManyResponse(-1, seq_num, -1))

    def reply(self, response: Any) -> None:
        """One append's answer (a partition's reply sink)."""
        if type(response) is not sm.SuccessResponse:
            self.failures.append((response.seq_num, response.error_code, response.message))
        self.left -= 1
        if not self.left:
            failures = tuple(sorted(self.failures)) if self.failures else ()
            self.send(sm.AppendManyResponse(-1, self.seq_num, -1, failures))


_READS = (sm.RecordRequest, sm.RecordHeaderRequest, sm.RecordListRequest, sm.RecordHeaderListRequest)
#: the requests a data connection queues for partitions: the reads, every message with an offline
#: flag, and the appends of several partitions
_SERVED: Final = frozenset(_READS) | frozenset(
    cls for cls in sm.MESSAGES if any(f.name == "offline" for f in attrs.fields(cls))) | {sm.StorageAppendManyRequest}


class _Outbox:
    """The responses of one data connection waiting for its writer task (filled on the loop)."""

    __slots__ = ("items", "closing", "_waiter")

    def __init__(self) -> None:
        self.items: list[Any] = []
        self.closing = False
        self._waiter: asyncio.Future[None] | None = None

    def put(self, response: Any) -> None:
        self.items.append(response)
        self._wake()

    def close(self) -> None:
        """The writer sends what is queued, then ends."""
        self.closing = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def wait(self) -> None:
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        await waiter


def _too_large(response: Any, exc: ProtocolError, peer: str) -> sm.FailureResponse:
    """What a request gets whose answer is over this node's frame limit (a record appended while
    the node took larger frames): a failure naming the limit, so the connection goes on."""
    log.warning("an answer to %s is over this node's transport.max_frame_size; answering with a failure: %s", peer, exc)
    return failure_for(response, StorageError(f"the answer is over storage transport.max_frame_size: {exc}"))


async def _write_loop(channel: MessageChannel, outbox: _Outbox) -> None:
    """Send responses as they come, all those ready in one write."""
    while True:
        if not outbox.items:
            if outbox.closing:
                return
            await outbox.wait()
            continue
        batch, outbox.items = outbox.items, []
        try:
            try:
                await channel.send_many(batch)
            except ProtocolError:  # one of them over our frame limit: nothing was sent, so one at a time
                for response in batch:
                    try:
                        await channel.send(response)
                    except ProtocolError as exc:
                        await channel.send(_too_large(response, exc, channel.conn.peer))
        except TransportError:
            return


async def _drain_and_close(channel: MessageChannel, outbox: _Outbox, writer: asyncio.Task[None] | None) -> None:
    if writer is not None:
        outbox.close()
        try:
            await wait_for(writer, 5.0)
        except (TimeoutError, asyncio.CancelledError):
            writer.cancel()
    await channel.close()
