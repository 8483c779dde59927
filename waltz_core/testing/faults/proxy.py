"""An asyncio TCP fault proxy: ``listen port -> target``, controllable from the test.

One :class:`FaultProxy` forwards every accepted connection to ``target`` and can, at any time:

* :meth:`cut` - reset every open connection and refuse new ones until :meth:`heal`;
* :meth:`reset` - reset the open connections once (new ones are accepted);
* :meth:`delay` - add a fixed latency to every chunk in both directions;
* :meth:`drop` - silently discard bytes in one direction (``"up"``: client -> target,
  ``"down"``: target -> client) or both (a black hole: the TCP connections stay open);
* :meth:`heal` - back to plain forwarding.

With ``record=True`` it also keeps every forwarded byte (both directions) in :attr:`captured`,
which is how the security tests check that nothing readable crosses the wire
(:func:`capture_echo_exchange`).

It runs on the caller's event loop (:meth:`start` / :meth:`close`) or on a thread of its own
(:class:`ThreadedFaultProxy`, for synchronous tests and the smoke test's nemesis). Waltz's own
``ProxyServer`` and Toxiproxy do the same; ``tc netem`` and ``iptables`` are not available here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Sequence
from typing import Literal

from ...errors import ConnectionClosedError
from ...transport.base import Connection, Transport

log = logging.getLogger("waltz.testing.faults.proxy")

Direction = Literal["up", "down", "both"]
_CHUNK = 65536


class FaultProxy:
    """Forward ``listen_host:listen_port`` to ``target_host:target_port``; inject faults on demand.

    All methods run on the proxy's event loop (use :class:`ThreadedFaultProxy` from other threads).
    """

    def __init__(self, target: str, listen_host: str = "127.0.0.1", listen_port: int = 0, *,
                 record: bool = False) -> None:
        host, _, port = target.rpartition(":")
        self.target_host, self.target_port = host, int(port)
        self.captured: bytearray | None = bytearray() if record else None  #: forwarded bytes when recording
        self.listen_host, self.listen_port = listen_host, listen_port
        self.refusing = False
        self.latency = 0.0
        self.dropping: set[str] = set()
        self.connections_accepted = 0
        self._server: asyncio.Server | None = None
        self._pipes: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> str:
        return f"{self.listen_host}:{self.listen_port}"

    async def start(self) -> FaultProxy:
        self._server = await asyncio.start_server(self._accept, self.listen_host, self.listen_port)
        self.listen_port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        self.reset()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task

    # --------------------------------------------------------------------------- faults

    def cut(self) -> None:
        """Reset every open connection and refuse (reset) new ones until :meth:`heal`."""
        self.refusing = True
        self.reset()

    def reset(self) -> None:
        """Reset (RST) every open connection once."""
        for a, b in list(self._pipes):
            _abort(a)
            _abort(b)
        self._pipes.clear()

    def delay(self, seconds: float) -> None:
        """Hold every forwarded chunk ``seconds`` (both directions)."""
        self.latency = max(0.0, seconds)

    def drop(self, direction: Direction = "both") -> None:
        """Discard bytes flowing ``up`` (to the target), ``down`` (to the client) or both."""
        self.dropping = {"up", "down"} if direction == "both" else {direction}

    def heal(self) -> None:
        """Plain forwarding again (open connections that survived keep working)."""
        self.refusing = False
        self.latency = 0.0
        self.dropping = set()

    # --------------------------------------------------------------------------- forwarding

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.refusing:
            _abort(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            _abort(writer)
            return
        self.connections_accepted += 1
        pipe = (writer, up_writer)
        self._pipes.add(pipe)
        a = asyncio.ensure_future(self._pump(reader, up_writer, "up", pipe))
        b = asyncio.ensure_future(self._pump(up_reader, writer, "down", pipe))
        for t in (a, b):
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: str,
                    pipe: tuple[asyncio.StreamWriter, asyncio.StreamWriter]) -> None:
        try:
            while True:
                chunk = await reader.read(_CHUNK)
                if not chunk:
                    break
                if self.latency:
                    await asyncio.sleep(self.latency)
                if direction in self.dropping:
                    continue
                if self.captured is not None:
                    self.captured += chunk
                writer.write(chunk)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            # One side ended: end both, so neither peer waits on a half-open pipe.
            self._pipes.discard(pipe)
            for w in pipe:
                with contextlib.suppress(Exception):
                    w.close()


async def capture_echo_exchange(server: Transport, client: Transport, payload: bytes, timeout: float = 20.0,
                                rounds: int = 20) -> bytes:
    """Echo ``payload`` between two transports through a recording proxy; return the wire bytes.

    ``rounds`` single sends and one ``send_many`` of ``rounds`` frames, each echoed back and
    checked. A control run without security shows ``payload`` in the result; an encrypted one must not.
    """

    async def echo(conn: Connection) -> None:
        with contextlib.suppress(ConnectionClosedError):
            while True:
                await conn.send(await conn.recv())

    listener = await server.listen("127.0.0.1", 0, echo)
    proxy = await FaultProxy(listener.address, record=True).start()
    try:
        conn = await client.connect(proxy.address)
        async with asyncio.timeout(timeout):
            for _ in range(rounds):
                await conn.send(payload)
                assert await conn.recv() == payload
            batch: Sequence[bytes] = [payload] * rounds
            await conn.send_many(batch)
            for _ in range(rounds):
                assert await conn.recv() == payload
        await conn.close()
    finally:
        await proxy.close()
        await listener.close()
    assert proxy.captured is not None
    return bytes(proxy.captured)


def _abort(writer: asyncio.StreamWriter) -> None:
    transport = writer.transport
    with contextlib.suppress(Exception):
        transport.abort()  # RST, not FIN: the peer sees a reset like a crashed host would cause


class ThreadedFaultProxy:
    """A :class:`FaultProxy` on an event loop thread of its own; every method is thread-safe."""

    def __init__(self, target: str, listen_host: str = "127.0.0.1", listen_port: int = 0) -> None:
        self._proxy = FaultProxy(target, listen_host, listen_port)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"fault-proxy-{target}", daemon=True)

    @property
    def address(self) -> str:
        return self._proxy.address

    @property
    def listen_port(self) -> int:
        return self._proxy.listen_port

    def start(self) -> ThreadedFaultProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._proxy.start(), self._loop).result(10)
        return self

    def _call(self, fn: str, *args: object) -> None:
        async def run() -> None:
            getattr(self._proxy, fn)(*args)

        asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    def cut(self) -> None:
        self._call("cut")

    def reset(self) -> None:
        self._call("reset")

    def delay(self, seconds: float) -> None:
        self._call("delay", seconds)

    def drop(self, direction: Direction = "both") -> None:
        self._call("drop", direction)

    def heal(self) -> None:
        self._call("heal")

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self._proxy.close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
