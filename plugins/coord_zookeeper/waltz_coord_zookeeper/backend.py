"""The ``zookeeper`` coordination backend: :class:`CoordinationBackend` on kazoo.

Threading: kazoo runs its own connection and callback threads. Every ZooKeeper request is issued
with kazoo's ``*_async`` API (which only enqueues it, never blocks) and its result is handed back
to the event loop that called :meth:`ZooKeeperBackend.start` with ``loop.call_soon_threadsafe``.
Watch events and session state changes take the same path, so every user callback runs on that
loop. Nothing here blocks the loop except ``start``/``close``, which run kazoo's blocking
start/stop in a worker thread.

Retries: a request that fails with a connection loss is retried after the client reconnects,
for at most ``session_timeout`` seconds. A write that was sent but whose reply was lost may have
been applied; the retry recognises its own earlier write (same data, expected version + 1, same
session owner) instead of reporting a false conflict.

Watches are kazoo one-shot watches re-armed by the backend: kazoo forgets every watcher when the
connection drops, so after each reconnect the backend re-arms all watches and fires each once.

Fail-over between members: kazoo opens the TCP connection to a member with the whole session
timeout as its connect timeout, so a member whose host vanished (SYNs dropped, no reset) holds
the client for a session timeout and the session expires although a majority is up. The handler
here bounds each member's TCP connect (``member_connect_timeout``, by default the session timeout
divided among the members plus one), so the client tries every member within one session timeout.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import time
from collections.abc import Callable
from typing import Any

from kazoo import exceptions as kz
from kazoo.client import KazooClient
from kazoo.handlers.threading import KazooTimeoutError, SequentialThreadingHandler
from kazoo.protocol.states import EventType, KazooState, WatchedEvent, ZnodeStat
from kazoo.security import ACL, Id

from waltz_core.coordination.base import SessionState, Versioned
from waltz_core.errors import (
    CasConflictError,
    CoordinationError,
    NodeExistsError,
    NoNodeError,
    SessionLostError,
)
from waltz_core.timeouts import wait_for
from waltz_core.transport import is_loopback

from .options import ZooKeeperOptions, parse_acl_entry

log = logging.getLogger("waltz.coordination.zookeeper")


class _BelowError(logging.Filter):
    """Drops records below ERROR (kazoo's connection-attempt warnings during the first connect)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR

_SEQUENCE_DIGITS = re.compile(r"\d{10}")
#: Failures after which the request may simply be sent again once the client is reconnected.
_TRANSIENT = (kz.ConnectionLoss, kz.OperationTimeoutError, kz.SessionMovedError, asyncio.TimeoutError)
_STATE_MAP = {KazooState.CONNECTED: SessionState.CONNECTED, KazooState.SUSPENDED: SessionState.SUSPENDED,
              KazooState.LOST: SessionState.LOST}


def _translate(exc: BaseException, key: str) -> BaseException:
    """The waltz_core.errors class for a kazoo failure on ``key``."""
    if isinstance(exc, kz.NoNodeError):
        return NoNodeError(f"{key}: no such key")
    if isinstance(exc, kz.NodeExistsError):
        return NodeExistsError(f"{key}: already exists")
    if isinstance(exc, kz.BadVersionError):
        return CasConflictError(f"{key}: version changed (compare-and-set lost)")
    if isinstance(exc, kz.SessionExpiredError):
        return SessionLostError(f"{key}: ZooKeeper session expired")
    if isinstance(exc, kz.NotEmptyError):
        return CoordinationError(f"{key}: has children (delete with recursive=True)")
    if isinstance(exc, (kz.NoAuthError, kz.AuthFailedError)):
        return CoordinationError(f"{key}: not authorised by the ZooKeeper ACL ({type(exc).__name__})")
    if isinstance(exc, kz.ConnectionClosedError):
        return CoordinationError(f"{key}: the ZooKeeper client is closed")
    if isinstance(exc, _TRANSIENT):
        return CoordinationError(f"{key}: ZooKeeper unreachable ({type(exc).__name__})")
    if isinstance(exc, ValueError):  # kazoo validates paths with ValueError
        return CoordinationError(f"{key}: {exc}")
    return CoordinationError(f"{key}: {type(exc).__name__}: {exc}")


def _consume(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


class _Watch:
    """One :meth:`ZooKeeperBackend.watch` registration (implements WatchHandle)."""

    __slots__ = ("backend", "key", "callback", "cancelled", "pending", "again", "watcher")

    def __init__(self, backend: ZooKeeperBackend, key: str, callback: Callable[[], None]) -> None:
        self.backend = backend
        self.key = key
        self.callback = callback
        self.cancelled = False
        self.pending = False  # a re-arm is in flight, its delivery not yet made
        self.again = False  # another event arrived while pending
        # One function object per registration: kazoo keeps watchers in sets, so re-arming with the
        # same object never stacks duplicates. Runs on a kazoo thread.
        self.watcher = self._on_kazoo_event

    def _on_kazoo_event(self, event: WatchedEvent) -> None:
        if event.type == EventType.NONE:
            return  # a connection state change: the reconnect handler re-arms and fires every watch
        self.backend.post_watch_event(self)

    def cancel(self) -> None:
        """Stop calling the callback; idempotent. Must be called on the backend's loop."""
        self.cancelled = True
        self.backend.release_watch(self)


class _BoundedConnectHandler(SequentialThreadingHandler):  # type: ignore[misc]  # kazoo has no types: Any
    """kazoo's threading handler with a bound on each member's TCP connect (see the module docstring)."""

    def __init__(self, connect_timeout: float) -> None:
        super().__init__()
        self.member_connect_timeout = connect_timeout
        #: why the latest connect failed (a refused port, a TLS handshake): what a failed start names
        self.last_error = ""

    def create_connection(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("timeout") is not None:
            kwargs["timeout"] = min(kwargs["timeout"], self.member_connect_timeout)
        try:
            return super().create_connection(*args, **kwargs)
        except OSError as exc:  # ssl.SSLError included
            self.last_error = str(exc) or type(exc).__name__
            raise


def _hosts(connect: str) -> list[str]:
    """The host names of ``host:port,...[/chroot]``."""
    return [h.strip().rpartition(":")[0].strip("[]") or h.strip()
            for h in connect.split("/", 1)[0].split(",") if h.strip()]


def member_connect_timeout(options: ZooKeeperOptions, session_timeout: float, connect: str) -> float:
    """The bound on one member's TCP connect: the option, or the session timeout shared among the
    members plus one (a client cycling through them all still reconnects within one session)."""
    if options.member_connect_timeout > 0:
        return options.member_connect_timeout
    members = len([h for h in connect.split("/", 1)[0].split(",") if h.strip()])
    return session_timeout / (max(members, 1) + 1)


class ZooKeeperBackend:
    """Coordination on a ZooKeeper ensemble (see the module docstring for threading and retries).

    :param connect: ``host:port,...`` (an optional ``/chroot`` suffix is honoured by kazoo)
    :param session_timeout: requested session timeout in seconds (the server clamps it to
        2-20 ticks); also the longest a request is retried while disconnected
    :param options: authentication, ACLs and tuning
    """

    name = "zookeeper"

    def __init__(self, connect: str, *, session_timeout: float = 10.0, options: ZooKeeperOptions | None = None) -> None:
        if not connect:
            raise CoordinationError("zookeeper: [coordination] connect is empty (expected host:port,...)")
        self.connect = connect
        self.session_timeout = session_timeout
        self.options = options or ZooKeeperOptions()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._zk: KazooClient | None = None
        self._state = SessionState.SUSPENDED
        self._connected = asyncio.Event()
        self._listeners: list[Callable[[SessionState], None]] = []
        self._watches: set[_Watch] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    # ------------------------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Connect and establish the session; CoordinationError if no server answers in time."""
        if self._zk is not None:
            raise CoordinationError("zookeeper: backend already started")
        self._loop = asyncio.get_running_loop()
        opts = self.options
        acl = [ACL(e.perms, Id(e.scheme, e.id)) for e in map(parse_acl_entry, opts.acl)] or None
        auth = [(opts.auth_scheme, opts.auth_credentials)] if opts.auth_scheme else None
        tls = self._tls_arguments()
        self._zk = KazooClient(
            hosts=self.connect, timeout=self.session_timeout, default_acl=acl, auth_data=auth, **tls,
            connection_retry={"max_tries": -1, "delay": 0.05, "max_delay": opts.reconnect_max_delay},
            handler=_BoundedConnectHandler(member_connect_timeout(opts, self.session_timeout, self.connect)),
            logger=logging.getLogger("waltz.coordination.zookeeper.kazoo"),
        )
        self._zk.add_listener(self._on_kazoo_state)
        # Until the first session exists, kazoo's per-attempt connection warnings are noise: a
        # failure ends in one CoordinationError that says it all (one clear line in the CLI).
        kazoo_log = logging.getLogger("waltz.coordination.zookeeper.kazoo")
        quiet = _BelowError()
        kazoo_log.addFilter(quiet)
        try:
            await asyncio.to_thread(self._zk.start, opts.connect_timeout)
        except (KazooTimeoutError, kz.KazooException, OSError, ValueError) as exc:
            zk, self._zk = self._zk, None
            await asyncio.to_thread(self._stop_client, zk)
            last_error = zk.handler.last_error
            last = f" (last attempt: {last_error})" if last_error else ""
            raise CoordinationError(
                f"zookeeper: cannot connect to {self.connect} within {opts.connect_timeout:g} s: "
                f"{exc or type(exc).__name__}{last}") from exc
        finally:
            kazoo_log.removeFilter(quiet)
        self._set_state(SessionState.CONNECTED)

    def _tls_arguments(self) -> dict[str, Any]:
        """kazoo's TLS arguments from ``tls``/``tls_ca``/``tls_cert``/``tls_key``; {} without TLS."""
        opts = self.options
        if not opts.tls_enabled:
            remote = sorted({h for h in _hosts(self.connect) if not is_loopback(h)})
            if remote:
                log.warning("zookeeper: the links to %s are not encrypted%s; set [coordination.zookeeper] tls_ca "
                            "(and tls_cert, tls_key) and connect to the members' secureClientPort",
                            ", ".join(remote), ": the digest credentials cross the network in plaintext"
                            if opts.auth_scheme == "digest" else "")
            return {}
        opts.load_tls_files("coordination.zookeeper")  # checked here: kazoo would only retry the connect
        return {"use_ssl": True, "verify_certs": True, "ca": opts.tls_ca or None, "certfile": opts.tls_cert or None,
                "keyfile": opts.tls_key or None}

    @staticmethod
    def _stop_client(zk: KazooClient) -> None:
        zk.stop()
        zk.close()

    async def close(self) -> None:
        """Close the session (its ephemeral znodes go at once) and stop kazoo's threads; idempotent."""
        if self._closed:
            return
        self._closed = True
        for w in list(self._watches):
            w.cancel()
        for task in list(self._tasks):
            task.cancel()
        self._listeners.clear()
        zk, self._zk = self._zk, None
        if zk is not None:
            zk.remove_listener(self._on_kazoo_state)
            try:
                # kazoo's stop joins its connection thread; never let a wedged one hang the caller.
                await wait_for(asyncio.to_thread(self._stop_client, zk), max(10.0, self.session_timeout))
            except TimeoutError:
                log.warning("zookeeper: client for %s did not stop within %.0fs", self.connect,
                            max(10.0, self.session_timeout))

    @property
    def session_state(self) -> SessionState:
        return self._state

    @property
    def session_id(self) -> int | None:
        """The current ZooKeeper session id (None while disconnected)."""
        cid = self._zk.client_id if self._zk is not None else None
        return cid[0] if cid else None

    @property
    def client(self) -> KazooClient:
        """The kazoo client (for tools and tests); CoordinationError before start/after close."""
        if self._zk is None:
            raise CoordinationError("zookeeper: backend not started or already closed")
        return self._zk

    # ------------------------------------------------------------------------------ threading
    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the backend's loop; called from kazoo threads, never raises."""
        loop = self._loop
        if loop is None or self._closed:
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is left to tell
            pass

    def _request(self, start_async: Callable[[], Any]) -> asyncio.Future[Any]:
        """Issue one kazoo ``*_async`` request and return a loop future of its result."""
        assert self._loop is not None
        fut: asyncio.Future[Any] = self._loop.create_future()

        def settle(value: Any, exc: BaseException | None) -> None:
            if fut.done():
                return
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(value)

        def done(result: Any) -> None:  # kazoo's completion thread
            try:
                value, exc = result.get_nowait(), None
            except Exception as e:  # noqa: BLE001 - carried to the loop and translated there
                value, exc = None, e
            self._post(settle, value, exc)

        start_async().rawlink(done)
        return fut

    async def _call(self, key: str, start_async: Callable[[KazooClient], Any], *, retry: bool = True) -> Any:
        """One request with retries across reconnects; failures translated for ``key``."""
        deadline = time.monotonic() + self.session_timeout
        while True:
            zk = self.client
            try:
                # kazoo drops queued requests when a session expires: bound the wait.
                return await wait_for(self._request(functools.partial(start_async, zk)), self.session_timeout)
            except _TRANSIENT as exc:
                if not retry or time.monotonic() >= deadline:
                    raise _translate(exc, key) from exc
                await self._wait_connected(deadline)
            except kz.KazooException as exc:
                raise _translate(exc, key) from exc
            except ValueError as exc:
                raise _translate(exc, key) from exc

    async def _attempts(self, key: str, attempt: Callable[[KazooClient], Any]) -> tuple[Any, bool]:
        """Like :meth:`_call` but also says whether an earlier attempt may have been applied."""
        deadline = time.monotonic() + self.session_timeout
        maybe_applied = False
        while True:
            zk = self.client
            try:
                value = await wait_for(self._request(functools.partial(attempt, zk)), self.session_timeout)
                return value, maybe_applied
            except _TRANSIENT as exc:
                maybe_applied = True
                if time.monotonic() >= deadline:
                    raise _translate(exc, key) from exc
                await self._wait_connected(deadline)
            except (kz.KazooException, ValueError) as exc:
                if maybe_applied:
                    exc.waltz_maybe_applied = True  # type: ignore[union-attr]
                raise

    async def _wait_connected(self, deadline: float) -> None:
        await asyncio.sleep(0.02)  # let kazoo notice the drop before waiting on the event
        remaining = deadline - time.monotonic()
        if remaining > 0:
            try:
                await wait_for(self._connected.wait(), remaining)
            except TimeoutError:
                pass

    # ---------------------------------------------------------------------------- operations
    async def get(self, key: str) -> Versioned | None:
        """The value and version of ``key``, or None."""
        try:
            data, stat = await self._call(key, lambda zk: zk.get_async(key))
        except NoNodeError:
            return None
        return Versioned(data, stat.version)

    async def _stat(self, key: str) -> tuple[bytes, ZnodeStat] | None:
        try:
            data, stat = await self._call(key, lambda zk: zk.get_async(key))
        except NoNodeError:
            return None
        return data, stat

    async def create(self, key: str, value: bytes, *, ephemeral: bool = False, make_parents: bool = True) -> int:
        """Create ``key`` (version 0); NodeExistsError if present, NoNodeError if the parent is missing."""
        try:
            await self._attempts(
                key, lambda zk: zk.create_async(key, value, ephemeral=ephemeral, makepath=make_parents))
            return 0
        except kz.NodeExistsError as exc:
            if getattr(exc, "waltz_maybe_applied", False):
                current = await self._stat(key)
                if current is not None and current[0] == value and (
                        not ephemeral or current[1].ephemeralOwner == self.session_id):
                    return int(current[1].version)  # our own create, whose reply was lost
            raise _translate(exc, key) from exc
        except (kz.KazooException, ValueError) as exc:
            raise _translate(exc, key) from exc

    async def create_sequential(self, prefix: str, value: bytes, *, ephemeral: bool = True) -> str:
        """Create ``prefix`` + 10 digits (ZooKeeper's per-parent sequence) and return the key.

        A request whose reply was lost is not blindly resent (that could leave two nodes): after
        reconnecting, a new node under the parent with this value (and, if ephemeral, this
        session as owner) is recognised as ours.
        """
        parent, _, base = prefix.rpartition("/")
        parent = parent or "/"
        before = set(await self.children(parent))
        deadline = time.monotonic() + self.session_timeout
        while True:
            zk = self.client
            try:
                create = functools.partial(zk.create_async, prefix, value, ephemeral=ephemeral, sequence=True,
                                           makepath=True)
                path = await wait_for(self._request(create), self.session_timeout)
                return str(path)
            except _TRANSIENT as exc:
                if time.monotonic() >= deadline:
                    raise _translate(exc, prefix) from exc
                await self._wait_connected(deadline)
                mine = await self._recover_sequential(parent, base, value, ephemeral, before)
                if mine is not None:
                    return mine
            except (kz.KazooException, ValueError) as exc:
                raise _translate(exc, prefix) from exc

    async def _recover_sequential(self, parent: str, base: str, value: bytes, ephemeral: bool,
                                  before: set[str]) -> str | None:
        for name in await self.children(parent):
            if name in before or not name.startswith(base) or not _SEQUENCE_DIGITS.fullmatch(name[len(base):]):
                continue
            key = f"{parent.rstrip('/')}/{name}"
            current = await self._stat(key)
            if current is not None and current[0] == value and (
                    not ephemeral or current[1].ephemeralOwner == self.session_id):
                return key
        return None

    async def set(self, key: str, value: bytes, *, expected_version: int | None = None) -> int:
        """Write ``key``; with ``expected_version`` only if it still matches. Returns the new version."""
        version = -1 if expected_version is None else expected_version
        try:
            stat, _ = await self._attempts(key, lambda zk: zk.set_async(key, value, version))
            return int(stat.version)
        except kz.BadVersionError as exc:
            if getattr(exc, "waltz_maybe_applied", False):
                current = await self._stat(key)
                if current is not None and current[0] == value and current[1].version == version + 1:
                    return int(current[1].version)  # our own write, whose reply was lost
            raise _translate(exc, key) from exc
        except (kz.KazooException, ValueError) as exc:
            raise _translate(exc, key) from exc

    async def delete(self, key: str, *, expected_version: int | None = None, recursive: bool = False) -> None:
        """Delete ``key`` (with its subtree when ``recursive``); an absent key is not an error."""
        if recursive:
            for name in await self.children(key):
                await self.delete(f"{key.rstrip('/')}/{name}", recursive=True)
        version = -1 if expected_version is None else expected_version
        try:
            await self._attempts(key, lambda zk: zk.delete_async(key, version))
        except kz.NoNodeError:
            return
        except (kz.KazooException, ValueError) as exc:
            raise _translate(exc, key) from exc

    async def children(self, key: str) -> list[str]:
        """Sorted names of the immediate children of ``key`` ([] if ``key`` does not exist)."""
        try:
            names = await self._call(key, lambda zk: zk.get_children_async(key))
        except NoNodeError:
            return []
        return sorted(names)

    async def increment(self, key: str) -> int:
        """Add one to the decimal counter at ``key`` (created at 0) with a CAS loop on its version."""
        while True:
            current = await self.get(key)
            if current is None:
                try:
                    await self.create(key, b"1")
                    return 1
                except NodeExistsError:
                    continue  # someone else created it first: CAS on theirs
            try:
                number = int(current.value.decode("ascii") or "0")
            except (UnicodeDecodeError, ValueError):
                raise CoordinationError(f"{key}: not a counter (value {current.value[:40]!r})") from None
            try:
                await self.set(key, str(number + 1).encode("ascii"), expected_version=current.version)
                return number + 1
            except CasConflictError:
                continue

    # ---------------------------------------------------------------------------------- watches
    def watch(self, key: str, callback: Callable[[], None]) -> _Watch:
        """Call ``callback()`` on the loop after the value or the children of ``key`` change.

        The ZooKeeper watches are requested before this returns (kazoo only enqueues them), so a
        change this backend makes afterwards is always seen.
        """
        if self._loop is None or self._closed:
            raise CoordinationError("zookeeper: watch() before start() or after close()")
        handle = _Watch(self, key, callback)
        self._watches.add(handle)
        self._arm(handle)  # replies awaited by nobody: this client's later requests queue behind them
        return handle

    def _arm(self, handle: _Watch) -> list[asyncio.Future[Any]]:
        """(Re)register the existence/data and children watches of ``handle``; futures of the replies.

        Failures need no handling (no node for children: the existence watch covers creation;
        connection loss: the reconnect handler re-arms) but are consumed, never left unretrieved.
        """
        zk = self._zk
        if zk is None or handle.cancelled:
            return []
        futures = []
        for start in (lambda: zk.exists_async(handle.key, watch=handle.watcher),
                      lambda: zk.get_children_async(handle.key, watch=handle.watcher)):
            try:
                fut = self._request(start)
            except Exception:  # a closing client; re-armed on reconnect or gone
                log.debug("arming watch on %s failed", handle.key, exc_info=True)
                continue
            fut.add_done_callback(_consume)
            futures.append(fut)
        return futures

    def post_watch_event(self, handle: _Watch) -> None:
        """Hand a ZooKeeper watch event of ``handle`` to the loop (there: :meth:`_fire`); never raises.

        Called on a kazoo thread by :meth:`_Watch._on_kazoo_event`.
        """
        self._post(self._fire, handle)

    def release_watch(self, handle: _Watch) -> None:
        """Forget ``handle``: a reconnect no longer re-arms or fires it; on the loop.

        Called by :meth:`_Watch.cancel` once the handle is marked cancelled.
        """
        self._watches.discard(handle)

    def _fire(self, handle: _Watch) -> None:
        """On the loop: re-arm ``handle``, then call its callback once the server has the new watches.

        Delivering only after the re-arm replies means any change made after the callback ran
        produces a new event, and the callback's own reads see every change made before.
        Events arriving meanwhile are coalesced into one more delivery.
        """
        if handle.cancelled or self._loop is None:
            return
        if handle.pending:
            handle.again = True
            return
        handle.pending = True
        task = self._loop.create_task(self._deliver(handle, self._arm(handle)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _deliver(self, handle: _Watch, armed: list[asyncio.Future[Any]]) -> None:
        if armed:
            await asyncio.wait(armed, timeout=self.session_timeout)
        handle.pending = False
        if handle.cancelled:
            return
        try:
            handle.callback()
        except Exception:  # a faulty callback must not kill the backend
            log.exception("watch callback for %s failed", handle.key)
        if handle.again:
            handle.again = False
            self._fire(handle)

    # ---------------------------------------------------------------------------- session state
    def add_session_listener(self, callback: Callable[[SessionState], None]) -> None:
        """Call ``callback(state)`` on the loop at every session state change."""
        self._listeners.append(callback)

    def _on_kazoo_state(self, state: str) -> None:  # kazoo's connection thread: must not block
        mapped = _STATE_MAP.get(state)
        if mapped is not None:
            self._post(self._set_state, mapped)

    def _set_state(self, state: SessionState) -> None:
        if self._closed or state == self._state:
            return
        previous, self._state = self._state, state
        log.info("zookeeper session %s -> %s (%s)", previous.value, state.value, self.connect)
        if state == SessionState.CONNECTED:
            self._connected.set()
        else:
            self._connected.clear()
        for listener in list(self._listeners):
            try:
                listener(state)
            except Exception:  # a faulty listener must not kill the backend
                log.exception("session listener failed")
        if state == SessionState.CONNECTED:
            # kazoo forgot every watcher when the connection dropped: re-arm all, fire each once.
            for handle in list(self._watches):
                self._fire(handle)

