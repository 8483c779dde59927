"""The ``etcd`` coordination backend: :class:`CoordinationBackend` on etcd v3 (etcd-sdk-python).

Mapping of the protocol onto etcd:

* keys are the paths themselves (UTF-8); the version of a key is its ``mod_revision``;
* the tree is real: ``create`` also creates missing parents (empty values), like ZooKeeper, and a
  create/sequential create checks in its transaction that the parent exists; children are the
  keys under ``key + "/"`` with exactly one more path segment;
* CAS is a transaction comparing ``mod_revision``; create-if-absent compares ``version == 0``;
  non-recursive delete also checks, in the same transaction, that no child exists;
* ephemeral keys are attached to this backend's lease (TTL = ``session_timeout`` rounded up),
  refreshed every third of the TTL. A refresh answered with TTL 0 means the lease expired:
  LOST is reported, a new lease is granted and CONNECTED follows;
* sequential keys: a per-parent counter key ``seq:<parent>`` (outside the ``/`` tree, so never
  listed) advanced in the same transaction that creates ``prefix + 10 digits``;
* counters: decimal text, CAS loop on ``mod_revision``;
* watches: one range watch per registration over ``key`` and ``key/...`` (events filtered to the key
  and its direct children), started from the newest revision this backend has seen + 1, so changes
  made after any of its earlier reads are replayed, never missed. A broken watch stream is re-armed
  from the last delivered revision + 1 and fires once;
* several ``host:port`` in ``connect`` use ``MultiEndpointEtcd3Client(failover=True)``: a failed
  endpoint is skipped for ``endpoint_retry`` seconds and the request is retried on another;
* with a user and password, a request refused for its token (a restarted member, a token unused
  for ``--auth-token-ttl``) fetches a new token and is sent again, and the watches move to a
  stream that carries it (:mod:`.client`).

Threading: pyetcd is blocking (grpc). Every RPC runs on this backend's own small thread pool via
``loop.run_in_executor``; watch responses arrive on pyetcd's watch thread and are handed to the
loop with ``call_soon_threadsafe``. Callbacks run on the loop that called :meth:`start`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import grpc
import pyetcd
from pyetcd import etcdrpc
from pyetcd import exceptions as etcd_exc
from pyetcd.watch import WatchResponse

from waltz_core.coordination.base import SessionState, Versioned
from waltz_core.errors import (
    CasConflictError,
    CoordinationError,
    NodeExistsError,
    NoNodeError,
    SessionLostError,
)
from waltz_core.retry import RetryPolicy
from waltz_core.transport import is_loopback

from .client import Client, WatchRefusedError, is_token_refusal
from .options import EtcdOptions

log = logging.getLogger("waltz.coordination.etcd")

#: Failures after which the same request may be sent again (possibly to another endpoint).
_TRANSIENT = (etcd_exc.ConnectionFailedError, etcd_exc.ConnectionTimeoutError, etcd_exc.InternalServerError,
              etcd_exc.NoServerAvailableError, etcd_exc.WatchTimedOut)
#: Re-granting a lost lease, re-arming a watch that failed: every 200 ms, jittered so that the
#: processes that lost the cluster together do not come back in lock step.
_REARM_RETRY = RetryPolicy(initial=0.2, maximum=0.2)
_SEQ_PREFIX = "seq:"
#: A watch refused within this many seconds of authenticating is refused for a missing right, not
#: for a stale token: no new token is fetched for it (each costs the server a bcrypt check).
_TOKEN_FRESH = 5.0
#: After an authentication that failed (a changed password), seconds during which callers get
#: its error again instead of another attempt: every watch and request would ask for one.
_AUTH_RETRY = 1.0


def parse_endpoints(connect: str) -> list[tuple[str, int]]:
    """``host:port,host:port`` (``http://``/``https://`` prefixes allowed) to ``[(host, port), ...]``."""
    out = []
    for item in connect.split(","):
        item = item.strip().removeprefix("http://").removeprefix("https://").rstrip("/")
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise CoordinationError(f"etcd: bad endpoint {item!r} in connect {connect!r} (expected host:port)")
        out.append((host.strip("[]"), int(port)))
    if not out:
        raise CoordinationError("etcd: [coordination] connect is empty (expected host:port,...)")
    return out


def _b(text: str) -> bytes:
    return text.encode("utf-8")


def _parent(key: str) -> str | None:
    """The parent path of ``key``, or None for a top-level key (whose parent is the implicit root)."""
    parent = key.rstrip("/").rpartition("/")[0]
    return parent or None


def _prefix_end(prefix: bytes) -> bytes:
    end: bytes = pyetcd.utils.prefix_range_end(prefix)
    return end


# -- raw protobuf builders (pyetcd's helpers cannot set ignore_lease or range compares)
def _cmp(key: str, target: str, value: int, op: str = "==", range_end: bytes | None = None) -> Any:
    c = etcdrpc.Compare(key=_b(key), target=getattr(etcdrpc.Compare, target),
                        result={"==": etcdrpc.Compare.EQUAL, ">": etcdrpc.Compare.GREATER,
                                "<": etcdrpc.Compare.LESS, "!=": etcdrpc.Compare.NOT_EQUAL}[op])
    if range_end is not None:
        c.range_end = range_end
    if target == "VERSION":
        c.version = value
    elif target == "MOD":
        c.mod_revision = value
    return c


def _put(key: str, value: bytes, *, lease: int = 0, ignore_lease: bool = False) -> Any:
    return etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=_b(key), value=value, lease=lease,
                                                            ignore_lease=ignore_lease))


def _get(key: str, range_end: bytes | None = None, *, keys_only: bool = False, count_only: bool = False) -> Any:
    req = etcdrpc.RangeRequest(key=_b(key), keys_only=keys_only, count_only=count_only)
    if range_end is not None:
        req.range_end = range_end
    return etcdrpc.RequestOp(request_range=req)


def _delete(key: str, range_end: bytes | None = None) -> Any:
    req = etcdrpc.DeleteRangeRequest(key=_b(key))
    if range_end is not None:
        req.range_end = range_end
    return etcdrpc.RequestOp(request_delete_range=req)


def _children_range(key: str) -> tuple[str, bytes]:
    prefix = key.rstrip("/") + "/"
    return prefix, _prefix_end(_b(prefix))


class _Watch:
    """One :meth:`EtcdBackend.watch` registration (implements WatchHandle)."""

    __slots__ = ("backend", "key", "callback", "cancelled", "watch_id", "revision", "pending", "arming", "generation")

    def __init__(self, backend: EtcdBackend, key: str, callback: Callable[[], None], revision: int) -> None:
        self.backend = backend
        self.key = key.rstrip("/") or "/"
        self.callback = callback
        self.cancelled = False
        self.watch_id: int | None = None
        self.revision = revision  # newest revision whose changes were delivered (or known)
        self.pending = False
        self.arming = False
        #: bumped whenever the server watch must be made again; answers of older ones are ignored
        self.generation = 0

    def relevant(self, event_key: bytes) -> bool:
        """The key itself or one of its direct children (the range also holds siblings like key-x)."""
        k = event_key.decode("utf-8", "replace")
        if k == self.key:
            return True
        prefix = self.key.rstrip("/") + "/"
        return k.startswith(prefix) and "/" not in k[len(prefix):]

    def responder(self, generation: int) -> Callable[[Any], None]:
        """The callback for pyetcd's watch thread, tagged with the arming it belongs to."""
        def on_response(response: Any) -> None:
            self.backend.post_watch_response(self, response, generation)
        return on_response

    def cancel(self) -> None:
        """Stop calling the callback; idempotent. Call it on the backend's loop."""
        if self.cancelled:
            return
        self.cancelled = True
        self.backend.release_watch(self)


class EtcdBackend:
    """Coordination on etcd v3 (see the module docstring for the mapping and threading).

    :param connect: ``host:port[,host:port...]`` of the members' client URLs (``https://host:port``
        turns TLS on, as ``[coordination.etcd] tls``/``tls_ca``/``tls_cert`` do)
    :param session_timeout: lease TTL in seconds (rounded up, at least 2); also how long a request
        is retried while no endpoint answers
    :param options: authentication and tuning
    """

    name = "etcd"

    def __init__(self, connect: str, *, session_timeout: float = 10.0, options: EtcdOptions | None = None) -> None:
        self.endpoints = parse_endpoints(connect)
        self.connect = connect
        self.session_timeout = session_timeout
        self.options = options or EtcdOptions()
        #: TLS when the options ask for it, or the connect string names https:// members
        self.tls = self.options.tls_enabled or "https://" in connect
        self.ttl = max(2, math.ceil(session_timeout))
        #: a transient RPC failure: retried every 100 ms (jittered) for up to session_timeout
        self._rpc_retry = RetryPolicy(initial=0.1, maximum=0.1, deadline=session_timeout)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._client: Client | None = None
        self._lease_id: int | None = None
        self._revision = 0
        self._state = SessionState.SUSPENDED
        self._listeners: list[Callable[[SessionState], None]] = []
        self._watches: set[_Watch] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._keepalive: asyncio.Task[None] | None = None
        self._closed = False
        self._auth_lock = asyncio.Lock()
        self._authenticated_at = 0.0  # time.monotonic() of the newest token
        self._auth_failure: tuple[float, str] | None = None  # (when, why) of the last failed authentication

    # ------------------------------------------------------------------------------- lifecycle
    def _make_client(self) -> Client:
        """Build the grpc client (blocking: authenticates when a user is configured)."""
        opts = [
            ("grpc.enable_http_proxy", 0),  # loopback and cluster links never go through a proxy
            # A member whose host vanished answers nothing: without keepalive pings a watch stream
            # on that connection stays open and silent forever. etcd refuses pings more often than
            # every 5 s (--grpc-keepalive-min-time) and without an open stream.
            ("grpc.keepalive_time_ms", 5000),
            ("grpc.keepalive_timeout_ms", 2000),
            ("grpc.keepalive_permit_without_calls", 0),
            ("grpc.http2.max_pings_without_data", 0),
        ]
        creds = self._channel_credentials()
        endpoints = [pyetcd.Endpoint(host=h, port=p, secure=creds is not None, creds=creds,
                                     time_retry=self.options.endpoint_retry, opts=opts)
                     for h, p in self.endpoints]
        client = Client(
            endpoints=endpoints, timeout=self.options.request_timeout, failover=True,
            user=self.options.user or None, password=self.options.password or None)
        # grpc refuses call credentials on plaintext channels ("does not have a sufficient security
        # level"); the auth token travels as plain metadata instead, which pyetcd also sets.
        client.call_credentials = None
        self._authenticated_at = time.monotonic()
        return client

    def _channel_credentials(self) -> grpc.ChannelCredentials | None:
        """TLS credentials from ``tls_ca``/``tls_cert``/``tls_key``; None without TLS."""
        if not self.tls:
            return None
        ca, cert, key = self.options.load_tls_files("coordination.etcd")
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    async def start(self) -> None:
        """Connect and grant the lease; CoordinationError if no endpoint answers within session_timeout."""
        if self._loop is not None:
            raise CoordinationError("etcd: backend already started")
        self._loop = asyncio.get_running_loop()
        if not self.tls:
            remote = sorted({h for h, _ in self.endpoints if not is_loopback(h)})
            if remote:
                log.warning("etcd: the links to %s are not encrypted%s; set [coordination.etcd] tls_ca (and tls_cert, "
                            "tls_key for etcd --client-cert-auth)", ", ".join(remote),
                            ": the password and auth tokens cross the network in plaintext" if self.options.user
                            else "")
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="waltz-etcd")
        try:
            self._client = await self._in_pool(self._make_client)
            await self._grant_lease()
        except (CoordinationError, grpc.RpcError, etcd_exc.Etcd3Exception, ValueError) as exc:
            await self._shutdown()
            if isinstance(exc, CoordinationError):
                raise CoordinationError(f"etcd: cannot start a session with {self.connect}: {exc}") from exc
            raise CoordinationError(f"etcd: cannot connect to {self.connect}: {exc}") from exc
        self._set_state(SessionState.CONNECTED)
        self._keepalive = self._loop.create_task(self._keep_lease_alive())

    async def close(self) -> None:
        """Revoke the lease (ephemeral keys go at once), cancel watches, close the client; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._listeners.clear()
        for w in list(self._watches):
            w.cancelled = True
        self._watches.clear()
        if self._keepalive is not None:
            self._keepalive.cancel()
        for task in list(self._tasks):
            task.cancel()
        if self._client is not None and self._lease_id is not None:
            try:
                await self._rpc("lease", lambda c: c.revoke_lease(self._lease_id), retry=False)
            except CoordinationError as exc:
                log.info("etcd: could not revoke lease on close (it expires by itself): %s", exc)
        await self._shutdown()

    async def _shutdown(self) -> None:
        client, self._client = self._client, None
        pool, self._pool = self._pool, None
        if pool is None:
            return
        if client is not None:
            await asyncio.get_running_loop().run_in_executor(pool, client.close)
        await asyncio.to_thread(pool.shutdown, True)

    @property
    def session_state(self) -> SessionState:
        return self._state

    @property
    def lease_id(self) -> int | None:
        """The id of the current lease (ephemeral keys are attached to it)."""
        return self._lease_id

    @property
    def client(self) -> Client:
        """The pyetcd client (for tools and tests); CoordinationError when not started."""
        if self._client is None:
            raise CoordinationError("etcd: backend not started or already closed")
        return self._client

    # ------------------------------------------------------------------------------ threading
    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the backend's loop; called from other threads, never raises."""
        loop = self._loop
        if loop is None or self._closed:
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed
            pass

    async def _in_pool(self, fn: Callable[[], Any]) -> Any:
        if self._pool is None or self._loop is None:
            raise CoordinationError("etcd: backend not started or already closed")
        return await self._loop.run_in_executor(self._pool, fn)

    def _spawn(self, coro: Any) -> None:
        assert self._loop is not None
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_log_task_failure)

    def _seen(self, header: Any) -> None:
        if header is not None and header.revision > self._revision:
            self._revision = header.revision

    async def _rpc(self, what: str, call: Callable[[Client], Any], *,
                   retry: bool = True, attempts: list[int] | None = None, renew_token: bool = True) -> Any:
        """Run ``call(client)`` in the pool, retrying transient failures for up to session_timeout.

        ``attempts`` (if given) receives one entry per failed attempt, so a write can tell that
        an earlier attempt may have been applied although its reply was lost. A request refused
        for its token is sent again once with a new one (``renew_token``, with a user configured);
        such a refusal means it was not applied.
        """
        # _TRANSIENT are pyetcd's own exceptions: the retry decision stays with that list (the
        # Waltz flags only exist once they are translated, below)
        delays = self._rpc_retry.delays() if retry else iter(())
        renew_token = renew_token and bool(self.options.user)
        last_error = ""  # grpc's words for the latest failure: pyetcd's exceptions drop them
        while True:
            client = self.client
            token = client.metadata

            def run(client: Client = client) -> Any:
                try:
                    return call(client)
                except grpc.RpcError as exc:  # calls that bypass pyetcd's own error mapping
                    client._manage_grpc_errors(exc)  # noqa: SLF001 - pyetcd's error mapping + failover, not public

            try:
                return await self._in_pool(run)
            except _TRANSIENT as exc:
                if attempts is not None:
                    attempts.append(1)
                last_error = _grpc_details(exc) or last_error
                delay = None if self._closed else next(delays, None)
                if delay is None:  # not retried, past session_timeout, or closing
                    why = f"{exc}; last error: {last_error}" if last_error else str(exc)
                    raise CoordinationError(f"{what}: etcd unreachable at {self.connect} ({why})") from exc
                await asyncio.sleep(delay)
            except grpc.RpcError as exc:
                details = exc.details() or ""
                if renew_token and is_token_refusal(details):
                    renew_token = False
                    await self._renew_token(token, f"{what}: {details}")
                    continue
                if exc.code() == grpc.StatusCode.NOT_FOUND and "lease" in details:
                    raise SessionLostError(f"{what}: etcd lease expired ({details})") from exc
                raise CoordinationError(f"{what}: etcd refused: {exc.code().name}: {details}") from exc
            except etcd_exc.Etcd3Exception as exc:
                raise CoordinationError(f"{what}: etcd: {type(exc).__name__}: {exc}") from exc

    async def _renew_token(self, refused: Any, why: str) -> None:
        """Authenticate again unless another caller already replaced the ``refused`` token.

        Then every watch moves to a new stream: a stream carries the token it was opened with.
        """
        async with self._auth_lock:
            if self.client.metadata != refused:
                return
            failure = self._auth_failure
            if failure is not None and time.monotonic() - failure[0] < _AUTH_RETRY:
                raise CoordinationError(failure[1])
            log.info("etcd: the auth token was refused (%s); authenticating again", why)
            user, password = self.options.user, self.options.password
            try:
                await self._rpc("authenticate", lambda c: c.authenticate(user, password), renew_token=False)
            except CoordinationError as exc:
                self._auth_failure = (time.monotonic(), str(exc))
                raise
            self._auth_failure = None
            self._authenticated_at = time.monotonic()
        await self._renew_watches()

    async def _txn(self, what: str, compare: list[Any], success: list[Any], failure: list[Any],
                   attempts: list[int] | None = None) -> Any:
        """One transaction; returns the raw TxnResponse (``succeeded``, ``responses``, ``header``)."""
        request = etcdrpc.TxnRequest(compare=compare, success=success, failure=failure)
        resp = await self._rpc(what, lambda c: c.kvstub.Txn(request, c.timeout, credentials=c.call_credentials,
                                                            metadata=c.metadata), attempts=attempts)
        self._seen(resp.header)
        return resp

    # ---------------------------------------------------------------------------------- leases
    async def _grant_lease(self) -> None:
        # The raw grant, for its header (pyetcd's lease() drops it): the revision it carries is
        # where a watch set before any read starts. Without one it started "from now", when its
        # stream was made on a pool thread, and missed a change made in between.
        request = etcdrpc.LeaseGrantRequest(TTL=self.ttl, ID=0)
        resp = await self._rpc("lease grant", lambda c: c.leasestub.LeaseGrant(
            request, c.timeout, credentials=c.call_credentials, metadata=c.metadata))
        self._seen(resp.header)
        self._lease_id = int(resp.ID)

    async def _keep_lease_alive(self) -> None:
        """Refresh the lease every TTL/3; SUSPENDED while unreachable, LOST when it expired."""
        interval = self.ttl / 3
        last_ok = time.monotonic()
        while not self._closed:
            await asyncio.sleep(interval if self._state is SessionState.CONNECTED else 0.2)
            lease_id = self._lease_id
            try:
                replies = await self._rpc("lease keep-alive",
                                          lambda c: list(c.refresh_lease(lease_id)),  # noqa: B023 - awaited here
                                          retry=False)
            except CoordinationError as exc:
                log.debug("etcd keep-alive failed: %s", exc)
                self._set_state(SessionState.SUSPENDED)
                if time.monotonic() - last_ok < 2 * self.ttl:
                    continue
                # Unreachable for two TTLs: the lease cannot be alive any more.
                why = f"etcd unreachable for {2 * self.ttl} s"
            else:
                if replies and replies[-1].TTL > 0:
                    last_ok = time.monotonic()
                    self._set_state(SessionState.CONNECTED)
                    continue
                why = (f"the keep-alive answered TTL {replies[-1].TTL}" if replies
                       else "the keep-alive stream ended without an answer")
            # A lost session makes a server give up its partitions: worth a line at WARNING, with why.
            log.warning("etcd: lease %x of this session is gone (%s); granting a new one", lease_id or 0, why)
            self._set_state(SessionState.LOST)
            for delay in _REARM_RETRY.delays():
                if self._closed:
                    break
                try:
                    await self._grant_lease()
                    break
                except CoordinationError as exc:  # any: without a lease the backend is useless
                    log.debug("etcd: new lease not granted yet: %s", exc)
                    await asyncio.sleep(delay)
            last_ok = time.monotonic()
            self._set_state(SessionState.CONNECTED)

    # ---------------------------------------------------------------------------- operations
    async def get(self, key: str) -> Versioned | None:
        """The value and version (mod_revision) of ``key``, or None."""
        resp = await self._rpc(key, lambda c: c.get_response(key))
        self._seen(resp.header)
        if not resp.kvs:
            return None
        kv = resp.kvs[0]
        return Versioned(bytes(kv.value), int(kv.mod_revision))

    async def _ensure_parents(self, key: str) -> None:
        """Create every missing ancestor of ``key`` with an empty value (top-down, create-if-absent)."""
        parts = key.strip("/").split("/")[:-1]
        path = ""
        for part in parts:
            path += "/" + part
            await self._txn(path, [_cmp(path, "VERSION", 0)], [_put(path, b"")], [])

    def _parent_exists_compare(self, key: str) -> list[Any]:
        parent = _parent(key)
        return [] if parent is None else [_cmp(parent, "VERSION", 0, ">")]

    async def create(self, key: str, value: bytes, *, ephemeral: bool = False, make_parents: bool = True) -> int:
        """Create ``key`` if absent and return its version; NodeExistsError/NoNodeError otherwise."""
        lease = self._lease_id or 0 if ephemeral else 0
        compare = [_cmp(key, "VERSION", 0), *self._parent_exists_compare(key)]
        retried_parents = False
        while True:
            attempts: list[int] = []
            resp = await self._txn(key, compare, [_put(key, value, lease=lease)], [_get(key)], attempts)
            if resp.succeeded:
                return int(resp.header.revision)
            kvs = resp.responses[0].response_range.kvs
            if kvs:
                if attempts and kvs[0].value == value and kvs[0].lease == lease:
                    return int(kvs[0].mod_revision)  # our own create, whose reply was lost
                raise NodeExistsError(f"{key}: already exists")
            if not make_parents or retried_parents:
                raise NoNodeError(f"{_parent(key)}: parent of {key} does not exist")
            await self._ensure_parents(key)
            retried_parents = True

    async def create_sequential(self, prefix: str, value: bytes, *, ephemeral: bool = True) -> str:
        """Create ``prefix`` + 10 digits from the parent's counter (in one transaction); return the key."""
        parent = _parent(prefix) or "/"
        counter_key = _SEQ_PREFIX + parent
        lease = self._lease_id or 0 if ephemeral else 0
        parents_made = False
        while True:
            resp = await self._rpc(counter_key, lambda c: c.get_response(counter_key))
            self._seen(resp.header)
            if resp.kvs:
                number, guard = int(resp.kvs[0].value or b"0"), _cmp(counter_key, "MOD", resp.kvs[0].mod_revision)
            else:
                number, guard = 0, _cmp(counter_key, "VERSION", 0)
            key = f"{prefix}{number:010d}"
            compare = [guard, _cmp(key, "VERSION", 0), *self._parent_exists_compare(key)]
            success = [_put(counter_key, str(number + 1).encode("ascii")), _put(key, value, lease=lease)]
            txn = await self._txn(prefix, compare, success, [])
            if txn.succeeded:
                return key
            if not parents_made and _parent(key) is not None and await self.get(_parent(key) or "/") is None:
                await self._ensure_parents(key)
                parents_made = True
            # else: the counter moved (another creator, or a lost reply of ours): take the next number

    async def set(self, key: str, value: bytes, *, expected_version: int | None = None) -> int:
        """Write ``key`` (keeping its lease); with ``expected_version`` only if mod_revision matches."""
        compare = [_cmp(key, "VERSION", 0, ">")]
        if expected_version is not None:
            compare.append(_cmp(key, "MOD", expected_version))
        attempts: list[int] = []
        resp = await self._txn(key, compare, [_put(key, value, ignore_lease=True)], [_get(key)], attempts)
        if resp.succeeded:
            return int(resp.header.revision)
        kvs = resp.responses[0].response_range.kvs
        if not kvs:
            raise NoNodeError(f"{key}: no such key")
        if attempts and kvs[0].value == value:
            return int(kvs[0].mod_revision)  # our own write, whose reply was lost
        raise CasConflictError(f"{key}: version {kvs[0].mod_revision} is not the expected {expected_version}")

    async def delete(self, key: str, *, expected_version: int | None = None, recursive: bool = False) -> None:
        """Delete ``key`` (and its subtree when ``recursive``); absent keys are not an error."""
        prefix, end = _children_range(key)
        compare = [] if expected_version is None else [_cmp(key, "MOD", expected_version)]
        if not recursive:  # no child may exist: version of every key in the range is 0
            compare.append(_cmp(prefix, "VERSION", 0, range_end=end))
        success = [_delete(key)] + ([_delete(prefix, end)] if recursive else [])
        resp = await self._txn(key, compare, success, [_get(key), _get(prefix, end, count_only=True)])
        if resp.succeeded:
            return
        current = resp.responses[0].response_range.kvs
        if not current:
            if recursive or resp.responses[1].response_range.count == 0:
                return
        elif expected_version is not None and current[0].mod_revision != expected_version:
            raise CasConflictError(f"{key}: version {current[0].mod_revision} is not the expected {expected_version}")
        if resp.responses[1].response_range.count:
            raise CoordinationError(f"{key}: has children (delete with recursive=True)")

    async def children(self, key: str) -> list[str]:
        """Sorted names of the direct children of ``key`` ([] if none)."""
        prefix, end = _children_range(key)
        resp = await self._rpc(key, lambda c: c.kvstub.Range(
            etcdrpc.RangeRequest(key=_b(prefix), range_end=end, keys_only=True), c.timeout,
            credentials=c.call_credentials, metadata=c.metadata))
        self._seen(resp.header)
        names = set()
        for kv in resp.kvs:
            rest = kv.key.decode("utf-8", "replace")[len(prefix):]
            if rest and "/" not in rest:
                names.add(rest)
        return sorted(names)

    async def increment(self, key: str) -> int:
        """Add one to the decimal counter at ``key`` (created at 0): CAS loop on mod_revision."""
        while True:
            current = await self.get(key)
            if current is None:
                try:
                    await self.create(key, b"1")
                    return 1
                except NodeExistsError:
                    continue
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

        The server-side watch starts at the newest revision this backend has seen + 1, so a
        change made after this call (or after any earlier read of this backend) is delivered.
        """
        if self._loop is None or self._closed:
            raise CoordinationError("etcd: watch() before start() or after close()")
        handle = _Watch(self, key, callback, self._revision)
        self._watches.add(handle)
        self._spawn(self._arm(handle, fire_after=False))
        return handle

    async def _arm(self, handle: _Watch, *, fire_after: bool) -> None:
        """Create the server watch from ``handle.revision + 1``; retried until it works or is cancelled."""
        if handle.arming:
            return
        handle.arming = True
        try:
            prefix_end = _prefix_end(_b(handle.key.rstrip("/") + "/"))
            delays = _REARM_RETRY.delays()
            refused_logged = False
            while not handle.cancelled and not self._closed:
                start = handle.revision + 1 if handle.revision > 0 else None
                client = self.client
                generation = handle.generation
                respond = handle.responder(generation)

                def create(client: Client = client, start: int | None = start,
                           respond: Callable[[Any], None] = respond) -> int:
                    return int(client.add_watch_callback(handle.key, respond, range_end=prefix_end,
                                                         start_revision=start))

                token = client.metadata
                try:
                    watch_id = await self._in_pool(create)
                except WatchRefusedError as exc:
                    # etcd says "invalid auth token" for a token it forgot; "permission denied"
                    # is a missing right, or a token the server no longer takes (the reasons
                    # vary between versions): then a new token is tried unless the current one
                    # is fresh.
                    if self.options.user and (is_token_refusal(exc.reason) or
                                              time.monotonic() - self._authenticated_at > _TOKEN_FRESH):
                        try:
                            await self._renew_token(token, f"watch on {handle.key}: {exc.reason}")
                        except CoordinationError as auth_exc:
                            if not refused_logged:
                                log.warning("etcd: watch on %s refused (%s), and %s; trying again", handle.key,
                                            exc.reason, auth_exc)
                                refused_logged = True
                    elif not refused_logged:
                        log.warning("etcd: watch on %s refused (%s); trying again", handle.key, exc.reason)
                        refused_logged = True
                    fire_after = True
                    await asyncio.sleep(next(delays))
                    continue
                except etcd_exc.RevisionCompactedError:
                    handle.revision = 0  # history gone: watch from now; the delivery below covers the gap
                    fire_after = True
                    continue
                except (grpc.RpcError, etcd_exc.Etcd3Exception) as exc:
                    log.debug("etcd: arming watch on %s failed: %r", handle.key, exc)
                    self._fail_endpoint(client)
                    fire_after = True
                    await asyncio.sleep(next(delays))
                    continue
                if handle.cancelled or self._closed:
                    self._cancel_server_watch(watch_id)
                    return
                if generation != handle.generation:  # re-arm asked for while this one was made
                    self._cancel_server_watch(watch_id)
                    fire_after = True
                    continue
                handle.watch_id = watch_id
                break
        finally:
            handle.arming = False
        if fire_after:
            self._deliver_soon(handle)

    def _fail_endpoint(self, client: Client) -> None:
        # A watch stream failure does not go through pyetcd's failover bookkeeping: do it here so
        # the next attempt uses another endpoint.
        if len(self.endpoints) > 1:
            try:
                client.endpoint_in_use.fail()
            except Exception:  # noqa: BLE001 - bookkeeping only
                pass

    def post_watch_response(self, handle: _Watch, response: Any, generation: int) -> None:
        """Hand a watch response (or the end of its stream) to the loop; never raises.

        Called on pyetcd's watch thread by the callback of :meth:`_Watch.responder`.
        """
        self._post(self._on_watch_response, handle, response, generation)

    def release_watch(self, handle: _Watch) -> None:
        """Forget ``handle`` and cancel its server watch, if any; on the loop.

        Called by :meth:`_Watch.cancel` once the handle is marked cancelled.
        """
        self._watches.discard(handle)
        if handle.watch_id is not None:
            self._cancel_server_watch(handle.watch_id)
            handle.watch_id = None

    def _cancel_server_watch(self, watch_id: int) -> None:
        client, pool = self._client, self._pool
        if client is None or pool is None:
            return
        try:
            pool.submit(client.cancel_watch, watch_id).add_done_callback(lambda f: f.exception())
        except RuntimeError:  # pool shutting down: the stream closes with the client
            pass

    def _on_watch_response(self, handle: _Watch, response: Any, generation: int) -> None:
        """On the loop: a watch response, or the end of the stream (an error or None)."""
        if handle.cancelled or self._closed or generation != handle.generation:
            return  # cancelled, or the answer of a server watch that was since replaced
        if isinstance(response, WatchResponse):
            self._seen(response.header)
            if any(handle.relevant(ev.key) for ev in response.events):
                handle.revision = max(handle.revision, response.header.revision)
                self._deliver_soon(handle)
            return
        # The stream ended (server gone, endpoint switched, compaction): re-arm and fire once.
        handle.watch_id = None
        if isinstance(response, etcd_exc.RevisionCompactedError):
            handle.revision = 0
        self._spawn(self._arm(handle, fire_after=True))

    def _deliver_soon(self, handle: _Watch) -> None:
        if handle.pending or self._loop is None:
            return  # coalesced with the delivery already queued
        handle.pending = True
        self._loop.call_soon(self._deliver, handle)

    def _deliver(self, handle: _Watch) -> None:
        handle.pending = False
        if handle.cancelled or self._closed:
            return
        try:
            handle.callback()
        except Exception:  # a faulty callback must not kill the backend
            log.exception("watch callback for %s failed", handle.key)

    # ---------------------------------------------------------------------------- session state
    def add_session_listener(self, callback: Callable[[SessionState], None]) -> None:
        """Call ``callback(state)`` on the loop at every session state change."""
        self._listeners.append(callback)

    def _set_state(self, state: SessionState) -> None:
        if self._closed or state == self._state:
            return
        previous, self._state = self._state, state
        log.info("etcd session %s -> %s (%s)", previous.value, state.value, self.connect)
        for listener in list(self._listeners):
            try:
                listener(state)
            except Exception:  # a faulty listener must not kill the backend
                log.exception("session listener failed")
        if state is SessionState.CONNECTED and previous is not SessionState.CONNECTED:
            if previous is SessionState.SUSPENDED or previous is SessionState.LOST:
                self._spawn(self._renew_watches())
            else:
                for handle in list(self._watches):  # changes may have been missed: fire each once
                    self._deliver_soon(handle)

    async def _renew_watches(self) -> None:
        """After the session was in trouble, make every server watch again on a new stream.

        A watch stream whose connection died silently (its member's host vanished) stays open on
        this side and delivers nothing, and may be the one stream pyetcd would reuse: so a new
        watcher (a new stream) is put in place, every watch is armed again from the revision it
        had delivered, and each fires once (changes may have been missed). Answers of the old
        watches are ignored (generation).
        """
        client = self._client
        if client is None:
            return

        def new_stream() -> Any:
            old, client.watcher = client.watcher, client.get_watcher()
            return old

        try:
            old = await self._in_pool(new_stream)
        except (CoordinationError, grpc.RpcError, etcd_exc.Etcd3Exception, ValueError) as exc:
            log.debug("etcd: could not open a new watch stream yet: %r", exc)
            old = None
        for handle in list(self._watches):
            handle.generation += 1
            handle.watch_id = None  # the old server watch dies with its stream
            self._spawn(self._arm(handle, fire_after=True))
        if old is not None and self._pool is not None:
            self._pool.submit(old.close).add_done_callback(lambda f: f.exception())


def _grpc_details(exc: BaseException) -> str:
    """The details of the grpc error behind ``exc`` (a TLS handshake that failed, a refused
    connection), which pyetcd's own exceptions do not carry; "" if there is none."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, grpc.RpcError):
            return str(seen.details() or seen.code().name)
        seen = seen.__cause__ or seen.__context__
    return ""


def _log_task_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("etcd backend task failed", exc_info=task.exception())
