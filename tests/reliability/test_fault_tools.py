"""The fault tools themselves: proxy cut/reset/delay/one-way drop, the fsync journal, bit flips."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from waltz_core.errors import WaltzError
from waltz_core.storage.segmented import SegmentedLayout
from waltz_core.testing.faults import (
    CrashMode,
    FaultProxy,
    crash_lose_unsynced,
    flip_bits,
    storage_files,
    sync_journal_env,
    synced_sizes,
)

pytestmark = pytest.mark.timeout(60)


async def _echo_server() -> asyncio.Server:
    async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while data := await r.read(1024):
                w.write(data)
                await w.drain()
        except OSError:
            pass
        finally:
            w.close()

    return await asyncio.start_server(echo, "127.0.0.1", 0)


async def _roundtrip(address: str, payload: bytes = b"ping", timeout: float = 2.0) -> bytes:
    host, _, port = address.rpartition(":")
    r, w = await asyncio.open_connection(host, int(port))
    try:
        w.write(payload)
        await w.drain()
        return await asyncio.wait_for(r.readexactly(len(payload)), timeout)
    finally:
        w.close()


async def test_proxy_forwards_cuts_heals_delays_and_drops() -> None:
    server = await _echo_server()
    port = server.sockets[0].getsockname()[1]
    proxy = await FaultProxy(f"127.0.0.1:{port}").start()
    try:
        assert await _roundtrip(proxy.address) == b"ping"
        # An open connection is reset by cut(), and new ones are refused until heal().
        host, _, p = proxy.address.rpartition(":")
        r, w = await asyncio.open_connection(host, int(p))
        w.write(b"x")
        await w.drain()
        assert await r.readexactly(1) == b"x"
        proxy.cut()
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            w.write(b"y")
            await w.drain()
            await asyncio.wait_for(r.readexactly(1), 2)
        w.close()
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await _roundtrip(proxy.address)
        proxy.heal()
        assert await _roundtrip(proxy.address) == b"ping"
        proxy.delay(0.3)
        began = time.monotonic()
        assert await _roundtrip(proxy.address) == b"ping"
        assert time.monotonic() - began >= 0.5  # both directions held
        proxy.heal()
        proxy.drop("up")  # a one-way black hole: the connection stays open, nothing arrives
        with pytest.raises(TimeoutError):
            await _roundtrip(proxy.address, timeout=0.5)
        proxy.heal()
        assert await _roundtrip(proxy.address) == b"ping"
        assert proxy.connections_accepted >= 5
    finally:
        await proxy.close()
        server.close()
        await server.wait_closed()


def test_sync_journal_records_synced_sizes_and_crash_loses_the_rest(tmp_path: Path) -> None:
    journal = tmp_path / "journal.jsonl"
    data = tmp_path / "data.bin"
    script = (f"import os\nfd = os.open({str(data)!r}, os.O_WRONLY | os.O_CREAT)\n"
              "os.write(fd, b'a' * 100)\nos.fdatasync(fd)\nos.write(fd, b'b' * 50)\n")
    env = {**os.environ, **sync_journal_env(journal)}
    subprocess.run([sys.executable, "-c", script], env=env, check=True)
    assert synced_sizes(journal) == {data.resolve(): 100}
    assert data.stat().st_size == 150
    (effect,) = crash_lose_unsynced(tmp_path, journal, CrashMode.DROP)
    assert (effect.synced, effect.size_before, effect.size_after) == (100, 150, 100)
    assert data.read_bytes() == b"a" * 100
    # GARBLE keeps a random prefix of the unsynced tail, with bytes changed, never the synced part.
    data.write_bytes(b"a" * 100 + b"b" * 4000)
    (effect,) = crash_lose_unsynced(tmp_path, journal, CrashMode.GARBLE, random.Random(3))
    content = data.read_bytes()
    assert content[:100] == b"a" * 100 and 100 <= len(content) <= 4100


def test_bit_flips_in_segment_index_and_control_files_are_detected(tmp_path: Path) -> None:
    """A flipped bit in acknowledged data never comes back as a good record."""
    import zlib

    from waltz_core.protocol.wire import Record, ReqId

    key = uuid.uuid4()
    layout = SegmentedLayout(tmp_path, index_checkpoint_interval=5)
    layout.open(key, 1)
    store = layout.open_partition(0)
    datas = [f"payload-{i}".encode() * 4 for i in range(20)]
    records = [Record(i, ReqId(1, 1, 0, i + 1), 0, d, zlib.crc32(d)) for i, d in enumerate(datas)]
    store.append(records)
    store.close()
    layout.close()
    files = {p.suffix: p for p in storage_files(tmp_path)}
    assert set(files) == {".seq", ".idx", ".ctl"}
    originals = {suffix: p.read_bytes() for suffix, p in files.items()}
    rng = random.Random(7)
    outcomes = {"refused": 0, "repaired": 0, "intact": 0}
    for suffix, trials, start in ((".seq", 20, 200), (".idx", 10, 0), (".ctl", 10, 0)):
        for _ in range(trials):
            for s, p in files.items():
                p.write_bytes(originals[s])
            flip_bits(files[suffix], 1, rng, start=start)
            layout = SegmentedLayout(tmp_path, index_checkpoint_interval=5)
            try:
                layout.open(key, 1)
                store = layout.open_partition(0)
                got = list(store.read_records(0, 100))
                store.close()
                # Whatever is served must be exactly what was written (a corrupted tail is cut off).
                assert got == records[: len(got)], suffix
                outcomes["intact" if len(got) == len(records) else "repaired"] += 1
            except WaltzError:
                outcomes["refused"] += 1  # refusing to serve is a detection too
            finally:
                layout.close()
    print(outcomes)
    # A flip inside a record of the segment can never leave all 20 records served.
    assert outcomes["refused"] + outcomes["repaired"] >= 20
