"""The storage-layout conformance kit: every layout registered with ``waltz_register_storage_layouts`` passes it.

Subclass :class:`StorageLayoutConformance` in the layout's tests (the fsspec model)::

    from waltz_core.testing.conformance.storage_layout import StorageLayoutConformance

    class TestMyLayout(StorageLayoutConformance):
        layout_name = "mine"
        node_config = {"segment_size_threshold": 700}     # small: the kit's logs are small
        capabilities = frozenset({"crash-points", "torn-tail"})

Layouts are built through the registry of the kit's ``runtime`` fixture, as a storage node builds
them (``factory(StorageNodeConfig(directory=..., layout=..., **node_config), options)``), so the kit
also proves the registration. A layout that is not installed is registered with
``extra_plugins = [my_plugin]`` (:class:`~waltz_core.testing.conformance.KitRuntime`). Fixture contract:

``runtime`` (class scope; default: built-ins, installed entry points and ``extra_plugins``)
    The :class:`~waltz_core.runtime.Runtime` whose registries the layout is resolved in.
``layout_factory`` (function scope; default: :meth:`StorageLayoutConformance.build_layout`)
    ``make(directory) -> StorageLayout``: a new, unopened layout on ``directory``. Layouts made on
    one directory share what it stores: making another one is a restart. Override it to release
    what the layouts keep outside the directory (the ``memory`` layout discards its volumes).

The contract tests run for every layout: open/reopen and the cluster-key check, one open layout
per directory, partition-info round trips and sequence numbers, appends (records and stored
bytes) read back record by record, as headers, as lists and as byte-bounded batches, the
high-water mark, truncation, partitions kept apart, a clean reopen losing nothing and repairing
nothing, deleting and quarantining, and a Hypothesis state machine against a list model.

Capabilities (durability features only a layout on disk has). A test that needs a capability
the subclass does not declare is *deselected*: removed from the subclass when the class is
created, so it is never collected and never skips (under ``CI=true`` nothing that should run can
hide as a skip); the subclass's :attr:`~StorageLayoutConformance.not_applicable` lists what was
removed and why. An unknown capability name is a TypeError.

``crash-points``
    The layout changes its files through ``os`` calls (``os.open``, ``os.write``/``os.pwrite``,
    ``os.ftruncate``, ``os.fsync``/``os.fdatasync``, ``os.rename``/``os.replace``, ``os.unlink``,
    ``os.mkdir``/``os.rmdir``) on Linux. The kit runs a scenario of creates, appends (a segment
    roll included, given small ``node_config`` sizes), truncations and partition-info writes and
    crashes at every one of those calls (:class:`CrashPoints`): as a process kill (files as the
    page cache holds them; a crash inside a write leaves half of it) and as a power loss (every
    write since the file's last fsync is lost). Reopened, the storage must hold a state the
    operation may leave (a prefix of an append's records, a truncation between its target and
    the old end, the old or the new partition info), every acknowledged change (the operation
    returned) survives a power loss, and a second reopen repairs nothing.
``torn-tail``
    An append cut at every byte of each of its writes (a process kill inside the write) is
    repaired at open: the acknowledged records are there, the torn record is not, the layout
    reports a :class:`~waltz_core.storage.layout.Repair`, and appends continue.
``index-rebuild``
    The layout keeps an index it can rebuild from the data: after :meth:`damage_index` (``"lost"``
    or ``"garbage"``) every record reads back, a repair is reported, and it is not needed again.
    The subclass implements :meth:`~StorageLayoutConformance.damage_index`.
``control-twins``
    Partition info is kept in two copies written alternately: after
    :meth:`damage_control_copy` (``"newest"`` or ``"older"``) the other copy is served (a
    rollback, reported); the next write goes over the damaged copy; with both damaged that
    partition alone is refused until it is written again. The subclass implements
    :meth:`~StorageLayoutConformance.damage_control_copy`.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import uuid
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar, Protocol, Self

import attrs
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from ...config import StorageNodeConfig
from ...errors import ClusterKeyMismatchError, StorageCorruptionError, StorageError
from ...protocol.wire import Record, RecordBatch, RecordHeader, ReqId
from ...runtime import Runtime
from ...storage import open_layout
from ...storage.format import PartitionInfo
from ...storage.layout import DeferredSyncStore, PartitionStore, Repair, StorageLayout
from . import KitRuntime

LayoutFactory = Callable[[Path], StorageLayout]

#: Every capability a subclass may declare (see the module docstring).
CAPABILITIES: frozenset[str] = frozenset({"crash-points", "torn-tail", "index-rebuild", "control-twins"})

CLUSTER_KEY = uuid.UUID("5eed0000-0000-4000-8000-00000000ca11")
NUM_PARTITIONS = 2


def requires_capability(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark a kit test as needing ``name``; subclasses that do not declare it do not get the test.

    The mark is the test function's ``waltz_capabilities`` set, read by ``StorageLayoutConformance.__init_subclass__``.
    """
    if name not in CAPABILITIES:
        raise ValueError(f"unknown storage-layout capability {name!r}")

    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn.waltz_capabilities = getattr(fn, "waltz_capabilities", frozenset()) | {name}  # type: ignore[attr-defined]
        return fn

    return mark


def make_record(transaction_id: int, size: int, partition_id: int = 0, salt: int = 0) -> Record:
    """A record whose bytes depend on its id, size and ``salt`` (so a rewritten id differs)."""
    data = bytes((transaction_id * 31 + salt * 7 + i) % 251 for i in range(size))
    return Record(transaction_id, ReqId(7, 1 + salt, partition_id, transaction_id), (transaction_id + salt) & 0xFFFF,
                  data, zlib.crc32(data))


def make_records(start: int, sizes: Sequence[int], partition_id: int = 0, salt: int = 0) -> list[Record]:
    return [make_record(start + i, size, partition_id, salt) for i, size in enumerate(sizes)]


def read_all(store: PartitionStore) -> list[Record]:
    """Every record of the store, in as many reads as it takes."""
    out: list[Record] = []
    while batch := store.read_records(len(out), 1000):
        out.extend(batch)
    return out


def info_fields(info: PartitionInfo) -> tuple[int, int, int, int]:
    """What a partition-info write stores (the sequence number is the layout's)."""
    return info.session_id, info.low_water_mark, info.local_low_water_mark, info.flags


# ------------------------------------------------------------------------------- crash points


class SimulatedCrash(BaseException):
    """The process dies here: a BaseException, so a layout's ``except Exception`` does not catch it."""


@attrs.frozen(slots=True)
class Step:
    """One call that changes a file under the storage directory."""

    call: str  #: the ``os`` function, e.g. ``"pwrite"``
    path: str
    size: int = 0  #: bytes of a write


_WRAPPED = ("open", "write", "pwrite", "ftruncate", "truncate", "fsync", "fdatasync", "unlink", "remove", "rename",
            "replace", "rmdir", "mkdir")
_SYNCS = frozenset({"fsync", "fdatasync"})


def _fd_path(fd: int) -> str | None:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


def _resolve(path: Any, dir_fd: int | None = None) -> str | None:
    """The absolute path ``path`` names (parent directories resolved; the name itself may not exist yet)."""
    if isinstance(path, int):
        return _fd_path(path)
    name = os.fsdecode(path)
    if dir_fd is not None and not os.path.isabs(name):
        base = _fd_path(dir_fd)
        if base is None:
            return None
        name = os.path.join(base, name)
    name = os.path.abspath(name)
    return os.path.join(os.path.realpath(os.path.dirname(name)), os.path.basename(name))


def _read(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


class CrashPoints:
    """Replace the ``os`` calls that change files (see the module docstring) while the context is
    active: each call on a path under ``root`` is recorded as a :class:`Step`, and the call number
    ``crash_at`` raises :class:`SimulatedCrash` instead of running (a write first writes its first
    ``torn`` bytes, when ``0 < torn < size``). Syncs are not passed on (the model tracks them).

    Durability model for :meth:`materialize`: names (create, rename, unlink) are durable in the
    order they are made, as a journaling file system's metadata; file *contents* are durable as
    of the file's last fsync/fdatasync, and a file never synced is empty after a power loss.
    """

    def __init__(self, root: Path, *, crash_at: int | None = None, torn: int = 0) -> None:
        self.root = os.path.realpath(root)
        self.crash_at = crash_at
        self.torn = torn
        self.steps: list[Step] = []
        self.durable: dict[str, bytes] = {}
        self._real: dict[str, Callable[..., Any]] = {}

    def __enter__(self) -> Self:
        for directory, _, files in os.walk(self.root):
            for name in files:
                path = os.path.join(directory, name)
                self.durable[path] = _read(path)
        self._real = {name: getattr(os, name) for name in _WRAPPED}
        for name in _WRAPPED:
            setattr(os, name, getattr(self, f"_{name}"))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, fn in self._real.items():
            setattr(os, name, fn)

    @property
    def synced(self) -> bool:
        return any(step.call in _SYNCS for step in self.steps)

    def materialize(self, into: Path, *, power_loss: bool) -> None:
        """Write what ``root`` holds after the crash into ``into``: as the page cache holds it (a
        process kill), or only what was synced (a power loss). Call after the context exited."""
        for directory, _, files in os.walk(self.root):
            target = into / os.path.relpath(directory, self.root)
            target.mkdir(parents=True, exist_ok=True)
            for name in files:
                path = os.path.join(directory, name)
                (target / name).write_bytes(self.durable.get(path, b"") if power_loss else _read(path))

    # ------------------------------------------------------------------------------ the calls
    def _gate(self, call: str, path: str | None, size: int = 0, tear: Callable[[int], object] | None = None) -> bool:
        """Record the step if ``path`` is under the root (True), crashing if it is the chosen one."""
        if path is None or not (path == self.root or path.startswith(self.root + os.sep)):
            return False
        index = len(self.steps)
        self.steps.append(Step(call, path, size))
        if index == self.crash_at:
            if tear is not None and 0 < self.torn < size:
                tear(self.torn)
            raise SimulatedCrash(f"crash at step {index}: {call} {path}")
        return True

    def _open(self, path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        if flags & (os.O_CREAT | os.O_TRUNC):
            self._gate("open", _resolve(path, dir_fd))
        return self._real["open"](path, flags, mode, dir_fd=dir_fd)  # type: ignore[no-any-return]

    def _write(self, fd: int, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._gate("write", _fd_path(fd), len(view), lambda n: self._real["write"](fd, view[:n]))
        return self._real["write"](fd, data)  # type: ignore[no-any-return]

    def _pwrite(self, fd: int, data: Any, offset: int) -> int:
        view = memoryview(data).cast("B")
        self._gate("pwrite", _fd_path(fd), len(view), lambda n: self._real["pwrite"](fd, view[:n], offset))
        return self._real["pwrite"](fd, data, offset)  # type: ignore[no-any-return]

    def _ftruncate(self, fd: int, length: int) -> None:
        self._gate("ftruncate", _fd_path(fd))
        self._real["ftruncate"](fd, length)

    def _truncate(self, path: Any, length: int) -> None:
        self._gate("truncate", _resolve(path))
        self._real["truncate"](path, length)

    def _sync(self, call: str, fd: Any) -> None:
        fileno = fd if isinstance(fd, int) else fd.fileno()
        path = _fd_path(fileno)
        if not self._gate(call, path):
            self._real[call](fd)
        elif path is not None and os.path.isfile(path):
            self.durable[path] = _read(path)

    def _fsync(self, fd: Any) -> None:
        self._sync("fsync", fd)

    def _fdatasync(self, fd: Any) -> None:
        self._sync("fdatasync", fd)

    def _unlink(self, path: Any, *, dir_fd: int | None = None) -> None:
        resolved = _resolve(path, dir_fd)
        counted = self._gate("unlink", resolved)
        self._real["unlink"](path, dir_fd=dir_fd)
        if counted:
            self.durable.pop(resolved, None)  # type: ignore[arg-type]

    _remove = _unlink

    def _move(self, call: str, src: Any, dst: Any, src_dir_fd: int | None, dst_dir_fd: int | None) -> None:
        source, target = _resolve(src, src_dir_fd), _resolve(dst, dst_dir_fd)
        counted = self._gate(call, source) or self._gate(call, target)
        self._real[call](src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
        if counted and source is not None and target is not None:
            self.durable.pop(target, None)  # replaced: its inode is gone
            for key in [k for k in self.durable if k == source or k.startswith(source + os.sep)]:
                self.durable[target + key[len(source):]] = self.durable.pop(key)

    def _rename(self, src: Any, dst: Any, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None) -> None:
        self._move("rename", src, dst, src_dir_fd, dst_dir_fd)

    def _replace(self, src: Any, dst: Any, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None) -> None:
        self._move("replace", src, dst, src_dir_fd, dst_dir_fd)

    def _rmdir(self, path: Any, *, dir_fd: int | None = None) -> None:
        self._gate("rmdir", _resolve(path, dir_fd))
        self._real["rmdir"](path, dir_fd=dir_fd)

    def _mkdir(self, path: Any, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
        self._gate("mkdir", _resolve(path, dir_fd))
        self._real["mkdir"](path, mode, dir_fd=dir_fd)


@attrs.frozen(slots=True)
class State:
    """What the storage holds: each partition's records and partition-info fields."""

    logs: tuple[tuple[Record, ...], ...]
    infos: tuple[tuple[int, int, int, int], ...]

    @classmethod
    def empty(cls) -> State:
        return cls(((),) * NUM_PARTITIONS, (info_fields(PartitionInfo()),) * NUM_PARTITIONS)

    def with_log(self, partition_id: int, records: Sequence[Record]) -> State:
        logs = list(self.logs)
        logs[partition_id] = tuple(records)
        return attrs.evolve(self, logs=tuple(logs))

    def with_info(self, partition_id: int, fields: tuple[int, int, int, int]) -> State:
        infos = list(self.infos)
        infos[partition_id] = fields
        return attrs.evolve(self, infos=tuple(infos))

    def describe(self) -> str:
        return f"records per partition {[len(log) for log in self.logs]}, infos {list(self.infos)}"


class CrashOp(Protocol):
    """One operation of the crash scenario."""

    opens_layout: ClassVar[bool]  #: the operation opens the layout itself (nothing is opened before it)

    def run(self, layout: StorageLayout, stores: Sequence[PartitionStore]) -> None: ...

    def outcomes(self, before: State) -> list[State]:
        """Every state a crash during the operation may leave; the last is the state on return."""


@attrs.frozen(slots=True)
class _Create:
    opens_layout: ClassVar[bool] = True

    def run(self, layout: StorageLayout, stores: Sequence[PartitionStore]) -> None:
        layout.open(CLUSTER_KEY, NUM_PARTITIONS)

    def outcomes(self, before: State) -> list[State]:
        return [before]

    def __str__(self) -> str:
        return "create the storage"


@attrs.frozen(slots=True)
class _Append:
    partition_id: int
    records: tuple[Record, ...]
    validated: bool  #: through append_validated (the node's path) rather than append
    #: through write_validated then sync_written, when the store defers syncs (DeferredSyncStore)
    deferred: bool = False
    opens_layout: ClassVar[bool] = False

    def run(self, layout: StorageLayout, stores: Sequence[PartitionStore]) -> None:
        store = stores[self.partition_id]
        if self.validated:
            batch = RecordBatch.from_records(self.records)
            if self.deferred and isinstance(store, DeferredSyncStore):
                store.write_validated(batch.data, batch.offsets)
                store.sync_written()
            else:
                store.append_validated(batch.data, batch.offsets)
        else:
            store.append(self.records)

    def outcomes(self, before: State) -> list[State]:
        log = before.logs[self.partition_id]
        return [before.with_log(self.partition_id, log + self.records[:n]) for n in range(len(self.records) + 1)]

    def __str__(self) -> str:
        first = self.records[0].transaction_id
        how = ("write_validated + sync_written" if self.deferred else "append_validated") if self.validated \
            else "append"
        return f"{how} of transactions {first}..{first + len(self.records) - 1} to partition {self.partition_id}"


@attrs.frozen(slots=True)
class _Truncate:
    partition_id: int
    transaction_id: int
    opens_layout: ClassVar[bool] = False

    def run(self, layout: StorageLayout, stores: Sequence[PartitionStore]) -> None:
        stores[self.partition_id].truncate(self.transaction_id)

    def outcomes(self, before: State) -> list[State]:
        log = before.logs[self.partition_id]
        kept = range(len(log), self.transaction_id, -1)  # the old end first, the target last
        return [before.with_log(self.partition_id, log[:n]) for n in kept]

    def __str__(self) -> str:
        return f"truncate partition {self.partition_id} to {self.transaction_id}"


@attrs.frozen(slots=True)
class _WriteInfo:
    partition_id: int
    fields: tuple[int, int, int, int]
    opens_layout: ClassVar[bool] = False

    def run(self, layout: StorageLayout, stores: Sequence[PartitionStore]) -> None:
        layout.write_partition_info(self.partition_id, PartitionInfo(*self.fields))

    def outcomes(self, before: State) -> list[State]:
        return [before, before.with_info(self.partition_id, self.fields)]

    def __str__(self) -> str:
        return f"write partition info {self.fields} of partition {self.partition_id}"


def crash_scenario() -> list[CrashOp]:
    """Creates, appends of both kinds (enough bytes to roll small segments), truncations within and
    across segments and to empty, and partition-info writes, on two partitions."""
    ops: list[CrashOp] = [_Create(), _Append(1, tuple(make_records(0, [50, 0, 20], 1)), True)]
    sizes = [[30], [0, 15, 60], [90, 10], [120, 0, 60], [33], [100, 100], [7, 70, 77], [110]]
    start = 0
    for i, batch in enumerate(sizes):
        ops.append(_Append(0, tuple(make_records(start, batch)), validated=i % 2 == 1, deferred=i % 4 == 3))
        start += len(batch)
        if i == 2:
            ops.append(_WriteInfo(0, (3, start - 1, start - 1, 5)))
    ops += [
        _Truncate(0, start - 3),  # inside the last segment
        _Truncate(0, 4),  # back across segments
        _Append(0, tuple(make_records(5, [40, 45], salt=1)), validated=True),
        _WriteInfo(0, (4, 6, 6, 5)),
        _Truncate(0, -1),
        _Append(0, tuple(make_records(0, [25, 26], salt=2)), validated=False),
    ]
    return ops


# ------------------------------------------------------------------------------------ the kit


class StorageLayoutConformance(KitRuntime):
    """Behaviour every storage layout must show. Subclass it and set ``layout_name``."""

    layout_name: ClassVar[str]
    #: StorageNodeConfig keys the layout is built with (small sizes exercise segment rolls).
    node_config: ClassVar[Mapping[str, Any]] = MappingProxyType({})
    capabilities: ClassVar[frozenset[str]] = frozenset()
    #: Set on each subclass: the tests it does not get, with the capabilities they need.
    not_applicable: ClassVar[Mapping[str, frozenset[str]]] = MappingProxyType({})

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        unknown = cls.capabilities - CAPABILITIES
        if unknown:
            raise TypeError(f"{cls.__name__}: unknown storage-layout capabilities {sorted(unknown)}; "
                            f"known: {sorted(CAPABILITIES)}")
        dropped: dict[str, frozenset[str]] = {}
        for name in dir(cls):
            # The nearest definition: a parent subclass may have removed the test (None) for itself.
            test = next((c.__dict__[name] for c in cls.__mro__ if c.__dict__.get(name) is not None), None)
            needs: frozenset[str] = getattr(test, "waltz_capabilities", frozenset())
            if not name.startswith("test_") or not needs:
                continue
            if needs <= cls.capabilities:
                setattr(cls, name, test)
            else:
                dropped[name] = needs - cls.capabilities
                setattr(cls, name, None)  # pytest collects nothing under this name
        cls.not_applicable = MappingProxyType(dropped)

    # ------------------------------------------------------------------------ fixtures, hooks
    def build_layout(self, runtime: Runtime, directory: Path) -> StorageLayout:
        """An unopened layout on ``directory``, built through ``runtime``'s registry as a storage node does."""
        config = StorageNodeConfig(directory=str(directory), layout=self.layout_name, **self.node_config)
        return open_layout(config, runtime.registries)

    @pytest.fixture
    def layout_factory(self, runtime: Runtime) -> Iterator[LayoutFactory]:
        made: list[StorageLayout] = []

        def make(directory: Path) -> StorageLayout:
            layout = self.build_layout(runtime, directory)
            made.append(layout)
            return layout

        yield make
        for layout in made:
            layout.close()
        for layout in made:
            self.forget(layout)

    def forget(self, layout: StorageLayout) -> None:
        """After a test, release what outlives a closed layout (an in-memory layout's data); no-op here."""

    @pytest.fixture
    def directory(self, tmp_path: Path) -> Path:
        return tmp_path / "storage"

    def damage_index(self, directory: Path, partition_id: int, how: str) -> None:
        """``index-rebuild``: make the partition's index useless, on a closed layout: ``"lost"``
        (gone) or ``"garbage"`` (entries that cannot be right)."""
        raise NotImplementedError(f"{type(self).__name__} declares index-rebuild: implement damage_index")

    def damage_control_copy(self, directory: Path, partition_id: int, which: str) -> None:
        """``control-twins``: fail the checksum of one partition-info copy, on a closed layout:
        ``"newest"`` (the copy with the higher sequence number) or ``"older"``."""
        raise NotImplementedError(f"{type(self).__name__} declares control-twins: implement damage_control_copy")

    # ---------------------------------------------------------------------------- helpers
    @staticmethod
    def opened(make: LayoutFactory, directory: Path) -> StorageLayout:
        layout = make(directory)
        layout.open(CLUSTER_KEY, NUM_PARTITIONS)
        return layout

    @staticmethod
    def fill(make: LayoutFactory, directory: Path, sizes: Sequence[Sequence[int]]) -> list[Record]:
        """Append one batch per entry of ``sizes`` to partition 0, then close cleanly."""
        layout = StorageLayoutConformance.opened(make, directory)
        store = layout.open_partition(0)
        records: list[Record] = []
        for batch in sizes:
            new = make_records(len(records), batch)
            store.append(new)
            records += new
        store.close()
        layout.close()
        return records

    # ---------------------------------------------------------------------------- registration
    def test_registered_through_the_hook(self, layout_factory: LayoutFactory, directory: Path,
                                         runtime: Runtime) -> None:
        """Found by name in the registry; what its factory builds implements the protocols."""
        assert self.layout_name in runtime.registries.storage_layout.names()
        layout = layout_factory(directory)
        assert isinstance(layout, StorageLayout)
        assert layout.directory == str(directory)
        layout.open(CLUSTER_KEY, NUM_PARTITIONS)
        store = layout.open_partition(0)
        assert isinstance(store, PartitionStore) and store.partition_id == 0
        store.close()
        layout.close()

    # --------------------------------------------------------------------------- control data
    def test_open_creates_the_storage_and_reopens_it(self, layout_factory: LayoutFactory, directory: Path) -> None:
        layout = layout_factory(directory)
        header = layout.open(CLUSTER_KEY, NUM_PARTITIONS)
        assert (header.cluster_key, header.num_partitions) == (CLUSTER_KEY, NUM_PARTITIONS)
        assert layout.repairs() == []
        layout.close()
        layout.close()  # idempotent
        again = layout_factory(directory)
        assert again.open(CLUSTER_KEY, NUM_PARTITIONS) == header  # same creation time: not created twice
        again.close()

    def test_open_refuses_another_cluster_key_or_partition_count(self, layout_factory: LayoutFactory,
                                                                 directory: Path) -> None:
        self.opened(layout_factory, directory).close()
        for key, count in ((uuid.uuid4(), NUM_PARTITIONS), (CLUSTER_KEY, NUM_PARTITIONS + 1)):
            with pytest.raises(ClusterKeyMismatchError):
                layout_factory(directory).open(key, count)
        self.opened(layout_factory, directory).close()  # refusing changed nothing

    def test_one_open_layout_per_directory(self, layout_factory: LayoutFactory, directory: Path) -> None:
        """Two storage nodes on one directory would each believe they own its logs."""
        first = self.opened(layout_factory, directory)
        with pytest.raises(StorageError):
            layout_factory(directory).open(CLUSTER_KEY, NUM_PARTITIONS)
        first.close()
        self.opened(layout_factory, directory).close()

    def test_partition_info_round_trips_with_increasing_sequence_numbers(self, layout_factory: LayoutFactory,
                                                                         directory: Path) -> None:
        layout = self.opened(layout_factory, directory)
        assert [info_fields(layout.read_partition_info(p)) for p in range(NUM_PARTITIONS)] == \
            [info_fields(PartitionInfo())] * NUM_PARTITIONS
        start = layout.read_partition_info(0).sequence_number
        written = []
        for i in range(3):
            # The sequence number passed in is ignored: the layout numbers its writes.
            new = layout.write_partition_info(0, PartitionInfo(10 + i, 20 + i, 19 + i, 5, sequence_number=999))
            assert info_fields(new) == (10 + i, 20 + i, 19 + i, 5)
            assert new.sequence_number == start + i + 1
            assert layout.read_partition_info(0) == new
            written.append(new)
        assert info_fields(layout.read_partition_info(1)) == info_fields(PartitionInfo())
        layout.write_partition_info(1, PartitionInfo(1, 2, 3, 4))
        layout.close()
        layout = self.opened(layout_factory, directory)
        assert layout.read_partition_info(0) == written[-1]
        assert info_fields(layout.read_partition_info(1)) == (1, 2, 3, 4)
        assert layout.repairs() == []
        layout.close()

    def test_partition_ids_outside_the_cluster_are_refused(self, layout_factory: LayoutFactory,
                                                          directory: Path) -> None:
        layout = self.opened(layout_factory, directory)
        for pid in (-1, NUM_PARTITIONS):
            with pytest.raises(StorageError):
                layout.read_partition_info(pid)
            with pytest.raises(StorageError):
                layout.write_partition_info(pid, PartitionInfo(1, 1, 1, 1))
            with pytest.raises(StorageError):
                layout.open_partition(pid)
        layout.close()

    # ------------------------------------------------------------------------------- records
    def test_an_empty_partition_holds_nothing(self, layout_factory: LayoutFactory, directory: Path) -> None:
        layout = self.opened(layout_factory, directory)
        store = layout.open_partition(0)
        assert store.max_transaction_id == -1
        assert store.read_record(0) is None and store.read_header(0) is None
        assert store.read_records(0, 10) == [] and store.read_headers(0, 10) == []
        batch = store.read_batch(0, 10, 1 << 20)
        assert len(batch) == 0 and bytes(batch.data) == b""
        assert store.repairs() == []
        store.close()
        layout.close()

    def test_appended_records_read_back(self, layout_factory: LayoutFactory, directory: Path) -> None:
        layout = self.opened(layout_factory, directory)
        store = layout.open_partition(0)
        records = make_records(0, [0, 1, 17, 300, 5, 64, 0, 2000, 9])
        store.append(records[:1])
        store.append(records[1:4])
        store.append([])  # nothing to write
        store.append(records[4:])
        assert store.max_transaction_id == len(records) - 1
        for r in records:
            assert store.read_record(r.transaction_id) == r
            assert store.read_header(r.transaction_id) == RecordHeader(r.transaction_id, r.req_id, r.header)
        assert store.read_records(0, 100) == records
        assert store.read_records(2, 3) == records[2:5]
        assert store.read_records(7, 100) == records[7:]
        assert [h.transaction_id for h in store.read_headers(3, 4)] == [3, 4, 5, 6]
        for absent in (-1, len(records), len(records) + 5):
            assert store.read_record(absent) is None and store.read_header(absent) is None
            assert store.read_records(absent, 10) == [] and store.read_headers(absent, 10) == []
        assert store.read_records(0, 0) == []
        store.close()
        layout.close()

    def test_append_validated_stores_the_bytes_it_is_given(self, layout_factory: LayoutFactory,
                                                           directory: Path) -> None:
        """The node's path: bytes already in the stored layout, maybe a view into a larger buffer."""
        layout = self.opened(layout_factory, directory)
        store = layout.open_partition(0)
        first = RecordBatch.from_records(make_records(0, [10, 0, 90]))
        second = RecordBatch.from_records(make_records(3, [33, 4]))
        buffer = bytearray(b"\xee" * 7 + bytes(second.data) + b"\xee" * 5)
        store.append_validated(first.data, first.offsets)
        store.append_validated(memoryview(buffer)[7 : 7 + len(second.data)], second.offsets)
        buffer[:] = b"\0" * len(buffer)  # the caller reuses its buffer after the append returned
        store.append(make_records(5, [12]))
        everything = store.read_batch(0, 100, 1 << 20)
        assert everything.first_transaction_id == 0 and len(everything) == 6
        assert bytes(everything.data) == bytes(first.data) + bytes(second.data) + bytes(
            RecordBatch.from_records(make_records(5, [12])).data)
        assert store.read_records(0, 100) == [*first, *second, *make_records(5, [12])]
        store.close()
        layout.close()

    def test_read_batch_is_bounded_but_serves_one_record(self, layout_factory: LayoutFactory, directory: Path) -> None:
        layout = self.opened(layout_factory, directory)
        store = layout.open_partition(0)
        records = make_records(0, [100, 100, 100, 500, 10])
        store.append(records)
        sizes = [len(RecordBatch.from_records([r]).data) for r in records]
        assert store.read_batch(0, 2, 1 << 20) == records[:2]
        assert store.read_batch(0, 100, sizes[0] + sizes[1]) == records[:2]  # exactly fits
        assert store.read_batch(0, 100, sizes[0] + sizes[1] - 1) == records[:1]
        assert store.read_batch(3, 100, 10) == records[3:4]  # larger than the budget: served alone
        assert store.read_batch(1, 100, 0) == records[1:2]
        batch = store.read_batch(2, 100, 1 << 20)
        assert batch.first_transaction_id == 2 and batch == records[2:]
        assert len(store.read_batch(5, 100, 1 << 20)) == 0
        store.close()
        layout.close()

    def test_truncate_then_append_reuses_the_ids(self, layout_factory: LayoutFactory, directory: Path) -> None:
        layout = self.opened(layout_factory, directory)
        store = layout.open_partition(0)
        store.append(make_records(0, [40] * 10))
        store.truncate(20)  # above the end: nothing to do
        assert store.max_transaction_id == 9
        store.truncate(5)
        assert store.max_transaction_id == 5
        assert store.read_record(6) is None and store.read_records(4, 10) == make_records(4, [40, 40])
        rewritten = make_records(6, [41, 42], salt=1)
        store.append(rewritten)
        assert store.read_records(0, 100) == make_records(0, [40] * 6) + rewritten
        store.truncate(-1)
        assert store.max_transaction_id == -1 and store.read_records(0, 10) == []
        store.append(make_records(0, [1], salt=2))
        store.truncate(-7)  # anything below -1 empties the partition too
        assert store.max_transaction_id == -1
        store.close()
        layout.close()

    def test_partitions_are_kept_apart(self, layout_factory: LayoutFactory, directory: Path) -> None:
        layout = self.opened(layout_factory, directory)
        zero, one = layout.open_partition(0), layout.open_partition(1)
        zero.append(make_records(0, [10, 20, 30]))
        one.append(make_records(0, [5], partition_id=1))
        zero.truncate(0)
        assert one.read_records(0, 10) == make_records(0, [5], partition_id=1)
        assert zero.read_records(0, 10) == make_records(0, [10])
        zero.close()
        one.close()
        layout.close()

    def test_a_clean_reopen_loses_and_repairs_nothing(self, layout_factory: LayoutFactory, directory: Path) -> None:
        layout = self.opened(layout_factory, directory)
        zero, one = layout.open_partition(0), layout.open_partition(1)
        zero.append(make_records(0, [50] * 30))
        zero.truncate(11)  # a truncation is durable too
        zero.append(make_records(12, [60, 70], salt=1))
        one.append(make_records(0, [5, 6], partition_id=1))
        info = layout.write_partition_info(0, PartitionInfo(2, 13, 13, 5))
        expected = make_records(0, [50] * 12) + make_records(12, [60, 70], salt=1)
        zero.close()
        one.close()
        layout.close()
        for _ in range(2):
            layout = self.opened(layout_factory, directory)
            zero, one = layout.open_partition(0), layout.open_partition(1)
            assert zero.max_transaction_id == 13 and read_all(zero) == expected
            assert read_all(one) == make_records(0, [5, 6], partition_id=1)
            assert layout.read_partition_info(0) == info
            assert zero.repairs() == [] and one.repairs() == [] and layout.repairs() == []
            zero.close()
            one.close()
            layout.close()

    def test_deleted_partition_files_leave_an_empty_partition(self, layout_factory: LayoutFactory,
                                                              directory: Path) -> None:
        layout = self.opened(layout_factory, directory)
        zero, one = layout.open_partition(0), layout.open_partition(1)
        zero.append(make_records(0, [30] * 5))
        one.append(make_records(0, [30], partition_id=1))
        zero.close()
        layout.delete_partition_files(0)
        zero = layout.open_partition(0)
        assert zero.max_transaction_id == -1
        zero.append(make_records(0, [8], salt=3))
        zero.close()
        one.close()
        layout.close()
        layout = self.opened(layout_factory, directory)
        assert read_all(layout.open_partition(0)) == make_records(0, [8], salt=3)
        assert read_all(layout.open_partition(1)) == make_records(0, [30], partition_id=1)
        layout.close()

    def test_quarantine_sets_a_partition_aside(self, layout_factory: LayoutFactory, directory: Path,
                                               tmp_path: Path) -> None:
        layout = self.opened(layout_factory, directory)
        zero, one = layout.open_partition(0), layout.open_partition(1)
        zero.append(make_records(0, [30] * 4))
        one.append(make_records(0, [30], partition_id=1))
        copied = layout.quarantine(0, tmp_path / "copy", copy=True)  # for an operator; still in use
        assert copied and all(Path(p).exists() and Path(p).is_relative_to(tmp_path / "copy") for p in copied)
        assert read_all(zero) == make_records(0, [30] * 4)
        zero.close()
        moved = layout.quarantine(0, tmp_path / "aside")
        assert moved and all(Path(p).exists() and Path(p).is_relative_to(tmp_path / "aside") for p in moved)
        zero = layout.open_partition(0)
        assert zero.max_transaction_id == -1  # a fresh partition, as recover-partition expects
        assert read_all(one) == make_records(0, [30], partition_id=1)
        zero.close()
        one.close()
        layout.close()

    def test_quarantine_sets_the_control_data_aside_before_open(self, layout_factory: LayoutFactory,
                                                                directory: Path, tmp_path: Path) -> None:
        layout = self.opened(layout_factory, directory)
        store = layout.open_partition(0)
        store.append(make_records(0, [10, 10]))
        store.close()
        layout.write_partition_info(0, PartitionInfo(9, 1, 1, 5))
        with pytest.raises(StorageError):
            layout.quarantine(None, tmp_path / "aside")  # in use
        layout.close()
        layout = layout_factory(directory)
        moved = layout.quarantine(None, tmp_path / "aside")
        assert moved and all(Path(p).exists() and Path(p).is_relative_to(tmp_path / "aside") for p in moved)
        layout.open(CLUSTER_KEY, NUM_PARTITIONS)  # a new control file; the partitions' records stay
        assert info_fields(layout.read_partition_info(0)) == info_fields(PartitionInfo())
        assert read_all(layout.open_partition(0)) == make_records(0, [10, 10])
        layout.close()

    def test_a_closed_store_refuses_appends(self, layout_factory: LayoutFactory, directory: Path) -> None:
        layout = self.opened(layout_factory, directory)
        store = layout.open_partition(0)
        store.append(make_records(0, [3]))
        store.close()
        store.close()  # idempotent
        with pytest.raises(StorageError):
            store.append(make_records(1, [3]))
        with pytest.raises(StorageError):
            store.truncate(-1)
        layout.close()
        layout = self.opened(layout_factory, directory)
        assert read_all(layout.open_partition(0)) == make_records(0, [3])
        layout.close()

    def test_random_operations_match_a_list_model(self, layout_factory: LayoutFactory, tmp_path: Path) -> None:
        """Appends, truncations, reopens and reads in any order, against a list of records."""
        numbers = itertools.count()
        opened = self.opened

        class Machine(RuleBasedStateMachine):
            def __init__(self) -> None:
                super().__init__()
                self.directory = tmp_path / f"example-{next(numbers)}"
                self.model: list[Record] = []
                self.salt = 0
                self.layout = opened(layout_factory, self.directory)
                self.store = self.layout.open_partition(0)

            @rule(sizes=st.lists(st.integers(0, 150), min_size=1, max_size=8),
                  how=st.sampled_from(["append", "validated", "deferred", "written"]))
            def append(self, sizes: list[int], how: str) -> None:
                """``deferred``: write_validated then sync_written; ``written``: write_validated
                alone, the sync left to whatever comes next (a store must be right either way)."""
                batch = make_records(len(self.model), sizes, salt=self.salt)
                store = self.store
                if how == "append":
                    store.append(batch)
                else:
                    encoded = RecordBatch.from_records(batch)
                    if how != "validated" and isinstance(store, DeferredSyncStore):
                        store.write_validated(encoded.data, encoded.offsets)
                        if how == "deferred":
                            store.sync_written()
                    else:
                        store.append_validated(encoded.data, encoded.offsets)
                self.model += batch

            @precondition(lambda self: self.model)
            @rule(data=st.data())
            def truncate(self, data: st.DataObject) -> None:
                keep = data.draw(st.integers(-1, len(self.model) - 1), label="truncate to")
                self.store.truncate(keep)
                del self.model[keep + 1 :]
                self.salt += 1  # the ids after it will hold other records

            @rule()
            def reopen(self) -> None:
                self.store.close()
                self.layout.close()
                self.layout = opened(layout_factory, self.directory)
                self.store = self.layout.open_partition(0)
                assert self.store.repairs() == [], "a clean close needs no repair"

            @rule(data=st.data())
            def read(self, data: st.DataObject) -> None:
                start = data.draw(st.integers(-2, len(self.model) + 2), label="start")
                count = data.draw(st.integers(0, 30), label="count")
                expected = self.model[start : start + count] if start >= 0 else []
                assert self.store.read_records(start, count) == expected
                assert self.store.read_batch(start, count, 1 << 20) == expected
                if 0 <= start < len(self.model):
                    assert self.store.read_record(start) == self.model[start]

            @invariant()
            def high_water_mark(self) -> None:
                assert self.store.max_transaction_id == len(self.model) - 1

            def teardown(self) -> None:
                self.store.close()
                self.layout.close()

        run_state_machine_as_test(Machine, settings=settings(max_examples=25, stateful_step_count=25, deadline=None))

    # --------------------------------------------------------------------------- crash points
    def _reopen_and_check(self, make: LayoutFactory, snapshot: Path, allowed: Sequence[State],
                          what: str) -> list[Repair]:
        """The crashed storage opens and holds an allowed state, and a second open repairs nothing;
        the partitions' repairs at the first open."""
        layout = self.opened(make, snapshot)
        stores = [layout.open_partition(p) for p in range(NUM_PARTITIONS)]
        got = State(tuple(tuple(read_all(s)) for s in stores),
                    tuple(info_fields(layout.read_partition_info(p)) for p in range(NUM_PARTITIONS)))
        repairs = [r for s in stores for r in s.repairs()]
        for s in stores:
            s.close()
        layout.close()
        assert got in allowed, f"{what}: the storage holds {got.describe()}, allowed: " + "; ".join(
            s.describe() for s in allowed)
        layout = self.opened(make, snapshot)
        store = layout.open_partition(0)
        assert tuple(read_all(store)) == got.logs[0], f"{what}: the second open changed the records"
        assert store.repairs() == [], f"{what}: the first open's repairs were not made durable: {store.repairs()}"
        follow = make_records(len(got.logs[0]), [21], salt=9)
        store.append(follow)  # the repaired log takes appends again
        assert store.read_records(len(got.logs[0]), 5) == follow, what
        store.close()
        layout.close()
        return repairs

    def _run_op(self, make: LayoutFactory, base: Path, work: Path, op: CrashOp,
                harness: CrashPoints) -> tuple[bool, Callable[[], None]]:
        """Run ``op`` on a copy of ``base`` under ``harness``: (crashed, close what is open)."""
        if base.exists():
            shutil.copytree(base, work)
        else:
            work.mkdir(parents=True)
        layout = make(work)
        stores: list[PartitionStore] = []
        if not op.opens_layout:
            layout.open(CLUSTER_KEY, NUM_PARTITIONS)
            stores = [layout.open_partition(p) for p in range(NUM_PARTITIONS)]

        def close() -> None:
            for s in stores:
                s.close()
            layout.close()

        def close_crashed() -> None:
            closables: list[PartitionStore | StorageLayout] = [*stores, layout]
            for obj in closables:  # each one, whatever state the crash left the others in
                with contextlib.suppress(Exception):
                    obj.close()

        try:
            with harness:
                op.run(layout, stores)
        except SimulatedCrash:
            return True, close_crashed
        return False, close

    def _sweep(self, make: LayoutFactory, scratch: Path, base: Path, op: CrashOp, before: State,
               power_loss: bool) -> tuple[Path, State]:
        """Crash ``op`` at each of its steps (and right after it returned); the next base and state."""
        outcomes = op.outcomes(before)
        after = outcomes[-1]
        mode = "power loss" if power_loss else "process kill"
        # A clean run: counts the steps, checks what survives right after it returned, makes the next base.
        counted = CrashPoints(scratch / "next")
        crashed, close = self._run_op(make, base, scratch / "next", op, counted)
        assert not crashed
        counted.materialize(scratch / "returned", power_loss=power_loss)
        close()
        self._reopen_and_check(make, scratch / "returned", [after], f"{op}, {mode} after it returned")
        shutil.rmtree(scratch / "returned")
        if before != after:
            assert counted.synced, (f"{op} returned without an fsync/fdatasync under the storage directory: "
                                    f"not durable (a layout on disk syncs through os.fsync/os.fdatasync)")
        for index, step in enumerate(counted.steps):
            torns = [0] if power_loss or step.size < 2 else [0, step.size // 2]
            for torn in torns:
                what = f"{op}, {mode} at step {index} ({step.call} {os.path.relpath(step.path, counted.root)}" + (
                    f", {torn} of {step.size} bytes written)" if torn else ")")
                harness = CrashPoints(scratch / "work", crash_at=index, torn=torn)
                crashed, close = self._run_op(make, base, scratch / "work", op, harness)
                assert crashed, f"{what}: the step was not reached again (the layout's calls are not repeatable)"
                harness.materialize(scratch / "crashed", power_loss=power_loss)
                close()
                self._reopen_and_check(make, scratch / "crashed", outcomes, what)
                shutil.rmtree(scratch / "work")
                shutil.rmtree(scratch / "crashed")
        if base.exists():
            shutil.rmtree(base)
        (scratch / "next").rename(base)
        return base, after

    @requires_capability("crash-points")
    @pytest.mark.parametrize("power_loss", [False, True], ids=["process-kill", "power-loss"])
    def test_every_crash_point_leaves_a_state_the_operation_allows(self, layout_factory: LayoutFactory,
                                                                   tmp_path: Path, power_loss: bool) -> None:
        base = tmp_path / "base"
        state = State.empty()
        for op in crash_scenario():
            base, state = self._sweep(layout_factory, tmp_path, base, op, state, power_loss)

    @requires_capability("torn-tail")
    def test_a_torn_append_is_repaired_at_open(self, layout_factory: LayoutFactory, tmp_path: Path) -> None:
        base = tmp_path / "base"
        acknowledged = self.fill(layout_factory, base, [[40, 0, 70], [12]])
        torn = _Append(0, tuple(make_records(len(acknowledged), [45])), validated=True)
        before = State.empty().with_log(0, acknowledged)
        allowed = torn.outcomes(before)
        counted = CrashPoints(tmp_path / "count")
        _, close = self._run_op(layout_factory, base, tmp_path / "count", torn, counted)
        close()
        writes = [(i, step) for i, step in enumerate(counted.steps) if step.size > 1]
        assert writes, "the append wrote nothing through os.write/os.pwrite under the storage directory"
        repaired = 0
        for index, step in writes:
            for cut in range(1, step.size):
                what = f"append torn after {cut} of {step.size} bytes of step {index} ({step.call})"
                harness = CrashPoints(tmp_path / "work", crash_at=index, torn=cut)
                _, close = self._run_op(layout_factory, base, tmp_path / "work", torn, harness)
                harness.materialize(tmp_path / "crashed", power_loss=False)
                close()
                repaired += bool(self._reopen_and_check(layout_factory, tmp_path / "crashed", allowed, what))
                shutil.rmtree(tmp_path / "work")
                shutil.rmtree(tmp_path / "crashed")
        assert repaired, "no torn append was reported as a repair"

    @requires_capability("index-rebuild")
    @pytest.mark.parametrize("how", ["lost", "garbage"])
    def test_an_index_that_is_lost_or_wrong_is_rebuilt(self, layout_factory: LayoutFactory, directory: Path,
                                                       how: str) -> None:
        records = self.fill(layout_factory, directory, [[50] * 4, [80, 0, 20], [100] * 5, [30] * 6, [7]])
        self.damage_index(directory, 0, how)
        layout = self.opened(layout_factory, directory)
        store = layout.open_partition(0)
        assert read_all(store) == records
        assert [r.transaction_id for r in store.read_headers(0, 100)] == list(range(len(records)))
        assert store.repairs(), f"index {how}: rebuilt without reporting a repair"
        store.append(make_records(len(records), [9]))
        store.close()
        layout.close()
        layout = self.opened(layout_factory, directory)
        store = layout.open_partition(0)
        assert read_all(store) == records + make_records(len(records), [9])
        assert store.repairs() == [], "the rebuilt index was not kept"
        store.close()
        layout.close()

    @requires_capability("control-twins")
    @pytest.mark.parametrize("which", ["newest", "older"])
    def test_a_damaged_partition_info_copy_falls_back_to_the_other(self, layout_factory: LayoutFactory,
                                                                   directory: Path, which: str) -> None:
        layout = self.opened(layout_factory, directory)
        older = layout.write_partition_info(0, PartitionInfo(5, 10, 10, 5))
        newest = layout.write_partition_info(0, PartitionInfo(6, 20, 20, 5))
        other = layout.write_partition_info(1, PartitionInfo(7, 1, 1, 5))
        layout.close()
        self.damage_control_copy(directory, 0, which)
        layout = self.opened(layout_factory, directory)
        survivor = older if which == "newest" else newest
        assert info_fields(layout.read_partition_info(0)) == info_fields(survivor)
        assert [r.partition_id for r in layout.repairs()] == [0], layout.repairs()
        assert layout.read_partition_info(1) == other
        latest = layout.write_partition_info(0, PartitionInfo(8, 30, 30, 5))  # goes over the damaged copy
        layout.close()
        layout = self.opened(layout_factory, directory)
        assert layout.read_partition_info(0) == latest and layout.repairs() == []
        layout.close()
        self.damage_control_copy(directory, 0, "newest")
        layout = self.opened(layout_factory, directory)
        assert info_fields(layout.read_partition_info(0)) == info_fields(survivor), "the good copy was overwritten"
        layout.close()

    @requires_capability("control-twins")
    def test_both_partition_info_copies_damaged_refuse_only_that_partition(self, layout_factory: LayoutFactory,
                                                                            directory: Path) -> None:
        layout = self.opened(layout_factory, directory)
        layout.write_partition_info(0, PartitionInfo(5, 10, 10, 5))
        layout.write_partition_info(0, PartitionInfo(6, 20, 20, 5))
        other = layout.write_partition_info(1, PartitionInfo(7, 1, 1, 5))
        layout.close()
        self.damage_control_copy(directory, 0, "newest")
        self.damage_control_copy(directory, 0, "older")
        layout = self.opened(layout_factory, directory)
        with pytest.raises(StorageCorruptionError):
            layout.read_partition_info(0)
        assert layout.read_partition_info(1) == other
        fresh = layout.write_partition_info(0, PartitionInfo(9, -1, -1, 5))  # an admin re-initialises it
        assert layout.read_partition_info(0) == fresh
        layout.close()
        layout = self.opened(layout_factory, directory)
        assert info_fields(layout.read_partition_info(0)) == (9, -1, -1, 5)
        layout.close()
