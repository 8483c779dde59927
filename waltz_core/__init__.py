"""Waltz: a distributed, replicated, partitioned write-ahead log with optimistic locking.

The core holds the hook specifications, the plugin manager, configuration, errors, the sans-IO
protocol and the transport seam; backends (transports, coordination, storage layouts, lock
tables) are plugins, the built-in ones registered like any other.
"""

from __future__ import annotations

from .hookspecs import NAME, hookimpl, hookspec
from .plugins import core_version, get_plugin_manager, load_registries

__version__ = core_version()

__all__ = [
    "NAME", "AsyncWaltzClient", "PartitionLocalLock", "Transaction", "TransactionBuilder", "TransactionContext",
    "WaltzClient", "WaltzClientCallbacks", "__version__", "get_plugin_manager", "hookimpl", "hookspec",
    "load_registries",
]

_CLIENT_NAMES = frozenset({"AsyncWaltzClient", "PartitionLocalLock", "Transaction", "TransactionBuilder",
                           "TransactionContext", "WaltzClient", "WaltzClientCallbacks"})


def __getattr__(name: str) -> object:
    # The client API is imported on first use so that `import waltz_core` stays light for servers.
    if name in _CLIENT_NAMES:
        from . import client

        return getattr(client, name)
    raise AttributeError(f"module 'waltz_core' has no attribute {name!r}")
