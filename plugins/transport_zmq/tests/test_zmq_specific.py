"""zmq-specific behaviour: ROUTER high-water mark, dead/silent peers, garbage, options, key helper."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from waltz_core.config import TransportConfig, backend_options
from waltz_core.errors import ConfigError, ConnectError, ConnectionClosedError, PeerTimeoutError
from waltz_core.transport.base import Connection
from waltz_transport_zmq import ZmqOptions, ZmqTransport, keys, wire
from waltz_transport_zmq.connection import ZmqConnection

STEP = 20.0


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    """A raw pyzmq context for hand-made peers."""
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
async def transports() -> AsyncIterator[list[ZmqTransport]]:
    made: list[ZmqTransport] = []
    yield made
    for t in made:
        await t.aclose()


def _make(made: list[ZmqTransport], **options: object) -> ZmqTransport:
    t = ZmqTransport(1024 * 1024, ZmqOptions(**options), connect_timeout=3.0)  # type: ignore[arg-type]
    made.append(t)
    return t


async def _echo(conn: Connection) -> None:
    with contextlib.suppress(ConnectionClosedError):
        while True:
            await conn.send(await conn.recv())


async def test_router_burst_above_hwm_loses_nothing(transports: list[ZmqTransport],
                                                    ctx: zmq.asyncio.Context) -> None:
    """The ROUTER's HWM (20 messages) is far below the burst and the credit window is huge, so
    only ROUTER_MANDATORY stands between the burst and silent drops: the sender must wait, and
    every frame must arrive, in order.

    The reader is a hand-made DEALER that reads nothing for a while: a transport connection would
    drain the socket into its credit window (here, all of it) at whatever speed the machine has,
    so whether the sender ever met the HWM would depend on timing. With this peer, ZeroMQ buffers
    at most ``rcvhwm`` messages and the kernel a few MB of the 40 MB burst."""
    n, size = 20_000, 2000
    # heartbeat_timeout=0: the hand-made reader never answers heartbeats, and a slow drain must not
    # turn into a peer timeout.
    server = _make(transports, send_hwm=20, recv_hwm=20, window_frames=1_000_000, window_bytes=1 << 30,
                   heartbeat_timeout=0)
    sent = 0
    done = asyncio.Event()
    server_conns: list[ZmqConnection] = []

    async def burst(conn: Connection) -> None:
        nonlocal sent
        assert isinstance(conn, ZmqConnection)
        server_conns.append(conn)
        for seq in range(n):
            await conn.send(seq.to_bytes(4, "big") + b"b" * (size - 4))
            sent += 1
        done.set()
        with contextlib.suppress(ConnectionClosedError):
            await conn.recv()  # until the reader closes

    listener = await server.listen("127.0.0.1", 0, burst)
    reader = ctx.socket(zmq.DEALER)
    reader.linger = 0
    reader.rcvhwm = 20
    reader.rcvbuf = 64 * 1024
    reader.connect(f"tcp://{listener.address}")
    await reader.send_multipart([wire.encode_open(wire.HELLO, 1_000_000, 1 << 30)])
    await asyncio.sleep(0.5)  # the reader reads nothing yet
    assert not done.is_set() and sent < n, f"{sent} frames of {n * size} bytes accepted with nobody reading"
    received = 0
    async with asyncio.timeout(STEP * 2):
        assert (await reader.recv_multipart())[0][0] == wire.WELCOME
        while received < n:
            header, *frames = await reader.recv_multipart()
            if header[0] == wire.PING:
                continue
            assert header[0] == wire.DATA and wire.decode_data(header) == received, "frames lost"
            for frame in frames:
                assert frame[:4] == received.to_bytes(4, "big"), f"frame {received} missing or out of order"
                assert len(frame) == size
                received += 1
        await done.wait()
    assert server_conns[0].stats.hwm_retries > 0, "the ROUTER never reported its high-water mark"
    assert server_conns[0].stats.credit_waits == 0, "the credit window, not the HWM, stopped the sender"
    await reader.send_multipart([wire.encode_close(wire.CloseReason.NORMAL)])
    reader.close()
    await listener.close()


async def test_silent_peer_times_out_on_both_sides(transports: list[ZmqTransport],
                                                   ctx: zmq.asyncio.Context) -> None:
    """A hand-made peer that completes HELLO/WELCOME and then never sends: PeerTimeoutError."""
    t = _make(transports, heartbeat_interval=0.1, heartbeat_timeout=0.5)
    outcome: asyncio.Queue[BaseException] = asyncio.Queue()

    async def handler(conn: Connection) -> None:
        try:
            await conn.recv()
        except Exception as exc:  # noqa: BLE001 - the test checks which one
            await outcome.put(exc)

    listener = await t.listen("127.0.0.1", 0, handler)
    silent = ctx.socket(zmq.DEALER)
    silent.linger = 0
    silent.connect(f"tcp://{listener.address}")
    await silent.send_multipart([wire.encode_open(wire.HELLO, 100, 1 << 20)])
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with asyncio.timeout(STEP):
        assert (await silent.recv_multipart())[0][0] == wire.WELCOME
        error = await outcome.get()
        # The listener kept sending heartbeats to the silent peer meanwhile.
        assert (await silent.recv_multipart())[0][0] in (wire.PING, wire.CLOSE)
    assert isinstance(error, PeerTimeoutError), repr(error)
    assert loop.time() - started < 3.0
    silent.close()

    # The other direction: a ROUTER that answers WELCOME and then goes quiet.
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")

    async def welcome_then_silence() -> None:
        rid, _hello = await router.recv_multipart()
        await router.send_multipart([rid, wire.encode_open(wire.WELCOME, 100, 1 << 20)])

    answering = asyncio.create_task(welcome_then_silence())
    conn = await t.connect(f"127.0.0.1:{port}")
    await answering
    started = loop.time()
    async with asyncio.timeout(STEP):
        with pytest.raises(PeerTimeoutError):
            await conn.recv()
    assert loop.time() - started < 3.0
    await conn.close()
    router.close()


async def test_dead_listener_detected_before_heartbeat_timeout(transports: list[ZmqTransport],
                                                               ctx: zmq.asyncio.Context) -> None:
    """ZeroMQ would reconnect silently; the monitor turns the disconnect into ConnectionClosedError,
    after the frames that arrived before it."""
    t = _make(transports, heartbeat_interval=1.0, heartbeat_timeout=30.0)
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")

    async def answer_then_die() -> None:
        rid, _hello = await router.recv_multipart()
        await router.send_multipart([rid, wire.encode_open(wire.WELCOME, 100, 1 << 20)])
        await router.send_multipart([rid, wire.encode_data(0), b"last words"])
        await asyncio.sleep(0.1)
        router.close()

    answering = asyncio.create_task(answer_then_die())
    conn = await t.connect(f"127.0.0.1:{port}")
    await answering
    async with asyncio.timeout(5.0):
        assert await conn.recv() == b"last words"
        with pytest.raises(ConnectionClosedError):
            await conn.recv()
    await conn.close()


async def test_garbage_from_peers_never_kills_the_listener(transports: list[ZmqTransport],
                                                           ctx: zmq.asyncio.Context) -> None:
    t = _make(transports)
    handled: list[str] = []

    async def handler(conn: Connection) -> None:
        handled.append(conn.peer)
        await _echo(conn)

    listener = await t.listen("127.0.0.1", 0, handler)
    good = await t.connect(listener.address)
    async with asyncio.timeout(STEP):
        # ZeroMQ peers speaking nonsense: each is told to close; none gets a handler.
        for junk in ([b"GET / HTTP/1.1"], [b""], [b"\x03", b"data before hello"], [bytes([wire.HELLO]), b"x"]):
            bad = ctx.socket(zmq.DEALER)
            bad.linger = 0
            bad.connect(f"tcp://{listener.address}")
            await bad.send_multipart(junk)
            reply = await bad.recv_multipart()
            assert reply[0][0] == wire.CLOSE, f"{junk!r} got {reply!r}"
            bad.close()
        # A raw TCP peer writing an HTTP request (libzmq's ZMTP handshake either drops it or, taking
        # it for a ZMTP/1.0 peer, hands us junk messages that we answer with CLOSE).
        _, writer = await asyncio.open_connection("127.0.0.1", int(listener.address.rsplit(":", 1)[1]))
        writer.write(b"GET / HTTP/1.1\r\nHost: waltz\r\n\r\n" * 100)
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
        # A known peer breaking the protocol (a second HELLO) loses its link only.
        victim = await t.connect(listener.address)
        await victim.send(b"hi")
        assert await victim.recv() == b"hi"
        assert isinstance(victim, ZmqConnection)
        victim._sender.try_send([wire.encode_open(wire.HELLO, 1, 1)])
        with pytest.raises(ConnectionClosedError, match="protocol error"):
            await victim.recv()
        await good.send(b"still serving")
        assert await good.recv() == b"still serving"
    assert len(handled) == 2  # good and victim only
    await victim.close()
    await good.close()


async def test_close_without_reader_is_bounded(transports: list[ZmqTransport], ctx: zmq.asyncio.Context) -> None:
    """A peer that never confirms a CLOSE cannot make close() hang: close_timeout bounds it."""
    t = _make(transports, close_timeout=0.3)
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")

    async def welcome() -> None:
        rid, _hello = await router.recv_multipart()
        await router.send_multipart([rid, wire.encode_open(wire.WELCOME, 100, 1 << 20)])

    answering = asyncio.create_task(welcome())
    conn = await t.connect(f"127.0.0.1:{port}")
    await answering
    loop = asyncio.get_running_loop()
    started = loop.time()
    await conn.close()
    assert loop.time() - started < 2.0
    assert conn.closed
    router.close()


async def test_connect_timeout_when_nothing_answers(ctx: zmq.asyncio.Context) -> None:
    """A ROUTER that accepts TCP but never answers HELLO: ConnectError after connect_timeout."""
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")
    t = ZmqTransport(1024, ZmqOptions(), connect_timeout=0.5)
    try:
        with pytest.raises(ConnectError, match="no answer"):
            await t.connect(f"127.0.0.1:{port}")
    finally:
        await t.aclose()
        router.close()


async def test_aclose_closes_everything_and_is_final(transports: list[ZmqTransport]) -> None:
    t = ZmqTransport(1024, ZmqOptions())
    listener = await t.listen("127.0.0.1", 0, _echo)
    conn = await t.connect(listener.address)
    await conn.send(b"x")
    assert await conn.recv() == b"x"
    async with asyncio.timeout(5.0):
        await t.aclose()
    assert conn.closed
    with pytest.raises(ConnectError):
        await t.connect(listener.address)


def test_options_validation_through_config() -> None:
    config = TransportConfig(name="zmq", options={"zmq": {"heartbeat_interval": 5, "heartbeat_timeout": 1}})
    with pytest.raises(ConfigError, match="heartbeat_interval"):
        backend_options(ZmqOptions, config, "transport")
    config = TransportConfig(name="zmq", options={"zmq": {"curve_client_secret_key_file": "c.key_secret"}})
    with pytest.raises(ConfigError, match="curve_server_public_key_file"):
        backend_options(ZmqOptions, config, "transport")
    config = TransportConfig(name="zmq", options={"zmq": {"window_frames": "64", "curve_allowed_client_keys": []}})
    options = backend_options(ZmqOptions, config, "transport")
    assert options is not None and options.window_frames == 64


def test_waltz_curve_create_writes_usable_pairs(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "waltz_core.cli", "curve", "create", "--dir", str(tmp_path / "k"),
                             "node-1", "client-1"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stderr == "", result.stderr  # no runpy warning, no traceback
    for name in ("node-1", "client-1"):
        public_file, secret_file = tmp_path / "k" / f"{name}.key", tmp_path / "k" / f"{name}.key_secret"
        public, secret = keys.load_secret_keypair(secret_file)
        assert keys.load_keypair(public_file) == (public, None)
        assert zmq.curve_public(secret) == public  # the pair matches
        assert secret_file.stat().st_mode & 0o077 == 0
        assert keys.public_key(public_file) in result.stdout
    with pytest.raises(ConfigError, match="no secret key"):
        keys.load_secret_keypair(tmp_path / "k" / "node-1.key")
    bad = subprocess.run([sys.executable, "-m", "waltz_core.cli", "curve", "create", "--dir", str(tmp_path / "k"),
                          "../escape"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "is not a plain file name" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "escape.key").exists()
