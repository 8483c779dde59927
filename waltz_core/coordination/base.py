"""The coordination backend protocol: what every backend (local, zookeeper, etcd) provides.

A hierarchical key space of small values (paths like ``/waltz/store/partition/3``) with:

* versioned values and compare-and-set (``set(..., expected_version=v)``);
* create-if-absent, optionally *ephemeral* (bound to this backend's session/lease) and
  *sequential* (a unique, increasing suffix: ``s_0000000007``);
* child listing, atomic counters;
* watches: ``watch(key, callback)`` calls ``callback()`` after the value or the children of
  ``key`` changed (level-triggered: the callback re-reads; several changes may coalesce into one
  call). Watches survive reconnects; after a reconnect every watch fires once, since changes may
  have been missed;
* session state events: CONNECTED, SUSPENDED (connection lost, session may still be alive),
  LOST (session/lease expired: every ephemeral key of this backend is gone). After LOST the
  backend establishes a new session by itself and reports CONNECTED again; ephemeral keys
  created from then on belong to the new session (recipes re-register on LOST).

All methods are coroutines run on the event loop that called :meth:`start`; callbacks (watches
and session listeners) are invoked on that same loop and must not block. Library exceptions are
translated at this boundary into :mod:`waltz_core.errors` (``NoNodeError``, ``NodeExistsError``,
``CasConflictError``, ``SessionLostError``, ``CoordinationError``).

Recipes built on this protocol (:mod:`waltz_core.coordination.recipes`) are identical for every
backend. Values are bytes; the recipes store UTF-8 JSON so they stay readable with zkCli/etcdctl.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import attrs


class SessionState(enum.Enum):
    CONNECTED = "connected"
    SUSPENDED = "suspended"
    LOST = "lost"


@attrs.frozen(slots=True)
class Versioned:
    """A value and its version; the version changes on every write of that key."""

    value: bytes
    version: int


@runtime_checkable
class WatchHandle(Protocol):
    def cancel(self) -> None:
        """Stop calling the callback; idempotent."""


@runtime_checkable
class CoordinationBackend(Protocol):
    name: str

    async def start(self) -> None:
        """Connect and establish the session/lease. Raises CoordinationError if unreachable."""

    async def close(self) -> None:
        """End the session (its ephemeral keys disappear) and release resources; idempotent."""

    async def get(self, key: str) -> Versioned | None:
        """The value and version of ``key``, or None if it does not exist."""

    async def create(self, key: str, value: bytes, *, ephemeral: bool = False, make_parents: bool = True) -> int:
        """Create ``key`` if absent and return its version; NodeExistsError if present."""

    async def create_sequential(self, prefix: str, value: bytes, *, ephemeral: bool = True) -> str:
        """Create ``prefix + <10-digit increasing number>``; return the whole key."""

    async def set(self, key: str, value: bytes, *, expected_version: int | None = None) -> int:
        """Write ``key``; with ``expected_version`` only if the version still matches (CAS).

        Returns the new version. NoNodeError if absent; CasConflictError on a version mismatch.
        """

    async def delete(self, key: str, *, expected_version: int | None = None, recursive: bool = False) -> None:
        """Delete ``key`` (and its descendants when ``recursive``). Absent keys are not an error."""

    async def children(self, key: str) -> list[str]:
        """Names (last path segment) of the immediate children of ``key``, sorted; ``[]`` if ``key`` is absent."""

    async def increment(self, key: str) -> int:
        """Atomically add one to the integer counter at ``key`` (created at 0) and return the new value."""

    def watch(self, key: str, callback: Callable[[], None]) -> WatchHandle:
        """Call ``callback()`` whenever the value or the children of ``key`` change."""

    def add_session_listener(self, callback: Callable[[SessionState], None]) -> None:
        """Call ``callback(state)`` on every session state change."""

    @property
    def session_state(self) -> SessionState:
        """The current session state."""
