"""Negative controls: test-only plugins that each break one safety property on purpose.

The reliability suite must *catch* each of them (``tests/reliability/test_negative_controls.py``,
docs/reliability.md); a checker that passes while one is loaded is broken. Production modules
know nothing about them: each is an ordinary plugin object, registered like any other.

``no_lock_check``
    registers the lock table ``unsafe-no-lock-check``: the ``hashed`` table whose ``check`` never
    reports a conflict (in-flight serialisation still works), so contended transfers commit on
    stale reads. Active where ``[server] lock_table`` names it.
``no_fsync``
    registers the storage layout ``unsafe-no-fsync``: ``segmented`` without the fdatasync that
    makes an appended batch durable, so a power loss loses acknowledged records. Active where
    ``[storage] layout`` names it; the files are ``segmented``'s.
``ack_before_quorum``
    a ``waltz_commit_quorum`` policy (``tryfirst``): a transaction commits on ONE replica's
    acknowledgement instead of a majority's. Active once loaded into a server.

Loading them: into the processes a test starts with ``WALTZ_PLUGINS`` (they inherit the
environment), for which :func:`environment` gives the variables, selection included::

    for key, value in sabotage.environment("no-fsync").items():
        monkeypatch.setenv(key, value)

or into a runtime of the test's own with ``Runtime.load(extra=[sabotage.no_fsync])``. Each
declares ``WALTZ_UNSAFE``, so every server and storage process that loads one logs
``UNSAFE: plugin waltz_core.testing.sabotage:<name> is loaded ...`` at start.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import ClassVar

from ..config import ServerConfig, StorageNodeConfig
from ..hookspecs import hookimpl
from ..locks.base import LockRequest
from ..locks.hashed import HashedLockTable
from ..registry import LockTableFactory, Registry, StorageLayoutFactory
from ..storage.segmented import SegmentedLayout, SegmentedPartition

#: Backend names the controls register (chosen in the config like any other backend).
NO_LOCK_CHECK = "unsafe-no-lock-check"
NO_FSYNC = "unsafe-no-fsync"


class NoLockCheckTable(HashedLockTable):
    """The ``hashed`` table, except that no request ever conflicts."""

    __slots__ = ()

    def check(self, request: LockRequest, client_high_water_mark: int) -> int | None:
        return None


class NoFsyncPartition(SegmentedPartition):
    """A ``segmented`` partition whose appends return before their bytes are durable."""

    def _sync_appended(self, data_fd: int) -> None:
        pass


class NoFsyncLayout(SegmentedLayout):
    """The ``segmented`` layout with :class:`NoFsyncPartition` partitions."""

    partition_class = NoFsyncPartition
    journal_capable = False  # the node journal's fdatasync would make the appends durable after all


def _no_fsync_layout(config: StorageNodeConfig, options: None) -> NoFsyncLayout:
    return NoFsyncLayout(config.directory, segment_size_threshold=config.segment_size_threshold,
                         segment_cache_capacity=config.segment_cache_capacity,
                         index_checkpoint_interval=config.index_checkpoint_interval)


def _one_ack(replicas: int) -> int:
    return 1


class NoLockCheck:
    """Plugin: registers the lock table ``unsafe-no-lock-check``."""

    WALTZ_UNSAFE: ClassVar[str] = (f"lock table {NO_LOCK_CHECK!r} never reports a lock conflict: where "
                                   "[server] lock_table names it, transactions commit on stale reads")

    @hookimpl
    def waltz_register_lock_tables(self, registry: Registry[LockTableFactory]) -> None:
        def factory(config: ServerConfig, options: None) -> NoLockCheckTable:
            return NoLockCheckTable(config.lock_table_size, config.lock_hash_count)

        registry.add(NO_LOCK_CHECK, factory, description="UNSAFE negative control: hashed without the lock check")


class NoFsync:
    """Plugin: registers the storage layout ``unsafe-no-fsync``."""

    WALTZ_UNSAFE: ClassVar[str] = (f"storage layout {NO_FSYNC!r} does not fdatasync appends: where [storage] "
                                   "layout names it, a power loss loses acknowledged records")

    @hookimpl
    def waltz_register_storage_layouts(self, registry: Registry[StorageLayoutFactory]) -> None:
        registry.add(NO_FSYNC, _no_fsync_layout, description="UNSAFE negative control: segmented without fdatasync")


class AckBeforeQuorum:
    """Plugin: a commit rule of one acknowledgement, whatever the number of replicas."""

    WALTZ_UNSAFE: ClassVar[str] = ("transactions commit on ONE replica's acknowledgement instead of a majority's: "
                                   "a replica failure can lose them")

    @hookimpl(tryfirst=True)
    def waltz_commit_quorum(self) -> Callable[[int], int]:
        return _one_ack


no_lock_check = NoLockCheck()
no_fsync = NoFsync()
ack_before_quorum = AckBeforeQuorum()

#: control name -> (plugin object name in this module, config variables that select its backend)
CONTROLS: dict[str, tuple[str, dict[str, str]]] = {
    "no-lock-check": ("no_lock_check", {"WALTZ_SERVER_LOCK_TABLE": NO_LOCK_CHECK}),
    "no-fsync": ("no_fsync", {"WALTZ_STORAGE_LAYOUT": NO_FSYNC}),
    "ack-before-quorum": ("ack_before_quorum", {}),
}


def environment(control: str) -> dict[str, str]:
    """Environment variables under which the processes a test starts run negative control
    ``control`` (a key of :data:`CONTROLS`): the plugin added to ``WALTZ_PLUGINS`` (after what the
    environment has already) and the config variable choosing its backend, if it has one."""
    try:
        attr, selection = CONTROLS[control]
    except KeyError:
        raise ValueError(f"unknown negative control {control!r}; known: {', '.join(CONTROLS)}") from None
    plugins = [p for p in os.environ.get("WALTZ_PLUGINS", "").split(",") if p.strip()]
    return {"WALTZ_PLUGINS": ",".join([*plugins, f"{__name__}:{attr}"]), **selection}
