"""TCP-specific behaviour the generic kit cannot see: options, socket flags, addresses, logging."""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from typing import Any

import pytest

from waltz_core.config import TransportConfig, backend_options
from waltz_core.errors import ConfigError, ConnectError, ConnectionClosedError
from waltz_core.runtime import Runtime
from waltz_core.transport import Connection, open_transport
from waltz_transport_tcp import TcpConnection, TcpOptions, TcpTransport
from waltz_transport_tcp.transport import parse_address


def _options(**table: Any) -> TcpOptions | None:
    return backend_options(TcpOptions, TransportConfig(name="tcp", options={"tcp": table}), "transport")


async def _hold(conn: Connection) -> None:
    await asyncio.Event().wait()


def test_options_from_config_table() -> None:
    opts = _options(heartbeat_interval=0.5, idle_timeout=3, nodelay=False)
    assert opts == TcpOptions(heartbeat_interval=0.5, idle_timeout=3.0, nodelay=False)


@pytest.mark.parametrize(
    ("table", "words"),
    [
        ({"heartbeat_interval": 5, "idle_timeout": 2}, "heartbeat_interval"),
        ({"write_buffer_low": 10, "write_buffer_high": 5}, "write_buffer_low"),
        ({"idle_timeout": -1}, "idle_timeout"),
        ({"no_such_option": 1}, "no_such_option"),
    ],
)
def test_invalid_options_name_the_key(table: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        _options(**table)


def test_open_transport_builds_tcp_with_config() -> None:
    transport = open_transport(TransportConfig(name="tcp", max_frame_size=1234, connect_timeout=2.5,
                                               options={"tcp": {"idle_timeout": 7.0}}), Runtime.load().registries)
    assert isinstance(transport, TcpTransport)
    assert (transport.max_frame_size, transport.connect_timeout, transport.options.idle_timeout) == (1234, 2.5, 7.0)


@pytest.mark.parametrize(
    ("address", "expected"),
    [("127.0.0.1:80", ("127.0.0.1", 80)), ("[::1]:5", ("::1", 5)), ("db.example:65535", ("db.example", 65535))],
)
def test_parse_address(address: str, expected: tuple[str, int]) -> None:
    assert parse_address(address) == expected


@pytest.mark.parametrize("address", ["nohost", ":80", "host:", "host:0", "host:65536", "host:http"])
def test_parse_address_rejects(address: str) -> None:
    with pytest.raises(ConnectError, match="invalid tcp address"):
        parse_address(address)


@pytest.mark.parametrize("enabled", [True, False])
async def test_socket_options_applied(enabled: bool) -> None:
    transport = TcpTransport(options=TcpOptions(nodelay=enabled, keepalive=enabled))
    listener = await transport.listen("127.0.0.1", 0, _hold)
    conn = await transport.connect(listener.address)
    assert isinstance(conn, TcpConnection)
    sock = conn._transport.get_extra_info("socket")  # type: ignore[union-attr]
    assert bool(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)) is enabled
    assert bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)) is enabled
    await conn.close()
    await listener.close()


async def test_a_connection_accepted_as_the_listener_closes_is_closed_before_close_returns() -> None:
    class SlowToClose:
        closed = False

        async def close(self) -> None:
            await asyncio.sleep(0.05)
            self.closed = True

    listener = await TcpTransport().listen("127.0.0.1", 0, _hold)
    late = SlowToClose()
    server = listener._server  # type: ignore[attr-defined]
    stop_listening = server.close

    def stop_as_one_more_arrives() -> None:
        stop_listening()
        listener._accepted(late)  # type: ignore[attr-defined]

    server.close = stop_as_one_more_arrives
    await listener.close()
    assert late.closed


async def test_listen_on_a_busy_port_is_connect_error() -> None:
    transport = TcpTransport()
    listener = await transport.listen("127.0.0.1", 0, _hold)
    port = int(listener.address.rsplit(":", 1)[1])
    with pytest.raises(ConnectError, match="cannot listen"):
        await transport.listen("127.0.0.1", port, _hold)
    await listener.close()


async def test_ipv6_loopback() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 support")
    transport = TcpTransport()
    try:
        listener = await transport.listen("::1", 0, _hold_echo)
    except ConnectError as exc:
        pytest.skip(f"IPv6 loopback unavailable: {exc}")
    assert listener.address.startswith("[::1]:")
    conn = await transport.connect(listener.address)
    await conn.send(b"v6")
    async with asyncio.timeout(10):
        assert await conn.recv() == b"v6"
    await conn.close()
    await listener.close()


async def _hold_echo(conn: Connection) -> None:
    while True:
        await conn.send(await conn.recv())


async def test_bad_bytes_logged_at_warning_with_peer_address(caplog: pytest.LogCaptureFixture) -> None:
    transport = TcpTransport(max_frame_size=1024)
    listener = await transport.listen("127.0.0.1", 0, _hold_echo)
    host, port = listener.address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    local_host, local_port = writer.get_extra_info("sockname")[:2]
    local = f"{local_host}:{local_port}"
    with caplog.at_level(logging.WARNING, logger="waltz.transport.tcp"):
        writer.write(struct.pack(">I", 4096) + b"x")
        async with asyncio.timeout(10):
            assert await reader.read() == b""  # closed by the listener
    writer.close()
    await writer.wait_closed()
    await listener.close()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert any(local in r.getMessage() and "4096" in r.getMessage() for r in warnings), caplog.text


async def test_close_gives_up_on_a_peer_that_reads_nothing() -> None:
    """close() flushes, but a peer that never reads cannot hold it beyond close_timeout."""
    transport = TcpTransport(options=TcpOptions(close_timeout=0.3, heartbeat_interval=0, idle_timeout=0))
    listener = await transport.listen("127.0.0.1", 0, _hold)
    conn = await transport.connect(listener.address)
    blob = b"b" * (1024 * 1024)
    # Fill the socket buffers and our write buffer; send() waits once the peer's window is full.
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(1.0):
            while True:
                await conn.send(blob)
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with asyncio.timeout(10):
        await conn.close()
    assert loop.time() - started < 5
    assert conn.closed
    with pytest.raises(ConnectionClosedError):
        await conn.send(b"x")
    await listener.close()


def test_works_on_a_uvloop_event_loop() -> None:
    """uvloop calls connection_made after create_connection returns and its transports do not
    subclass asyncio.Transport: connect() must still hand back a usable connection."""
    import uvloop  # a test dependency (waltz-core[testing]): missing is a failure, not a skip

    async def exchange() -> list[bytes]:
        transport = TcpTransport()
        listener = await transport.listen("127.0.0.1", 0, _hold_echo)
        try:
            conns = [await transport.connect(listener.address) for _ in range(5)]
            for i, conn in enumerate(conns):
                await conn.send_many([b"uv", str(i).encode()])
            async with asyncio.timeout(10):
                got = [await conn.recv() + await conn.recv() for conn in conns]
            for conn in conns:
                await conn.close()
            return got
        finally:
            await listener.close()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert runner.get_loop().__class__.__module__.startswith("uvloop")
        assert runner.run(exchange()) == [b"uv%d" % i for i in range(5)]


async def test_frames_sent_in_one_loop_iteration_go_out_in_one_write() -> None:
    """Small frames sent by the callbacks of one event-loop iteration are gathered and written
    together at its end (one syscall, one wake-up of the peer); a large frame, send_many and
    close write what was gathered first, so the order never changes."""
    transport = TcpTransport(max_frame_size=1 << 20)
    received: asyncio.Queue[bytes] = asyncio.Queue()

    async def collect(conn: Connection) -> None:
        while True:
            received.put_nowait(await conn.recv())

    listener = await transport.listen("127.0.0.1", 0, collect)
    conn = await transport.connect(listener.address)
    assert isinstance(conn, TcpConnection)
    writes: list[bytes] = []
    asyncio_transport = conn._transport
    assert asyncio_transport is not None
    real_write = asyncio_transport.write

    def counting_write(data: bytes | bytearray | memoryview) -> None:
        writes.append(bytes(data))
        real_write(data)

    asyncio_transport.write = counting_write  # type: ignore[method-assign]
    for i in range(5):
        await conn.send(b"small-%d" % i)  # no wait: all in this iteration
    assert writes == []
    await asyncio.sleep(0)
    assert len(writes) == 1
    await conn.send(b"a")
    await conn.send(b"L" * 70_000)  # above the copy limit: "a" is written before it
    await conn.send_many([b"b", b"c"])
    await conn.send(b"last")
    await conn.close()  # flushes "last"
    expected = [b"small-%d" % i for i in range(5)] + [b"a", b"L" * 70_000, b"b", b"c", b"last"]
    got = [await asyncio.wait_for(received.get(), 5) for _ in expected]
    assert got == expected
    assert writes[1] == struct.pack(">I", 1) + b"a"
    await listener.close()
