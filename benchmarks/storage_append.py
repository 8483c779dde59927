"""Append throughput of the segmented layout vs a raw write+fdatasync loop (same run, same disk).

Prints records/s at batch sizes 1, 10, 100 with 256-byte records, the layout/raw ratio and the
layout's CPU per record. The layout is timed on the storage node's append path: a received
storage append frame is decoded, its record batch (the stored layout, as the server sends it)
validated (ids, lengths, record and data checksums) and written with one pwrite + one fdatasync.
Goal: layout >= 70 % of raw at batch 100. Usage::

    python benchmarks/storage_append.py [--seconds 3] [--dir /tmp] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import tempfile
import time
import uuid
import zlib
from array import array
from pathlib import Path

from waltz_core.protocol import storage as sm
from waltz_core.protocol.wire import Record, RecordBatch, ReqId
from waltz_core.storage.segmented import SegmentedLayout

RECORD_DATA = 256


def make_frame(start: int, n: int, data: bytes, checksum: int) -> bytes:
    """A storage append frame payload as the server sends it."""
    records = [Record(t, ReqId(1, 1, 0, t), 0, data, checksum) for t in range(start, start + n)]
    return sm.encode(sm.StorageAppendRequest(1, 1, 0, RecordBatch.from_records(records)))


def bench_layout(directory: Path, batch: int, seconds: float) -> tuple[float, float]:
    """Records/s and CPU microseconds per record of the node's append path."""
    layout = SegmentedLayout(directory)
    layout.open(uuid.uuid4(), 1)
    store = layout.open_partition(0)
    data = os.urandom(RECORD_DATA)
    crc = zlib.crc32(data)
    txn = 0
    # Timed: what the node does with a received frame (decode, validate, write, sync).
    elapsed = cpu = 0.0
    offsets = array("q")
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        frame = make_frame(txn, batch, data, crc)
        t0, c0 = time.perf_counter(), time.process_time()
        received: RecordBatch = sm.decode(frame).records  # type: ignore[union-attr]
        received.validate_into(offsets)
        store.append_validated(received.data, offsets)
        elapsed += time.perf_counter() - t0
        cpu += time.process_time() - c0
        del offsets[:]
        txn += batch
    store.close()
    layout.close()
    return txn / elapsed, cpu / txn * 1e6


def bench_raw(directory: Path, batch: int, seconds: float) -> float:
    """The floor: one write of batch * (40 + 256) bytes, one fdatasync, nothing else."""
    path = directory / "raw.dat"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    payload = os.urandom((40 + RECORD_DATA) * batch)
    n = 0
    deadline = time.perf_counter() + seconds
    start = time.perf_counter()
    while time.perf_counter() < deadline:
        os.write(fd, payload)
        os.fdatasync(fd)
        n += batch
    elapsed = time.perf_counter() - start
    os.close(fd)
    return n / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0, help="duration per measurement")
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: system temp)")
    ap.add_argument("--profile", action="store_true", help="cProfile the layout at batch 100 and print the top")
    args = ap.parse_args()
    print(f"storage_append: {RECORD_DATA}-byte records, {args.seconds:.1f}s per measurement, "
          f"dir={args.dir or tempfile.gettempdir()}")
    print(f"{'batch':>6} {'layout rec/s':>14} {'raw rec/s':>14} {'layout/raw':>11} {'layout CPU us/rec':>18}")
    for batch in (1, 10, 100):
        with tempfile.TemporaryDirectory(dir=args.dir) as d1, tempfile.TemporaryDirectory(dir=args.dir) as d2:
            # Interleave raw and layout so drift of the shared disk hits both alike.
            raw_a = bench_raw(Path(d2), batch, args.seconds / 2)
            lay, cpu = bench_layout(Path(d1), batch, args.seconds)
            raw_b = bench_raw(Path(d2), batch, args.seconds / 2)
            raw = (raw_a + raw_b) / 2
            print(f"{batch:>6} {lay:>14,.0f} {raw:>14,.0f} {lay / raw:>10.0%} {cpu:>18.2f}")
    if args.profile:
        with tempfile.TemporaryDirectory(dir=args.dir) as d:
            prof = cProfile.Profile()
            prof.enable()
            bench_layout(Path(d), 100, args.seconds)
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
