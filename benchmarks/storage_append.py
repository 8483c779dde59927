"""Append throughput of the segmented layout vs a raw write+fdatasync loop (same run, same disk).

Prints records/s at batch sizes 1, 10, 100 with 256-byte records and the layout/raw ratio.
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
from pathlib import Path

from waltz_core.protocol.wire import Record, ReqId
from waltz_core.storage.segmented import SegmentedLayout

RECORD_DATA = 256


def make_batch(start: int, n: int, data: bytes, checksum: int) -> list[Record]:
    return [Record(t, ReqId(1, 1, 0, t), 0, data, checksum) for t in range(start, start + n)]


def bench_layout(directory: Path, batch: int, seconds: float) -> float:
    layout = SegmentedLayout(directory)
    layout.open(uuid.uuid4(), 1)
    store = layout.open_partition(0)
    data = os.urandom(RECORD_DATA)
    crc = zlib.crc32(data)
    txn = 0
    # Only store.append is timed: the node receives batches already decoded from the wire.
    elapsed = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        batch_records = make_batch(txn, batch, data, crc)
        t0 = time.perf_counter()
        store.append(batch_records)
        elapsed += time.perf_counter() - t0
        txn += batch
    store.close()
    layout.close()
    return txn / elapsed


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
    print(f"{'batch':>6} {'layout rec/s':>14} {'raw rec/s':>14} {'layout/raw':>11}")
    for batch in (1, 10, 100):
        with tempfile.TemporaryDirectory(dir=args.dir) as d1, tempfile.TemporaryDirectory(dir=args.dir) as d2:
            # Interleave raw and layout so drift of the shared disk hits both alike.
            raw_a = bench_raw(Path(d2), batch, args.seconds / 2)
            lay = bench_layout(Path(d1), batch, args.seconds)
            raw_b = bench_raw(Path(d2), batch, args.seconds / 2)
            raw = (raw_a + raw_b) / 2
            print(f"{batch:>6} {lay:>14,.0f} {raw:>14,.0f} {lay / raw:>10.0%}")
    if args.profile:
        with tempfile.TemporaryDirectory(dir=args.dir) as d:
            prof = cProfile.Profile()
            prof.enable()
            bench_layout(Path(d), 100, args.seconds)
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
