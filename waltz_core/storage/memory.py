"""The ``memory`` storage layout: control data and partition logs in process memory, for application tests.

Select it with ``storage.layout = "memory"``. Nothing is written under ``directory``, which only
names the storage: the data lives in a process-wide volume per directory, so a storage node
stopped and started again in the same process (``InProcessCluster.stop_storage`` then
``start_storage``) finds its partitions as it would on a disk. Nothing survives the process;
:func:`discard` drops a volume earlier (tests that make many directories call it).

It makes no durability claim: no fsync, no torn tails to repair, no index, no control-file
copies. It passes the contract part of the storage-layout kit
(:mod:`waltz_core.testing.conformance.storage_layout`) and declares none of its durability
capabilities. Records are kept in the stored layout, as the node appends them, so
:meth:`MemoryPartition.read_batch` serves the bytes it was given, like ``segmented``.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from ..errors import ClusterKeyMismatchError, StorageError
from ..protocol.wire import STORED_RECORD_HEAD, Record, RecordBatch, RecordHeader, ReqId
from .format import FORMAT_VERSION, ControlHeader, PartitionInfo
from .layout import Repair

if TYPE_CHECKING:
    from ..config import StorageNodeConfig


class _Volume:
    """What a directory holds: the control data and one record list per partition."""

    __slots__ = ("header", "infos", "logs", "holder", "lock")

    def __init__(self) -> None:
        self.header: ControlHeader | None = None
        self.infos: dict[int, PartitionInfo] = {}
        self.logs: dict[int, list[bytes]] = {}  #: stored bytes of each record, index = transaction id
        self.holder: MemoryLayout | None = None  #: the open layout (one at a time, like the control file's lock)
        self.lock = threading.Lock()  #: the I/O threads of several partitions write their infos concurrently


_VOLUMES: dict[str, _Volume] = {}
_VOLUMES_LOCK = threading.Lock()


def _key(directory: str | os.PathLike[str]) -> str:
    return os.path.abspath(directory)


def _volume(directory: str | os.PathLike[str]) -> _Volume:
    with _VOLUMES_LOCK:
        return _VOLUMES.setdefault(_key(directory), _Volume())


def discard(directory: str | os.PathLike[str]) -> None:
    """Drop the volume of ``directory`` (its data is gone); StorageError while a layout has it open."""
    with _VOLUMES_LOCK:
        volume = _VOLUMES.get(_key(directory))
        if volume is not None and volume.holder is not None:
            raise StorageError(f"memory storage {directory} is open; close its layout first")
        _VOLUMES.pop(_key(directory), None)


def _decode(raw: bytes) -> Record:
    txn, client, generation, partition, seq, header, length, checksum = STORED_RECORD_HEAD.unpack_from(raw)
    start = STORED_RECORD_HEAD.size
    return Record(txn, ReqId(client, generation, partition, seq), header, raw[start : start + length], checksum)


class MemoryPartition:
    """One partition's records (implements :class:`~.layout.PartitionStore`)."""

    def __init__(self, partition_id: int, log: list[bytes]) -> None:
        self.partition_id = partition_id
        self._log = log
        self._closed = False

    @property
    def max_transaction_id(self) -> int:
        return len(self._log) - 1

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError(f"partition {self.partition_id}: store is closed")

    def append(self, records: Sequence[Record]) -> None:
        self._check_open()
        if records:
            batch = RecordBatch.from_records(records)
            self.append_validated(batch.data, batch.offsets)

    def append_validated(self, records: bytes | memoryview, offsets: array[int]) -> None:
        self._check_open()
        data = bytes(records)  # the caller may reuse its buffer
        ends = [*offsets[1:], len(data)]
        self._log.extend(data[start:end] for start, end in zip(offsets, ends, strict=True))

    def truncate(self, transaction_id: int) -> None:
        self._check_open()
        del self._log[max(transaction_id, -1) + 1 :]

    def _slice(self, transaction_id: int, max_records: int) -> list[bytes]:
        self._check_open()
        if transaction_id < 0 or max_records <= 0:
            return []
        return self._log[transaction_id : transaction_id + max_records]

    def read_record(self, transaction_id: int) -> Record | None:
        raw = self._slice(transaction_id, 1)
        return _decode(raw[0]) if raw else None

    def read_header(self, transaction_id: int) -> RecordHeader | None:
        rec = self.read_record(transaction_id)
        return None if rec is None else RecordHeader(rec.transaction_id, rec.req_id, rec.header)

    def read_records(self, transaction_id: int, max_records: int) -> list[Record]:
        return [_decode(raw) for raw in self._slice(transaction_id, max_records)]

    def read_batch(self, transaction_id: int, max_records: int, max_bytes: int) -> RecordBatch:
        taken: list[bytes] = []
        size = 0
        for raw in self._slice(transaction_id, max_records):
            if taken and size + len(raw) > max_bytes:
                break
            taken.append(raw)
            size += len(raw)
        return RecordBatch(b"".join(taken), len(taken), transaction_id)

    def read_headers(self, transaction_id: int, max_records: int) -> list[RecordHeader]:
        return [RecordHeader(r.transaction_id, r.req_id, r.header) for r in self.read_records(transaction_id, max_records)]

    def repairs(self) -> list[Repair]:
        return []  # nothing is ever torn in memory

    def close(self) -> None:
        self._closed = True


class MemoryLayout:
    """A storage "directory" in memory (implements :class:`~.layout.StorageLayout`)."""

    open_files_per_partition = 0

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = str(directory)
        self._volume = _volume(directory)
        self._open = False

    @property
    def header(self) -> ControlHeader:
        header = self._volume.header
        if not self._open or header is None:
            raise StorageError("the storage layout is not open")
        return header

    def open(self, cluster_key: uuid.UUID, num_partitions: int) -> ControlHeader:
        volume = self._volume
        with volume.lock:
            if volume.holder is not None and volume.holder is not self:
                raise StorageError(f"memory storage {self.directory} is in use by another layout (a running node)")
            header = volume.header
            if header is None:
                header = volume.header = ControlHeader(FORMAT_VERSION, int(time.time() * 1000), cluster_key,
                                                       num_partitions)
            elif header.cluster_key != cluster_key or header.num_partitions != num_partitions:
                raise ClusterKeyMismatchError(
                    f"memory storage {self.directory} belongs to cluster key {header.cluster_key} with "
                    f"{header.num_partitions} partitions; this node was started for cluster key {cluster_key} "
                    f"with {num_partitions} partitions")
            volume.holder = self
            self._open = True
            return header

    def _check_partition(self, partition_id: int) -> None:
        if not 0 <= partition_id < self.header.num_partitions:
            raise StorageError(f"partition {partition_id} is outside 0..{self.header.num_partitions - 1}")

    def read_partition_info(self, partition_id: int) -> PartitionInfo:
        self._check_partition(partition_id)
        with self._volume.lock:
            return self._volume.infos.get(partition_id, PartitionInfo())

    def write_partition_info(self, partition_id: int, info: PartitionInfo) -> PartitionInfo:
        self._check_partition(partition_id)
        volume = self._volume
        with volume.lock:
            current = volume.infos.get(partition_id, PartitionInfo())
            new = attrs.evolve(info, sequence_number=(current.sequence_number + 1) & 0x7FFFFFFF)
            volume.infos[partition_id] = new
            return new

    def open_partition(self, partition_id: int) -> MemoryPartition:
        self._check_partition(partition_id)
        with self._volume.lock:
            log = self._volume.logs.setdefault(partition_id, [])
        return MemoryPartition(partition_id, log)

    def delete_partition_files(self, partition_id: int) -> None:
        self._check_partition(partition_id)
        with self._volume.lock:
            self._volume.logs.pop(partition_id, None)

    def quarantine(self, partition_id: int | None, into: Path, *, copy: bool = False) -> list[str]:
        """Write what is set aside into ``into`` (stored record bytes, or the control data as JSON)
        so an operator - a test - can look at it; without ``copy`` it is no longer in use."""
        volume = self._volume
        into = Path(into)
        with volume.lock:
            if partition_id is None:
                if self._open and not copy:
                    raise StorageError(f"memory storage {self.directory} is open: set its control data aside before open()")
                header = volume.header
                if header is None:
                    return []
                into.mkdir(parents=True, exist_ok=True)
                target = into / "control.json"
                target.write_text(json.dumps({
                    "cluster_key": str(header.cluster_key), "num_partitions": header.num_partitions,
                    "creation_time": header.creation_time,
                    "partitions": {str(p): attrs.asdict(i) for p, i in sorted(volume.infos.items())}}))
                if not copy:
                    volume.header = None
                    volume.infos.clear()
                return [str(target)]
        self._check_partition(partition_id)
        with volume.lock:
            log = volume.logs.get(partition_id)
            if log is None:
                return []
            into.mkdir(parents=True, exist_ok=True)
            target = into / f"{partition_id}.records"
            target.write_bytes(b"".join(log))
            if not copy:
                del volume.logs[partition_id]
            return [str(target)]

    def repairs(self) -> list[Repair]:
        return []

    def close(self) -> None:
        with self._volume.lock:
            if self._volume.holder is self:
                self._volume.holder = None
            self._open = False


def memory_factory(config: StorageNodeConfig, options: None = None) -> MemoryLayout:
    """Registry factory, ``factory(config, options)``: the volume of ``config.directory``; nothing
    else of the node's config applies to this layout."""
    return MemoryLayout(config.directory)
