"""The transport conformance kit: every transport backend must pass it.

Use it from a plugin's tests (pytest-asyncio in auto mode)::

    from waltz_core.testing.conformance.transport import TransportConformance

    class TestTcpTransport(TransportConformance):
        backend_name = "tcp"
        capabilities = frozenset({"heartbeat", "raw-socket"})
        idle_timeout = 0.6

        @pytest.fixture
        def transport_options(self):
            return {"heartbeat_interval": 0.1, "idle_timeout": 0.6}

By default transports are built through the registry of the kit's ``runtime`` fixture (built-ins,
installed entry points and ``extra_plugins``, see :class:`~waltz_core.testing.conformance.KitRuntime`)
from ``TransportConfig(name=backend_name, max_frame_size=..., options={name: transport_options})``,
so the kit also proves that the entry point and the options class work. A subclass may instead
override the ``transport_factory`` fixture (a callable ``max_frame_size -> Transport``) or the
``transport`` fixture; transports must then use :attr:`TransportConformance.max_frame_size`.

Capabilities (tests of capabilities not declared are skipped, like fsspec's ``supports_*``):

``raw-socket``
    addresses are real TCP ``host:port`` endpoints speaking ``uint32 length`` + payload framing,
    so the kit can connect or listen with plain sockets (garbage, oversize announcements, torn frames);
``heartbeat``
    the transport writes heartbeats when idle and fails a silent peer with PeerTimeoutError within
    :attr:`TransportConformance.idle_timeout` (plus one heartbeat interval), but not because its
    own event loop was stalled;
``send-nowait``
    connections have the optional ``send_nowait(frame)``: :meth:`Connection.send` without waiting
    for room, for a caller that bounds what it has in flight (the storage client's streaming
    appends use it; without it they are sent from a task).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, ClassVar

import pytest

from ...config import TransportConfig, backend_options
from ...errors import ConnectError, ConnectionClosedError, FrameTooLargeError, PeerTimeoutError, ProtocolError
from ...runtime import Runtime
from ...timeouts import wait_for
from ...transport.base import Connection, ConnectionHandler, Listener, Transport
from . import KitRuntime

#: Upper bound for any single wait in the kit; a correct transport finishes far below it.
STEP_TIMEOUT = 20.0
_LEN = struct.Struct(">I")

TransportFactory = Callable[..., Transport]
Serve = Callable[..., Awaitable[Listener]]


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _tagged(tag: int, seq: int, size: int) -> bytes:
    """A frame that names its sender and position, padded with a byte derived from both."""
    head = struct.pack(">II", tag, seq)
    return head + bytes([(tag * 31 + seq) % 251]) * max(0, size - len(head))


def _check_tagged(frame: bytes, tag: int, seq: int) -> None:
    got_tag, got_seq = struct.unpack_from(">II", frame)
    assert (got_tag, got_seq) == (tag, seq), f"expected frame {seq} of sender {tag}, got {got_seq} of {got_tag}"
    assert frame[8:] == bytes([(tag * 31 + seq) % 251]) * (len(frame) - 8), f"payload of frame {seq} corrupted"


async def _echo(conn: Connection) -> None:
    """Handler: send every frame back until the connection closes."""
    with contextlib.suppress(ConnectionClosedError):
        while True:
            await conn.send(await conn.recv())


async def _recv_n(conn: Connection, n: int) -> list[bytes]:
    return [await conn.recv() for _ in range(n)]


async def _read_raw_until_eof(reader: asyncio.StreamReader) -> bytes:
    """Everything a raw peer receives until the other side closes (a reset counts as the end)."""
    chunks = []
    with contextlib.suppress(ConnectionResetError):
        while chunk := await reader.read(65536):
            chunks.append(chunk)
    return b"".join(chunks)


async def _close_raw(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


def requires_capability(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark a kit test as needing a capability; it is skipped for backends that do not declare it.

    The mark is the test function's ``waltz_capabilities`` set, read by the kit's capability gate fixture.
    """

    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn.waltz_capabilities = getattr(fn, "waltz_capabilities", frozenset()) | {name}  # type: ignore[attr-defined]
        return fn

    return mark


class TransportConformance(KitRuntime):
    """Behaviour every transport must show. Subclass it and set ``backend_name``.

    Override ``transport_options`` (the ``[transport.<name>]`` table), ``capabilities`` and,
    for heartbeat backends, ``idle_timeout`` (the idle timeout those options configure).
    """

    backend_name: ClassVar[str]
    capabilities: ClassVar[frozenset[str]] = frozenset()
    #: max_frame_size of the transports under test (large frames of 4 MiB must fit).
    max_frame_size: ClassVar[int] = 8 * 1024 * 1024
    #: idle timeout configured through ``transport_options`` (heartbeat capability only).
    idle_timeout: ClassVar[float] = 1.0
    #: number of simultaneous connections in the concurrency test.
    concurrent_connections: ClassVar[int] = 50

    # ---------------------------------------------------------------------------- fixtures
    @pytest.fixture(autouse=True)
    def _capability_gate(self, request: pytest.FixtureRequest) -> None:
        needed: frozenset[str] = getattr(request.function, "waltz_capabilities", frozenset())
        missing = needed - self.capabilities
        if missing:
            pytest.skip(f"transport {self.backend_name!r} does not declare {', '.join(sorted(missing))}")

    @pytest.fixture
    def transport_options(self) -> dict[str, Any]:
        """The ``[transport.<backend_name>]`` options table used to build transports."""
        return {}

    @pytest.fixture
    async def transport_factory(self, transport_options: dict[str, Any],
                                runtime: Runtime) -> AsyncIterator[TransportFactory]:
        """``make(max_frame_size=None) -> Transport`` built through the registry; all closed afterwards."""
        info = runtime.registries.resolve("transport", self.backend_name)
        made: list[Transport] = []

        def make(max_frame_size: int | None = None) -> Transport:
            config = TransportConfig(name=self.backend_name, max_frame_size=max_frame_size or self.max_frame_size,
                                     connect_timeout=5.0, options={self.backend_name: transport_options})
            options = backend_options(info.config_cls, config, "transport")
            transport: Transport = info.factory(config, options)
            made.append(transport)
            return transport

        yield make
        for transport in made:
            await transport.aclose()

    @pytest.fixture
    def transport(self, transport_factory: TransportFactory) -> Transport:
        return transport_factory()

    @pytest.fixture
    async def serve(self, transport: Transport) -> AsyncIterator[Serve]:
        """``await serve(handler, on=transport)`` -> a listener on 127.0.0.1:0, closed after the test."""
        listeners: list[Listener] = []

        async def start(handler: ConnectionHandler, on: Transport | None = None) -> Listener:
            listener = await (on or transport).listen("127.0.0.1", 0, handler)
            listeners.append(listener)
            return listener

        yield start
        for listener in listeners:
            await listener.close()

    @pytest.fixture
    async def pair(self, transport: Transport, serve: Serve) -> AsyncIterator[tuple[Connection, Connection]]:
        """(client, server) ends of one connection; the server end stays open until the test ends."""
        accepted: asyncio.Queue[Connection] = asyncio.Queue()
        done = asyncio.Event()

        async def hold(conn: Connection) -> None:
            await accepted.put(conn)
            await done.wait()

        listener = await serve(hold)
        client = await transport.connect(listener.address)
        async with asyncio.timeout(STEP_TIMEOUT):
            server = await accepted.get()
        yield client, server
        done.set()
        await client.close()

    # ---------------------------------------------------------------------------- registration
    def test_registered_via_entry_point(self, runtime: Runtime) -> None:
        """The backend is found through the plugin manager, with an attrs options class or none."""
        registries = runtime.registries
        assert self.backend_name in registries.transport.names()
        info = registries.resolve("transport", self.backend_name)
        if info.config_cls is not None:
            info.config_cls()  # defaults alone must form valid options
        transport = info.factory(TransportConfig(name=self.backend_name), backend_options(
            info.config_cls, TransportConfig(name=self.backend_name), "transport"))
        assert isinstance(transport, Transport)
        assert transport.name == self.backend_name

    # ---------------------------------------------------------------------------- connect / exchange
    async def test_connect_and_exchange(self, transport: Transport, serve: Serve) -> None:
        listener = await serve(_echo)
        assert not listener.address.endswith(":0"), "the listener must report the port it really bound"
        conn = await transport.connect(listener.address)
        assert isinstance(conn, Connection)
        assert conn.peer and not conn.closed
        async with asyncio.timeout(STEP_TIMEOUT):
            await conn.send(b"hello")
            assert await conn.recv() == b"hello"
            await conn.send_many([b"a", b"bb", b"ccc"])
            assert await _recv_n(conn, 3) == [b"a", b"bb", b"ccc"]
        await conn.close()

    async def test_many_frames_in_order_both_directions(self, pair: tuple[Connection, Connection]) -> None:
        """Both ends send 5,000 frames of mixed sizes at once (single sends and batches)."""
        client, server = pair
        n = 5000
        rng = random.Random(7)
        sizes = [rng.choice((9, 10, 100, 1000, 5000, 70_000)) for _ in range(n)]

        async def write(conn: Connection, tag: int) -> None:
            seq = 0
            while seq < n:
                batch = rng.randint(1, 50)
                frames = [_tagged(tag, s, sizes[s]) for s in range(seq, min(n, seq + batch))]
                if batch % 3 == 0:
                    for f in frames:
                        await conn.send(f)
                else:
                    await conn.send_many(frames)
                seq += len(frames)

        async def read(conn: Connection, tag: int) -> None:
            for seq in range(n):
                frame = await conn.recv()
                assert len(frame) == sizes[seq]
                _check_tagged(frame, tag, seq)

        async with asyncio.timeout(STEP_TIMEOUT * 3):
            await asyncio.gather(write(client, 1), write(server, 2), read(server, 1), read(client, 2))

    async def test_concurrent_senders_do_not_corrupt_frames(self, pair: tuple[Connection, Connection]) -> None:
        """Eight tasks share one connection; each task's frames arrive whole and in its order."""
        client, server = pair
        senders, per_sender = 8, 150

        async def write(tag: int) -> None:
            for seq in range(per_sender):
                frame = _tagged(tag, seq, 40_000 if seq % 10 == 0 else 300)
                if seq % 2:
                    await client.send(frame)
                else:
                    await client.send_many([frame])

        async with asyncio.timeout(STEP_TIMEOUT * 2):
            writers = asyncio.gather(*(write(t) for t in range(senders)))
            next_seq = [0] * senders
            for _ in range(senders * per_sender):
                frame = await server.recv()
                tag = struct.unpack_from(">I", frame)[0]
                _check_tagged(frame, tag, next_seq[tag])
                next_seq[tag] += 1
            await writers
        assert next_seq == [per_sender] * senders

    async def test_large_frames_intact(self, transport: Transport, serve: Serve) -> None:
        listener = await serve(_echo)
        conn = await transport.connect(listener.address)
        big = os.urandom(4 * 1024 * 1024)
        largest = os.urandom(self.max_frame_size)
        async with asyncio.timeout(STEP_TIMEOUT * 2):
            await conn.send(big)
            await conn.send_many([b"x", big])
            await conn.send(largest)
            assert await conn.recv() == big
            assert await conn.recv() == b"x"
            assert await conn.recv() == big
            assert await conn.recv() == largest
        await conn.close()

    async def test_cancelled_recv_loses_no_frame(self, pair: tuple[Connection, Connection]) -> None:
        client, server = pair
        for i in range(20):
            with pytest.raises(TimeoutError):
                await wait_for(client.recv(), 0.01)
            await server.send(b"frame-%d" % i)
            async with asyncio.timeout(STEP_TIMEOUT):
                assert await client.recv() == b"frame-%d" % i

    # ---------------------------------------------------------------------------- invalid frames
    async def test_empty_frame_rejected(self, pair: tuple[Connection, Connection]) -> None:
        """Empty frames are reserved for heartbeats; a bad batch is rejected as a whole."""
        client, server = pair
        with pytest.raises(ProtocolError) as info:
            await client.send(b"")
        assert not isinstance(info.value, FrameTooLargeError)
        with pytest.raises(ProtocolError):
            await client.send_many([b"first", b""])
        await client.send(b"after")
        async with asyncio.timeout(STEP_TIMEOUT):
            assert await server.recv() == b"after", "a rejected batch must not be sent in part"

    async def test_oversize_send_rejected(self, pair: tuple[Connection, Connection]) -> None:
        """An oversize frame is refused before any byte is written; the connection stays usable."""
        client, server = pair
        too_big = b"\0" * (self.max_frame_size + 1)
        with pytest.raises(FrameTooLargeError):
            await client.send(too_big)
        with pytest.raises(FrameTooLargeError):
            await client.send_many([b"first", too_big])
        assert not client.closed
        await client.send(b"after")
        async with asyncio.timeout(STEP_TIMEOUT):
            assert await server.recv() == b"after"

    async def test_oversize_receive_closes_only_that_connection(
        self, transport: Transport, transport_factory: TransportFactory, serve: Serve
    ) -> None:
        """A peer allowed larger frames sends one above our maximum: FrameTooLargeError, then closed."""
        errors: asyncio.Queue[BaseException] = asyncio.Queue()

        async def handler(conn: Connection) -> None:
            try:
                while True:
                    await conn.send(await conn.recv())
            except (ProtocolError, ConnectionClosedError) as exc:
                await errors.put(exc)

        listener = await serve(handler)
        bystander = await transport.connect(listener.address)
        big_peer = await transport_factory(self.max_frame_size * 2).connect(listener.address)
        async with asyncio.timeout(STEP_TIMEOUT):
            await bystander.send(b"before")
            assert await bystander.recv() == b"before"
            await big_peer.send(b"small first")
            assert await big_peer.recv() == b"small first"
            with contextlib.suppress(ConnectionClosedError):  # the listener may hang up mid-write
                await big_peer.send(b"\1" * (self.max_frame_size + 1))
            error = await errors.get()
            assert isinstance(error, FrameTooLargeError), f"expected FrameTooLargeError, got {error!r}"
            with pytest.raises(ConnectionClosedError):
                await big_peer.recv()
            # The listener and its other connections carry on.
            await bystander.send(b"still here")
            assert await bystander.recv() == b"still here"
            fresh = await transport.connect(listener.address)
            await fresh.send(b"new")
            assert await fresh.recv() == b"new"
        await fresh.close()
        await bystander.close()
        await big_peer.close()

    # ---------------------------------------------------------------------------- close semantics
    async def test_peer_close_delivers_earlier_frames_first(self, pair: tuple[Connection, Connection]) -> None:
        client, server = pair
        frames = [b"frame %d" % i for i in range(300)]
        await server.send_many(frames)
        await server.close()
        async with asyncio.timeout(STEP_TIMEOUT):
            assert await _recv_n(client, len(frames)) == frames
            with pytest.raises(ConnectionClosedError):
                await client.recv()
            with pytest.raises(ConnectionClosedError):
                await client.recv()  # and again: the close is sticky
        assert client.closed
        with pytest.raises(ConnectionClosedError):
            await client.send(b"too late")

    async def test_close_flushes_queued_frames(self, pair: tuple[Connection, Connection]) -> None:
        client, server = pair
        frames = [_tagged(1, i, 1024) for i in range(2000)]

        async def read_all() -> None:
            for i in range(len(frames)):
                _check_tagged(await server.recv(), 1, i)
            with pytest.raises(ConnectionClosedError):
                await server.recv()

        async with asyncio.timeout(STEP_TIMEOUT):
            reader = asyncio.create_task(read_all())  # a bounded transport blocks a writer nobody reads
            await client.send_many(frames[:500])
            for f in frames[500:]:
                await client.send(f)
            await client.close()
            await reader

    async def test_local_close_is_idempotent_and_final(self, pair: tuple[Connection, Connection]) -> None:
        client, server = pair
        await client.close()
        await client.close()
        assert client.closed
        with pytest.raises(ConnectionClosedError):
            await client.send(b"x")
        with pytest.raises(ConnectionClosedError):
            await client.send_many([b"x"])
        async with asyncio.timeout(STEP_TIMEOUT):
            with pytest.raises(ConnectionClosedError):
                await client.recv()
            with pytest.raises(ConnectionClosedError):
                await server.recv()

    async def test_close_wakes_a_waiting_recv(self, pair: tuple[Connection, Connection]) -> None:
        client, _server = pair
        waiting = asyncio.create_task(client.recv())
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await client.close()
        async with asyncio.timeout(STEP_TIMEOUT):
            with pytest.raises(ConnectionClosedError):
                await waiting

    async def test_listener_close_closes_accepted_connections(self, transport: Transport) -> None:
        started = asyncio.Event()

        async def never_answers(conn: Connection) -> None:
            started.set()
            await asyncio.Event().wait()

        listener = await transport.listen("127.0.0.1", 0, never_answers)
        conn = await transport.connect(listener.address)
        async with asyncio.timeout(STEP_TIMEOUT):
            await started.wait()
            await listener.close()
            await listener.close()
            with pytest.raises(ConnectionClosedError):
                await conn.recv()
            with pytest.raises(ConnectError):
                await transport.connect(listener.address)
        await conn.close()

    async def test_handler_failure_closes_only_its_connection(self, transport: Transport, serve: Serve) -> None:
        calls = 0

        async def flaky(conn: Connection) -> None:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise RuntimeError("handler bug (expected by the test)")
            await _echo(conn)

        listener = await serve(flaky)
        first = await transport.connect(listener.address)
        async with asyncio.timeout(STEP_TIMEOUT):
            with pytest.raises(ConnectionClosedError):
                await first.recv()
            second = await transport.connect(listener.address)
            await second.send(b"ok")
            assert await second.recv() == b"ok"
        await second.close()
        await first.close()

    async def test_aclose_is_idempotent(self, transport: Transport) -> None:
        await transport.aclose()
        await transport.aclose()

    # ---------------------------------------------------------------------------- connect errors
    async def test_connect_refused(self, transport: Transport) -> None:
        listener = await transport.listen("127.0.0.1", 0, _echo)
        address = listener.address
        await listener.close()
        with pytest.raises(ConnectError):
            await transport.connect(address)
        with pytest.raises(ConnectError):
            await transport.connect("not-an-address")

    # ---------------------------------------------------------------------------- scale / flow control
    async def test_many_concurrent_connections(self, transport: Transport, serve: Serve) -> None:
        listener = await serve(_echo)
        per_conn = 20

        async def client(tag: int) -> None:
            conn = await transport.connect(listener.address)
            frames = [_tagged(tag, s, 16 + (tag * 7 + s) % 500) for s in range(per_conn)]
            await conn.send_many(frames[:10])
            for f in frames[10:]:
                await conn.send(f)
            for s in range(per_conn):
                _check_tagged(await conn.recv(), tag, s)
            await conn.close()

        async with asyncio.timeout(STEP_TIMEOUT * 2):
            await asyncio.gather(*(client(t) for t in range(self.concurrent_connections)))

    @requires_capability("send-nowait")
    async def test_send_nowait_keeps_order_with_send_and_checks_like_it(self, pair: tuple[Connection, Connection]) -> None:
        client, server = pair
        send_nowait = client.send_nowait  # type: ignore[attr-defined]
        async with asyncio.timeout(STEP_TIMEOUT):
            for i in range(300):
                frame = i.to_bytes(4, "big") * (1 + i % 7)
                if i % 3:
                    send_nowait(frame)
                else:
                    await client.send(frame)
            got = await _recv_n(server, 300)
        assert [int.from_bytes(f[:4], "big") for f in got] == list(range(300))
        with pytest.raises(ProtocolError):
            send_nowait(b"")
        with pytest.raises(FrameTooLargeError):
            send_nowait(b"x" * (self.max_frame_size + 1))
        await client.close()
        with pytest.raises(ConnectionClosedError):
            send_nowait(b"after close")

    async def test_send_waits_when_peer_does_not_read(self, transport: Transport, serve: Serve) -> None:
        """Back pressure: a writer to a peer that reads nothing stops instead of buffering 64 MiB."""
        n, size = 2048, 32 * 1024
        release = asyncio.Event()
        all_read = asyncio.Event()
        problems: list[str] = []

        async def slow_reader(conn: Connection) -> None:
            await release.wait()
            for seq in range(n):
                frame = await conn.recv()
                if frame[:4] != seq.to_bytes(4, "big") or len(frame) != size:
                    problems.append(f"frame {seq} wrong")
            all_read.set()
            await asyncio.Event().wait()

        listener = await serve(slow_reader)
        conn = await transport.connect(listener.address)
        payload = b"p" * (size - 4)
        sent = 0

        async def writer() -> None:
            nonlocal sent
            for seq in range(n):
                await conn.send(seq.to_bytes(4, "big") + payload)
                sent += 1

        task = asyncio.create_task(writer())
        try:
            last = -1
            async with asyncio.timeout(STEP_TIMEOUT):
                while not task.done() and sent != last:
                    last = sent
                    await asyncio.sleep(0.3)
            assert not task.done(), f"all {n * size} bytes were accepted while the peer read nothing"
            assert 0 < sent < n
            release.set()
            async with asyncio.timeout(STEP_TIMEOUT * 2):
                await task
                await all_read.wait()
            assert problems == []
        finally:
            task.cancel()
            await conn.close()

    # ---------------------------------------------------------------------------- raw peers (real sockets)
    @requires_capability("raw-socket")
    async def test_garbage_from_raw_peer_closes_only_that_connection(
        self, transport: Transport, serve: Serve
    ) -> None:
        errors: asyncio.Queue[BaseException] = asyncio.Queue()

        async def handler(conn: Connection) -> None:
            try:
                await _echo_strict(conn)
            except (ProtocolError, ConnectionClosedError) as exc:
                await errors.put(exc)

        listener = await serve(handler)
        good = await transport.connect(listener.address)
        reader, writer = await asyncio.open_connection(*_host_port(listener.address))
        try:
            async with asyncio.timeout(STEP_TIMEOUT):
                await good.send(b"before")
                assert await good.recv() == b"before"
                writer.write(b"GET / HTTP/1.1\r\nHost: waltz\r\n\r\n")  # length prefix 0x47455420: far too big
                received = await _read_raw_until_eof(reader)
                assert set(received) <= {0}, "only heartbeats may reach a peer that sent garbage"
                error = await errors.get()
                assert isinstance(error, ProtocolError), f"expected a ProtocolError, got {error!r}"
                await good.send(b"after")
                assert await good.recv() == b"after"
        finally:
            await _close_raw(writer)
            await good.close()

    @requires_capability("raw-socket")
    async def test_oversize_announced_by_raw_peer(self, transport: Transport, serve: Serve) -> None:
        """Both directions: a raw listener and a raw client announce a frame above the maximum."""
        errors: asyncio.Queue[BaseException] = asyncio.Queue()

        async def handler(conn: Connection) -> None:
            try:
                await _echo_strict(conn)
            except (ProtocolError, ConnectionClosedError) as exc:
                await errors.put(exc)

        listener = await serve(handler)
        announce = _LEN.pack(self.max_frame_size + 1) + b"only the start"
        reader, writer = await asyncio.open_connection(*_host_port(listener.address))
        try:
            async with asyncio.timeout(STEP_TIMEOUT):
                writer.write(_LEN.pack(3) + b"abc")
                echoed = b""
                while echoed.replace(_LEN.pack(0), b"") != _LEN.pack(3) + b"abc":  # skip heartbeats
                    chunk = await reader.read(65536)
                    assert chunk, "connection closed before the valid frame was echoed"
                    echoed += chunk
                writer.write(announce)
                assert set(await _read_raw_until_eof(reader)) <= {0}
                error = await errors.get()
            assert isinstance(error, FrameTooLargeError), f"expected FrameTooLargeError, got {error!r}"
        finally:
            await _close_raw(writer)

        async def raw_server(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            w.write(_LEN.pack(2) + b"ok")
            while (await r.readexactly(4)) == _LEN.pack(0):  # skip heartbeats, wait for the client's ack
                pass
            w.write(announce)
            await _read_raw_until_eof(r)
            await _close_raw(w)

        server = await asyncio.start_server(raw_server, "127.0.0.1", 0)
        try:
            host, port = server.sockets[0].getsockname()[:2]
            conn = await transport.connect(f"{host}:{port}")
            async with asyncio.timeout(STEP_TIMEOUT):
                assert await conn.recv() == b"ok"
                await conn.send(b"ack")
                with pytest.raises(FrameTooLargeError):
                    await conn.recv()
            assert conn.closed
            with pytest.raises(ConnectionClosedError):
                await conn.send(b"x")
            await conn.close()
        finally:
            server.close()
            await server.wait_closed()

    @requires_capability("raw-socket")
    async def test_peer_dying_mid_frame(self, transport: Transport, serve: Serve) -> None:
        """Complete frames are delivered; the torn one is not; then ConnectionClosedError."""
        outcome: asyncio.Queue[object] = asyncio.Queue()

        async def handler(conn: Connection) -> None:
            try:
                while True:
                    await outcome.put(await conn.recv())
            except (ProtocolError, ConnectionClosedError) as exc:
                await outcome.put(exc)

        listener = await serve(handler)
        async with asyncio.timeout(STEP_TIMEOUT):
            _, writer = await asyncio.open_connection(*_host_port(listener.address))
            writer.write(_LEN.pack(5) + b"whole" + _LEN.pack(100) + b"only ten b")
            await _close_raw(writer)
            assert await outcome.get() == b"whole"
            last = await outcome.get()
        assert isinstance(last, ConnectionClosedError), f"expected ConnectionClosedError, got {last!r}"

    # ---------------------------------------------------------------------------- heartbeats
    @requires_capability("heartbeat")
    async def test_idle_connection_is_kept_alive_by_heartbeats(self, pair: tuple[Connection, Connection]) -> None:
        client, server = pair
        waiting = asyncio.create_task(server.recv())
        await asyncio.sleep(self.idle_timeout * 2.5)
        assert not waiting.done(), f"an idle but healthy peer was dropped: {waiting}"
        async with asyncio.timeout(STEP_TIMEOUT):
            await client.send(b"still alive")
            assert await waiting == b"still alive"
            await server.send(b"yes")
            assert await client.recv() == b"yes"

    @requires_capability("heartbeat")
    async def test_own_event_loop_stall_is_not_a_peer_timeout(self, pair: tuple[Connection, Connection]) -> None:
        """A blocked event loop (GC pause, slow callback) must not make us declare a live peer dead."""
        client, server = pair
        await asyncio.sleep(self.idle_timeout / 2)
        time.sleep(self.idle_timeout * 2.5)  # noqa: ASYNC251 - the point: stall the loop both ends share
        await asyncio.sleep(self.idle_timeout / 2)
        async with asyncio.timeout(STEP_TIMEOUT):
            await client.send(b"ping")
            assert await server.recv() == b"ping"
            await server.send(b"pong")
            assert await client.recv() == b"pong"

    @requires_capability("heartbeat")
    @requires_capability("raw-socket")
    async def test_silent_peer_detected(self, transport: Transport, serve: Serve) -> None:
        """A raw peer that never sends: PeerTimeoutError on both the listening and connecting side."""
        outcome: asyncio.Queue[BaseException] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        async def handler(conn: Connection) -> None:
            try:
                await conn.recv()
            except (ProtocolError, ConnectionClosedError, PeerTimeoutError) as exc:
                await outcome.put(exc)

        bound = self.idle_timeout * 3 + 2
        listener = await serve(handler)
        started = loop.time()
        async with asyncio.timeout(STEP_TIMEOUT):
            reader, writer = await asyncio.open_connection(*_host_port(listener.address))
            received = await _read_raw_until_eof(reader)
            error = await outcome.get()
        assert isinstance(error, PeerTimeoutError), f"expected PeerTimeoutError, got {error!r}"
        assert loop.time() - started < bound, "silent peer not detected near the idle timeout"
        await _close_raw(writer)
        assert received and set(received) == {0}, "an idle transport must send heartbeats (zero-length frames)"

        async def silent_server(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await _read_raw_until_eof(r)
            w.close()

        server = await asyncio.start_server(silent_server, "127.0.0.1", 0)
        try:
            host, port = server.sockets[0].getsockname()[:2]
            conn = await transport.connect(f"{host}:{port}")
            started = loop.time()
            async with asyncio.timeout(STEP_TIMEOUT):
                with pytest.raises(PeerTimeoutError):
                    await conn.recv()
            assert loop.time() - started < bound
            assert conn.closed
            await conn.close()
        finally:
            server.close()
            await server.wait_closed()


async def _echo_strict(conn: Connection) -> None:
    """Echo until an error, letting ConnectionClosedError and ProtocolError propagate."""
    while True:
        await conn.send(await conn.recv())
