"""Health and logs: ``/livez`` and ``/readyz`` with the usual codes, and ``--log-format json``.

The endpoint answers from a thread of its own: liveness fails only after a long stall of the
process's event loop, and readiness answers 503 with the reasons while the process cannot do its
job (a server without a storage quorum, a storage node not serving yet, a loop that does not answer).
``--log-format json`` makes every stderr line of a long-running command a JSON object, in the
processes ``waltz up`` starts too.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from waltz_core.cli.logs import JsonFormatter
from waltz_core.http import HttpEndpoint
from waltz_core.storage.node import StorageNode
from waltz_core.storage.segmented import SegmentedLayout
from waltz_core.testing.cluster import ClusterSpec, InProcessCluster, free_ports

pytestmark = pytest.mark.timeout(180)

WALTZ = [sys.executable, "-m", "waltz_core.cli"]
NO_WALTZ_ENV = {k: v for k, v in os.environ.items() if not k.startswith("WALTZ_")}
RFC3339_UTC = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z$")


async def get(address: str, path: str) -> tuple[int, Any]:
    """GET ``path``: the status and the JSON body."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    data = await reader.read()
    writer.close()
    await writer.wait_closed()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body)


async def until(check: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        await asyncio.sleep(0.1)


def assert_alive(answer: tuple[int, Any]) -> None:
    """``/livez`` answered 200, alive, with the event loop's lag (about 0 in these tests)."""
    status, body = answer
    assert status == 200 and body["alive"] is True, answer
    assert set(body) == {"alive", "event_loop_lag_seconds"} and 0.0 <= body["event_loop_lag_seconds"] < 30, answer


def check_json_line(line: str) -> dict[str, Any]:
    record = json.loads(line)
    assert isinstance(record, dict), line
    assert RFC3339_UTC.match(record["ts"]), line
    assert record["level"] in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"), line
    assert isinstance(record["logger"], str) and isinstance(record["msg"], str), line
    return record


# ------------------------------------------------------------------------------------ units


def test_json_formatter_fields_exception_and_extra() -> None:
    formatter = JsonFormatter()
    record = logging.LogRecord("waltz.storage", logging.WARNING, __file__, 1, "partition %d: %s", (3, "torn"), None)
    record.__dict__.update(partition=3, msg_id="x")  # what logging's extra= does
    out = json.loads(formatter.format(record))
    assert out == {"ts": out["ts"], "level": "WARNING", "logger": "waltz.storage", "msg": "partition 3: torn",
                   "partition": 3, "msg_id": "x"}
    assert RFC3339_UTC.match(out["ts"])
    assert out["ts"] == time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + out["ts"][19:]
    try:
        raise ValueError("boom")
    except ValueError:
        failed = logging.LogRecord("waltz", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    text = formatter.format(failed)
    assert "\n" not in text  # one line per record, traceback included
    out = json.loads(text)
    assert out["msg"] == "failed" and out["exc"].startswith("Traceback") and "ValueError: boom" in out["exc"]


async def test_livez_stays_200_while_readyz_and_health_answer_503_with_reasons() -> None:
    state: dict[str, Any] = {"ok": True, "reasons": []}
    ep = HttpEndpoint(service_name="t", version="0", health=lambda: (state["ok"], {"reasons": state["reasons"]}))
    await ep.start("127.0.0.1", 0)
    try:
        assert_alive(await get(ep.address, "/livez"))
        assert await get(ep.address, "/readyz") == (200, {"ready": True, "reasons": []})
        state.update(ok=False, reasons=["partition 0 is recovering (not open yet)"])
        assert_alive(await get(ep.address, "/livez"))
        assert await get(ep.address, "/readyz") == (503, {"ready": False,
                                                          "reasons": ["partition 0 is recovering (not open yet)"]})
        assert (await get(ep.address, "/health"))[0] == 503
    finally:
        await ep.close()


def _blocking_get(address: str, path: str) -> tuple[int, bytes]:
    """GET from another thread, with plain sockets (the test's event loop is the stalled one)."""
    import socket

    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


async def test_the_endpoint_answers_while_the_process_loop_is_stalled(monkeypatch: pytest.MonkeyPatch) -> None:
    """A storage node's file work on a slow disk, or a long collection, stalls the process's
    loop: the endpoint's own thread still serves /metrics and the probes, and says so."""
    from concurrent.futures import ThreadPoolExecutor

    from waltz_core import http
    from waltz_core.http import HttpResponse
    from waltz_core.metrics import MetricsRegistry

    registry = MetricsRegistry()
    registry.counter("appends", "Appends.").inc(7)

    async def extra(_q: object) -> HttpResponse:
        return HttpResponse(200, b"extra\n")

    ep = HttpEndpoint(service_name="waltz-storage", version="0", metrics=registry,
                      health=lambda: (True, {"reasons": []}), routes={"/extra": extra})
    await ep.start("127.0.0.1", 0)
    try:
        with ThreadPoolExecutor(4) as pool:
            def ask_later(path: str) -> Any:
                def ask() -> tuple[int, bytes]:
                    time.sleep(1.4)  # into the stall below
                    return _blocking_get(ep.address, path)
                return pool.submit(ask)

            answers = {path: ask_later(path) for path in ("/livez", "/readyz", "/metrics", "/extra")}
            time.sleep(2.6)  # noqa: ASYNC251 - the process's loop stalls (this test's own loop), on purpose
            got = {path: f.result(timeout=10) for path, f in answers.items()}
        status, body = got["/livez"]
        livez = json.loads(body)
        assert status == 200 and livez["alive"] is True and livez["event_loop_lag_seconds"] > 0.5, got
        status, body = got["/readyz"]
        readyz = json.loads(body)
        assert status == 503 and readyz["ready"] is False, got
        assert readyz["reasons"][0].startswith("the event loop of waltz-storage did not answer within"), readyz
        status, body = got["/metrics"]
        text = body.decode()
        assert status == 200 and "waltz_appends_total 7" in text, got
        lag = float(next(line.split()[1] for line in text.splitlines()
                         if line.startswith("waltz_event_loop_lag_seconds ")))
        assert lag > 0.5, text
        assert got["/extra"][0] == 503 and b"did not answer" in got["/extra"][1], got
        # The loop turns again: everything answers as usual.
        await asyncio.sleep(0.6)
        assert_alive(await get(ep.address, "/livez"))
        assert await get(ep.address, "/readyz") == (200, {"ready": True, "reasons": []})
        # A loop that does not turn for LOOP_STALL_NOT_ALIVE seconds fails liveness (a restart is the cure).
        monkeypatch.setattr(http, "LOOP_STALL_NOT_ALIVE", 0.3)
        with ThreadPoolExecutor(1) as pool:
            def late_livez() -> tuple[int, bytes]:
                time.sleep(1.2)
                return _blocking_get(ep.address, "/livez")

            future = pool.submit(late_livez)
            time.sleep(1.6)  # noqa: ASYNC251 - stalled on purpose, as above
            status, body = future.result(timeout=10)
        assert status == 503 and json.loads(body)["alive"] is False, body
    finally:
        await ep.close()
    import threading

    assert not [t for t in threading.enumerate() if t.name == "waltz-storage-http"]  # close() ended its thread


async def test_storage_node_is_ready_only_while_serving(tmp_path: Path) -> None:
    node = StorageNode(SegmentedLayout(tmp_path), uuid.uuid4(), 2)
    assert node.healthy() == (False, {"partitions": 0, "broken_partitions": {}, "reasons": ["storage node is starting"]})
    await node.start()
    assert node.healthy() == (True, {"partitions": 2, "broken_partitions": {}, "reasons": []})
    await node.close()
    assert node.healthy()[1]["reasons"] == ["storage node is stopping"]


# ------------------------------------------------------------------- real server and storage


async def test_server_not_ready_without_a_storage_quorum_and_ready_again(tmp_path: Path) -> None:
    spec = ClusterSpec(tmp_path, num_partitions=2, num_storages=3, http=True)
    async with InProcessCluster(spec) as cluster:
        server = cluster.servers[0].http_address
        storages = [f"127.0.0.1:{node.http_port}" for node in spec.storages]
        for address in [server, *storages]:
            assert_alive(await get(address, "/livez"))
        for address in storages:
            assert await get(address, "/readyz") == (200, {"ready": True, "partitions": 2, "broken_partitions": {},
                                                           "reasons": []})

        async def server_ready(want: bool) -> bool:
            return (await get(server, "/readyz"))[0] == (200 if want else 503)

        await until(lambda: server_ready(True), 30, "the server is ready")  # both partitions recovered
        assert await get(server, "/readyz") == (200, {"ready": True, "coordination": True,
                                                      "partitions": {"0": True, "1": True}, "reasons": []})

        await cluster.stop_storage(1)
        await cluster.stop_storage(2)
        await until(lambda: server_ready(False), 30, "the server is not ready without a storage quorum")
        status, body = await get(server, "/readyz")
        assert status == 503 and body["ready"] is False and body["coordination"] is True
        assert body["partitions"] == {"0": False, "1": False}
        assert body["reasons"] == [f"partition {p} reaches 1 of its 3 storage replicas; a commit needs 2"
                                   for p in (0, 1)]
        assert_alive(await get(server, "/livez"))  # alive: no restart would help
        status, body = await get(server, "/health")
        assert status == 503 and body["healthy"] is False
        assert (await get(storages[0], "/readyz"))[0] == 200  # the storage node left is fine

        await cluster.start_storage(1)
        await until(lambda: server_ready(True), 30, "the server is ready again with 2 of 3 storage nodes")


# --------------------------------------------------------------------------------- --log-format


@pytest.mark.parametrize("how", ["environment", "subcommand option"])
def test_storage_start_logs_json_lines_and_serves_livez_readyz(tmp_path: Path, how: str) -> None:
    port, admin, http = free_ports(3)
    config = tmp_path / "storage.toml"
    config.write_text(f'[storage]\nhost = "127.0.0.1"\nport = {port}\nadmin_port = {admin}\n'
                      f'directory = "{tmp_path / "data"}"\n[http]\nport = {http}\n')
    # The format may come from WALTZ_LOG_FORMAT or from the long-running command's own option
    # (which wins over the group's default).
    env, option = ({"WALTZ_LOG_FORMAT": "json"}, []) if how == "environment" else ({}, ["--log-format", "json"])
    proc = subprocess.Popen([*WALTZ, "storage", "start", *option, "--config", str(config), "--cluster-key",
                             str(uuid.uuid4()), "--num-partitions", "2"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**NO_WALTZ_ENV, **env})
    try:
        assert proc.stdout is not None
        ready = proc.stdout.readline()
        assert ready.startswith("waltz storage ready"), ready
        assert_alive(asyncio.run(get(f"127.0.0.1:{http}", "/livez")))
        status, body = asyncio.run(get(f"127.0.0.1:{http}", "/readyz"))
        assert status == 200 and body["ready"] is True and body["partitions"] == 2
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    records = [check_json_line(line) for line in stderr.splitlines()]
    # the plaintext warning of a loopback node: at least one line to check
    assert any(r["logger"] == "waltz.storage" and "not encrypted" in r["msg"] for r in records), stderr


def test_a_bad_log_format_is_one_clear_error() -> None:
    for before, after, env in ((["--log-format", "xml"], [], {}), ([], [], {"WALTZ_LOG_FORMAT": "xml"}),
                               ([], ["--log-format", "xml"], {})):
        result = subprocess.run([*WALTZ, *before, "storage", "start", *after], capture_output=True, text=True,
                                timeout=60, env={**NO_WALTZ_ENV, **env})
        assert result.returncode == 2, result.stderr
        last = result.stderr.strip().splitlines()[-1]
        assert "Invalid value for '--log-format'" in last and "'xml' is not one of 'text', 'json'" in last, last


def test_a_failing_command_logs_its_error_as_json(tmp_path: Path) -> None:
    result = subprocess.run([*WALTZ, "--log-format", "json", "storage", "start", "--config", str(tmp_path / "no.toml")],
                            capture_output=True, text=True, timeout=60, env=NO_WALTZ_ENV)
    assert result.returncode == 1
    (line,) = result.stderr.splitlines()
    record = check_json_line(line)
    assert record["level"] == "ERROR" and "no.toml" in record["msg"], line


@pytest.mark.slow
def test_waltz_up_children_inherit_the_log_format(tmp_path: Path) -> None:
    data = tmp_path / "waltz-data"

    def waltz(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*WALTZ, *args], capture_output=True, text=True, timeout=120, env=NO_WALTZ_ENV)

    up = waltz("--log-format", "json", "up", "--background", "--data-dir", str(data), "--partitions", "1")
    try:
        assert up.returncode == 0, up.stdout + up.stderr
    finally:
        stop = waltz("up", "--stop", "--data-dir", str(data))
    assert stop.returncode == 0, stop.stderr
    for name in ("storage-0", "storage-1", "storage-2", "server-0"):
        # the log file holds the child's stdout too: its one "waltz ... ready" line is not a log line
        lines = [line for line in (data / "logs" / f"{name}.log").read_text().splitlines()
                 if not line.startswith(("waltz storage ready", "waltz server ready"))]
        assert lines, name
        for line in lines:
            check_json_line(line)


async def test_an_http_port_in_use_is_a_config_error_naming_the_keys() -> None:
    """A server or storage node whose http.port is taken says so in one line (the CLI prints a
    ConfigError as 'error: ...'), instead of ending in an OSError's traceback."""
    import socket

    from waltz_core.errors import ConfigError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ep = HttpEndpoint(service_name="t", version="0")
        with pytest.raises(ConfigError, match=rf"^http.host/http.port: cannot serve HTTP on 127.0.0.1:{port}: .*in use"):
            await ep.start("127.0.0.1", port)
        await ep.close()  # nothing to close: harmless
