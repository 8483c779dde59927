"""Append throughput and latency over tcp and zmq, side by side, on the same cluster shape.

    python benchmarks/transport_compare.py [--appends 3000] [--window 64] [--size 256] [--secure]

For each transport, a ProcessCluster (3 storage node processes, 1 server process, local
coordination, 1 partition) is started with that transport chosen by name in every config
file; a client-library driver (AsyncWaltzClient, one process) keeps ``--window`` appends in
flight (closed loop: a new append is submitted when one completes) and measures, per append,
the time from submit to its completion callback (committed: written to a quorum of storage
nodes and acknowledged). ``--secure`` adds tcp with mutual TLS and zmq with CURVE.

Prints appends/s, and p50/p99 latency in milliseconds per transport. The figures are for one
client process on a shared machine; compare the rows, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from waltz_core.client import AsyncWaltzClient, TransactionContext, WaltzClientCallbacks
from waltz_core.testing.cluster import ClusterSpec, ProcessCluster


class Sink(WaltzClientCallbacks):
    """The benchmark application: it applies nothing (only appends are measured)."""

    def client_high_water_mark(self, partition_id: int) -> int:
        return -1

    async def apply_transaction(self, txn: Any) -> None:
        return None


class Append(TransactionContext):
    """One append of ``payload``; records its latency and wakes the driver when it completes."""

    def __init__(self, payload: bytes, started: float, latencies: list[float], done: asyncio.Semaphore) -> None:
        super().__init__()
        self.payload, self.started, self.latencies, self.done = payload, started, latencies, done

    def partition_id(self, num_partitions: int) -> int:
        return 0

    def execute(self, builder: Any) -> bool:
        builder.set_transaction_data(self.payload)
        return True

    def on_completion(self, result: bool) -> None:
        if result:
            self.latencies.append(time.perf_counter() - self.started)
        self.done.release()


def security_options(kind: str, directory: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(process options, client options) of the secure variants."""
    if kind == "tls":
        from waltz_transport_tcp.certs import create_test_ca

        certs = create_test_ca(directory, clients=("bench",))
        return certs.server_options(), certs.client_options("bench")
    from waltz_transport_zmq import keys

    public, secret = keys.create_keypair(directory, "node")
    opts = {"curve_server_secret_key_file": str(secret), "curve_server_public_key_file": str(public),
            "curve_client_secret_key_file": str(secret), "curve_allowed_client_keys": [keys.public_key(public)]}
    return opts, opts


async def run_one(label: str, transport: str, security: str, args: argparse.Namespace, root: Path) -> dict[str, float]:
    directory = root / label
    process_opts, client_opts = security_options(security, directory / "sec") if security else ({}, {})
    spec = ClusterSpec(directory / "cluster", num_partitions=1, num_storages=3, num_servers=1,
                       transport=transport, transport_options=process_opts)
    cluster = ProcessCluster(spec)
    await cluster.start()
    try:
        import attrs

        config = spec.client_config(long_wait_threshold=1.0, mount_timeout=60.0,
                                    max_concurrent_transactions=max(args.window, 1))
        if client_opts:
            config = attrs.evolve(config, transport=attrs.evolve(config.transport, options={transport: client_opts}))
        payload = b"x" * args.size
        async with AsyncWaltzClient(Sink(), config) as client:
            await client.wait_mounted(60)
            # Warm-up (connections, mounts, JIT-less but cache-warm code paths).
            warm: list[float] = []
            await drive(client, payload, min(200, args.appends), args.window, warm)
            latencies: list[float] = []
            started = time.perf_counter()
            await drive(client, payload, args.appends, args.window, latencies)
            elapsed = time.perf_counter() - started
    finally:
        cluster.stop()
    latencies.sort()
    return {"appends/s": len(latencies) / elapsed, "p50 ms": 1000 * statistics.median(latencies),
            "p99 ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))], "committed": len(latencies)}


async def drive(client: AsyncWaltzClient, payload: bytes, n: int, window: int, latencies: list[float]) -> None:
    """Closed loop: at most ``window`` appends in flight; returns when all ``n`` completed."""
    slots = asyncio.Semaphore(window)
    for _ in range(n):
        await slots.acquire()
        await client.submit(Append(payload, time.perf_counter(), latencies, slots))
    for _ in range(window):
        await slots.acquire()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--appends", type=int, default=3000)
    parser.add_argument("--window", type=int, default=64, help="appends in flight (closed loop)")
    parser.add_argument("--size", type=int, default=256, help="payload bytes per append")
    parser.add_argument("--secure", action="store_true", help="also tcp + mutual TLS and zmq + CURVE")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    variants = [("tcp", "tcp", ""), ("zmq", "zmq", "")]
    if args.secure:
        variants += [("tcp+tls", "tcp", "tls"), ("zmq+curve", "zmq", "curve")]
    print(f"{args.appends} appends of {args.size} B, window {args.window}, 3 storage processes, 1 server process, "
          f"1 partition, local coordination")
    print(f"{'transport':<12}{'appends/s':>12}{'p50 ms':>10}{'p99 ms':>10}{'committed':>11}")
    with tempfile.TemporaryDirectory(prefix="waltz-bench-") as tmp:
        for label, transport, security in variants:
            r = await run_one(label, transport, security, args, Path(tmp))
            print(f"{label:<12}{r['appends/s']:>12.0f}{r['p50 ms']:>10.2f}{r['p99 ms']:>10.2f}{r['committed']:>11.0f}",
                  flush=True)


if __name__ == "__main__":
    asyncio.run(main())
