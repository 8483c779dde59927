"""Adapters from the store layer's seams to coordination and storage nodes.

* :class:`CoordinationMetadata` implements the store's ``MetadataAccess`` over the coordination
  recipes: new session ids and replica states are written only by compare-and-set, and a
  partition's metadata never goes back to an older generation (a stale owner is refused).
* :class:`StorageConnector` is this server's one view of each storage node it writes to, shared
  by all its partitions: one pipelined :class:`~waltz_core.storage.client.StorageClient` per node,
  failures remembered, unreachable nodes probed in the background.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence

import attrs

from ..coordination.metadata import PartitionMetadata, ReplicaState, states_kept
from ..coordination.recipes import StoreMetadata
from ..errors import CasConflictError, GenerationMismatchError, WaltzError
from ..retry import RetryPolicy
from ..storage.client import DEFAULT_REQUEST_TIMEOUT, StorageClient
from ..timeouts import wait_for
from ..transport.base import Transport
from .store import SessionStart

log = logging.getLogger("waltz.server")


class CoordinationMetadata:
    def __init__(self, store_metadata: StoreMetadata) -> None:
        self.sm = store_metadata

    async def begin_session(self, partition_id: int, generation: int) -> SessionStart:
        while True:
            meta, version = await self.sm.get_partition_metadata(partition_id)
            if meta.generation > generation:
                raise GenerationMismatchError(
                    f"partition {partition_id} is at generation {meta.generation}; this server has {generation}")
            assignments = await self.sm.get_replica_assignments()
            assigned = sorted(ep for ep, pids in assignments.items() if partition_id in pids)
            states = states_kept(meta, assigned)
            new = PartitionMetadata(generation=generation, session_id=meta.session_id + 1, replicas=states,
                                    replica_set=meta.replica_set)
            try:
                await self.sm.cas_partition_metadata(partition_id, new, version)
            except CasConflictError:
                continue  # another writer raced us: read again
            previous = list(meta.replica_set) if meta.replica_set is not None else None
            return SessionStart(new.session_id, states, assigned, previous)

    async def write_states(self, partition_id: int, generation: int, session_id: int,
                           states: Mapping[str, ReplicaState], replica_set: Sequence[str] | None = None) -> None:
        while True:
            meta, version = await self.sm.get_partition_metadata(partition_id)
            if meta.generation > generation:
                raise GenerationMismatchError(f"partition {partition_id} moved on to generation {meta.generation}")
            if meta.session_id != session_id:
                raise CasConflictError(f"partition {partition_id} is in session {meta.session_id}, not {session_id}")
            new = PartitionMetadata(generation=meta.generation, session_id=session_id,
                                    replicas={**meta.replicas, **states},
                                    replica_set=meta.replica_set if replica_set is None else replica_set)
            try:
                await self.sm.cas_partition_metadata(partition_id, new, version)
                return
            except CasConflictError:
                continue


@attrs.define
class _Node:
    """What the server knows of one storage node."""

    endpoint: str
    client: StorageClient | None = None
    attempt: asyncio.Task[StorageClient | None] | None = None  #: the connect attempt running now
    down_since: float | None = None  #: monotonic time it became unreachable; None: reachable or untried
    last_error: str = ""
    reconnect: asyncio.Task[None] | None = None  #: the background loop while it is down


class StorageConnector:
    """``await connector(endpoint)`` -> the node's connected client, or None while it is unreachable.

    The answer is immediate for a node that is connected or known to be down; only a node never
    tried yet (or being tried for the first time since it was last reachable) makes the caller wait
    for the connect attempt, which is one per node, shared by every caller (a caller that is
    cancelled does not cancel it). A connection that fails - refused, reset, heartbeat silence, a
    request past its deadline - marks the node down at once, and a background loop tries it again
    (jittered backoff from 0.1 s up to ``retry_interval``) until it answers. So when a host
    vanishes, every partition learns it from the same failure, none waits for a connect of its
    own, and recovery proceeds with the replicas that answer (see :mod:`.recovery`).
    """

    def __init__(self, transport: Transport, cluster_key: uuid.UUID, num_partitions: int, role: str,
                 connect_timeout: float = 5.0, request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT,
                 retry_interval: float = 1.0) -> None:
        self.transport = transport
        self.cluster_key = cluster_key
        self.num_partitions = num_partitions
        self.role = role
        self.connect_timeout = connect_timeout
        self.request_timeout = request_timeout
        self.retry_interval = retry_interval
        # jittered: the servers that lost a storage node together do not probe it in lock step
        self._reconnect_policy = RetryPolicy(initial=min(0.1, retry_interval), maximum=retry_interval)
        self._nodes: dict[str, _Node] = {}
        #: the storage endpoints of the replica assignment (None until the server has read it)
        self._wanted: frozenset[str] | None = None
        self._closed = False

    def smallest_frame_limit(self, own: int) -> int:
        """``own``, or the smallest ``max_frame_size`` of the connected storage nodes if below it
        (storage protocol 5): what this server tells its clients a transaction's frame may take."""
        limits = [client.max_frame_size for node in self._nodes.values() if (client := node.client) is not None]
        return min([own, *limits])

    def keep_only(self, endpoints: Iterable[str]) -> None:
        """The replica assignment now names these storage endpoints. A node outside them is
        not tried again once it is down (a decommissioned node: its reconnect loop, health entry
        and ``storage_reachable`` gauge would stay for as long as the server runs, its alert
        firing); one that is connected keeps its connection until that fails, since a session
        winding down may still use it."""
        self._wanted = frozenset(endpoints)
        for node in list(self._nodes.values()):
            if node.down_since is not None and node.attempt is None and not self._is_wanted(node):
                self._forget(node)

    def _is_wanted(self, node: _Node) -> bool:
        return self._wanted is None or node.endpoint in self._wanted

    def _forget(self, node: _Node) -> None:
        if self._nodes.get(node.endpoint) is node:
            del self._nodes[node.endpoint]
            log.info("storage %s is not in the replica assignment any more: not trying it again", node.endpoint)
        if node.reconnect is not None and node.reconnect is not asyncio.current_task():
            node.reconnect.cancel()

    async def __call__(self, endpoint: str) -> StorageClient | None:
        node = self._nodes.get(endpoint)
        if node is None:
            node = self._nodes[endpoint] = _Node(endpoint)
        client = node.client
        if client is not None and not client.closed:
            return client
        if node.down_since is not None or self._closed:
            return None  # known unreachable: the background loop tries it, nobody waits for it
        if node.attempt is None:
            node.attempt = asyncio.get_running_loop().create_task(self._attempt(node), name=f"connect-{endpoint}")
        return await asyncio.shield(node.attempt)

    async def _attempt(self, node: _Node) -> StorageClient | None:
        try:
            client = await wait_for(
                StorageClient.connect(self.transport, node.endpoint, self.cluster_key, self.num_partitions, self.role,
                                      request_timeout=self.request_timeout,
                                      on_failure=lambda exc: self._lost(node, exc)),
                self.connect_timeout)
        except (WaltzError, TimeoutError, OSError) as exc:
            self._mark_down(node, str(exc) or f"no connection within {self.connect_timeout:g}s")
            return None
        finally:
            node.attempt = None
        if self._closed:
            await client.close()
            return None
        if node.down_since is not None:
            log.info("storage %s is reachable again (down %.1fs)", node.endpoint, time.monotonic() - node.down_since)
        node.client, node.down_since, node.last_error = client, None, ""
        return client

    def _lost(self, node: _Node, exc: WaltzError) -> None:
        """The node's connection failed (called by the client, on the loop)."""
        node.client = None
        self._mark_down(node, str(exc))

    def _mark_down(self, node: _Node, reason: str) -> None:
        node.last_error = reason
        if not self._is_wanted(node):
            self._forget(node)
            return
        if node.down_since is None:
            node.down_since = time.monotonic()
            log.warning("storage %s unreachable: %s", node.endpoint, reason)
        if not self._closed and (node.reconnect is None or node.reconnect.done()):
            node.reconnect = asyncio.get_running_loop().create_task(self._reconnect(node),
                                                                    name=f"reconnect-{node.endpoint}")

    async def _reconnect(self, node: _Node) -> None:
        # Any failed attempt is retried, whatever its error: _attempt already marked the node down
        # and keeps its reason; the loop only ends when the node answers or the connector closes.
        for delay in self._reconnect_policy.delays():
            if self._closed:
                return
            if not self._is_wanted(node):
                self._forget(node)
                return
            await asyncio.sleep(delay)
            if node.attempt is None:
                node.attempt = asyncio.get_running_loop().create_task(self._attempt(node))
            if await asyncio.shield(node.attempt) is not None:
                return

    async def check(self, endpoint: str) -> bool:
        return await self(endpoint) is not None

    def health(self) -> dict[str, tuple[bool, float | None, str]]:
        """endpoint -> (reachable, seconds down or None, last error) for every node tried so far."""
        now = time.monotonic()
        return {ep: (n.client is not None and not n.client.closed,
                     None if n.down_since is None else now - n.down_since, n.last_error)
                for ep, n in sorted(self._nodes.items())}

    async def close(self) -> None:
        self._closed = True
        nodes = list(self._nodes.values())
        tasks = [t for n in nodes for t in (n.attempt, n.reconnect) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        clients = [n.client for n in nodes if n.client is not None]
        for n in nodes:
            n.client = None
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
