"""Built-in plugin for the locks package: registers the ``hashed`` and ``exact`` lock tables."""

from __future__ import annotations

from typing import Any

from ..hookspecs import hookimpl
from .exact import ExactLockTable, ExactOptions
from .hashed import HashedLockTable, HashedOptions


@hookimpl
def waltz_register_lock_tables(registry: Any) -> None:
    registry.add("hashed", HashedLockTable.from_options, config_cls=HashedOptions,
                 description="L x N array of high-water marks (fixed memory; false conflicts possible)")
    registry.add("exact", ExactLockTable.from_options, config_cls=ExactOptions,
                 description="last commit per lock in a dict (exact; memory grows with locks)")
