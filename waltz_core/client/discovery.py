"""How a client learns its id, the number of partitions and which server owns each partition.

The default, :class:`CoordinationDiscovery`, reads them from the coordination backend (client id
from the cluster's counter, ``num_partitions`` from the cluster params, owners from the
assignment watch). :class:`StaticDiscovery` is a fixed, settable view (the mock cluster and
tests use it to move partitions between servers).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

from ..coordination.recipes import PartitionOwner

if TYPE_CHECKING:
    from ..config import CoordinationConfig
    from ..coordination.base import CoordinationBackend
    from ..coordination.recipes import AssignmentWatcher
    from ..plugins import Registries

OwnersCallback = Callable[[dict[int, PartitionOwner]], None]


class Discovery(Protocol):
    """What the client needs from the cluster. All methods run on the client's event loop."""

    async def start(self, on_change: OwnersCallback) -> tuple[int, int]:
        """Connect; return ``(client_id, num_partitions)``. ``on_change(owners)`` is called (on the
        loop, possibly during ``start``) with the whole partition -> owner mapping whenever it changes."""
        ...

    @property
    def owners(self) -> dict[int, PartitionOwner]:
        """The latest mapping (only owned partitions appear)."""
        ...

    async def close(self) -> None: ...


class CoordinationDiscovery:
    """Discovery through the coordination backend (``local``, ``zookeeper``, ``etcd``, a plugin's)."""

    def __init__(self, config: CoordinationConfig, registries: Registries) -> None:
        self._config = config
        self._registries = registries
        self._backend: CoordinationBackend | None = None
        self._watcher: AssignmentWatcher | None = None

    async def start(self, on_change: OwnersCallback) -> tuple[int, int]:
        from ..coordination import open_coordination
        from ..coordination.recipes import AssignmentWatcher, allocate_client_id

        backend = open_coordination(self._config, self._registries)
        await backend.start()
        self._backend = backend
        try:
            client_id = await allocate_client_id(backend, self._config.root)
            watcher = self._watcher = AssignmentWatcher(backend, self._config.root, on_change)
            await watcher.start()
        except BaseException:
            await self.close()
            raise
        return client_id, watcher.num_partitions

    @property
    def owners(self) -> dict[int, PartitionOwner]:
        return dict(self._watcher.current) if self._watcher is not None else {}

    async def close(self) -> None:
        if self._watcher is not None:
            await self._watcher.close()
            self._watcher = None
        if self._backend is not None:
            await self._backend.close()
            self._backend = None


class StaticDiscovery:
    """A mapping set by its owner, for one client; ids come from a counter the owner may share."""

    _ids = itertools.count(1)

    def __init__(self, num_partitions: int, owners: Mapping[int, PartitionOwner],
                 client_ids: itertools.count[int] | None = None) -> None:
        self.num_partitions = num_partitions
        self._owners = dict(owners)
        self._listeners: list[OwnersCallback] = []
        self._client_ids = client_ids or StaticDiscovery._ids
        self.client_id: int | None = None

    async def start(self, on_change: OwnersCallback) -> tuple[int, int]:
        self._listeners.append(on_change)
        on_change(dict(self._owners))
        self.client_id = next(self._client_ids)
        return self.client_id, self.num_partitions

    @property
    def owners(self) -> dict[int, PartitionOwner]:
        return dict(self._owners)

    def set_owners(self, owners: Mapping[int, PartitionOwner]) -> None:
        """Replace the mapping and tell every started client (call on the clients' loop)."""
        self._owners = dict(owners)
        for listener in list(self._listeners):
            listener(dict(self._owners))

    async def close(self) -> None:
        self._listeners.clear()
