"""Optimistic-lock tables (one per partition) and client-side lock ids.

See :mod:`waltz_core.locks.base` for the protocol and how the server drives it.
"""

from __future__ import annotations

from .base import NO_LOCKS, Begin, LockRequest, LockTable
from .exact import ExactLockTable
from .hashed import HashedLockTable
from .lock_id import PartitionLocalLock, java_long_hash, java_string_hash, lock_hash, lock_hashes
from .open import open_lock_table

__all__ = [
    "NO_LOCKS", "Begin", "LockRequest", "LockTable", "ExactLockTable", "HashedLockTable",
    "PartitionLocalLock", "java_long_hash", "java_string_hash", "lock_hash", "lock_hashes", "open_lock_table",
]
