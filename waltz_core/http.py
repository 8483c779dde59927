"""A tiny HTTP/1.1 endpoint: ``/livez``, ``/readyz``, ``/health``, ``/metrics``, ``/buildinfo`` and more.

Shared by the storage node and the Waltz server (original: Jetty with riff servlets). One
request per connection (``Connection: close``), GET/HEAD only, bounded request head; a bad
request gets a 400 and never disturbs the process.

It serves from a thread of its own (its own event loop), not from the process's event loop, so
that it still answers while that loop is stalled (a storage node's file work on a slow disk,
a long garbage collection): that is when an operator needs ``/metrics`` and the probes most. A
heartbeat on the process's loop (:class:`LoopHeartbeat`) measures how long the loop has not
turned. What reads process state (the health check, the caller's extra routes) runs on the
process's loop and is given :data:`LOOP_ANSWER_TIMEOUT` to answer; the metrics are rendered on
the endpoint's thread (their updates are single attribute writes, also made by the storage
node's I/O threads).

* ``/ping`` -> ``pong``;
* ``/livez`` -> JSON ``{"alive": bool, "event_loop_lag_seconds": s}``: 200 unless the process's
  event loop has not turned for :data:`LOOP_STALL_NOT_ALIVE` seconds (503; a restart is then the
  cure). A broken partition or a lost quorum is not checked here: a restart would not fix it.
  For a Kubernetes ``livenessProbe``;
* ``/readyz`` -> JSON ``{"ready": bool, "reasons": [...], ...details}``, 200 when the process can
  do its job, 503 with the reasons when it cannot (the ``health`` check of the process, or its
  loop not answering within :data:`LOOP_ANSWER_TIMEOUT`). For a Kubernetes ``readinessProbe``
  and load balancers;
* ``/health`` -> the same check as ``/readyz`` under its older name and body key
  (``{"healthy": bool, ...}``), 200 or 503;
* ``?pretty=true`` indents the JSON of these three;
* ``/metrics`` -> Prometheus text exposition (0.0.4) of a :class:`~waltz_core.metrics.MetricsRegistry`,
  plus ``process_*``, ``waltz_build_info`` and ``waltz_event_loop_lag_seconds``;
* ``/buildinfo`` -> JSON ``{"version", "service_name"}``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any, Final, TypeVar
from urllib.parse import parse_qs, urlsplit

import attrs

from .errors import ConfigError
from .metrics import MetricsRegistry, process_registry
from .timeouts import wait_for

log = logging.getLogger("waltz.http")

MAX_HEAD = 16 * 1024
#: Seconds between two beats of :class:`LoopHeartbeat` on the process's event loop.
HEARTBEAT_INTERVAL: Final = 0.5
#: Seconds the process's loop gets to answer a health check or an extra route before the
#: endpoint answers 503 for it (the Kubernetes probes' default timeout is 1 s).
LOOP_ANSWER_TIMEOUT: Final = 0.8
#: ``/livez`` fails once the process's loop has not turned for this many seconds: far longer
#: than any fdatasync or collection that ends by itself, so only a hung loop restarts a process.
LOOP_STALL_NOT_ALIVE: Final = 60.0
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 500: "Internal Server Error",
            503: "Service Unavailable"}


@attrs.frozen(slots=True)
class HttpResponse:
    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"


Route = Callable[[Mapping[str, list[str]]], Awaitable[HttpResponse]]
HealthCheck = Callable[[], tuple[bool, Mapping[str, Any]]]
_T = TypeVar("_T")


class LoopHeartbeat:
    """Stamps the time on the event loop it is started on every ``interval`` seconds; any
    thread reads :meth:`lag`, how much later than due the loop's last beat is (0.0 while the
    loop turns)."""

    def __init__(self, interval: float = HEARTBEAT_INTERVAL) -> None:
        self.interval = interval
        self._last = time.monotonic()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._beat()

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _beat(self) -> None:
        self._last = time.monotonic()
        assert self._loop is not None
        self._handle = self._loop.call_later(self.interval, self._beat)

    def lag(self) -> float:
        late = time.monotonic() - self._last - self.interval
        return late if late > 0.0 else 0.0


def _log_bad_request(writer: asyncio.StreamWriter, exc: BaseException) -> None:
    """One line per bad HTTP peer. A peer that connects and hangs up without a byte (a TCP health
    check) is not a bad peer: debug only."""
    peer = writer.get_extra_info("peername")
    where = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
    if isinstance(exc, asyncio.IncompleteReadError):
        if not exc.partial:
            log.debug("http connection from %s closed before a request", where)
            return
        why = f"peer closed after {len(exc.partial)} bytes without ending the request head"
    elif isinstance(exc, asyncio.LimitOverrunError):
        why = f"request head longer than {MAX_HEAD} bytes"
    elif isinstance(exc, TimeoutError):
        why = "no complete request head within 10 s"
    else:
        why = "malformed request line (expected METHOD TARGET VERSION)"
    log.warning("http: bad request from %s: %s; answered 400 and closed", where, why)


def _json(status: int, obj: Mapping[str, Any], query: Mapping[str, list[str]]) -> HttpResponse:
    indent = 2 if query.get("pretty", ["false"])[0] == "true" else None
    return HttpResponse(status, json.dumps(obj, indent=indent, default=str).encode() + b"\n", "application/json")


class HttpEndpoint:
    """Serve the standard routes plus ``routes`` (path -> async handler(query) -> HttpResponse).

    ``health`` is the readiness check of the process: ``(ready, details)``, where details name in
    ``reasons`` what is missing; ``/readyz`` and ``/health`` answer it, ``/livez`` never calls it.
    """

    def __init__(self, *, service_name: str, version: str, metrics: MetricsRegistry | None = None,
                 health: HealthCheck | None = None, routes: Mapping[str, Route] | None = None) -> None:
        self.service_name = service_name
        self.version = version
        self.metrics = metrics
        self._process_metrics = process_registry(service_name, version)
        self.health = health
        self.routes: dict[str, Route] = {"/ping": self._ping, "/livez": self._livez, "/readyz": self._readyz,
                                         "/health": self._health, "/metrics": self._metrics,
                                         "/buildinfo": self._buildinfo}
        self._builtin_routes = frozenset(self.routes.values())  #: served on the endpoint's thread
        self.routes.update(routes or {})
        self.heartbeat = LoopHeartbeat()
        self._process_metrics.gauge("waltz_event_loop_lag_seconds",
                                    "Seconds the process's event loop is late: 0 while it turns, growing while "
                                    "it is stalled (a slow disk under a storage node's file work on the loop, a "
                                    "long collection).", fn=self.heartbeat.lag)
        self._main_loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._address = ""
        self._own_loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None  #: of the endpoint's loop
        self._stopped: concurrent.futures.Future[None] = concurrent.futures.Future()  #: the thread ended

    @property
    def address(self) -> str:
        return self._address

    @property
    def process_metrics(self) -> MetricsRegistry:
        """The registry of ``process_*``, ``waltz_build_info`` and the process's other unprefixed gauges."""
        return self._process_metrics

    async def start(self, host: str, port: int) -> None:
        """Listen on ``host:port`` from the endpoint's own thread (ConfigError naming ``http.port``
        if it cannot: a port in use, an address not of this host)."""
        self._main_loop = asyncio.get_running_loop()
        ready: concurrent.futures.Future[str] = concurrent.futures.Future()
        self._stopped = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._thread_main, args=(host, port, ready), daemon=True,
                                        name=f"{self.service_name}-http")
        self._thread.start()
        try:
            self._address = await asyncio.wrap_future(ready)
        except BaseException as exc:
            self._thread = None
            if isinstance(exc, OSError):
                raise ConfigError(f"http.host/http.port: cannot serve HTTP on {host}:{port}: "
                                  f"{exc.strerror or exc}") from exc
            raise
        self.heartbeat.start()

    async def close(self) -> None:
        if self._thread is None:
            return
        self.heartbeat.stop()
        assert self._own_loop is not None and self._stopping is not None
        try:
            self._own_loop.call_soon_threadsafe(self._stopping.set)
        except RuntimeError:  # its loop is closed: the thread ended by itself (and logged why)
            pass
        await asyncio.wrap_future(self._stopped)
        self._thread.join(1.0)  # it has returned from its last call: this is at most a moment
        self._thread = None

    def _thread_main(self, host: str, port: int, ready: concurrent.futures.Future[str]) -> None:
        try:
            asyncio.run(self._serve_until_stopped(host, port, ready))
        except BaseException as exc:  # reported to start() or logged; the thread ends either way
            if not ready.done():
                ready.set_exception(exc)
            else:
                log.exception("http endpoint of %s stopped", self.service_name)
        finally:
            self._stopped.set_result(None)

    async def _serve_until_stopped(self, host: str, port: int, ready: concurrent.futures.Future[str]) -> None:
        server = await asyncio.start_server(self._serve, host, port, limit=MAX_HEAD)
        self._own_loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        bound_host, bound_port = server.sockets[0].getsockname()[:2]
        ready.set_result(f"{bound_host}:{bound_port}")
        async with server:
            await self._stopping.wait()
            server.close()
            # Connections still being answered (one waiting for the process's loop, at most
            # LOOP_ANSWER_TIMEOUT) are cut: the process is stopping.
            current = asyncio.current_task()
            handlers = [t for t in asyncio.all_tasks() if t is not current]
            for task in handlers:
                task.cancel()
            await asyncio.gather(*handlers, return_exceptions=True)

    async def _on_process_loop(self, fn: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
        """Run ``fn()`` on the process's event loop; TimeoutError if it does not answer within
        LOOP_ANSWER_TIMEOUT (RuntimeError once that loop is closed)."""
        assert self._main_loop is not None
        future = asyncio.run_coroutine_threadsafe(fn(), self._main_loop)
        try:
            return await wait_for(asyncio.wrap_future(future), LOOP_ANSWER_TIMEOUT)
        finally:
            future.cancel()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        method = "GET"
        try:
            try:
                head = await wait_for(reader.readuntil(b"\r\n\r\n"), 10)
                request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
                method, target, _version = request_line.split(" ", 2)
            except (ValueError, asyncio.LimitOverrunError, asyncio.IncompleteReadError, TimeoutError) as exc:
                response = HttpResponse(400, b"bad request\n")
                _log_bad_request(writer, exc)
            else:
                response = await self._dispatch(method, target)
            reason = _REASONS.get(response.status, "")
            body = b"" if method == "HEAD" else response.body
            writer.write(
                f"HTTP/1.1 {response.status} {reason}\r\nContent-Type: {response.content_type}\r\n"
                f"Content-Length: {len(response.body)}\r\nConnection: close\r\n\r\n".encode("latin-1") + body)
            await writer.drain()
        except (ConnectionError, OSError) as exc:
            log.debug("http client went away: %s", exc)
        finally:
            writer.close()

    async def _dispatch(self, method: str, target: str) -> HttpResponse:
        if method not in ("GET", "HEAD"):
            return HttpResponse(405, b"only GET and HEAD\n")
        parts = urlsplit(target)
        route = self.routes.get(parts.path)
        if route is None:
            return HttpResponse(404, f"no route {parts.path}; try {', '.join(sorted(self.routes))}\n".encode())
        query = parse_qs(parts.query)
        try:
            if route in self._builtin_routes:
                return await route(query)
            try:
                async def run_route() -> HttpResponse:
                    return await route(query)

                return await self._on_process_loop(run_route)
            except TimeoutError:
                return HttpResponse(503, self._stalled_text().encode() + b"\n")
        except Exception as exc:  # a failing route must not break the endpoint
            log.exception("http route %s failed", parts.path)
            return HttpResponse(500, f"{type(exc).__name__}: {exc}\n".encode())

    async def _ping(self, _query: Mapping[str, list[str]]) -> HttpResponse:
        return HttpResponse(200, b"pong\n")

    async def _livez(self, query: Mapping[str, list[str]]) -> HttpResponse:
        lag = self.heartbeat.lag()
        alive = lag < LOOP_STALL_NOT_ALIVE
        return _json(200 if alive else 503, {"alive": alive, "event_loop_lag_seconds": round(lag, 3)}, query)

    async def _readyz(self, query: Mapping[str, list[str]]) -> HttpResponse:
        return await self._check("ready", query)

    async def _health(self, query: Mapping[str, list[str]]) -> HttpResponse:
        return await self._check("healthy", query)

    def _stalled_text(self) -> str:
        return (f"the event loop of {self.service_name} did not answer within {LOOP_ANSWER_TIMEOUT:g}s (late by "
                f"{self.heartbeat.lag():.1f}s: a slow disk under file work on the loop, or a stalled process)")

    async def _check(self, key: str, query: Mapping[str, list[str]]) -> HttpResponse:
        """The health check (run on the process's loop) as JSON under ``key``: 200, or 503
        (unavailable: try again later) when it fails or the loop does not answer in time."""
        health = self.health
        if health is None:
            return _json(200, {key: True}, query)

        async def check() -> tuple[bool, Mapping[str, Any]]:
            return health()

        try:
            ok, details = await self._on_process_loop(check)
        except TimeoutError:
            return _json(503, {key: False, "reasons": [self._stalled_text()]}, query)
        return _json(200 if ok else 503, {key: ok, **details}, query)

    async def _metrics(self, _query: Mapping[str, list[str]]) -> HttpResponse:
        text = self.metrics.render_prometheus() if self.metrics is not None else ""
        text += self._process_metrics.render_prometheus()
        return HttpResponse(200, text.encode(), "text/plain; version=0.0.4; charset=utf-8")

    async def _buildinfo(self, _query: Mapping[str, list[str]]) -> HttpResponse:
        body = json.dumps({"version": self.version, "service_name": self.service_name}).encode() + b"\n"
        return HttpResponse(200, body, "application/json")
