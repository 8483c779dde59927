"""Time to reopen a partition of 1,000,000 records (goal <= 2 s).

Builds the partition once (batches of 1000 x 256-byte records), then measures:

* clean reopen (index checkpointed at close),
* reopen after a kill (the index tail past the last checkpoint lost, as after a crash),
* reopen with the index file deleted (full rebuild from the data file: the worst case).

Usage: ``python benchmarks/storage_restart.py [--records 1000000] [--dir /tmp] [--profile]``
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import shutil
import tempfile
import time
import uuid
import zlib
from pathlib import Path

from waltz_core.protocol.wire import Record, ReqId
from waltz_core.storage.segmented import SegmentedLayout


def build(directory: Path, key: uuid.UUID, n: int) -> float:
    layout = SegmentedLayout(directory)
    layout.open(key, 1)
    store = layout.open_partition(0)
    data = os.urandom(256)
    crc = zlib.crc32(data)
    start = time.perf_counter()
    for first in range(0, n, 1000):
        store.append([Record(t, ReqId(1, 1, 0, t), 0, data, crc) for t in range(first, min(n, first + 1000))])
    elapsed = time.perf_counter() - start
    store.close()
    layout.close()
    return elapsed


def reopen(directory: Path, key: uuid.UUID, expect: int) -> tuple[float, int]:
    layout = SegmentedLayout(directory)
    start = time.perf_counter()
    layout.open(key, 1)
    store = layout.open_partition(0)
    elapsed = time.perf_counter() - start
    assert store.max_transaction_id == expect - 1, store.max_transaction_id
    repairs = len(store.repairs())
    store.close()
    layout.close()
    return elapsed, repairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--profile", action="store_true", help="cProfile the full index rebuild")
    args = ap.parse_args()
    key = uuid.uuid4()
    tmp = Path(tempfile.mkdtemp(dir=args.dir, prefix="waltz-restart-"))
    try:
        build_s = build(tmp, key, args.records)
        (idx,) = (tmp / "0").glob("*.idx")
        (seg,) = (tmp / "0").glob("*.seq")
        print(f"storage_restart: {args.records:,} records of 256 bytes, data file {seg.stat().st_size / 1e6:.0f} MB, "
              f"built in {build_s:.1f}s")
        t, r = reopen(tmp, key, args.records)
        print(f"clean reopen (index checkpointed):         {t * 1000:8.1f} ms  repairs={r}")
        # A kill: entries past the last checkpoint never reached the disk; the checkpoint count says so.
        raw = bytearray(idx.read_bytes())
        from waltz_core.storage.format import CHECKPOINT_OFFSET, encode_checkpoint

        lost_from = (args.records - 1) // 1000 * 1000
        raw[CHECKPOINT_OFFSET : CHECKPOINT_OFFSET + 12] = encode_checkpoint(lost_from)
        del raw[128 + 8 * lost_from :]
        idx.write_bytes(bytes(raw))
        t, r = reopen(tmp, key, args.records)
        print(f"reopen after a kill (index tail rescanned): {t * 1000:8.1f} ms  repairs={r}")
        idx.unlink()
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
        t, r = reopen(tmp, key, args.records)
        if args.profile:
            prof.disable()
        print(f"reopen without index (full rebuild):       {t * 1000:8.1f} ms  repairs={r}")
        if args.profile:
            pstats.Stats(prof).sort_stats("tottime").print_stats(8)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
