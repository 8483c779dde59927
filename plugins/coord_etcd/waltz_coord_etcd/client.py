"""pyetcd's client, adapted for a process that runs for months: tokens renewed, refusals seen.

Two gaps of pyetcd that the backend must not inherit:

* **The auth token is fetched once**, in the client's constructor. etcd forgets a simple token
  when the member restarts and after ``--auth-token-ttl`` seconds (300 by default) without use,
  and refuses a token issued before the auth store changed. Every later request is then refused
  with ``invalid auth token`` for ever. :meth:`Client.authenticate` fetches a new one; the backend
  calls it when a request is refused that way (etcd's own clientv3 does the same).
* **A watch the server refuses looks created.** etcd answers a watch it will not serve (a stale
  token, no read permission) with a response both ``created`` and ``canceled``; pyetcd takes it
  for a created watch, which then never delivers anything. :class:`Watcher` raises
  :class:`WatchRefusedError` from ``add_callback`` instead, and hands the same error to the callback
  of a watch the server cancels later, so the backend arms it again.
"""

from __future__ import annotations

from typing import Any

import pyetcd
from pyetcd import etcdrpc
from pyetcd import exceptions as etcd_exc
from pyetcd import watch as etcd_watch

#: Refusals that a new token cures (etcd's clientv3 ``shouldRefreshToken``): the token is unknown
#: (member restarted, TTL passed), was issued before the auth store changed, or is missing.
TOKEN_REFUSALS = ("invalid auth token", "revision of auth store is old", "user name is empty")


def is_token_refusal(details: str) -> bool:
    """True when a request's error ``details`` say its token is stale, not that it lacks a right."""
    return any(reason in details for reason in TOKEN_REFUSALS)


class WatchRefusedError(etcd_exc.Etcd3Exception):  # type: ignore[misc]  # pyetcd has no type hints
    """The server canceled a watch (its ``cancel_reason``): refused at creation or ended later."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Watcher(etcd_watch.Watcher):  # type: ignore[misc]  # pyetcd has no type hints
    """pyetcd's watcher; a watch the server cancels is an error, not silence (module docstring)."""

    def _handle_response(self, rs: Any) -> None:
        if not rs.canceled or rs.compact_revision != 0:  # compaction: pyetcd's own handling
            super()._handle_response(rs)
            return
        error = WatchRefusedError(rs.cancel_reason or "canceled by the server")
        with self._lock:
            if rs.created:
                if self._new_watch is not None:  # else add_callback gave up waiting already
                    self._new_watch.err = error
                    self._new_watch_cond.notify_all()
                return
            # A watch this side canceled has no callback left: only the server's own cancels remain.
            callback = self._callbacks.pop(rs.watch_id, None)
        if callback is not None:
            etcd_watch._safe_callback(callback, error)  # noqa: SLF001 - pyetcd's guarded call


class Client(pyetcd.MultiEndpointEtcd3Client):  # type: ignore[misc]  # pyetcd has no type hints
    """``MultiEndpointEtcd3Client`` with :class:`Watcher` and a token that can be renewed."""

    def get_watcher(self) -> Watcher:
        # also what pyetcd calls when failover switches the endpoint and drops the old stubs
        return Watcher(etcdrpc.WatchStub(self.channel), timeout=self.timeout,
                       call_credentials=self.call_credentials, metadata=self.metadata)

    def authenticate(self, user: str, password: str) -> None:
        """Fetch a new token (blocking); later requests and watch streams carry it.

        Requests read ``metadata`` when they are sent, so a request in flight keeps the old
        token; the watch stream has it for its lifetime, so the caller makes a new stream.
        """
        resp = self.authstub.Authenticate(etcdrpc.AuthenticateRequest(name=user, password=password), self.timeout)
        self.metadata = (("token", resp.token),)
