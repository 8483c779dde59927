"""Offline recovery of a storage node's partitions, and checking them against a replica.

``waltz storage recover-partition`` rebuilds partitions of a *stopped* node, in its own
directory, from a healthy replica reached through that replica's admin port (the original's
StorageCli ``recover-partition``, done offline). For each partition:

1. the local copy is read: the records up to the partition's own low-water mark (known
   committed, so identical on every replica) that pass their checksums are kept; everything else
   - a damaged segment, both control structs gone, a lost disk - is moved aside into
   ``<directory>/recovered-<time>/``, never deleted;
2. the source must hold at least as much as every other replica of the partition (asked through
   their admin ports, from the coordination metadata): a rebuilt replica that held less than
   what it had acknowledged before its damage could, counted in a later recovery vote, lose a
   committed transaction. An unreachable replica makes the check impossible: refused unless
   ``--force``;
3. the records after the kept prefix are copied from the source up to its max transaction id,
   and the partition's control struct becomes the source's session info. The rebuilt replica is
   a copy of the source: a later recovery treats it exactly as it treats the source (engaged in
   the same session, or, where the metadata says otherwise, truncated to the source's low-water
   mark), so it never claims less than it had acknowledged, nor more than a replica has.

A control file whose header is damaged is moved aside too and written anew: only the partitions
recovered get structs, so recover every partition the node holds (``--partition`` with all its
ids, as ``waltz cluster list`` shows them).

``waltz storage validate`` compares a node's partitions with a replica's, record by record
(both through their admin ports, or a stopped node's files): the common prefix must be
identical; a replica ahead or behind is reported, not an error.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import attrs

from ..errors import ChecksumError, StorageCorruptionError, StorageError, WaltzError
from ..protocol.wire import Record
from .format import FLAG_ASSIGNED, FLAG_AVAILABLE, PartitionInfo
from .journal import replay_into_layout
from .layout import PartitionStore, Repair, StorageLayout

log = logging.getLogger("waltz.storage.recovery")

#: Records per admin request while copying or comparing.
BATCH = 500


class RecoveryRefused(StorageError):
    """Recovering would be unsafe or is impossible as asked; nothing was changed."""


class AdminSource(Protocol):
    """What recovery needs from a replica (a :class:`~waltz_core.storage.client.StorageAdminClient`)."""

    address: str

    async def record_list(self, partition_id: int, transaction_id: int, max_records: int) -> Sequence[Record]: ...

    async def last_session_info(self, partition_id: int) -> Any: ...


@attrs.frozen
class PartitionRecovery:
    """What recover-partition did to one partition."""

    partition_id: int
    kept: int  #: last local transaction id kept (-1: none)
    copied: int  #: records copied from the source
    max_transaction_id: int
    session_id: int
    low_water_mark: int
    quarantined: tuple[str, ...]  #: files moved aside
    why: str  #: why the local copy was (not) kept


async def find_max_transaction_id(source: AdminSource, partition_id: int, at_least: int = -1) -> int:
    """The source's max transaction id, by probing single records (exponential, then binary search)."""
    low = at_least  # known present (or -1)
    step = 1
    while await source.record_list(partition_id, low + step, 1):
        low += step
        step *= 2
    high = low + step  # known absent
    while high - low > 1:
        mid = (low + high) // 2
        if await source.record_list(partition_id, mid, 1):
            low = mid
        else:
            high = mid
    return low


def _sound(record: Record) -> bool:
    try:
        record.verify()
    except ChecksumError:
        return False
    return True


def _intact_prefix(store: PartitionStore, upto: int) -> int:
    """The last transaction id <= ``upto`` such that every record from 0 passes its checksums."""
    txn = 0
    while txn <= upto:
        try:
            records = store.read_records(txn, min(BATCH, upto - txn + 1))
        except StorageCorruptionError:
            # The batch holds a damaged record: find it one record at a time.
            while txn <= upto:
                try:
                    record = store.read_record(txn)
                except StorageCorruptionError:
                    return txn - 1
                if record is None or not _sound(record):
                    return txn - 1
                txn += 1
            return upto
        if not records:
            break
        for r in records:
            if r.transaction_id != txn or not _sound(r):
                return txn - 1
            txn += 1
    return min(txn - 1, upto)


class PartitionRebuild:
    """Opens a stopped node's layout for recovery, moving damaged files aside on demand."""

    def __init__(self, layout: StorageLayout, cluster_key: Any, num_partitions: int, aside: Path) -> None:
        self.layout = layout
        self.cluster_key = cluster_key
        self.num_partitions = num_partitions
        self.aside = aside
        self.moved: list[str] = []
        self.repairs: list[Repair] = []  #: what opening it repaired (a replayed journal)

    def open(self) -> None:
        try:
            self.layout.open(self.cluster_key, self.num_partitions)
        except StorageCorruptionError as exc:
            log.warning("%s; moving it aside and writing a new one", exc)
            self.moved += self.layout.quarantine(None, self.aside)
            self.layout.open(self.cluster_key, self.num_partitions)
        # Records acknowledged from the node journal go back into their files before any is read.
        self.repairs = replay_into_layout(self.layout)

    def local(self, partition_id: int) -> tuple[PartitionStore | None, PartitionInfo | None, str]:
        """The partition's store and struct as they are, or None for what is damaged, and why."""
        try:
            info: PartitionInfo | None = self.layout.read_partition_info(partition_id)
        except StorageCorruptionError as exc:
            info, why = None, str(exc)
        else:
            why = ""
        try:
            return self.layout.open_partition(partition_id), info, why
        except StorageCorruptionError as exc:
            return None, info, why or str(exc)

    def fresh(self, partition_id: int) -> tuple[PartitionStore, tuple[str, ...]]:
        moved = tuple(self.layout.quarantine(partition_id, self.aside))
        self.moved += moved
        return self.layout.open_partition(partition_id), moved


async def recover_partition(rebuild: PartitionRebuild, partition_id: int, source: AdminSource,
                            others: Sequence[AdminSource], unreachable: Sequence[str], *,
                            force: bool = False) -> PartitionRecovery:
    """Rebuild one partition of a stopped node from ``source`` (see the module docstring)."""
    pid = partition_id
    src_info = await source.last_session_info(pid)
    src_max = await find_max_transaction_id(source, pid)
    for other in others:
        if await other.record_list(pid, src_max + 1, 1):
            raise RecoveryRefused(
                f"partition {pid}: replica {other.address} holds transaction {src_max + 1}, the source "
                f"{source.address} holds up to {src_max}: recover from the most advanced replica")
    if unreachable and not force:
        raise RecoveryRefused(
            f"partition {pid}: replica(s) {', '.join(unreachable)} did not answer, so it is unknown whether one holds "
            f"more than {source.address} (up to {src_max}); recover when they answer, or --force if they are gone")
    store, info, why = rebuild.local(pid)
    kept = -1
    quarantined: tuple[str, ...] = ()
    if store is not None and info is not None:
        committed = min(info.low_water_mark, store.max_transaction_id, src_max)
        kept = _intact_prefix(store, committed)
        why = (f"kept the intact local prefix up to {kept} (low-water mark {info.low_water_mark})" if kept >= 0
               else "no local record is both known committed and intact")
        if 0 <= kept < committed:  # damage below the committed mark: keep a copy of the files for an operator
            why += f"; record {kept + 1} is damaged"
            quarantined = tuple(rebuild.layout.quarantine(pid, rebuild.aside, copy=True))
    elif store is not None:
        why = f"{why}: its records cannot be trusted without it"
    if store is None or (kept < 0 <= store.max_transaction_id):
        # Unreadable, or nothing worth keeping: the files go aside (an operator may want them).
        if store is not None:
            store.close()
        store, quarantined = rebuild.fresh(pid)
        why = why or "the local copy is damaged"
    try:
        if store.max_transaction_id > kept:
            store.truncate(kept)  # maybe dirty: the source's records replace them
        copied = 0
        txn = kept + 1
        while txn <= src_max:
            records = list(await source.record_list(pid, txn, min(BATCH, src_max - txn + 1)))
            if not records or records[0].transaction_id != txn:
                raise RecoveryRefused(f"partition {pid}: the source {source.address} returned no record {txn} "
                                      f"(it held up to {src_max} a moment ago)")
            store.append(records)
            copied += len(records)
            txn = records[-1].transaction_id + 1
        max_id = store.max_transaction_id
    finally:
        store.close()
    # An operator's "offline" (unavailable) stays as it was; a lost or fresh struct becomes available.
    flags = info.flags if info is not None and info.assigned else FLAG_AVAILABLE
    rebuild.layout.write_partition_info(pid, PartitionInfo(
        src_info.session_id, max(src_info.low_water_mark, max_id), src_info.local_low_water_mark,
        flags | FLAG_ASSIGNED))
    return PartitionRecovery(pid, kept, copied, max_id, src_info.session_id, max(src_info.low_water_mark, max_id),
                             quarantined, why)


def write_report(aside: Path, results: Sequence[PartitionRecovery], source: str) -> Path | None:
    """A JSON record of the recovery next to the files moved aside (None when nothing was moved)."""
    if not aside.exists():
        return None
    path = aside / "recovery.json"
    path.write_text(json.dumps({"time": time.time(), "source": source,
                                "partitions": [attrs.asdict(r) for r in results]}, indent=2))
    return path


def aside_directory(directory: str | Path) -> Path:
    return Path(directory) / time.strftime("recovered-%Y%m%dT%H%M%S")


# ---------------------------------------------------------------------------------- validate


@attrs.frozen
class PartitionComparison:
    partition_id: int
    checked: int  #: records compared (the common prefix)
    local_max: int
    replica_max: int
    mismatch: int | None  #: first transaction id that differs, None if the prefix is identical
    detail: str

    @property
    def ok(self) -> bool:
        return self.mismatch is None


async def _read(side: AdminSource | PartitionStore, pid: int, txn: int) -> list[Record]:
    if isinstance(side, PartitionStore):
        return list(side.read_records(txn, BATCH))
    return list(await side.record_list(pid, txn, BATCH))


async def _end(side: AdminSource | PartitionStore, pid: int, txn: int) -> int:
    """The last transaction id of ``side``, reading on from ``txn`` (which it holds)."""
    while batch := await _read(side, pid, txn):
        txn = batch[-1].transaction_id + 1
    return txn - 1


async def compare_partition(local: AdminSource | PartitionStore, replica: AdminSource,
                            partition_id: int) -> PartitionComparison:
    """Compare a partition record by record: the common prefix must be identical; what one side
    holds past the other's end is reported, not a mismatch (a replica behind, or a dirty tail that
    the next recovery truncates)."""
    pid = partition_id
    txn = 0
    while True:
        try:
            mine = await _read(local, pid, txn)
        except WaltzError as exc:
            return PartitionComparison(pid, txn, txn - 1, -1, txn, f"local record {txn} is unreadable: {exc}")
        theirs = await _read(replica, pid, txn)
        n = min(len(mine), len(theirs))
        for a, b in zip(mine[:n], theirs[:n], strict=True):
            if not _sound(a):
                return PartitionComparison(pid, txn, -1, -1, a.transaction_id,
                                           f"local record {a.transaction_id} fails its checksum")
            if (a.transaction_id, a.req_id, a.header, bytes(a.data), a.checksum) != (
                    b.transaction_id, b.req_id, b.header, bytes(b.data), b.checksum):
                return PartitionComparison(pid, txn, -1, -1, a.transaction_id,
                                           f"record {a.transaction_id} differs from {replica.address}'s")
            txn += 1
        if n == len(mine) == len(theirs) and n:
            continue
        local_max = await _end(local, pid, txn) if len(mine) > n else txn - 1
        replica_max = await _end(replica, pid, txn) if len(theirs) > n else txn - 1
        detail = "identical" if local_max == replica_max else (
            f"identical up to {txn - 1}; local holds up to {local_max}, {replica.address} up to {replica_max}")
        return PartitionComparison(pid, txn, local_max, replica_max, None, detail)


def quarantine_paths(paths: Sequence[Path], aside: Path, *, copy: bool = False) -> list[str]:
    """Move (or copy) ``paths`` - files or directories - into ``aside``, keeping their names; the
    new paths."""
    moved = []
    for path in paths:
        if path.exists():
            aside.mkdir(parents=True, exist_ok=True)
            target = aside / path.name
            if not copy:
                shutil.move(str(path), target)
            elif path.is_dir():
                shutil.copytree(path, target)
            else:
                shutil.copy2(path, target)
            moved.append(str(target))
    return moved
