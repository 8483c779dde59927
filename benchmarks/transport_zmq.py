"""Frames/s and ping-pong latency of the zmq transport next to tcp, over loopback, in one process.

    python benchmarks/transport_zmq.py [--frames 100000] [--size 1024] [--pings 5000]

Prints, per transport: one-way throughput (frames/s, MB/s) with send_many batches of 64, and
sequential ping-pong round trips (p50/p99 in microseconds). Client and server share one event
loop (GIL-bound), so the figures compare the transports, not the machine's limits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import time

from waltz_core.config import TransportConfig, backend_options
from waltz_core.errors import ConnectionClosedError
from waltz_core.runtime import Runtime
from waltz_core.transport.base import Connection, Transport


def _build(name: str) -> Transport:
    info = Runtime.load().registries.resolve("transport", name)
    config = TransportConfig(name=name)
    return info.factory(config, backend_options(info.config_cls, config, "transport"))


async def _throughput(transport: Transport, frames: int, size: int) -> tuple[float, float]:
    done = asyncio.Event()

    async def sink(conn: Connection) -> None:
        for _ in range(frames):
            await conn.recv()
        await conn.send(b"done")
        done.set()
        with contextlib.suppress(ConnectionClosedError):
            await conn.recv()

    listener = await transport.listen("127.0.0.1", 0, sink)
    conn = await transport.connect(listener.address)
    batch = [b"x" * size] * 64
    start = time.perf_counter()
    for _ in range(frames // 64):
        await conn.send_many(batch)
    for _ in range(frames % 64):
        await conn.send(batch[0])
    assert await conn.recv() == b"done"
    elapsed = time.perf_counter() - start
    await conn.close()
    await listener.close()
    return frames / elapsed, frames * size / elapsed / 1e6


async def _ping_pong(transport: Transport, pings: int) -> tuple[float, float]:
    async def echo(conn: Connection) -> None:
        with contextlib.suppress(ConnectionClosedError):
            while True:
                await conn.send(await conn.recv())

    listener = await transport.listen("127.0.0.1", 0, echo)
    conn = await transport.connect(listener.address)
    samples = []
    for _ in range(pings):
        start = time.perf_counter()
        await conn.send(b"ping-16-bytes!!!")
        await conn.recv()
        samples.append(time.perf_counter() - start)
    await conn.close()
    await listener.close()
    samples.sort()
    return samples[len(samples) // 2] * 1e6, samples[int(len(samples) * 0.99)] * 1e6


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=100_000)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--pings", type=int, default=5000)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)  # hide the plaintext warnings
    print(f"{'transport':<10}{'frames/s':>12}{'MB/s':>9}{'p50 us':>9}{'p99 us':>9}   "
          f"({args.frames} x {args.size} B one way, {args.pings} ping-pongs)")
    for name in ("tcp", "zmq"):
        transport = _build(name)
        try:
            rate, mbs = await _throughput(transport, args.frames, args.size)
            p50, p99 = await _ping_pong(transport, args.pings)
        finally:
            await transport.aclose()
        print(f"{name:<10}{rate:>12,.0f}{mbs:>9.1f}{p50:>9.0f}{p99:>9.0f}")


if __name__ == "__main__":
    asyncio.run(main())
