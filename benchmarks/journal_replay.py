"""How long a storage node's start takes to replay a full node journal after an unclean stop,
and how long the checkpoint of a full journal takes.

    python benchmarks/journal_replay.py                      # 64 MiB, 4 partitions
    python benchmarks/journal_replay.py --megabytes 16 --partitions 64

Writes journaled rounds as a node does (every partition's batch into its data file without a
sync, the round into the journal with one fdatasync) until the journal holds ``--megabytes``,
then times the checkpoint (every partition file synced: the round waits for it in a node), then
:func:`~waltz_core.storage.journal.replay_journals` twice on copies of that journal:
against partition files that hold every record (a node whose page cache reached the disk: only
checks), and against files cut back to their headers (a power loss took everything since the last
checkpoint: every record is written again). Prints both times.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import uuid
import zlib
from array import array
from pathlib import Path

from waltz_core.protocol.wire import Record, RecordBatch, ReqId
from waltz_core.storage.format import HEADER_SIZE
from waltz_core.storage.journal import JOURNAL_DIRECTORY, NodeJournal, replay_journals
from waltz_core.storage.segmented import SegmentedLayout

_DATA = b"x" * 256


def _batch(partition_id: int, first: int, count: int) -> RecordBatch:
    return RecordBatch.from_records(Record(t, ReqId(1, 1, partition_id, t), 0, _DATA, zlib.crc32(_DATA))
                                    for t in range(first, first + count))


def _write(directory: Path, key: uuid.UUID, partitions: int, batch: int, megabytes: int) -> int:
    layout = SegmentedLayout(directory)
    layout.open(key, partitions)
    journal = NodeJournal(directory / JOURNAL_DIRECTORY / "io-0.wal", checkpoint_bytes=1 << 62)
    stores = [layout.open_partition(p) for p in range(partitions)]
    records = 0
    while journal.position < megabytes * 1024 * 1024:
        entries = []
        for pid, store in enumerate(stores):
            first = store.max_transaction_id + 1
            b = _batch(pid, first, batch)
            offsets = array("q")
            b.validate_into(offsets)
            store.write_validated(b.data, offsets, lazy_writeback=True)
            entries.append((pid, first, batch, bytes(b.data)))
        journal.append(entries)
        records += batch * partitions
    # The checkpoint a node's I/O thread makes when the journal is full: every partition's file
    # synced (what was written since its last sync), then the next generation.
    start = time.perf_counter()
    for store in stores:
        store.start_writeback()  # as IoThread.checkpoint: every file's writes under way first
    for store in stores:
        store.sync_written()
    elapsed = time.perf_counter() - start
    print(f"checkpoint: {partitions} partition files synced in {elapsed * 1000:.1f} ms")
    for store in stores:
        store.close()  # the intact case below: every record is in the partition files
    journal.close()
    layout.close()
    return records


def _replay(directory: Path, key: uuid.UUID, partitions: int) -> tuple[float, int]:
    layout = SegmentedLayout(directory)
    layout.open(key, partitions)
    failures: list[int] = []
    try:
        start = time.perf_counter()
        repairs = replay_journals(directory, layout.open_partition, lambda pid, exc: failures.append(pid))
        elapsed = time.perf_counter() - start
    finally:
        layout.close()
    if failures:
        raise SystemExit(f"replay failed for partitions {failures}")
    return elapsed, len(repairs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=int, default=64, help="journal size to replay (64: the default "
                                                                  "storage.journal_checkpoint_bytes)")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16, help="records per partition and round")
    parser.add_argument("--dir", help="where to write (a temporary directory by default)")
    args = parser.parse_args()
    if args.megabytes < 1 or args.partitions < 1 or args.batch < 1:
        parser.error("--megabytes, --partitions and --batch must be at least 1")
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="waltz-journal-replay-"))
    directory = root / "storage"
    key = uuid.uuid4()
    try:
        t = time.perf_counter()
        records = _write(directory, key, args.partitions, args.batch, args.megabytes)
        print(f"journaled {records:,} records of {args.partitions} partitions ({args.megabytes} MiB) "
              f"in {time.perf_counter() - t:.1f} s")
        saved = root / "journal.copy"
        shutil.copy(directory / JOURNAL_DIRECTORY / "io-0.wal", saved)
        elapsed, repaired = _replay(directory, key, args.partitions)
        print(f"replay against intact partition files: {elapsed:.2f} s ({repaired} partitions rewritten)")
        shutil.copy(saved, directory / JOURNAL_DIRECTORY / "io-0.wal")
        for pid in range(args.partitions):
            for segment in (directory / str(pid)).glob("*.seq"):
                os.truncate(segment, HEADER_SIZE)
            for index in (directory / str(pid)).glob("*.idx"):
                index.unlink()
        elapsed, repaired = _replay(directory, key, args.partitions)
        print(f"replay into partition files that lost every journaled record: {elapsed:.2f} s "
              f"({repaired} partitions rewritten)")
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
