"""Transport benchmark: one-way throughput and ping-pong latency, memory and tcp side by side.

Run: ``python benchmarks/transport_throughput.py [--frames 100000] [--size 256] [--batch 1000]
[--pings 5000] [--transports memory,tcp]``. Each transport is built through the plugin registry
with its default options (tcp: loopback 127.0.0.1). Prints, per transport:

* one-way: ``frames`` frames of ``size`` bytes sent with ``send_many`` in batches of ``batch``,
  timed from the first send until the receiver has read the last frame (frames/s and MB/s of
  payload);
* ping-pong: ``pings`` sequential round trips of a 64-byte frame against an echo handler
  (p50/p99/max latency in microseconds).

Both ends run on one event loop in this process, so the figures include both sides' CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import sys
import time

from waltz_core.config import TransportConfig
from waltz_core.errors import TransportError
from waltz_core.runtime import Runtime
from waltz_core.transport import Connection, open_transport


async def _echo(conn: Connection) -> None:
    try:
        while True:
            await conn.send(await conn.recv())
    except TransportError:
        return


async def one_way(name: str, frames: int, size: int, batch: int) -> tuple[float, float]:
    """Return (frames/s, MB/s) for ``frames`` frames of ``size`` bytes sent in ``send_many`` batches."""
    transport = open_transport(TransportConfig(name=name), Runtime.load().registries)
    done = asyncio.get_running_loop().create_future()

    async def sink(conn: Connection) -> None:
        received = 0
        nbytes = 0
        while received < frames:
            nbytes += len(await conn.recv())
            received += 1
        done.set_result(nbytes)
        await asyncio.sleep(3600)

    listener = await transport.listen("127.0.0.1", 0, sink)
    conn = await transport.connect(listener.address)
    payload = b"x" * size
    chunk = [payload] * batch
    await conn.send_many([payload])  # warm up the path and let the handler start
    t0 = time.perf_counter()
    sent = 0
    while sent < frames - 1:
        n = min(batch, frames - 1 - sent)
        await conn.send_many(chunk if n == batch else chunk[:n])
        sent += n
    nbytes = await done
    elapsed = time.perf_counter() - t0
    await conn.close()
    await listener.close()
    await transport.aclose()
    assert nbytes == frames * size
    return frames / elapsed, nbytes / elapsed / 1e6


async def ping_pong(name: str, pings: int) -> list[float]:
    """Round-trip latencies in microseconds, sorted."""
    transport = open_transport(TransportConfig(name=name), Runtime.load().registries)
    listener = await transport.listen("127.0.0.1", 0, _echo)
    conn = await transport.connect(listener.address)
    frame = b"p" * 64
    for _ in range(200):  # warm-up
        await conn.send(frame)
        await conn.recv()
    out = []
    clock = time.perf_counter
    for _ in range(pings):
        t0 = clock()
        await conn.send(frame)
        await conn.recv()
        out.append((clock() - t0) * 1e6)
    await conn.close()
    await listener.close()
    await transport.aclose()
    out.sort()
    return out


def _pct(sorted_values: list[float], p: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * p))]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--frames", type=int, default=100_000)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--pings", type=int, default=5000)
    parser.add_argument("--transports", default="memory,tcp")
    args = parser.parse_args()
    print(f"python {platform.python_version()} on {platform.machine()}, {sys.platform}; "
          f"{args.frames} frames x {args.size} B, send_many batch {args.batch}; {args.pings} ping-pongs of 64 B")
    print(f"{'transport':<10} {'frames/s':>12} {'MB/s':>8} {'p50 us':>8} {'p99 us':>8} {'max us':>8}")
    for name in args.transports.split(","):
        fps, mbps = await one_way(name, args.frames, args.size, args.batch)
        lat = await ping_pong(name, args.pings)
        print(f"{name:<10} {fps:>12,.0f} {mbps:>8.1f} {_pct(lat, 0.50):>8.1f} {_pct(lat, 0.99):>8.1f} {lat[-1]:>8.1f}")


if __name__ == "__main__":
    asyncio.run(main())
