"""Waltz: a distributed, replicated, partitioned write-ahead log with optimistic locking.

The core holds the hook specifications, the plugin manager, configuration, errors, the sans-IO
protocol and the transport seam; backends (transports, coordination, storage layouts, lock
tables) are plugins, the built-in ones registered like any other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .hookspecs import NAME, hookimpl, hookspec
from .plugins import core_version, get_plugin_manager, load_registries
from .runtime import Runtime

if TYPE_CHECKING:  # their real types for type checkers and IDEs; at run time __getattr__ imports them
    from .client import (
        AsyncWaltzClient,
        PartitionLocalLock,
        Transaction,
        TransactionBuilder,
        TransactionContext,
        WaltzClient,
        WaltzClientCallbacks,
    )

__version__ = core_version()

__all__ = [
    "NAME", "AsyncWaltzClient", "PartitionLocalLock", "Runtime", "Transaction", "TransactionBuilder",
    "TransactionContext", "WaltzClient", "WaltzClientCallbacks", "__version__", "get_plugin_manager", "hookimpl",
    "hookspec", "load_registries",
]

_CLIENT_NAMES = frozenset({"AsyncWaltzClient", "PartitionLocalLock", "Transaction", "TransactionBuilder",
                           "TransactionContext", "WaltzClient", "WaltzClientCallbacks"})


if not TYPE_CHECKING:  # hidden from type checkers: a name not imported above is an error there

    def __getattr__(name: str) -> object:
        # The client API is imported on first use so that `import waltz_core` stays light for servers
        # (the client pulls in asyncio, ssl, json, subprocess...: about twice the import time).
        if name in _CLIENT_NAMES:
            from . import client

            return getattr(client, name)
        raise AttributeError(f"module 'waltz_core' has no attribute {name!r}")
