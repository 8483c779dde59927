"""Typed registries that plugins fill through the ``waltz_register_*`` hooks.

A registry maps a backend name (``"tcp"``, ``"zookeeper"``, ``"segmented"``) to a factory plus
what the user needs to know about it: the options class read from configuration, a one-line
description and the plugin and distribution that provided it. Resolving a name that nobody
registered raises :class:`~waltz_core.errors.BackendNotFoundError` with the installed names and,
for the backends this project ships, the distribution to install.

Every backend kind has the same factory signature, ``factory(config, options)``:

``config``
    the configuration section the backend is named in: :class:`~waltz_core.config.TransportConfig`
    (``[transport] name``), :class:`~waltz_core.config.CoordinationConfig` (``[coordination]
    name``), :class:`~waltz_core.config.StorageNodeConfig` (``[storage] layout``) or
    :class:`~waltz_core.config.ServerConfig` (``[server] lock_table``);
``options``
    an instance of the ``config_cls`` given to :meth:`Registry.add`, built from the backend's own
    table ``[<section>.<name>]`` (``[transport.tcp]``, ``[storage.segmented]``,
    ``[server.hashed]``) by :func:`waltz_core.config.backend_options`, or ``None`` when the
    backend has no ``config_cls``.

The aliases below name each kind's factory type (``Registry[TransportFactory]``). They are
strings at run time so that importing this module does not import every backend protocol.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Generic, TypeAlias, TypeVar

import attrs

from .errors import BackendNotFoundError, PluginError

if TYPE_CHECKING:
    from .config import CoordinationConfig, ServerConfig, StorageNodeConfig, TransportConfig
    from .coordination.base import CoordinationBackend
    from .locks.base import LockTable
    from .storage.layout import StorageLayout
    from .transport.base import Transport

#: ``factory(config, options) -> Transport`` (not yet listening or connected).
TransportFactory: TypeAlias = "Callable[[TransportConfig, Any], Transport]"
#: ``factory(config, options) -> CoordinationBackend`` (not yet started).
CoordinationFactory: TypeAlias = "Callable[[CoordinationConfig, Any], CoordinationBackend]"
#: ``factory(config, options) -> StorageLayout`` on ``config.directory`` (not yet opened).
StorageLayoutFactory: TypeAlias = "Callable[[StorageNodeConfig, Any], StorageLayout]"
#: ``factory(config, options) -> LockTable`` of one partition, nothing committed (the server resets
#: it to the partition's high-water mark).
LockTableFactory: TypeAlias = "Callable[[ServerConfig, Any], LockTable]"

F = TypeVar("F", bound=Callable[..., Any])

#: Backends shipped by this project outside the core, and the distribution (extra) that has them.
KNOWN_PROVIDERS: dict[tuple[str, str], str] = {
    ("transport", "tcp"): "waltz-transport-tcp (pip install 'waltz-core[tcp]')",
    ("transport", "zmq"): "waltz-transport-zmq (pip install 'waltz-core[zmq]')",
    ("coordination", "zookeeper"): "waltz-coord-zookeeper (pip install 'waltz-core[zookeeper]')",
    ("coordination", "etcd"): "waltz-coord-etcd (pip install 'waltz-core[etcd]')",
}


@attrs.frozen(slots=True)
class BackendInfo(Generic[F]):
    """One registered backend."""

    kind: str
    name: str
    factory: F  #: ``factory(config, options)`` (see the module docstring)
    config_cls: type | None
    description: str
    plugin: str  #: name of the plugin (module or entry point) that registered it
    distribution: str  #: "name version" of the distribution that holds the plugin, or "built-in"
    capabilities: frozenset[str] = frozenset()


class Registry(Generic[F]):
    """The registry handed to one ``waltz_register_<kind>`` hook."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, BackendInfo[F]] = {}
        # Who is registering now: set by the plugin manager around each plugin's hook call
        # (waltz_core.plugins.load_registries), so every entry and every error names its plugin.
        self._current_plugin = "?"
        self._current_distribution = "?"

    @contextlib.contextmanager
    def registering_plugin(self, plugin: str, distribution: str) -> Iterator[None]:
        """Attribute every :meth:`add` inside the block to ``plugin`` of ``distribution``.

        Used by :func:`waltz_core.plugins.load_registries` around each plugin's hook call.
        """
        self._current_plugin, self._current_distribution = plugin, distribution
        try:
            yield
        finally:
            self._current_plugin = self._current_distribution = "?"

    def add(
        self,
        name: str,
        factory: F,
        *,
        config_cls: type | None = None,
        description: str = "",
        capabilities: frozenset[str] | set[str] = frozenset(),
    ) -> None:
        """Register ``factory`` under ``name``. A name may be registered once.

        :param factory: ``factory(config, options)`` returning an unstarted backend (module docstring)
        :param config_cls: a frozen attrs class whose fields are the keys of the backend's
            ``[<section>.<name>]`` table, every one with a default; None: the backend takes no options
        """
        if not name or not name.replace("-", "").replace("_", "").isalnum():
            raise PluginError(f"{self.kind} name {name!r} from plugin {self._current_plugin!r} is not a plain identifier")
        if name in self._entries:
            other = self._entries[name]
            raise PluginError(
                f"{self.kind} {name!r} is registered twice: by {other.plugin!r} ({other.distribution}) "
                f"and by {self._current_plugin!r} ({self._current_distribution}); block one with WALTZ_DISABLED_PLUGINS"
            )
        if config_cls is not None and not attrs.has(config_cls):
            raise PluginError(f"{self.kind} {name!r}: config_cls must be an attrs class, got {config_cls!r}")
        self._entries[name] = BackendInfo(
            kind=self.kind,
            name=name,
            factory=factory,
            config_cls=config_cls,
            description=description,
            plugin=self._current_plugin,
            distribution=self._current_distribution,
            capabilities=frozenset(capabilities),
        )

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[BackendInfo[F]]:
        return iter(self._entries[n] for n in self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, name: str) -> BackendInfo[F]:
        """Return the backend registered as ``name`` or raise a clear :class:`BackendNotFoundError`."""
        try:
            return self._entries[name]
        except KeyError:
            installed = ", ".join(self.names()) or "none"
            hint = KNOWN_PROVIDERS.get((self.kind, name))
            msg = f"{self.kind} {name!r} not found; installed: {installed}."
            if hint:
                msg += f" It is provided by {hint}."
            else:
                msg += " Is the plugin that provides it installed (see `waltz plugins`)?"
            raise BackendNotFoundError(msg) from None
