"""In-memory stand-ins for storage nodes and partition metadata, for testing the store layer.

:class:`FakeReplica` follows the storage node's request semantics (session fencing, in-order
appends, truncate, low-water marks) without files or sockets, and can be taken down, brought
back and slowed down. :class:`MemoryMetadata` keeps partition metadata with the same CAS rules
as the coordination recipes. Both are for tests of :mod:`waltz_core.server`; the real storage
node has its own tests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence

import attrs

from ..coordination.metadata import PartitionMetadata, ReplicaState, states_kept
from ..errors import (
    CasConflictError,
    ConnectionClosedError,
    GenerationMismatchError,
    OutOfOrderAppendError,
    PartitionNotFoundError,
    StaleSessionError,
    StorageError,
    WaltzError,
)
from ..protocol.wire import Record, RecordHeader, SessionInfo
from ..server.store import SessionStart


@attrs.define
class _FakePartition:
    records: list[Record] = attrs.Factory(list)
    max_session_seen: int = -1
    info: SessionInfo = SessionInfo(-1, -1, -1)

    @property
    def max_id(self) -> int:
        return self.records[-1].transaction_id if self.records else -1


class FakeReplica:
    """One storage node holding any number of partitions in memory."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.partitions: dict[int, _FakePartition] = {}
        self.down = False
        #: when set, appends are refused with a StorageError of this text (the node answers: a full disk)
        self.refuse_appends: str | None = None
        self.refusals = 0
        #: partitions assigned to it in the metadata but not on the node (sync-partitions not run):
        #: every request for them is refused, as the storage node does
        self.not_holding: set[int] = set()
        self.delay = 0.0
        self.appends = 0
        self.reads = 0  #: record_list calls answered

    def _p(self, session_id: int, partition_id: int) -> _FakePartition:
        if self.down:
            raise ConnectionClosedError(f"storage {self.endpoint} is down")
        if partition_id in self.not_holding:
            self.refusals += 1
            raise PartitionNotFoundError(f"partition {partition_id} is not assigned to this storage node")
        p = self.partitions.setdefault(partition_id, _FakePartition())
        if session_id < p.max_session_seen:
            raise StaleSessionError(f"session {session_id} is older than {p.max_session_seen}")
        p.max_session_seen = session_id
        return p

    async def _io(self) -> None:
        await asyncio.sleep(self.delay)
        if self.down:
            raise ConnectionClosedError(f"storage {self.endpoint} is down")

    async def last_session_info(self, session_id: int, partition_id: int) -> SessionInfo:
        await self._io()
        return self._p(session_id, partition_id).info

    async def max_transaction_id(self, session_id: int, partition_id: int) -> int:
        await self._io()
        return self._p(session_id, partition_id).max_id

    async def truncate(self, session_id: int, partition_id: int, transaction_id: int) -> None:
        await self._io()
        p = self._p(session_id, partition_id)
        p.records = [r for r in p.records if r.transaction_id <= transaction_id]

    async def set_low_water_mark(self, session_id: int, partition_id: int, low_water_mark: int) -> None:
        await self._io()
        p = self._p(session_id, partition_id)
        p.info = SessionInfo(session_id, low_water_mark, p.max_id)

    async def append(self, session_id: int, partition_id: int, records: Sequence[Record]) -> None:
        await self._io()
        p = self._p(session_id, partition_id)
        if self.refuse_appends is not None:
            self.refusals += 1
            raise StorageError(self.refuse_appends)
        if records and records[0].transaction_id != p.max_id + 1:
            raise OutOfOrderAppendError(f"append of {records[0].transaction_id} after {p.max_id}")
        p.records.extend(records)
        self.appends += 1

    async def record_header_list(self, session_id: int, partition_id: int, first: int, max_records: int) -> list[RecordHeader]:
        recs = await self.record_list(session_id, partition_id, first, max_records)
        return [RecordHeader(r.transaction_id, r.req_id, r.header) for r in recs]

    async def record_list(self, session_id: int, partition_id: int, first: int, max_records: int) -> list[Record]:
        await self._io()
        p = self._p(session_id, partition_id)
        self.reads += 1
        return [r for r in p.records if first <= r.transaction_id < first + max_records]

    def log(self, partition_id: int) -> list[Record]:
        p = self.partitions.get(partition_id)
        return list(p.records) if p else []


class StreamingFakeReplica(FakeReplica):
    """A :class:`FakeReplica` that also has the storage client's ``append_nowait``, so the store
    streams to it (callbacks) instead of driving it from a task per replica session."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(endpoint)
        self._tasks: set[asyncio.Task[None]] = set()
        self.nowait_appends = 0

    def append_nowait(self, session_id: int, partition_id: int, records: Sequence[Record],
                      done: Callable[[WaltzError | None], None]) -> None:
        if self.down:  # as the client of a failed connection: raise, do not call back
            raise ConnectionClosedError(f"storage {self.endpoint} is down")
        self.nowait_appends += 1

        async def append() -> None:
            try:
                await self.append(session_id, partition_id, records)
            except WaltzError as exc:
                done(exc)
            else:
                done(None)

        task = asyncio.get_running_loop().create_task(append())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


@attrs.define
class _Meta:
    generation: int = 0
    session_id: int = -1
    replicas: dict[str, ReplicaState] = attrs.Factory(dict)
    replica_set: list[str] | None = None


class MemoryMetadata:
    """Partition metadata with CAS semantics, implementing the store's ``MetadataAccess``."""

    def __init__(self, assignments: Mapping[int, list[str]]) -> None:
        self.assignments = {pid: list(eps) for pid, eps in assignments.items()}
        self.meta: dict[int, _Meta] = {}

    async def begin_session(self, partition_id: int, generation: int) -> SessionStart:
        m = self.meta.setdefault(partition_id, _Meta())
        if m.generation > generation:
            raise GenerationMismatchError(f"partition {partition_id} is at generation {m.generation}, not {generation}")
        assigned = list(self.assignments.get(partition_id, []))
        m.generation = generation
        m.session_id += 1
        m.replicas = states_kept(PartitionMetadata(m.generation, m.session_id, m.replicas, m.replica_set), assigned)
        previous = list(m.replica_set) if m.replica_set is not None else None
        return SessionStart(m.session_id, dict(m.replicas), assigned, previous)

    async def write_states(self, partition_id: int, generation: int, session_id: int,
                           states: Mapping[str, ReplicaState], replica_set: Sequence[str] | None = None) -> None:
        m = self.meta[partition_id]
        if m.generation > generation:
            raise GenerationMismatchError(f"partition {partition_id} is at generation {m.generation}")
        if m.session_id != session_id:
            raise CasConflictError(f"partition {partition_id} is in session {m.session_id}, not {session_id}")
        m.replicas.update(states)
        if replica_set is not None:
            m.replica_set = sorted(replica_set)


def connector(replicas: Mapping[str, FakeReplica]):  # type: ignore[no-untyped-def]
    """A ReplicaConnector over fake replicas: None while a replica is down."""

    async def connect(endpoint: str) -> FakeReplica | None:
        r = replicas.get(endpoint)
        return None if r is None or r.down else r

    return connect
