"""The lock-table protocol: optimistic-lock bookkeeping of one partition.

A transaction names three kinds of lock (32-bit lock hashes, see :mod:`waltz_core.locks.lock_id`):

* **write** locks are checked against the client high-water mark and advanced on commit;
* **read** locks are checked but not advanced (readers never fail each other);
* **append** locks are advanced but not checked (appenders never fail each other, but a reader or
  writer that read before the append fails).

The *estimate* of a lock is an upper bound of the id of the last committed transaction that wrote
(or appended to) it; the estimate of a request is the maximum over its write and read locks (or
``-1`` when it has none). A request is safe when ``estimate <= client_high_water_mark``; otherwise
the append is rejected with a lock failure that carries the estimate. A strategy may over-estimate
(a spurious lock failure, the client retries) but must never under-estimate the exact value: that
would let a stale transaction commit.

In-flight appends. The server pipelines appends to storage, so a request whose locks touch an
append that was accepted but is not committed yet must not be decided on the table as it is: the
commit will change it. The partition's append task therefore drives one table like this, in
commit order, on one thread (the table is not thread-safe and never blocks)::

    if table.begin(request) is Begin.BUSY:        # collides with an in-flight append
        set the append aside; after the next commit call begin again (the appends behind it
        go on meanwhile); if nothing is in flight any more and begin is still BUSY:
        table.reset(store_hwm)
    conflict = table.check(request, client_high_water_mark)
    if conflict is not None:
        table.abort(request)                      # reply LOCK_FAILURE(req_id, conflict)
    else:
        hand to the store; on commit -> table.commit(request, txn_id)
                           on failure -> table.abort(request)

Conflicts with in-flight appends therefore serialise rather than fail, and no hook call is made
per transaction: the server resolves the strategy by name once and calls the table directly.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import attrs

if TYPE_CHECKING:
    from ..protocol.client import AppendRequest

LockHashes = tuple[int, ...]


class Begin(enum.Enum):
    """Outcome of :meth:`LockTable.begin`."""

    OK = "ok"  #: the request is now in flight; it must end with commit() or abort()
    BUSY = "busy"  #: collides with an in-flight append; nothing changed, wait for commits and retry


def _int_tuple(value: object) -> LockHashes:
    return tuple(value)  # type: ignore[arg-type]


@attrs.frozen(slots=True)
class LockRequest:
    """The locks of one append, as signed 32-bit lock hashes.

    The server builds one per append with :meth:`from_append` (the wire tuples are reused, not
    copied) and passes the same object to begin/check/commit/abort.
    """

    write_locks: LockHashes = attrs.field(default=(), converter=_int_tuple)
    read_locks: LockHashes = attrs.field(default=(), converter=_int_tuple)
    append_locks: LockHashes = attrs.field(default=(), converter=_int_tuple)

    @classmethod
    def from_append(cls, request: AppendRequest) -> LockRequest:
        """The lock request of a decoded ``AppendRequest``."""
        w, r, a = request.write_locks, request.read_locks, request.append_locks
        if cls is LockRequest and type(w) is tuple and type(r) is tuple and type(a) is tuple:
            # Decoded appends carry tuples already: through the slot descriptors, without the
            # converters (one per locked append on the server's append path).
            lock_request: LockRequest = _new_object(LockRequest)
            _set_write_locks(lock_request, w)
            _set_read_locks(lock_request, r)
            _set_append_locks(lock_request, a)
            return lock_request
        return cls(w, r, a)

    @property
    def is_empty(self) -> bool:
        return not (self.write_locks or self.read_locks or self.append_locks)


_new_object = object.__new__
_set_write_locks, _set_read_locks, _set_append_locks = (
    getattr(LockRequest, field.name).__set__ for field in attrs.fields(LockRequest))

#: The request of an append without locks (always safe, never busy).
NO_LOCKS = LockRequest()


@runtime_checkable
class LockTable(Protocol):
    """One partition's lock table. Called only from the partition's append task; never blocks."""

    def begin(self, request: LockRequest) -> Begin:
        """Mark ``request`` in flight unless it collides with an in-flight append.

        Returns :attr:`Begin.BUSY` (and changes nothing) when any of its write, read or append
        locks may be advanced by an append that is in flight; the caller waits until in-flight
        appends have committed (or aborted) and calls ``begin`` again. A strategy may report BUSY
        spuriously (slot collisions) but must report it for every real collision with an in-flight
        write or append lock. In-flight read locks never make another request BUSY.
        Returns :attr:`Begin.OK` otherwise; the request must then end with :meth:`commit` or
        :meth:`abort`.
        """
        ...

    def estimate(self, request: LockRequest) -> int:
        """Upper bound of the last committed transaction id over the write and read locks (``-1``
        when the request has neither). Never below the exact value."""
        ...

    def check(self, request: LockRequest, client_high_water_mark: int) -> int | None:
        """``None`` when the request is safe for a client at ``client_high_water_mark``, else the
        estimated conflicting transaction id (``> client_high_water_mark``) for LOCK_FAILURE.
        Changes nothing."""
        ...

    def commit(self, request: LockRequest, transaction_id: int) -> None:
        """The in-flight ``request`` committed as ``transaction_id``: advance its write and append
        locks to it and end its in-flight state. Commits arrive in increasing transaction id order."""
        ...

    def abort(self, request: LockRequest) -> None:
        """The in-flight ``request`` will not commit (lock failure, store failure): end its
        in-flight state without advancing anything."""
        ...

    def reset(self, high_water_mark: int) -> None:
        """Forget everything: every lock's estimate becomes ``high_water_mark``, nothing is in flight."""
        ...

    @property
    def in_flight(self) -> int:
        """Number of requests begun and not yet committed or aborted."""
        ...
