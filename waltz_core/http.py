"""A tiny asyncio HTTP/1.1 endpoint: ``/livez``, ``/readyz``, ``/health``, ``/metrics``, ``/buildinfo`` and more.

Shared by the storage node and the Waltz server (original: Jetty with riff servlets). One
request per connection (``Connection: close``), GET/HEAD only, bounded request head; a bad
request gets a 400 and never disturbs the process. Runs on the caller's event loop.

* ``/ping`` -> ``pong``;
* ``/livez`` -> JSON ``{"alive": true}``, always 200: answering at all proves the event loop
  serves, which is all liveness means (a restart would not fix a broken partition or a lost
  quorum). For a Kubernetes ``livenessProbe``;
* ``/readyz`` -> JSON ``{"ready": bool, "reasons": [...], ...details}``, 200 when the process can
  do its job, 503 with the reasons when it cannot (the ``health`` check of the process). For a
  Kubernetes ``readinessProbe`` and load balancers;
* ``/health`` -> the same check as ``/readyz`` under its older name and body key
  (``{"healthy": bool, ...}``), 200 or 503;
* ``?pretty=true`` indents the JSON of these three;
* ``/metrics`` -> Prometheus text exposition (0.0.4) of a :class:`~waltz_core.metrics.MetricsRegistry`,
  plus ``process_*`` and ``waltz_build_info``;
* ``/buildinfo`` -> JSON ``{"version", "service_name"}``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any
from urllib.parse import parse_qs, urlsplit

import attrs

from .metrics import MetricsRegistry, process_registry

log = logging.getLogger("waltz.http")

MAX_HEAD = 16 * 1024
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 500: "Internal Server Error",
            503: "Service Unavailable"}


@attrs.frozen(slots=True)
class HttpResponse:
    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"


Route = Callable[[Mapping[str, list[str]]], Awaitable[HttpResponse]]
HealthCheck = Callable[[], tuple[bool, Mapping[str, Any]]]


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
        self.routes.update(routes or {})
        self._server: asyncio.Server | None = None

    @property
    def address(self) -> str:
        assert self._server is not None
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"{host}:{port}"

    async def start(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(self._serve, host, port, limit=MAX_HEAD)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        method = "GET"
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
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
        try:
            return await route(parse_qs(parts.query))
        except Exception as exc:  # a failing route must not break the endpoint
            log.exception("http route %s failed", parts.path)
            return HttpResponse(500, f"{type(exc).__name__}: {exc}\n".encode())

    async def _ping(self, _query: Mapping[str, list[str]]) -> HttpResponse:
        return HttpResponse(200, b"pong\n")

    async def _livez(self, query: Mapping[str, list[str]]) -> HttpResponse:
        return _json(200, {"alive": True}, query)

    async def _readyz(self, query: Mapping[str, list[str]]) -> HttpResponse:
        return self._check("ready", query)

    async def _health(self, query: Mapping[str, list[str]]) -> HttpResponse:
        return self._check("healthy", query)

    def _check(self, key: str, query: Mapping[str, list[str]]) -> HttpResponse:
        """The health check as JSON under ``key``: 200, or 503 (unavailable: try again later) when it fails."""
        ok, details = self.health() if self.health is not None else (True, {})
        return _json(200 if ok else 503, {key: ok, **details}, query)

    async def _metrics(self, _query: Mapping[str, list[str]]) -> HttpResponse:
        text = self.metrics.render_prometheus() if self.metrics is not None else ""
        text += self._process_metrics.render_prometheus()
        return HttpResponse(200, text.encode(), "text/plain; version=0.0.4; charset=utf-8")

    async def _buildinfo(self, _query: Mapping[str, list[str]]) -> HttpResponse:
        body = json.dumps({"version": self.version, "service_name": self.service_name}).encode() + b"\n"
        return HttpResponse(200, body, "application/json")
