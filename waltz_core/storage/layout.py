"""The storage-layout seam: how a storage node keeps its control data and partition logs on disk.

A storage node touches files only through a :class:`StorageLayout` (registered under the
``storage_layout`` registry kind, hook ``waltz_register_storage_layouts``; built-in:
``segmented``). Layout methods block (file I/O, fdatasync): the node calls them from the
partition's I/O thread (:class:`~.node.IoThread`), never from the event loop, and calls one partition's store from
one thread at a time. Layout errors are :mod:`waltz_core.errors` classes
(:class:`~waltz_core.errors.StorageCorruptionError`,
:class:`~waltz_core.errors.ClusterKeyMismatchError`).
"""

from __future__ import annotations

import uuid
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import attrs

from ..protocol.wire import Record, RecordBatch, RecordHeader
from .format import ControlHeader, PartitionInfo


@attrs.frozen(slots=True)
class Repair:
    """Something the layout fixed (or refused) when opening files; logged and shown by the tools."""

    partition_id: int  #: -1 for the control file header
    file: str
    action: str  #: what was done, e.g. "truncated torn tail", "rebuilt index"
    detail: str  #: why, in words an operator understands


@runtime_checkable
class PartitionStore(Protocol):
    """One partition's log. Transaction ids are dense: 0, 1, 2, ... up to :attr:`max_transaction_id`."""

    partition_id: int

    @property
    def max_transaction_id(self) -> int:
        """The highest stored transaction id, -1 when empty."""

    def append(self, records: Sequence[Record]) -> None:
        """Write ``records`` (ids ``max_transaction_id + 1 ...``, checked by the caller) durably.

        Durable on return with one fdatasync of the data file for the whole batch.
        """

    def append_validated(self, records: bytes | memoryview, offsets: array[int]) -> None:
        """Write records that are already in the stored layout, as they are (the node's append path).

        ``records`` holds ``len(offsets)`` consecutive records with ids ``max_transaction_id + 1 ...``,
        checked by the caller (:meth:`~waltz_core.protocol.wire.RecordBatch.validate_into`: ids,
        lengths, record and data checksums); ``offsets`` are their starts relative to
        ``records[0]``. Durable on return with one fdatasync, as :meth:`append`.
        """

    def truncate(self, transaction_id: int) -> None:
        """Remove every transaction above ``transaction_id`` (durable on return)."""

    def read_record(self, transaction_id: int) -> Record | None:
        """The record, None if absent; StorageCorruptionError if it fails its checksums."""

    def read_header(self, transaction_id: int) -> RecordHeader | None:
        """The record's header, None if absent."""

    def read_records(self, transaction_id: int, max_records: int) -> list[Record]:
        """Up to ``max_records`` consecutive records starting at ``transaction_id``."""

    def read_batch(self, transaction_id: int, max_records: int, max_bytes: int) -> RecordBatch:
        """:meth:`read_records` as stored bytes: at most ``max_bytes`` of them, but at least one
        record when there is one; StorageCorruptionError if a record fails its checksum."""

    def read_headers(self, transaction_id: int, max_records: int) -> list[RecordHeader]:
        """Up to ``max_records`` consecutive record headers starting at ``transaction_id``."""

    def repairs(self) -> list[Repair]:
        """What was repaired since the store was opened (torn tails, rebuilt indexes)."""

    def close(self) -> None:
        """Release file handles; idempotent."""


@runtime_checkable
class DeferredSyncStore(Protocol):
    """Optional for a :class:`PartitionStore`: an append in two steps, so that a storage node
    writes the batches of several partitions first and then syncs each (the writeback of all
    of them under way before the first fdatasync waits: one round of a node's I/O thread costs
    about one fdatasync of latency, not one per partition). A store without these methods gets
    :meth:`PartitionStore.append_validated` calls.

    Without a node journal the node calls ``write_validated`` and then, in the same I/O-thread
    round, ``sync_written``, and nothing else of the store in between; it acknowledges the
    records only after ``sync_written`` returned. With the journal (``storage.journal``) it
    acknowledges them once they are durable in the journal and calls ``sync_written`` at the
    journal's checkpoints; any other call may come in between. The store must be correct when
    anything follows a write (it syncs first where it must, e.g. before a truncate or a
    segment roll).
    """

    def write_validated(self, records: bytes | memoryview, offsets: array[int], *,
                        lazy_writeback: bool = False) -> None:
        """:meth:`PartitionStore.append_validated` without the durability: the records are
        written (and may be read), durable once :meth:`sync_written` returns.

        ``lazy_writeback``: the node made the records durable elsewhere (its journal) and calls
        :meth:`sync_written` only at checkpoints, so the store need not hurry their writeback; it
        may even keep them in memory until it is next read, synced, truncated or closed (a
        bounded amount: the node holds that memory for every partition)."""

    def sync_written(self) -> None:
        """Make everything written durable (one fdatasync), as ``append_validated`` would have.

        Optional, outside this protocol: ``start_writeback()``, which starts writing what
        ``sync_written`` would make durable without waiting; a node's journal checkpoint calls it
        for every partition before it syncs the first (measured: 64 partition files synced in
        22-25 ms instead of 33-34)."""


@runtime_checkable
class StorageLayout(Protocol):
    """A storage directory: the control file plus one store per partition.

    Optional: a class attribute ``journal_capable = True`` says that the layout's stores are
    :class:`DeferredSyncStore` s whose files live under :attr:`directory`, so a node with
    ``storage.journal`` makes their appends durable in its journal (``directory/journal/``);
    without it every append batch is synced by the store itself. Optional too: an attribute
    ``open_files_per_partition`` (default 2, :data:`waltz_core.openfiles.FILES_PER_PARTITION`),
    the most descriptors an open store holds, from which a node warns at start when the process may not
    open enough of them for its partitions."""

    directory: str

    def open(self, cluster_key: uuid.UUID, num_partitions: int) -> ControlHeader:
        """Open the control file, creating the directory and file if absent.

        ClusterKeyMismatchError when an existing control file belongs to another cluster key or
        another partition count.
        """

    def read_partition_info(self, partition_id: int) -> PartitionInfo:
        """The newest valid partition-info struct (a torn one falls back to the other).

        StorageCorruptionError when both structs fail their checksums.
        """

    def write_partition_info(self, partition_id: int, info: PartitionInfo) -> PartitionInfo:
        """Write ``info`` over the older struct with the next sequence number; durable on return.

        Returns what was written (with its sequence number).
        """

    def open_partition(self, partition_id: int) -> PartitionStore:
        """Open (creating if absent) the partition's files, repairing a torn tail."""

    def delete_partition_files(self, partition_id: int) -> None:
        """Remove the partition's directory and segment files (the store must be closed)."""

    def quarantine(self, partition_id: int | None, into: Path, *, copy: bool = False) -> list[str]:
        """Move a partition's files - or, with None, the control file and its repair report -
        into the directory ``into`` (created if absent), keeping them for an operator; with
        ``copy`` they are copied and stay in use. Moving needs the partition's store closed, and
        for the control file :meth:`open` not yet called (offline recovery, ``waltz storage
        recover-partition``). Returns the new paths."""

    def repairs(self) -> list[Repair]:
        """Repairs made to the control file since open."""

    def close(self) -> None:
        """Release the control file; idempotent."""
