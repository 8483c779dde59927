"""Conformance kit for coordination backends: every backend (local, zookeeper, etcd) runs it.

Use it by subclassing :class:`CoordinationConformance` in a test module of the backend and
providing the fixture contract::

    import pytest
    from waltz_core.testing.conformance.coordination import CoordinationConformance

    class TestZooKeeperConformance(CoordinationConformance):
        @pytest.fixture
        async def backend_factory(self, zk_server):
            made = []

            async def make():
                backend = ZooKeeperCoordination(CoordinationConfig(name="zookeeper",
                                                connect=zk_server.connect, session_timeout=4.0), None)
                await backend.start()
                made.append(backend)
                return backend

            yield make
            for backend in made:
                await backend.close()

        async def expire_session(self, backend):
            ...  # make the server expire this backend's session/lease

Fixture contract (stable; backends depend on it):

``backend_factory`` (async fixture, function scope, **required**)
    Yields an async callable ``make() -> CoordinationBackend``. Every call returns a NEW, started
    backend (its own session/lease) connected to the same store as the previous ones, so a test
    can act as two clients. Use a short session timeout (a few seconds): the expiry tests wait for
    it. Closing the backends at teardown is optional: the kit closes every backend it made
    (``close()`` is idempotent).

``expire_session(self, backend)`` (async method, **required**)
    Force ``backend``'s session/lease to expire as the server sees it: afterwards its ephemeral
    keys are deleted (another client sees them vanish) and ``backend`` reports
    ``SessionState.LOST`` to its listeners, then establishes a new session by itself and
    reports ``SessionState.CONNECTED`` again. ZooKeeper: kazoo's expiry trick (a second client
    with the same session id and password, then closed); etcd: revoke the lease; local: mark
    the lease expired.

Optional overrides: ``event_timeout`` (seconds to wait for an asynchronous event, default 20).
A ``backend_factory`` that builds backends by name, as a Waltz process does, takes the kit's
``runtime`` fixture (:class:`~waltz_core.testing.conformance.KitRuntime`) and calls
``open_coordination(config, runtime.registries)``.

Each test works under its own fresh root (fixture ``root``) and deletes it at the end, so one
server can serve the whole kit.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import pytest

from ...config import CoordinationConfig
from ...coordination.base import CoordinationBackend, SessionState
from ...errors import (
    CasConflictError,
    ClusterNotFoundError,
    CoordinationError,
    MetadataEditError,
    NodeExistsError,
    NoNodeError,
)
from ...runtime import Runtime
from ...timeouts import wait_for
from . import KitRuntime

BackendFactory = Callable[[], Awaitable[CoordinationBackend]]


async def eventually(predicate: Callable[[], Awaitable[bool]] | Callable[[], bool], timeout: float,
                     what: str, interval: float = 0.05) -> None:
    """Poll ``predicate`` (sync or async) until it is true; fail the test naming ``what`` after ``timeout`` s."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for: {what}")
        await asyncio.sleep(interval)


async def _registered(client: CoordinationBackend, key: str) -> None:
    """Return once a watch just set on ``key`` is in place: a backend may register it
    asynchronously (ZooKeeper), but a later request of the same client is answered after it,
    while a change made through another client is not ordered with it at all."""
    await client.get(key)
    await client.children(key)


class _Counter:
    """A watch callback that counts its calls and lets a test await the next one."""

    def __init__(self) -> None:
        self.calls = 0
        self._event = asyncio.Event()

    def __call__(self) -> None:
        self.calls += 1
        self._event.set()

    async def wait_beyond(self, calls: int, timeout: float) -> None:
        await eventually(lambda: self.calls > calls, timeout, f"watch callback beyond {calls} calls")


class CoordinationConformance(KitRuntime):
    """The shared tests. Subclass it and provide ``backend_factory`` and ``expire_session``."""

    event_timeout: float = 20.0

    # ------------------------------------------------------------------------ fixture contract

    @pytest.fixture
    async def backend_factory(self) -> AsyncIterator[BackendFactory]:  # pragma: no cover - overridden
        raise NotImplementedError("a backend's conformance test must override the backend_factory fixture")
        yield

    async def _expire(self, backend: CoordinationBackend) -> None:
        """``expire_session`` with a bound: a backend that never confirms the expiry fails the test
        with a clear message instead of hanging it."""
        try:
            await wait_for(self.expire_session(backend), max(30.0, self.event_timeout))
        except TimeoutError:
            pytest.fail(f"expire_session({backend!r}) did not return within {max(30.0, self.event_timeout)}s")

    async def expire_session(self, backend: CoordinationBackend) -> None:  # pragma: no cover - overridden
        raise NotImplementedError("a backend's conformance test must override expire_session(backend)")

    # ----------------------------------------------------------------------------- kit fixtures

    @pytest.fixture
    async def make_client(self, backend_factory: BackendFactory) -> AsyncIterator[BackendFactory]:
        made: list[CoordinationBackend] = []

        async def make() -> CoordinationBackend:
            backend = await backend_factory()
            made.append(backend)
            return backend

        yield make
        for backend in made:
            await backend.close()

    @pytest.fixture
    async def root(self, make_client: BackendFactory) -> AsyncIterator[str]:
        path = f"/waltz-kit-{uuid.uuid4().hex[:12]}"
        yield path
        cleaner = await make_client()
        await cleaner.delete(path, recursive=True)

    @pytest.fixture
    async def client(self, make_client: BackendFactory) -> CoordinationBackend:
        return await make_client()

    @pytest.fixture
    async def other(self, make_client: BackendFactory) -> CoordinationBackend:
        return await make_client()

    # ------------------------------------------------------------------------- key/value basics

    async def test_started_backend_is_connected(self, client: CoordinationBackend) -> None:
        assert client.session_state is SessionState.CONNECTED
        assert isinstance(client.name, str) and client.name

    async def test_get_absent_is_none(self, client: CoordinationBackend, root: str) -> None:
        assert await client.get(f"{root}/nothing") is None

    async def test_create_get_set_delete(self, client: CoordinationBackend, other: CoordinationBackend, root: str) -> None:
        key = f"{root}/a/b"
        v1 = await client.create(key, b"one")
        got = await other.get(key)
        assert got is not None and got.value == b"one" and got.version == v1
        v2 = await other.set(key, b"two")
        assert v2 != v1
        got = await client.get(key)
        assert got is not None and got.value == b"two" and got.version == v2
        parent = await client.get(f"{root}/a")  # make_parents created it
        assert parent is not None
        await client.delete(key)
        assert await other.get(key) is None
        await client.delete(key)  # absent: not an error

    async def test_values_are_bytes_verbatim(self, client: CoordinationBackend, root: str) -> None:
        payload = bytes(range(256)) + b"\x00" * 10
        await client.create(f"{root}/bin", payload)
        got = await client.get(f"{root}/bin")
        assert got is not None and got.value == payload
        await client.set(f"{root}/bin", b"")
        got = await client.get(f"{root}/bin")
        assert got is not None and got.value == b""

    async def test_create_existing_raises(self, client: CoordinationBackend, root: str) -> None:
        await client.create(f"{root}/k", b"x")
        with pytest.raises(NodeExistsError):
            await client.create(f"{root}/k", b"y")
        got = await client.get(f"{root}/k")
        assert got is not None and got.value == b"x"

    async def test_create_without_parents(self, client: CoordinationBackend, root: str) -> None:
        with pytest.raises(NoNodeError):
            await client.create(f"{root}/missing/child", b"x", make_parents=False)
        await client.create(root, b"")
        await client.create(f"{root}/child", b"x", make_parents=False)
        assert await client.children(root) == ["child"]

    async def test_set_absent_raises(self, client: CoordinationBackend, root: str) -> None:
        with pytest.raises(NoNodeError):
            await client.set(f"{root}/absent", b"x")
        with pytest.raises(NoNodeError):
            await client.set(f"{root}/absent", b"x", expected_version=0)

    async def test_cas_with_stale_version_fails(self, client: CoordinationBackend, root: str) -> None:
        key = f"{root}/cas"
        v1 = await client.create(key, b"1")
        v2 = await client.set(key, b"2", expected_version=v1)
        with pytest.raises(CasConflictError):
            await client.set(key, b"3", expected_version=v1)
        got = await client.get(key)
        assert got is not None and got.value == b"2" and got.version == v2

    async def test_delete_with_expected_version(self, client: CoordinationBackend, root: str) -> None:
        key = f"{root}/d"
        v1 = await client.create(key, b"1")
        v2 = await client.set(key, b"2")
        with pytest.raises(CasConflictError):
            await client.delete(key, expected_version=v1)
        assert await client.get(key) is not None
        await client.delete(key, expected_version=v2)
        assert await client.get(key) is None

    async def test_recursive_delete(self, client: CoordinationBackend, other: CoordinationBackend, root: str) -> None:
        for name in ("x/1", "x/2/deep", "y"):
            await client.create(f"{root}/{name}", b"v")
        await client.delete(f"{root}/x", recursive=True)
        assert await other.get(f"{root}/x") is None
        assert await other.get(f"{root}/x/2/deep") is None
        assert await other.children(root) == ["y"]

    async def test_children_listing(self, client: CoordinationBackend, root: str) -> None:
        for name in ("b", "a", "c", "a/nested"):
            await client.create(f"{root}/p/{name}", b"")
        assert await client.children(f"{root}/p") == ["a", "b", "c"]
        assert await client.children(f"{root}/p/a") == ["nested"]
        assert await client.children(f"{root}/p/b") == []
        assert await client.children(f"{root}/absent") == []

    # ---------------------------------------------------------------------- races between clients

    async def test_cas_race_between_two_clients(self, client: CoordinationBackend, other: CoordinationBackend,
                                                root: str) -> None:
        for i in range(10):
            key = f"{root}/race{i}"
            version = await client.create(key, b"start")
            results = await asyncio.gather(
                client.set(key, b"client", expected_version=version),
                other.set(key, b"other", expected_version=version),
                return_exceptions=True,
            )
            winners = [r for r in results if isinstance(r, int)]
            losers = [r for r in results if isinstance(r, CasConflictError)]
            assert len(winners) == 1 and len(losers) == 1, results
            got = await client.get(key)
            assert got is not None and got.version == winners[0]
            assert got.value == (b"client" if isinstance(results[0], int) else b"other")

    async def test_create_if_absent_race(self, client: CoordinationBackend, other: CoordinationBackend, root: str) -> None:
        for i in range(10):
            key = f"{root}/once{i}"
            results = await asyncio.gather(client.create(key, b"client"), other.create(key, b"other"),
                                           return_exceptions=True)
            winners = [r for r in results if isinstance(r, int)]
            assert len(winners) == 1, results
            assert sum(isinstance(r, NodeExistsError) for r in results) == 1, results

    async def test_sequential_keys_unique_and_increasing(self, client: CoordinationBackend, other: CoordinationBackend,
                                                         root: str) -> None:
        prefix = f"{root}/seq/s_"

        async def make_many(backend: CoordinationBackend, n: int) -> list[str]:
            return [await backend.create_sequential(prefix, b"v", ephemeral=False) for _ in range(n)]

        mine, theirs = await asyncio.gather(make_many(client, 15), make_many(other, 15))
        for keys in (mine, theirs):
            for key in keys:
                suffix = key[len(prefix):]
                assert key.startswith(prefix) and len(suffix) == 10 and suffix.isdigit(), key
            assert keys == sorted(keys) and len(set(keys)) == len(keys)
        assert len(set(mine) | set(theirs)) == 30
        children = await client.children(f"{root}/seq")
        assert sorted(children) == sorted(k.rsplit("/", 1)[1] for k in mine + theirs)

    async def test_counter_is_atomic_under_concurrency(self, client: CoordinationBackend, other: CoordinationBackend,
                                                       root: str) -> None:
        key = f"{root}/ids/counter"

        async def bump(backend: CoordinationBackend, n: int) -> list[int]:
            return [await backend.increment(key) for _ in range(n)]

        results = await asyncio.gather(bump(client, 20), bump(other, 20), bump(client, 5))
        values = [v for run in results for v in run]
        assert sorted(values) == list(range(1, 46))
        for run in results:
            assert run == sorted(run)
        assert await other.increment(key) == 46

    # --------------------------------------------------------------------------- ephemeral keys

    async def test_ephemeral_vanishes_on_close(self, make_client: BackendFactory, other: CoordinationBackend,
                                               root: str) -> None:
        owner = await make_client()
        await other.create(f"{root}/members", b"")
        key = f"{root}/members/eph"
        await owner.create(key, b"alive", ephemeral=True)
        seq = await owner.create_sequential(f"{root}/members/s_", b"alive", ephemeral=True)
        persistent = f"{root}/members/kept"
        await owner.create(persistent, b"kept")
        assert await other.get(key) is not None
        await owner.close()
        await eventually(lambda: self._absent(other, key), self.event_timeout, "ephemeral key gone after close")
        await eventually(lambda: self._absent(other, seq), self.event_timeout, "ephemeral sequential key gone")
        assert await other.get(persistent) is not None
        await owner.close()  # idempotent

    async def test_session_expiry(self, make_client: BackendFactory, other: CoordinationBackend, root: str) -> None:
        owner = await make_client()
        states: list[SessionState] = []
        owner.add_session_listener(states.append)
        key = f"{root}/eph"
        await owner.create(key, b"alive", ephemeral=True)
        await owner.create(f"{root}/kept", b"kept")
        await self._expire(owner)
        await eventually(lambda: SessionState.LOST in states, self.event_timeout, "LOST reported after expiry")
        await eventually(lambda: self._absent(other, key), self.event_timeout, "ephemeral key gone after expiry")
        await eventually(lambda: states[-1] is SessionState.CONNECTED and owner.session_state is SessionState.CONNECTED,
                         self.event_timeout, "CONNECTED again with a new session after LOST")
        assert states.index(SessionState.LOST) < len(states) - 1
        # The new session works and its ephemerals are bound to it.
        await owner.create(key, b"again", ephemeral=True)
        got = await other.get(key)
        assert got is not None and got.value == b"again"
        got = await other.get(f"{root}/kept")
        assert got is not None and got.value == b"kept"

    # ---------------------------------------------------------------------------------- watches

    async def test_watch_fires_on_value_change(self, client: CoordinationBackend, other: CoordinationBackend,
                                               root: str) -> None:
        key = f"{root}/watched"
        await client.create(key, b"0")
        seen = _Counter()
        handle = client.watch(key, seen)
        await _registered(client, key)
        before = seen.calls
        await other.set(key, b"1")
        await seen.wait_beyond(before, self.event_timeout)
        got = await client.get(key)
        assert got is not None and got.value == b"1"
        handle.cancel()
        handle.cancel()  # idempotent
        await asyncio.sleep(0.3)
        after_cancel = seen.calls
        await other.set(key, b"2")
        await asyncio.sleep(1.0)
        assert seen.calls == after_cancel

    async def test_watch_fires_on_create_and_delete_of_watched_key(self, client: CoordinationBackend,
                                                                  other: CoordinationBackend, root: str) -> None:
        key = f"{root}/later"
        seen = _Counter()
        client.watch(key, seen)
        await _registered(client, key)
        before = seen.calls
        await other.create(key, b"x")
        await seen.wait_beyond(before, self.event_timeout)
        before = seen.calls
        await other.delete(key)
        await seen.wait_beyond(before, self.event_timeout)

    async def test_watch_fires_on_children_change(self, client: CoordinationBackend, other: CoordinationBackend,
                                                  root: str) -> None:
        parent = f"{root}/dir"
        await client.create(parent, b"")
        seen = _Counter()
        client.watch(parent, seen)
        await _registered(client, parent)
        before = seen.calls
        await other.create(f"{parent}/child", b"x")
        await seen.wait_beyond(before, self.event_timeout)
        assert "child" in await client.children(parent)
        before = seen.calls
        await other.delete(f"{parent}/child")
        await seen.wait_beyond(before, self.event_timeout)
        assert await client.children(parent) == []

    async def test_watch_fires_on_ephemeral_child_vanishing(self, make_client: BackendFactory,
                                                            client: CoordinationBackend, root: str) -> None:
        parent = f"{root}/members"
        await client.create(parent, b"")
        owner = await make_client()
        await owner.create_sequential(f"{parent}/s_", b"me", ephemeral=True)
        seen = _Counter()
        client.watch(parent, seen)
        await _registered(client, parent)
        before = seen.calls
        await self._expire(owner)
        await seen.wait_beyond(before, self.event_timeout)
        await eventually(lambda: self._no_children(client, parent), self.event_timeout, "ephemeral child gone")

    async def test_watch_survives_session_loss(self, client: CoordinationBackend, other: CoordinationBackend,
                                               root: str) -> None:
        key = f"{root}/survivor"
        await other.create(key, b"0")
        seen = _Counter()
        client.watch(key, seen)
        states: list[SessionState] = []
        client.add_session_listener(states.append)
        await asyncio.sleep(0.3)
        before = seen.calls
        await self._expire(client)
        await eventually(lambda: SessionState.LOST in states and client.session_state is SessionState.CONNECTED,
                         self.event_timeout, "LOST then CONNECTED")
        # After a reconnect every watch fires once (changes may have been missed) ...
        await seen.wait_beyond(before, self.event_timeout)
        # ... and keeps firing for later changes.
        await asyncio.sleep(0.3)
        before = seen.calls
        await other.set(key, b"1")
        await seen.wait_beyond(before, self.event_timeout)

    # ---------------------------------------------------------------------------------- recipes

    async def test_recipe_cluster_create_list_delete(self, client: CoordinationBackend, other: CoordinationBackend,
                                                     root: str) -> None:
        from ...coordination import recipes

        params = await recipes.create_cluster(client, root, "kit", 6)
        assert params.num_partitions == 6
        with pytest.raises(NodeExistsError):
            await recipes.create_cluster(other, root, "kit", 6)
        listing = await recipes.list_cluster(other, root)
        assert listing.cluster.name == "kit" and listing.cluster.num_partitions == 6
        assert listing.store == params
        assert sorted(listing.partitions) == list(range(6))
        assert all(meta == recipes.PartitionMetadata.EMPTY for meta in listing.partitions.values())
        store = recipes.StoreMetadata(other, root)
        assert await store.get_store_params() == params
        await recipes.delete_cluster(other, root, "kit")
        with pytest.raises(ClusterNotFoundError):
            await store.get_store_params()
        with pytest.raises(ClusterNotFoundError):
            await recipes.list_cluster(client, root)

    async def test_recipe_partition_metadata_cas(self, client: CoordinationBackend, other: CoordinationBackend,
                                                 root: str) -> None:
        from ...coordination import recipes

        await recipes.create_cluster(client, root, "kit", 2)
        mine, theirs = recipes.StoreMetadata(client, root), recipes.StoreMetadata(other, root)
        _, version = await mine.get_partition_metadata(1)
        _, same_version = await theirs.get_partition_metadata(1)
        assert version == same_version
        replica = recipes.ReplicaState(session_id=1, closing_high_water_mark=recipes.UNRESOLVED)
        first = recipes.PartitionMetadata(generation=3, session_id=1, replicas={"127.0.0.1:9000": replica})
        second = recipes.PartitionMetadata(generation=3, session_id=1, replicas={})
        results = await asyncio.gather(mine.cas_partition_metadata(1, first, version),
                                       theirs.cas_partition_metadata(1, second, version), return_exceptions=True)
        assert sum(isinstance(r, CasConflictError) for r in results) == 1, results
        winner = first if not isinstance(results[0], BaseException) else second
        got, new_version = await theirs.get_partition_metadata(1)
        assert got == winner and new_version != version
        assert got.replicas.get("127.0.0.1:9000", replica).closing_high_water_mark == -(2**63)
        untouched, _ = await theirs.get_partition_metadata(0)
        assert untouched == recipes.PartitionMetadata.EMPTY

    async def test_recipe_storage_nodes_and_assignments(self, client: CoordinationBackend, other: CoordinationBackend,
                                                        root: str) -> None:
        from ...coordination import recipes

        await recipes.create_cluster(client, root, "kit", 4)
        store = recipes.StoreMetadata(client, root)
        await store.add_storage_node("127.0.0.1:7000", admin=7001, group=0)
        await store.add_storage_node("127.0.0.1:7100", admin=7101, group=0)
        with pytest.raises(NodeExistsError):
            await store.add_storage_node("127.0.0.1:7000", admin=7001, group=0)
        await store.assign_partitions("127.0.0.1:7000", recipes.parse_partition_ranges("0-2"))
        reader = recipes.StoreMetadata(other, root)
        assert await reader.get_replica_assignments() == {"127.0.0.1:7000": [0, 1, 2], "127.0.0.1:7100": []}
        assert await reader.get_groups() == {"127.0.0.1:7000": 0, "127.0.0.1:7100": 0}
        assert await reader.get_connections() == {"127.0.0.1:7000": 7001, "127.0.0.1:7100": 7101}
        await store.unassign_partitions("127.0.0.1:7000", [0, 1, 2])
        await store.auto_assign(group=0)
        assert await reader.get_replica_assignments() == {"127.0.0.1:7000": [0, 2], "127.0.0.1:7100": [1, 3]}
        await store.unassign_partitions("127.0.0.1:7100", [1, 3])
        await store.remove_storage_node("127.0.0.1:7100")
        assert await reader.get_groups() == {"127.0.0.1:7000": 0}
        # Addresses are the transport's: one that is not host:port is registered with its whole
        # admin address; an admin address on the node's own host is stored as the port.
        await store.add_storage_node("unix:/run/waltz/s1.sock", admin="unix:/run/waltz/s1-admin.sock", group=1)
        await store.add_storage_node("127.0.0.1:7200", admin="127.0.0.1:7201", group=1)
        assert await reader.get_connections() == {"127.0.0.1:7000": 7001, "unix:/run/waltz/s1.sock":
                                                  "unix:/run/waltz/s1-admin.sock", "127.0.0.1:7200": 7201}
        assert await reader.get_admin_addresses() == {"127.0.0.1:7000": "127.0.0.1:7001", "unix:/run/waltz/s1.sock":
                                                      "unix:/run/waltz/s1-admin.sock", "127.0.0.1:7200": "127.0.0.1:7201"}
        with pytest.raises(MetadataEditError, match="is not host:port: give its admin address"):
            await store.add_storage_node("unix:/run/waltz/s2.sock", admin=7301, group=1)
        with pytest.raises(MetadataEditError, match="must be an address"):
            await store.add_storage_node("a b", admin=7301, group=1)

    async def test_recipe_cluster_manager_assignment_and_generations(self, make_client: BackendFactory,
                                                                     client: CoordinationBackend, root: str) -> None:
        from ...coordination import recipes

        await recipes.create_cluster(client, root, "kit", 4)
        seen_by_client: list[dict[int, Any]] = []
        watcher = recipes.AssignmentWatcher(client, root, seen_by_client.append)
        await watcher.start()
        got: dict[str, list[recipes.ServerAssignment]] = {"a": [], "b": []}
        backend_a, backend_b = await make_client(), await make_client()
        manager_a = recipes.ClusterManager(backend_a, root, recipes.ServerDescriptor(address="127.0.0.1:5001"),
                                           on_assignment=got["a"].append)
        manager_b = recipes.ClusterManager(backend_b, root, recipes.ServerDescriptor(address="127.0.0.1:5002"),
                                           on_assignment=got["b"].append)
        try:
            await manager_a.start()
            await eventually(lambda: bool(got["a"]) and len(got["a"][-1].partitions) == 4, self.event_timeout,
                             "one server owns every partition")
            first = dict(got["a"][-1].partitions)
            await manager_b.start()
            assert manager_b.server_id > manager_a.server_id
            await eventually(lambda: bool(got["b"]) and len(got["b"][-1].partitions) == 2
                             and len(got["a"][-1].partitions) == 2, self.event_timeout, "two servers share 2/2")
            moved = set(got["b"][-1].partitions)
            for pid, generation in got["b"][-1].partitions.items():
                assert generation == first[pid] + 1  # moved: generation bumped
            for pid, generation in got["a"][-1].partitions.items():
                assert generation == first[pid]  # kept: generation unchanged
            await eventually(lambda: bool(seen_by_client) and {p for p, o in seen_by_client[-1].items()
                                                                if o.endpoint == "127.0.0.1:5002"} == moved,
                             self.event_timeout, "the client watcher sees the new owner")
            second = {**got["a"][-1].partitions, **got["b"][-1].partitions}
            await manager_b.close()
            await eventually(lambda: len(got["a"][-1].partitions) == 4, self.event_timeout,
                             "the remaining server takes every partition back")
            for pid, generation in got["a"][-1].partitions.items():
                assert generation == second[pid] + (1 if pid in moved else 0)
            await eventually(lambda: all(o.endpoint == "127.0.0.1:5001" for o in seen_by_client[-1].values())
                             and len(seen_by_client[-1]) == 4, self.event_timeout, "client sees one server")
            assert {p: o.generation for p, o in watcher.current.items()} == got["a"][-1].partitions
        finally:
            await manager_a.close()
            await manager_b.close()
            await watcher.close()

    async def test_recipe_cluster_manager_reregisters_after_session_loss(self, make_client: BackendFactory,
                                                                        client: CoordinationBackend, root: str) -> None:
        from ...coordination import recipes

        await recipes.create_cluster(client, root, "kit", 3)
        got: list[recipes.ServerAssignment] = []
        backend = await make_client()
        manager = recipes.ClusterManager(backend, root, recipes.ServerDescriptor(address="127.0.0.1:5001",
                                                                                 preferred_partitions=(2,)),
                                         on_assignment=got.append)
        try:
            await manager.start()
            await eventually(lambda: bool(got) and len(got[-1].partitions) == 3, self.event_timeout, "all partitions")
            old_id, old = manager.server_id, dict(got[-1].partitions)
            await self._expire(backend)
            await eventually(lambda: manager.server_id != old_id and bool(got) and len(got[-1].partitions) == 3
                             and got[-1].server_id == manager.server_id, self.event_timeout,
                             "re-registered with a new server id and got the partitions back")
            assert all(got[-1].partitions[p] == old[p] + 1 for p in old)  # a new owner: generations bumped
            assert any(len(a.partitions) == 0 for a in got)  # told to stop serving when the session was lost
            descriptors = await recipes.list_servers(client, root)
            assert [d.server_id for d in descriptors] == [manager.server_id]
            assert descriptors[0].preferred_partitions == (2,)
        finally:
            await wait_for(manager.close(), self.event_timeout)

    async def test_recipe_id_allocation(self, client: CoordinationBackend, other: CoordinationBackend, root: str) -> None:
        from ...coordination import recipes

        await recipes.create_cluster(client, root, "kit", 1)
        ids = await asyncio.gather(*(recipes.allocate_client_id(b, root) for b in (client, other) * 5))
        assert sorted(ids) == list(range(1, 11))

    # ---------------------------------------------------------------------------------- helpers

    @staticmethod
    async def _absent(backend: CoordinationBackend, key: str) -> bool:
        return await backend.get(key) is None

    @staticmethod
    async def _no_children(backend: CoordinationBackend, key: str) -> bool:
        return await backend.children(key) == []


# ------------------------------------------------------------------------ leader failover scenario


class ServerEnsemble(Protocol):
    """What :func:`leader_kill_scenario` needs of a multi-node coordination service under test
    (:class:`waltz_core.testing.servers.ZooKeeperServer` and ``EtcdServer`` fit)."""

    def leader(self) -> int: ...

    def kill(self, node: int) -> None: ...


async def _cas_until(store: Any, partition: int, stop: asyncio.Event, done: list[int]) -> None:
    """Bump the generation of ``partition`` by CAS until ``stop``; record each committed generation."""
    import attrs

    while not stop.is_set():
        try:
            meta, version = await store.get_partition_metadata(partition)
            new = attrs.evolve(meta, generation=meta.generation + 1)
            await store.cas_partition_metadata(partition, new, version)
            done.append(new.generation)
        except (CasConflictError, CoordinationError):
            await asyncio.sleep(0.05)  # a lost race or the service electing: re-read and retry


async def leader_kill_scenario(config: CoordinationConfig, ensemble: ServerEnsemble,
                               runtime: Runtime | None = None) -> float:
    """SIGKILL the leader of ``ensemble`` in the middle of recipe operations.

    Partition metadata CAS updates and the cluster manager must keep working once a new leader is
    elected, and every committed update must survive (the final generation equals the number of
    CAS updates that reported success). Returns the seconds from the kill to the first CAS commit.
    The backends are built by name in ``runtime``'s registries (default: a runtime of the installed
    plugins, ``Runtime.load()``).
    """
    import time

    from ...coordination import open_coordination, recipes

    backends: list[CoordinationBackend] = []
    registries = (runtime or Runtime.load()).registries

    async def make() -> CoordinationBackend:
        backend = open_coordination(config, registries)
        await backend.start()
        backends.append(backend)
        return backend

    admin, writer, server_a, server_b = [await make() for _ in range(4)]
    states: list[SessionState] = []
    writer.add_session_listener(states.append)
    root = "/waltz-failover"
    await recipes.create_cluster(admin, root, "failover", 4)
    got_a: list[recipes.ServerAssignment] = []
    got_b: list[recipes.ServerAssignment] = []
    manager_a = recipes.ClusterManager(server_a, root, recipes.ServerDescriptor(address="127.0.0.1:5001"),
                                       on_assignment=got_a.append)
    manager_b = recipes.ClusterManager(server_b, root, recipes.ServerDescriptor(address="127.0.0.1:5002"),
                                       on_assignment=got_b.append)
    stop = asyncio.Event()
    committed: list[int] = []
    store = recipes.StoreMetadata(writer, root)
    try:
        await manager_a.start()
        await eventually(lambda: bool(got_a) and len(got_a[-1].partitions) == 4, 20, "server A owns all partitions")
        cas = asyncio.create_task(_cas_until(store, 0, stop, committed))
        await eventually(lambda: len(committed) >= 20, 20, "20 CAS updates before the kill")

        killed = ensemble.leader()
        await asyncio.to_thread(ensemble.kill, killed)
        killed_at, before_kill = time.monotonic(), len(committed)
        await eventually(lambda: len(committed) > before_kill, 30, "a CAS update after the leader kill")
        recovery = time.monotonic() - killed_at
        assert await asyncio.to_thread(ensemble.leader) != killed
        await eventually(lambda: len(committed) >= before_kill + 20, 30, "20 CAS updates after the new leader")
        print(f"\n{config.name} leader kill: first CAS commit {recovery * 1000:.0f} ms after SIGKILL")
        await manager_b.start()  # membership change under the new leader: the coordinator rebalances
        await eventually(lambda: bool(got_b) and len(got_b[-1].partitions) == 2 and len(got_a[-1].partitions) == 2,
                         30, "two servers share the partitions after the failover")
        stop.set()
        await cas
        # Nothing committed is lost: a fresh client reads exactly the last committed generation.
        reader = await make()
        final, _ = await recipes.StoreMetadata(reader, root).get_partition_metadata(0)
        assert committed == list(range(0, len(committed)))  # EMPTY is generation -1: 0, 1, 2, ...
        assert final.generation == committed[-1]
        moved = set(got_b[-1].partitions)
        assert all(got_b[-1].partitions[p] == got_a[0].partitions[p] + 1 for p in moved)
        assert SessionState.LOST not in states, f"the writer's session was lost: states {states} (see its log)"
        assert writer.session_state is SessionState.CONNECTED, f"the writer's session ends {writer.session_state}"
        return recovery
    finally:
        stop.set()
        await manager_a.close()
        await manager_b.close()
        for backend in backends:
            await backend.close()
