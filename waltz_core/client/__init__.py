"""The Waltz client library: :class:`AsyncWaltzClient`, :class:`WaltzClient` and the application API.

See :mod:`.api` (contexts, builder, callbacks, transactions), :mod:`.core` (the asyncio client, a
facade over its parts: :mod:`.stream`, :mod:`.sender`, :mod:`.applier`, :mod:`.rpc` and
:mod:`.readahead`, around the pure session rules of :mod:`waltz_core.protocol.session`),
:mod:`.sync` (the blocking facade and its threading rules) and :mod:`.sql` (exactly-once apply for
SQL databases). :class:`waltz_core.testing.mock_cluster.MockCluster` serves these clients in memory.
"""

from __future__ import annotations

from ..locks.lock_id import PartitionLocalLock
from .api import (
    BytesSerializer,
    JsonSerializer,
    Serializer,
    Transaction,
    TransactionBuilder,
    TransactionContext,
    Utf8Serializer,
    WaltzClientCallbacks,
)
from .core import AsyncWaltzClient
from .discovery import CoordinationDiscovery, Discovery, StaticDiscovery
from .sync import WaltzClient

__all__ = [
    "AsyncWaltzClient", "BytesSerializer", "CoordinationDiscovery", "Discovery", "JsonSerializer",
    "PartitionLocalLock", "Serializer", "StaticDiscovery", "Transaction", "TransactionBuilder",
    "TransactionContext", "Utf8Serializer", "WaltzClient", "WaltzClientCallbacks",
]
