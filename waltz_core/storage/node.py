"""The storage node: serves the ten storage requests and the admin port over a layout.

Threading: connection handlers run on the event loop; each partition has one worker task on
the loop and one dedicated thread that does every file operation of that partition, so
partitions progress independently and one partition's requests are handled in arrival order.
A worker takes everything queued for its partition at once: consecutive appends in that batch
are written with one fdatasync (group commit, no fixed wait: the batch is whatever arrived
while the previous fdatasync ran). Each partition queue is bounded (``queue_size``); a
connection whose partition queue is full stops being read (back pressure).

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
import time
import uuid
from array import array
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

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
from ..protocol import ADMIN, STORAGE
from ..protocol import admin as am
from ..protocol import storage as sm
from ..protocol.wire import Record, RecordBatch, SessionInfo
from ..transport.base import Connection
from ..transport.channel import MessageChannel
from .format import FLAG_ASSIGNED, FLAG_AVAILABLE, PartitionInfo
from .layout import PartitionStore, Repair, StorageLayout

log = logging.getLogger("waltz.storage.node")

#: Largest record list served in one response; a larger max_records is served in several calls.
MAX_LIST_RECORDS = 10_000
_ROLE = "waltz-storage"


@attrs.frozen(slots=True)
class _Item:
    """A queued unit of partition work: a storage request, or a callable (admin work)."""

    work: Any
    reply: Callable[[Any], None]


class _AppendGroup:
    """Appends validated for one group commit: their bytes, replies and the records' offsets."""

    __slots__ = ("items", "chunks", "offsets", "count", "nbytes")

    def __init__(self) -> None:
        self.items: list[_Item] = []
        self.chunks: list[bytes | memoryview] = []
        self.offsets = array("q")  #: start of each record, relative to the group's first byte
        self.count = 0
        self.nbytes = 0

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


class PartitionWorker:
    """One partition: its state, its queue and its thread. State is touched only on the thread."""

    def __init__(self, node: StorageNode, partition_id: int) -> None:
        self.node = node
        self.partition_id = partition_id
        self.queue: asyncio.Queue[_Item] = asyncio.Queue(node.queue_size)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"storage-p{partition_id}")
        self._task: asyncio.Task[None] | None = None
        self.info: PartitionInfo | None = None
        self.error: StorageError | None = None  #: why the partition cannot be served (corrupt control data)
        self.store: PartitionStore | None = None
        self.max_session_id = -1
        m = node.metrics
        labels = {"partition": str(partition_id)}
        self._m_requests = {name: m.counter("storage_requests", "Storage requests by type.", {**labels, "type": name})
                            for name in ("open", "last_session_info", "set_low_water_mark", "truncate", "append",
                                         "record_header", "record", "max_transaction_id", "record_header_list",
                                         "record_list")}
        self._m_failures = m.counter("storage_failures", "Requests answered with a failure.", labels)
        self._m_records = m.counter("storage_appended_records", "Records appended.", labels)
        self._m_syncs = m.counter("storage_append_batches", "Append batches (one fdatasync each).", labels)
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
        """Run :meth:`load` on this partition's thread; :meth:`StorageNode.start` gathers these futures."""
        return asyncio.get_running_loop().run_in_executor(self._executor, self.load)

    def _open_store(self) -> None:
        try:
            self.store = self.node.layout.open_partition(self.partition_id)
        except StorageError as exc:
            self.error = exc
            log.error("partition %d cannot be opened: %s", self.partition_id, exc)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"storage-p{self.partition_id}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._close_store)
        self._executor.shutdown(wait=True)

    def _close_store(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None

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

        await self.queue.put(_Item(fn, reply))
        return await fut

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        queue = self.queue
        while True:
            batch = [await queue.get()]
            while not queue.empty():
                batch.append(queue.get_nowait())
            replies = await loop.run_in_executor(self._executor, self._process, batch)
            for reply, response in replies:
                try:
                    reply(response)
                except Exception:  # a reply sink of a closed connection; nothing to deliver to
                    log.debug("dropping a reply", exc_info=True)

    # ------------------------------------------------------------------ worker thread
    def _process(self, batch: list[_Item]) -> list[tuple[Callable[[Any], None], Any]]:
        out: list[tuple[Callable[[Any], None], Any]] = []
        group = _AppendGroup()
        limit = self.node.max_batch_records

        def flush() -> None:
            if not group.items:
                return
            started = time.perf_counter()
            try:
                assert self.store is not None
                self.store.append_validated(group.data(), group.offsets)
            except Exception as exc:  # an I/O failure: fail the batch, reopen to repair the tail
                log.exception("partition %d: append of %d records failed", self.partition_id, group.count)
                err = StorageError(f"partition {self.partition_id}: write failed: {exc}")
                for item in group.items:
                    self._m_failures.inc()
                    out.append((item.reply, failure_for(item.work, err)))
                self._reopen_after_failure()
            else:
                self._m_latency.observe(time.perf_counter() - started)
                self._m_syncs.inc()
                self._m_records.inc(group.count)
                for item in group.items:
                    req = item.work
                    out.append((item.reply, sm.SuccessResponse(req.session_id, req.seq_num, req.partition_id)))
            group.clear()

        for item in batch:
            work = item.work
            if callable(work):
                flush()
                try:
                    out.append((item.reply, work()))
                except Exception as exc:  # noqa: BLE001 - the request's reply
                    out.append((item.reply, exc))
                continue
            try:
                if type(work) is sm.StorageAppendRequest:
                    self._m_requests["append"].inc()
                    self._check(work, work.offline)
                    if group.count and group.count + len(work.records) > limit:
                        flush()
                    self._check_append(work, group)
                    group.add(item, work.records)
                    continue
                flush()
                response = self._handle(work)
            except WaltzError as exc:
                self._m_failures.inc()
                response = failure_for(work, exc)
            except Exception as exc:  # a bug must not take the partition down: answer and log it
                log.exception("partition %d: %s failed", self.partition_id, type(work).__name__)
                self._m_failures.inc()
                response = failure_for(work, StorageError(f"internal error: {exc!r}"))
            out.append((item.reply, response))
        flush()
        return out

    def _reopen_after_failure(self) -> None:
        self._close_store()
        self._open_store()

    def _check(self, req: Any, offline: bool) -> PartitionStore:
        pid = self.partition_id
        if self.error is not None:
            raise type(self.error)(str(self.error))
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
            raise PartitionNotFoundError(f"partition {pid} has no open store on this storage node")
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

    def _handle(self, req: Any) -> Any:
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
                req.transaction_id, self._list_size(req.max_records), self.node.max_frame_size // 2))
        if t is sm.RecordHeaderRequest:
            self._m_requests["record_header"].inc()
            store = self._check(req, False)
            return sm.RecordHeaderResponse(*head, store.read_header(req.transaction_id))
        if t is sm.RecordHeaderListRequest:
            self._m_requests["record_header_list"].inc()
            store = self._check(req, False)
            return sm.RecordHeaderListResponse(*head, tuple(store.read_headers(
                req.transaction_id, self._list_size(req.max_records))))
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

    def _bounded(self, records: list[Record]) -> list[Record]:
        """Trim a record list so its response fits in a frame (the caller asks again for the rest)."""
        budget = self.node.max_frame_size // 2
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
                if self.error is not None:
                    raise self.error
            return
        self._close_store()
        if delete_files:
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

    def export_records(self, transaction_id: int, max_records: int) -> list[Record]:
        """Records for offline recovery: the partition must be assigned; availability does not matter."""
        if self.error is not None:
            raise type(self.error)(str(self.error))
        if self.store is None:
            raise PartitionNotFoundError(f"partition {self.partition_id} is not assigned to this storage node")
        return self._bounded(self.store.read_records(transaction_id, self._list_size(max_records)))

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
                 max_batch_records: int = 100, max_frame_size: int = 16 * 1024 * 1024,
                 metrics: MetricsRegistry | None = None, name: str = "storage") -> None:
        self.layout = layout
        self.cluster_key = cluster_key
        self.num_partitions = num_partitions
        self.queue_size = queue_size
        self.max_batch_records = max_batch_records
        self.max_frame_size = max_frame_size
        self.metrics = metrics or MetricsRegistry()
        self.name = name
        self.workers: list[PartitionWorker] = []
        self.repairs: list[Repair] = []
        #: "starting" until :meth:`start` opened every partition, "serving", then "stopping" from :meth:`close`
        self.state = "starting"
        self._connections: set[asyncio.Task[Any]] = set()
        self._m_connections = self.metrics.gauge("storage_connections", "Open data and admin connections.")
        self.metrics.gauge("storage_num_partitions", "Partitions of the cluster.", fn=lambda: self.num_partitions)

    async def start(self) -> None:
        """Open the layout and every assigned partition (repairing torn tails), start the workers."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.layout.open, self.cluster_key, self.num_partitions)
        self.repairs.extend(self.layout.repairs())
        self.workers = [PartitionWorker(self, pid) for pid in range(self.num_partitions)]
        # Open partitions on their own threads: recovery of many partitions runs in parallel.
        results = await asyncio.gather(*(w.load_on_thread() for w in self.workers))
        for reps in results:
            self.repairs.extend(reps)
        self.repairs.extend(r for r in self.layout.repairs() if r not in self.repairs)
        for w in self.workers:
            w.start()
        self.state = "serving"

    async def close(self) -> None:
        self.state = "stopping"
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        await asyncio.gather(*(w.stop() for w in self.workers), return_exceptions=True)
        self.layout.close()

    def healthy(self) -> tuple[bool, dict[str, Any]]:
        """Ready (``/readyz``): serving, and no partition refused to open; ``reasons`` say why not."""
        broken = {w.partition_id: str(w.error) for w in self.workers if w.error is not None}
        reasons = [] if self.state == "serving" else [f"storage node is {self.state}"]
        reasons += [f"partition {pid} is broken: {error}" for pid, error in broken.items()]
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
        self._m_connections.set(len(self._connections))

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
        outgoing: asyncio.Queue[Any] = asyncio.Queue()
        writer = asyncio.get_running_loop().create_task(_write_loop(channel, outgoing))
        opened = False
        try:
            while True:
                try:
                    msg = await channel.recv()
                except (ConnectionClosedError, asyncio.IncompleteReadError):
                    break
                except ProtocolError as exc:
                    log.warning("closing data connection from %s: %s", conn.peer, exc)
                    outgoing.put_nowait(sm.FailureResponse(-1, -1, -1, wire_code(exc), str(exc)))
                    break
                except TransportError as exc:
                    log.info("data connection from %s failed: %s", conn.peer, exc)
                    break
                if type(msg) is sm.OpenRequest:
                    try:
                        self._check_key(msg.cluster_key, msg.num_partitions)
                    except ClusterKeyMismatchError as exc:
                        log.warning("open from %s refused: %s", conn.peer, exc)
                        outgoing.put_nowait(failure_for(msg, exc))
                        continue
                    opened = True
                    outgoing.put_nowait(sm.SuccessResponse(msg.session_id, msg.seq_num, msg.partition_id))
                    continue
                try:
                    if not hasattr(msg, "offline") and type(msg) not in _READS:
                        raise ProtocolError(f"{type(msg).__name__} is a response; a storage node serves requests")
                    if not opened:
                        raise StorageError("the connection is not open: send an OpenRequest with the cluster key first")
                    worker = self._worker(msg.partition_id)
                except WaltzError as exc:
                    outgoing.put_nowait(failure_for(msg, exc))
                    continue
                await worker.queue.put(_Item(msg, outgoing.put_nowait))  # waits when full: back pressure
        finally:
            await _drain_and_close(channel, outgoing, writer)

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
                    if type(msg) is am.AdminOpenRequest:
                        self._check_key(msg.cluster_key, msg.num_partitions)
                        opened = True
                        response: Any = am.AdminSuccessResponse(msg.seq_num)
                    elif not opened:
                        raise StorageError("the admin connection is not open: send an AdminOpenRequest first")
                    else:
                        response = await self._admin(msg)
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

    async def _admin(self, msg: Any) -> Any:
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
            records = await worker.call(lambda: worker.export_records(msg.transaction_id, msg.max_records))
            return am.AdminRecordListResponse(msg.seq_num, msg.partition_id, tuple(records))
        if t is am.AdminLastSessionInfoRequest:
            worker = self._worker(msg.partition_id)
            return am.AdminLastSessionInfoResponse(msg.seq_num, msg.partition_id, await worker.call(worker.session_info))
        if t is am.MetricsRequest:
            return am.MetricsResponse(msg.seq_num, json.dumps(self.metrics.snapshot(), indent=2, default=str))
        if t is am.AssignedPartitionStatusRequest:
            statuses = tuple((w.partition_id, bool(w.info and w.info.available and w.error is None))
                             for w in self.workers if w.info is not None and w.info.assigned)
            return am.AssignedPartitionStatusResponse(msg.seq_num, statuses)
        raise ProtocolError(f"{t.__name__} is not a request the admin port serves")


_READS = (sm.RecordRequest, sm.RecordHeaderRequest, sm.RecordListRequest, sm.RecordHeaderListRequest)


async def _write_loop(channel: MessageChannel, outgoing: asyncio.Queue[Any]) -> None:
    """Send responses as they come, many per write when several are ready."""
    while True:
        first = await outgoing.get()
        if first is None:
            return
        batch = [first]
        done = False
        while not outgoing.empty():
            nxt = outgoing.get_nowait()
            if nxt is None:
                done = True
                break
            batch.append(nxt)
        try:
            await channel.send_many(batch)
        except TransportError:
            return
        if done:
            return


async def _drain_and_close(channel: MessageChannel, outgoing: asyncio.Queue[Any], writer: asyncio.Task[None]) -> None:
    outgoing.put_nowait(None)
    try:
        await asyncio.wait_for(writer, 5.0)
    except (TimeoutError, asyncio.CancelledError):
        writer.cancel()
    await channel.close()
