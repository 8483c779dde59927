"""Typed registries that plugins fill through the ``waltz_register_*`` hooks.

A registry maps a backend name (``"tcp"``, ``"zookeeper"``, ``"segmented"``) to a factory plus
what the user needs to know about it: the options class read from configuration, a one-line
description and the plugin and distribution that provided it. Resolving a name that nobody
registered raises :class:`~waltz_core.errors.BackendNotFoundError` with the installed names and,
for the backends this project ships, the distribution to install.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

import attrs

from .errors import BackendNotFoundError, PluginError

T = TypeVar("T")

#: Backends shipped by this project outside the core, and the distribution (extra) that has them.
KNOWN_PROVIDERS: dict[tuple[str, str], str] = {
    ("transport", "tcp"): "waltz-transport-tcp (pip install 'waltz-core[tcp]')",
    ("transport", "zmq"): "waltz-transport-zmq (pip install 'waltz-core[zmq]')",
    ("coordination", "zookeeper"): "waltz-coord-zookeeper (pip install 'waltz-core[zookeeper]')",
    ("coordination", "etcd"): "waltz-coord-etcd (pip install 'waltz-core[etcd]')",
}


@attrs.frozen(slots=True)
class BackendInfo(Generic[T]):
    """One registered backend."""

    kind: str
    name: str
    factory: Callable[..., T]
    config_cls: type | None
    description: str
    plugin: str  #: name of the plugin (module or entry point) that registered it
    distribution: str  #: "name version" of the distribution that holds the plugin, or "built-in"
    capabilities: frozenset[str] = frozenset()


class Registry(Generic[T]):
    """The registry handed to one ``waltz_register_<kind>`` hook."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, BackendInfo[T]] = {}
        # Set by the plugin manager while it calls one plugin's hook implementation.
        self._current_plugin = "?"
        self._current_distribution = "?"

    def add(
        self,
        name: str,
        factory: Callable[..., T],
        *,
        config_cls: type | None = None,
        description: str = "",
        capabilities: frozenset[str] | set[str] = frozenset(),
    ) -> None:
        """Register ``factory`` under ``name``. A name may be registered once."""
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

    def __iter__(self) -> Iterator[BackendInfo[T]]:
        return iter(self._entries[n] for n in self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, name: str) -> BackendInfo[T]:
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
