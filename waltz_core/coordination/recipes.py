"""Recipes on top of any :class:`~.base.CoordinationBackend`: identical for local, zookeeper and etcd.

* cluster admin: :func:`create_cluster`, :func:`delete_cluster`, :func:`list_cluster`;
* store metadata (:class:`StoreMetadata`): store params, partition metadata (CAS only),
  replica assignments, storage groups and admin ports, with the original's admin edits;
* membership and partition assignment: :class:`ClusterManager` (servers) and
  :class:`AssignmentWatcher` (clients);
* id allocation: :func:`allocate_client_id`, :func:`allocate_server_id`.

Values are UTF-8 JSON (:mod:`.metadata`); the policy is the pure :func:`.assignment.compute_assignment`.
Everything here runs on the event loop of the backend; callbacks are called on that loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

import attrs

from ..errors import (
    CasConflictError,
    ClusterNotFoundError,
    ConfigError,
    CoordinationError,
    MetadataEditError,
    NodeExistsError,
    NoNodeError,
)
from ..retry import RetryPolicy
from ..timeouts import cancel_and_wait
from .assignment import compute_assignment
from .base import CoordinationBackend, SessionState, WatchHandle
from .metadata import (
    UNRESOLVED,
    ClusterParams,
    PartitionAssignment,
    PartitionInfo,
    PartitionMetadata,
    ReplicaState,
    ServerDescriptor,
    StoreParams,
    admin_address,
    decode,
    encode,
    format_partition_ranges,
    parse_admin_map,
    parse_partition_ranges,
    parse_replica_assignments,
    parse_str_int_map,
)

log = logging.getLogger("waltz.coordination.recipes")

T = TypeVar("T")

#: ``get_partition_metadata`` returns this version when the key is absent; CAS with it creates the key.
ABSENT_VERSION = -1
#: How long an admin edit waits for another process's admin lock.
ADMIN_LOCK_TIMEOUT = 30.0
#: Polling another process's admin lock: every 50 ms, jittered so that two waiting admins alternate.
_ADMIN_LOCK_POLL = RetryPolicy(initial=0.05, maximum=0.05)
#: The cluster manager after a coordination failure: 50 ms doubling to 2 s, from 50 ms again after a success.
_MANAGER_BACKOFF = RetryPolicy(initial=0.05, maximum=2.0)
#: A client's assignment watcher after a failed read: 200 ms (jittered: clients that lost the
#: coordination service together do not come back in lock step).
_WATCHER_BACKOFF = RetryPolicy(initial=0.2, maximum=0.2)


@attrs.frozen(slots=True)
class Paths:
    """Every key of one cluster (the original's znode layout)."""

    root: str

    def __attrs_post_init__(self) -> None:
        if not self.root.startswith("/") or self.root.endswith("/") or "//" in self.root:
            raise ConfigError(f"coordination.root must be an absolute path like /waltz, got {self.root!r}")

    @property
    def server_descriptors(self) -> str:
        return f"{self.root}/serverDescriptors"

    @property
    def server_prefix(self) -> str:
        return f"{self.root}/serverDescriptors/s_"

    @property
    def client_ids(self) -> str:
        return f"{self.root}/ids/client"

    @property
    def server_ids(self) -> str:
        return f"{self.root}/ids/server"

    @property
    def store(self) -> str:
        return f"{self.root}/store"

    def partition(self, partition_id: int) -> str:
        return f"{self.root}/store/partition/{partition_id}"

    @property
    def assignment(self) -> str:
        return f"{self.root}/store/assignment"

    @property
    def group(self) -> str:
        return f"{self.root}/store/group"

    @property
    def connection(self) -> str:
        return f"{self.root}/store/connection"

    @property
    def admin_lock(self) -> str:
        return f"{self.root}/store/adminLock"


def _missing(backend: CoordinationBackend, root: str, what: str = "") -> ClusterNotFoundError:
    detail = f" ({what} is missing)" if what else ""
    return ClusterNotFoundError(f"no Waltz cluster under {root} in the {backend.name} coordination backend{detail}")


async def get_cluster_params(backend: CoordinationBackend, root: str) -> ClusterParams:
    """``<root>``'s ClusterParams; ClusterNotFoundError when there is no cluster."""
    Paths(root)  # a clear ConfigError for a malformed root
    got = await backend.get(root)
    if got is None or not got.value:
        raise _missing(backend, root)
    try:
        return decode(root, got.value, ClusterParams.from_json)
    except CoordinationError:
        raise ClusterNotFoundError(f"{root} exists in the {backend.name} coordination backend but holds no Waltz cluster") from None


# ------------------------------------------------------------------------------ cluster admin


async def create_cluster(backend: CoordinationBackend, root: str, name: str, num_partitions: int) -> StoreParams:
    """Create a cluster under ``root`` with a fresh random cluster key; NodeExistsError if ``root`` exists.

    Writes ClusterParams, an empty partition assignment, StoreParams, one EMPTY partition
    metadata per partition and empty replica assignments, groups and connections.
    """
    paths = Paths(root)
    if not name:
        raise MetadataEditError("the cluster name must not be empty")
    if num_partitions < 1:
        raise MetadataEditError(f"a cluster needs at least one partition, got {num_partitions}")
    try:
        await backend.create(root, encode(ClusterParams(name, num_partitions).to_json()))
    except NodeExistsError:
        raise NodeExistsError(f"{root} already exists in the {backend.name} coordination backend; "
                              f"delete the cluster first or choose another root") from None
    params = StoreParams(uuid.uuid4(), num_partitions)
    await backend.create(paths.server_descriptors, encode(PartitionAssignment(num_partitions).to_json()))
    await backend.create(paths.store, encode(params.to_json()))
    for pid in range(num_partitions):
        await backend.create(paths.partition(pid), encode(PartitionMetadata.EMPTY.to_json()))
    for key in (paths.assignment, paths.group, paths.connection):
        await backend.create(key, encode({}))
    return params


async def delete_cluster(backend: CoordinationBackend, root: str, name: str | None = None, *, force: bool = False) -> None:
    """Delete everything under ``root``. ``name`` must match the cluster's name unless ``force``.

    ClusterNotFoundError when there is no cluster (unless ``force``, which deletes whatever is there).
    """
    Paths(root)
    try:
        params = await get_cluster_params(backend, root)
    except ClusterNotFoundError:
        if not force:
            raise
    else:
        if not force and name != params.name:
            raise MetadataEditError(f"the cluster under {root} is named {params.name!r}, not {name!r}; "
                                    f"give its name or force")
    await backend.delete(root, recursive=True)


@attrs.frozen(slots=True)
class ClusterListing:
    """Everything ``waltz cluster list`` shows."""

    root: str
    cluster: ClusterParams
    store: StoreParams | None
    servers: list[ServerDescriptor]
    assignment: PartitionAssignment | None
    replica_assignments: dict[str, list[int]]
    groups: dict[str, int]
    connections: dict[str, int | str]
    partitions: dict[int, PartitionMetadata]


async def list_servers(backend: CoordinationBackend, root: str) -> list[ServerDescriptor]:
    """The registered (live) servers, by server id."""
    paths = Paths(root)
    out = []
    for child in await backend.children(paths.server_descriptors):
        if not child.startswith("s_"):
            continue
        key = f"{paths.server_descriptors}/{child}"
        got = await backend.get(key)
        if got is not None:  # it may vanish between listing and reading
            out.append(decode(key, got.value, ServerDescriptor.from_json))
    return sorted(out, key=lambda d: d.server_id)


async def read_assignment(backend: CoordinationBackend, root: str) -> tuple[PartitionAssignment, int]:
    """The partition assignment and its version; ClusterNotFoundError when absent."""
    key = Paths(root).server_descriptors
    got = await backend.get(key)
    if got is None:
        raise _missing(backend, root, key)
    return decode(key, got.value, PartitionAssignment.from_json), got.version


async def list_cluster(backend: CoordinationBackend, root: str) -> ClusterListing:
    """Read every piece of the cluster's metadata (ClusterNotFoundError when there is none)."""
    cluster = await get_cluster_params(backend, root)
    store = StoreMetadata(backend, root)
    try:
        params: StoreParams | None = await store.get_store_params()
    except ClusterNotFoundError:
        params = None
    try:
        assignment: PartitionAssignment | None = (await read_assignment(backend, root))[0]
    except ClusterNotFoundError:
        assignment = None
    partitions = {}
    for pid in range(params.num_partitions if params else cluster.num_partitions):
        partitions[pid] = (await store.get_partition_metadata(pid))[0]
    return ClusterListing(
        root=root, cluster=cluster, store=params, servers=await list_servers(backend, root), assignment=assignment,
        replica_assignments=await store.get_replica_assignments(missing_ok=True),
        groups=await store.get_groups(missing_ok=True),
        connections=await store.get_connections(missing_ok=True),
        partitions=partitions,
    )


async def allocate_client_id(backend: CoordinationBackend, root: str) -> int:
    """A cluster-wide unique client id (1, 2, ...), from the ``<root>/ids/client`` counter."""
    return await backend.increment(Paths(root).client_ids)


async def allocate_server_id(backend: CoordinationBackend, root: str) -> int:
    """A cluster-wide unique server id (1, 2, ...), from the ``<root>/ids/server`` counter."""
    return await backend.increment(Paths(root).server_ids)


# ----------------------------------------------------------------------------- store metadata


def _check_address(what: str, address: str) -> None:
    """Addresses are the transport's (``host:port``, ``unix:/path``): only what no transport can
    mean is refused here (empty, spaces, characters that would garble a listing)."""
    if not address or any(c.isspace() or not c.isprintable() for c in address):
        raise MetadataEditError(f"{what} must be an address such as host:port, got {address!r}")


def _is_host_port(address: str) -> bool:
    host, sep, port = address.rpartition(":")
    return bool(sep and host) and port.isdigit()


class StoreMetadata:
    """Store metadata under ``<root>/store``: params, partition metadata, replica assignments, groups, admin ports.

    Reads are plain gets. Partition metadata changes only by compare-and-set. Admin edits
    (storage nodes, replica assignments) hold the ``adminLock`` key (ephemeral, as in the
    original) and still write with compare-and-set.
    """

    def __init__(self, backend: CoordinationBackend, root: str) -> None:
        self.backend = backend
        self.root = root
        self.paths = Paths(root)

    async def get_store_params(self) -> StoreParams:
        """The cluster key and partition count; ClusterNotFoundError when absent."""
        got = await self.backend.get(self.paths.store)
        if got is None or not got.value:
            raise _missing(self.backend, self.root, self.paths.store)
        return decode(self.paths.store, got.value, StoreParams.from_json)

    # partition metadata

    async def get_partition_metadata(self, partition_id: int) -> tuple[PartitionMetadata, int]:
        """The partition's metadata and version; ``(PartitionMetadata.EMPTY, ABSENT_VERSION)`` when absent."""
        key = self.paths.partition(partition_id)
        got = await self.backend.get(key)
        if got is None:
            return PartitionMetadata.EMPTY, ABSENT_VERSION
        return decode(key, got.value, PartitionMetadata.from_json), got.version

    async def cas_partition_metadata(self, partition_id: int, new: PartitionMetadata, expected_version: int) -> int:
        """Write ``new`` only if the metadata is still at ``expected_version``; return the new version.

        CasConflictError when another writer got there first (re-read and decide again).
        ``expected_version == ABSENT_VERSION`` creates the key if it is still absent.
        """
        key = self.paths.partition(partition_id)
        data = encode(new.to_json())
        try:
            if expected_version == ABSENT_VERSION:
                return await self.backend.create(key, data)
            return await self.backend.set(key, data, expected_version=expected_version)
        except (NodeExistsError, NoNodeError) as exc:
            raise CasConflictError(f"{key}: changed concurrently ({exc})") from exc

    # replica assignments, groups, connections

    async def _read_map(self, key: str, parse: Callable[[Any], T], *, missing_ok: bool = False) -> T:
        got = await self.backend.get(key)
        if got is None:
            if missing_ok:
                return parse({})
            raise _missing(self.backend, self.root, key)
        return decode(key, got.value, parse)

    async def get_replica_assignments(self, *, missing_ok: bool = False) -> dict[str, list[int]]:
        """``{"host:port": [partition ids]}`` of every storage node.

        ``missing_ok``: an absent key reads as empty instead of raising ClusterNotFoundError
        (:func:`list_cluster` uses it); the same holds for :meth:`get_groups` and :meth:`get_connections`.
        """
        return await self._read_map(self.paths.assignment, parse_replica_assignments, missing_ok=missing_ok)

    async def get_groups(self, *, missing_ok: bool = False) -> dict[str, int]:
        """``{"host:port": group id}`` of every storage node (``missing_ok``: see :meth:`get_replica_assignments`)."""
        return await self._read_map(self.paths.group, parse_str_int_map, missing_ok=missing_ok)

    async def get_connections(self, *, missing_ok: bool = False) -> dict[str, int | str]:
        """``{storage: admin port or admin address}`` of every storage node, as stored
        (``missing_ok``: see :meth:`get_replica_assignments`)."""
        return await self._read_map(self.paths.connection, parse_admin_map, missing_ok=missing_ok)

    async def get_admin_addresses(self) -> dict[str, str]:
        """``{storage: admin address}`` of every storage node."""
        return {storage: admin_address(storage, admin) for storage, admin in (await self.get_connections()).items()}

    @contextlib.asynccontextmanager
    async def admin_lock(self, timeout: float = ADMIN_LOCK_TIMEOUT) -> AsyncIterator[None]:
        """Hold ``<root>/store/adminLock`` (an ephemeral key: a crashed holder releases it with its session)."""
        await self.get_store_params()
        try:
            # NodeExistsError is final by its flag (create-if-absent found a value); here it means
            # "held", which is worth waiting for. Other failures propagate at once, as before.
            await attrs.evolve(_ADMIN_LOCK_POLL, deadline=timeout).call(
                lambda: self.backend.create(self.paths.admin_lock, b"", ephemeral=True),
                retry_if=lambda exc: isinstance(exc, NodeExistsError))
        except NodeExistsError:
            raise CoordinationError(f"{self.paths.admin_lock} is held by another process "
                                    f"for more than {timeout}s") from None
        try:
            yield
        finally:
            await self.backend.delete(self.paths.admin_lock)

    async def _edit(self, key: str, parse: Callable[[Any], dict[str, T]],
                    change: Callable[[dict[str, T]], dict[str, T]]) -> None:
        while True:
            got = await self.backend.get(key)
            if got is None:
                raise _missing(self.backend, self.root, key)
            new = change(decode(key, got.value, parse))
            try:
                await self.backend.set(key, encode(new), expected_version=got.version)
                return
            except CasConflictError:
                continue  # someone edited without the lock (or a stale lock): re-read and redo

    async def _partition_ids(self, partitions: Iterable[int]) -> list[int]:
        params = await self.get_store_params()
        ids = sorted(set(partitions))
        bad = [p for p in ids if not 0 <= p < params.num_partitions]
        if bad:
            raise MetadataEditError(f"partitions {format_partition_ranges(bad)} do not exist "
                                    f"(the cluster has partitions 0-{params.num_partitions - 1})")
        if not ids:
            raise MetadataEditError("no partitions given")
        return ids

    async def add_storage_node(self, storage: str, admin: int | str, group: int) -> None:
        """Add a storage node (its data address) to ``group``, with no partitions yet. ``admin`` is
        its admin port on the same host (``host:port`` addresses, the original's format) or its
        whole admin address (any transport's).

        NodeExistsError if the node is already known.
        """
        _check_address("a storage node", storage)
        if isinstance(admin, int):
            if not _is_host_port(storage):
                raise MetadataEditError(f"storage node {storage!r} is not host:port: give its admin address, "
                                        f"not a port")
            if not 0 < admin < 65536:
                raise MetadataEditError(f"invalid admin port {admin}")
        else:
            _check_address("an admin endpoint", admin)
            if _is_host_port(storage) and _is_host_port(admin) and \
                    admin.rpartition(":")[0] == storage.rpartition(":")[0]:
                admin = int(admin.rpartition(":")[2])  # the original's format where it can say it
        entry = admin
        async with self.admin_lock():
            if storage in await self.get_groups() or storage in await self.get_replica_assignments():
                raise NodeExistsError(f"storage node {storage} is already part of the cluster under {self.root}")
            def with_group(m: dict[str, int]) -> dict[str, int]:
                return {**m, storage: group}

            def with_admin(m: dict[str, int | str]) -> dict[str, int | str]:
                return {**m, storage: entry}

            def with_no_partitions(m: dict[str, list[int]]) -> dict[str, list[int]]:
                return {**m, storage: []}

            await self._edit(self.paths.group, parse_str_int_map, with_group)
            await self._edit(self.paths.connection, parse_admin_map, with_admin)
            await self._edit(self.paths.assignment, parse_replica_assignments, with_no_partitions)

    async def remove_storage_node(self, storage: str) -> None:
        """Remove a storage node; refused (MetadataEditError) while it still has partitions assigned."""
        async with self.admin_lock():
            assignments = await self.get_replica_assignments()
            if storage not in assignments and storage not in await self.get_groups():
                raise NoNodeError(f"storage node {storage} is not part of the cluster under {self.root}")
            if assignments.get(storage):
                raise MetadataEditError(f"storage node {storage} still has partitions "
                                        f"{format_partition_ranges(assignments[storage])} assigned; unassign them first")

            def without(m: dict[str, T]) -> dict[str, T]:
                return {k: v for k, v in m.items() if k != storage}

            await self._edit(self.paths.assignment, parse_replica_assignments, without)
            await self._edit(self.paths.group, parse_str_int_map, without)
            await self._edit(self.paths.connection, parse_admin_map, without)

    async def assign_partitions(self, storage: str, partitions: Iterable[int]) -> None:
        """Add replicas of ``partitions`` on ``storage``; refused for unknown nodes or partitions already there."""
        ids = await self._partition_ids(partitions)
        async with self.admin_lock():
            current = await self.get_replica_assignments()
            if storage not in current:
                raise NoNodeError(f"storage node {storage} is not part of the cluster under {self.root}; add it first")
            already = sorted(set(ids) & set(current[storage]))
            if already:
                raise MetadataEditError(f"partitions {format_partition_ranges(already)} are already assigned to {storage}")
            def with_added(m: dict[str, list[int]]) -> dict[str, list[int]]:
                return {**m, storage: sorted(set(m.get(storage, [])) | set(ids))}

            await self._edit(self.paths.assignment, parse_replica_assignments, with_added)

    async def unassign_partitions(self, storage: str, partitions: Iterable[int], *, keep_majority: bool = False,
                                  lost: bool = False) -> None:
        """Remove replicas of ``partitions`` from ``storage``; refused for partitions not assigned there.

        ``keep_majority`` (what ``waltz cluster unassign-partition`` asks unless ``--force``): also
        refused for a partition that would keep fewer than a majority of its replicas, none
        included. A partition's committed records are on a majority of its replicas, not
        necessarily on the ones that stay. The next recovery votes among the previous session's
        replicas (``replica_set`` of the partition metadata), counting one taken out as offline, so
        removing more would leave the partition waiting for them for ever. That is checked too:
        a replica assigned since (a move half done) does not vote until a session that has it
        finished its recovery, so two moves in a row can leave a majority of replicas but too few
        voters.

        ``lost`` (``--force``: the replicas are gone for good) also takes them out of the
        partition's ``replica_set``, so the next recovery settles for what the others hold,
        whatever only the removed ones held.
        """
        ids = await self._partition_ids(partitions)
        async with self.admin_lock():
            current = await self.get_replica_assignments()
            if storage not in current:
                raise NoNodeError(f"storage node {storage} is not part of the cluster under {self.root}")
            missing = sorted(set(ids) - set(current[storage]))
            if missing:
                raise MetadataEditError(f"partitions {format_partition_ranges(missing)} are not assigned to {storage}")
            if keep_majority:
                counts = {pid: sum(pid in pids for pids in current.values()) for pid in ids}
                short = sorted(pid for pid, n in counts.items() if n - 1 < n // 2 + 1)
                if short:
                    n = counts[short[0]]
                    which = (f"partition {short[0]} would keep {n - 1} of its {n} replicas, fewer than a majority: "
                             f"its" if len(short) == 1 else
                             f"partitions {format_partition_ranges(short)} would keep fewer than a majority of their "
                             f"replicas (partition {short[0]}: {n - 1} of {n}): their")
                    raise MetadataEditError(
                        f"{which} committed records may be only on the replicas that go. Move one replica at a time: "
                        f"assign the new one and let it catch up first (docs/operations.md, 'Move a replica to "
                        f"another storage node'), or --force")
                for pid in ids:
                    await self._check_voters_stay(pid, storage, current)
            def with_removed(m: dict[str, list[int]]) -> dict[str, list[int]]:
                return {**m, storage: sorted(set(m.get(storage, [])) - set(ids))}

            await self._edit(self.paths.assignment, parse_replica_assignments, with_removed)
            if lost:
                for pid in ids:
                    await self._forget_voter(pid, storage)

    async def _check_voters_stay(self, partition_id: int, storage: str, assignment: Mapping[str, Sequence[int]]) -> None:
        """Refuse to take ``storage`` out of a partition if fewer than a majority of the voters of
        its next recovery (its ``replica_set``) would stay assigned: that recovery would wait for
        the others for ever."""
        meta, _ = await self.get_partition_metadata(partition_id)
        voters = meta.replica_set
        if not voters or storage not in voters:
            return  # no set recorded yet (the count above is the check), or not a voter: it decides nothing
        staying = [ep for ep in voters if ep != storage and partition_id in assignment.get(ep, ())]
        need = len(voters) // 2 + 1
        if len(staying) < need:
            gone = [ep for ep in voters if ep not in staying]
            raise MetadataEditError(
                f"partition {partition_id}: its next recovery votes among the replicas of its last recovered "
                f"session ({', '.join(voters)}) and needs {need} of them; only {len(staying)} would stay assigned "
                f"({', '.join(staying) or 'none'}), so it would wait until one of {', '.join(gone)} is assigned "
                f"again. A replica assigned since votes once a session that has it finished its recovery: wait "
                f"until `waltz cluster verify` passes 'recovery' for the partition, then unassign; or --force "
                f"if the replicas that go are lost for good")

    async def _forget_voter(self, partition_id: int, storage: str) -> None:
        """Take ``storage`` out of the partition's ``replica_set`` (retried on a concurrent write)."""
        while True:
            meta, version = await self.get_partition_metadata(partition_id)
            if meta.replica_set is None or storage not in meta.replica_set:
                return
            rest = [ep for ep in meta.replica_set if ep != storage]
            try:
                await self.cas_partition_metadata(partition_id, attrs.evolve(meta, replica_set=rest or None), version)
                return
            except CasConflictError:
                continue

    async def auto_assign(self, group: int) -> dict[str, list[int]]:
        """Round-robin every partition over the nodes of ``group`` (sorted by ``host:port``); return the result.

        Refused if the group has no nodes or any of them already has partitions.
        """
        params = await self.get_store_params()
        async with self.admin_lock():
            groups = await self.get_groups()
            nodes = sorted(s for s, g in groups.items() if g == group)
            if not nodes:
                raise MetadataEditError(f"group {group} has no storage nodes under {self.root}")
            current = await self.get_replica_assignments()
            busy = [s for s in nodes if current.get(s)]
            if busy:
                raise MetadataEditError(f"storage nodes {', '.join(busy)} of group {group} already have partitions")
            planned: dict[str, list[int]] = {s: [] for s in nodes}
            for pid in range(params.num_partitions):
                planned[nodes[pid % len(nodes)]].append(pid)

            def with_planned(m: dict[str, list[int]]) -> dict[str, list[int]]:
                return {**m, **planned}

            await self._edit(self.paths.assignment, parse_replica_assignments, with_planned)
            return planned


# ------------------------------------------------------------------ membership and assignment


def _generations(partitions: Mapping[int, int]) -> dict[int, int]:
    return dict(partitions)


@attrs.frozen(slots=True)
class ServerAssignment:
    """What one server is told: its partitions with their generations (empty: serve nothing)."""

    server_id: int
    endpoint: str
    partitions: Mapping[int, int] = attrs.field(factory=dict, converter=_generations)  #: partition id -> generation
    num_partitions: int = 0


async def _call(callback: Callable[[T], Any], value: T) -> None:
    try:
        result = callback(value)
        if inspect.isawaitable(result):
            await result
    except Exception:  # the recipe keeps running when an application callback fails
        log.exception("callback %r failed", callback)


class ClusterManager:
    """A server's membership and the cluster manager (coordinator) role.

    ``start()`` allocates a server id (``<root>/ids/server``), registers the descriptor as an
    ephemeral sequential key ``<root>/serverDescriptors/s_<seq>`` and watches membership. The live
    server with the smallest id is the coordinator: on every membership change it computes the
    assignment with :func:`~.assignment.compute_assignment` and writes it with compare-and-set.
    Every server then gets ``on_assignment(ServerAssignment)`` (sync or async, called on the event
    loop) whenever its own partitions or generations change.

    On session loss the server is told at once to serve nothing (an empty assignment), then it
    registers again with a new server id; its partitions come back with bumped generations.
    """

    def __init__(self, backend: CoordinationBackend, root: str, descriptor: ServerDescriptor, *,
                 on_assignment: Callable[[ServerAssignment], Awaitable[None] | None] | None = None) -> None:
        self.backend = backend
        self.root = root
        self.paths = Paths(root)
        self.descriptor = descriptor
        self._on_assignment = on_assignment
        self._registered_key: str | None = None
        self._watch: WatchHandle | None = None
        self._task: asyncio.Task[None] | None = None
        self._dirty = asyncio.Event()
        self._lost = False
        self._closed = False
        self._coordinator = False
        self._last_delivered: ServerAssignment | None = None
        self.num_partitions = 0
        self.assignment: PartitionAssignment | None = None  #: the last assignment read

    @property
    def server_id(self) -> int:
        """This server's id (``-1`` before registration); it changes after a session loss."""
        return self.descriptor.server_id

    @property
    def is_coordinator(self) -> bool:
        """True while this server is the live server with the smallest id (as of the last membership read)."""
        return self._coordinator

    async def start(self) -> None:
        """Register and start managing; ClusterNotFoundError if there is no cluster under ``root``."""
        self.num_partitions = (await get_cluster_params(self.backend, self.root)).num_partitions
        self.backend.add_session_listener(self._session_changed)
        await self._register()
        self._watch = self.backend.watch(self.paths.server_descriptors, self._dirty.set)
        await self._reconcile()
        self._task = asyncio.create_task(self._run(), name=f"waltz-cluster-manager-{self.server_id}")

    async def close(self) -> None:
        """Deregister (delete the descriptor) and stop; idempotent. Does not close the backend."""
        if self._closed:
            return
        self._closed = True
        if self._watch is not None:
            self._watch.cancel()
        if self._task is not None:
            await cancel_and_wait(self._task)
        if self._registered_key is not None:
            try:
                await self.backend.delete(self._registered_key)
            except CoordinationError as exc:  # its session ending removes it anyway
                log.warning("could not delete %s: %s", self._registered_key, exc)
            self._registered_key = None

    def _session_changed(self, state: SessionState) -> None:
        if state is SessionState.LOST:
            self._lost = True
        self._dirty.set()

    async def _register(self) -> None:
        server_id = await allocate_server_id(self.backend, self.root)
        descriptor = attrs.evolve(self.descriptor, server_id=server_id)
        self._registered_key = await self.backend.create_sequential(
            self.paths.server_prefix, encode(descriptor.to_json()), ephemeral=True)
        self.descriptor = descriptor
        log.info("server %s registered as %s (id %d)", descriptor.endpoint, self._registered_key, server_id)

    async def set_preferred_partitions(self, partitions: Iterable[int]) -> None:
        """Change this server's preferred partitions (``waltz server add-preferred-partition``).

        The descriptor is registered again under a new sequential key (same server id) before the
        old key is deleted, so every watcher of the membership sees the change and the
        coordinator recomputes the assignment.
        """
        self.descriptor = attrs.evolve(self.descriptor, preferred_partitions=tuple(sorted(set(partitions))))
        old = self._registered_key
        if old is None:
            self._dirty.set()
            return
        self._registered_key = await self.backend.create_sequential(
            self.paths.server_prefix, encode(self.descriptor.to_json()), ephemeral=True)
        await self.backend.delete(old)
        self._dirty.set()

    async def _run(self) -> None:
        delays = _MANAGER_BACKOFF.delays()
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            try:
                if self._lost:
                    self._lost = False
                    self._registered_key = None
                    await self._deliver(ServerAssignment(self.server_id, self.descriptor.endpoint, {}, self.num_partitions))
                if self._registered_key is None:
                    if self.backend.session_state is not SessionState.CONNECTED:
                        continue  # the CONNECTED event sets _dirty again
                    await self._register()
                await self._reconcile()
                delays = _MANAGER_BACKOFF.delays()  # a success starts the backoff over
            except CoordinationError as exc:
                # Every coordination failure, retriable flag or not (a NoNodeError while a key is
                # being recreated, say): the manager must keep reconciling for as long as it runs.
                delay = next(delays)
                log.warning("cluster manager of %s: %s; retrying in %.2fs", self.descriptor.endpoint, exc, delay)
                await asyncio.sleep(delay)
                self._dirty.set()

    async def _reconcile(self) -> None:
        servers = await list_servers(self.backend, self.root)
        current, version = await read_assignment(self.backend, self.root)
        live_ids = [s.server_id for s in servers]
        self._coordinator = bool(live_ids) and min(live_ids) == self.server_id
        if self._coordinator:
            wanted = compute_assignment(self.num_partitions, servers, current)
            if wanted != current:
                try:
                    await self.backend.set(self.paths.server_descriptors, encode(wanted.to_json()), expected_version=version)
                except CasConflictError:
                    self._dirty.set()  # someone else wrote in between: recompute from the new value
                    return
                log.info("coordinator %d wrote a new assignment for %d servers", self.server_id, len(servers))
                current = wanted
        self.assignment = current
        if self._registered_key is not None and not self._lost:
            await self._deliver(ServerAssignment(self.server_id, self.descriptor.endpoint,
                                                 current.for_server(self.server_id), self.num_partitions))

    async def _deliver(self, assignment: ServerAssignment) -> None:
        if assignment == self._last_delivered:
            return
        self._last_delivered = assignment
        if self._on_assignment is not None:
            await _call(self._on_assignment, assignment)


class PartitionOwner(NamedTuple):
    """Where a client sends a partition's requests, and the generation it stamps on them."""

    endpoint: str
    generation: int
    server_id: int


class _Watcher:
    """Read a key once, then again after every change of ``watched`` (level-triggered: changes
    that come together are read once), retrying a failed read after a short back-off for as long
    as the watcher runs. Subclasses read in :meth:`_refresh`."""

    name = "watcher"

    def __init__(self, backend: CoordinationBackend, root: str) -> None:
        self.backend = backend
        self.root = root
        self.paths = Paths(root)
        self._dirty = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._watch: WatchHandle | None = None

    async def _watch_and_read(self, watched: str) -> None:
        self._watch = self.backend.watch(watched, self._dirty.set)
        await self._refresh()
        self._task = asyncio.create_task(self._run(), name=f"waltz-{self.name.replace(' ', '-')}")

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    async def _run(self) -> None:
        delays = _WATCHER_BACKOFF.delays()
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            try:
                await self._refresh()
                delays = _WATCHER_BACKOFF.delays()
            except CoordinationError as exc:  # any of them: the watcher lives as long as its process
                log.warning("%s: %s; retrying", self.name, exc)
                await asyncio.sleep(next(delays))
                self._dirty.set()

    async def _refresh(self) -> None:
        raise NotImplementedError


class AssignmentWatcher(_Watcher):
    """A client's view of the assignment: ``{partition id: PartitionOwner(endpoint, generation, server_id)}``.

    Only owned partitions appear. ``callback(mapping)`` (sync or async) is called on the event loop
    after :meth:`start` and whenever the mapping changes.
    """

    name = "assignment watcher"

    def __init__(self, backend: CoordinationBackend, root: str,
                 callback: Callable[[dict[int, PartitionOwner]], Awaitable[None] | None] | None = None) -> None:
        super().__init__(backend, root)
        self._callback = callback
        self.num_partitions = 0
        self.current: dict[int, PartitionOwner] = {}
        self._delivered: dict[int, PartitionOwner] | None = None

    async def start(self) -> None:
        """Read the assignment once (ClusterNotFoundError without a cluster) and keep watching it."""
        self.num_partitions = (await get_cluster_params(self.backend, self.root)).num_partitions
        await self._watch_and_read(self.paths.server_descriptors)

    async def _refresh(self) -> None:
        assignment, _ = await read_assignment(self.backend, self.root)
        owners = {p.partition_id: PartitionOwner(p.endpoint, p.generation, p.server_id)
                  for p in assignment.partitions if p.server_id is not None and p.endpoint is not None}
        self.current = owners
        if owners != self._delivered:
            self._delivered = owners
            if self._callback is not None:
                await _call(self._callback, dict(owners))


class ReplicaAssignmentWatcher(_Watcher):
    """A server's view of the replica assignment (``<root>/store/assignment``, edited by ``waltz
    cluster assign-partition`` / ``unassign-partition``): ``callback({partition id: sorted
    storage endpoints})`` after :meth:`start` and whenever it changes, so that the partitions it
    owns start sessions on their new replicas (the original's ``onReplicaAssignmentsUpdate``)."""

    name = "replica assignment watcher"

    def __init__(self, backend: CoordinationBackend, root: str,
                 callback: Callable[[dict[int, list[str]]], Awaitable[None] | None]) -> None:
        super().__init__(backend, root)
        self._callback = callback
        self._delivered: dict[int, list[str]] | None = None

    async def start(self) -> None:
        await self._watch_and_read(self.paths.assignment)

    async def _refresh(self) -> None:
        by_partition: dict[int, list[str]] = {}
        for endpoint, pids in sorted((await StoreMetadata(self.backend, self.root).get_replica_assignments()).items()):
            for pid in pids:
                by_partition.setdefault(pid, []).append(endpoint)
        if by_partition != self._delivered:
            self._delivered = by_partition
            await _call(self._callback, by_partition)


__all__ = [
    "ABSENT_VERSION", "UNRESOLVED", "AssignmentWatcher", "ClusterListing", "ClusterManager", "ClusterParams",
    "PartitionAssignment", "PartitionInfo", "PartitionMetadata", "PartitionOwner", "Paths",
    "ReplicaAssignmentWatcher", "ReplicaState",
    "ServerAssignment", "ServerDescriptor", "StoreMetadata", "StoreParams", "allocate_client_id",
    "allocate_server_id", "compute_assignment", "create_cluster", "delete_cluster", "format_partition_ranges",
    "get_cluster_params", "list_cluster", "list_servers", "parse_partition_ranges", "read_assignment",
]
