"""The generic HTTP endpoint and the metrics registry."""

from __future__ import annotations

import asyncio
import json

from waltz_core.http import HttpEndpoint, HttpResponse
from waltz_core.metrics import MetricsRegistry


async def _get(address: str, raw_request: bytes) -> tuple[int, bytes]:
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(raw_request)
    await writer.drain()
    data = await reader.read()
    writer.close()
    await writer.wait_closed()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


def _req(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()


async def test_routes_health_metrics_buildinfo() -> None:
    registry = MetricsRegistry()
    registry.counter("requests", "Requests.", {"partition": "1"}).inc(3)
    registry.histogram("latency_seconds", "Latency.").observe(0.003)
    healthy = {"ok": True}

    async def extra(_q: object) -> HttpResponse:
        return HttpResponse(200, b"extra\n")

    ep = HttpEndpoint(service_name="waltz-storage", version="9.9", metrics=registry,
                      health=lambda: (healthy["ok"], {"partitions": 2}), routes={"/extra": extra})
    await ep.start("127.0.0.1", 0)
    try:
        assert await _get(ep.address, _req("/ping")) == (200, b"pong\n")
        status, body = await _get(ep.address, _req("/metrics"))
        text = body.decode()
        assert status == 200
        assert 'waltz_requests_total{partition="1"} 3' in text
        assert 'waltz_latency_seconds_bucket{le="0.005"} 1' in text and "waltz_latency_seconds_count 1" in text
        assert "# TYPE waltz_requests_total counter" in text
        status, body = await _get(ep.address, _req("/health?pretty=true"))
        assert status == 200 and json.loads(body) == {"healthy": True, "partitions": 2}
        healthy["ok"] = False
        assert (await _get(ep.address, _req("/health")))[0] == 503
        status, body = await _get(ep.address, _req("/buildinfo"))
        assert json.loads(body) == {"version": "9.9", "service_name": "waltz-storage"}
        assert await _get(ep.address, _req("/extra")) == (200, b"extra\n")
        assert (await _get(ep.address, _req("/nope")))[0] == 404
        assert (await _get(ep.address, b"POST /ping HTTP/1.1\r\n\r\n"))[0] == 405
        assert (await _get(ep.address, b"garbage\r\n\r\n"))[0] == 400
        assert await _get(ep.address, _req("/ping")) == (200, b"pong\n")  # still serving
    finally:
        await ep.close()


def test_metrics_registry_identity_snapshot_and_removal() -> None:
    r = MetricsRegistry(prefix="")
    a = r.counter("c", labels={"p": "1"})
    assert r.counter("c", labels={"p": "1"}) is a
    g = r.gauge("g", fn=lambda: 42)
    h = r.histogram("h", buckets=(1, 2))
    for v in (0.5, 1.5, 1.5, 3):
        h.observe(v)
    a.inc(2)
    snap = r.snapshot()
    assert snap["c"] == [{"labels": {"p": "1"}, "value": 2}]
    assert snap["g"][0]["value"] == 42 and g.read() == 42
    assert snap["h"][0]["count"] == 4 and h.quantile(0.5) == 2
    assert 'h_bucket{le="+Inf"} 4' in r.render_prometheus()
    r.remove({"p": "1"})
    assert "c_total" not in r.render_prometheus()
