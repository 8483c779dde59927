"""Built-in plugin for the locks package: registers the ``hashed`` and ``exact`` lock tables."""

from __future__ import annotations

from ..hookspecs import hookimpl
from ..registry import LockTableFactory, Registry
from .exact import ExactLockTable
from .hashed import HashedLockTable


@hookimpl
def waltz_register_lock_tables(registry: Registry[LockTableFactory]) -> None:
    registry.add("hashed", HashedLockTable.from_config,
                 description="L x N array of high-water marks (fixed memory; false conflicts possible)")
    registry.add("exact", ExactLockTable.from_config,
                 description="last commit per lock in a dict (exact; memory grows with locks)")
