"""Opening a partition's lock table from the server configuration."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..config import ServerConfig
    from ..plugins import Registries
    from .base import LockTable

#: Option field of a strategy's config class -> the ``[server]`` key that fills it.
SERVER_KEYS = {"size": "lock_table_size", "hash_count": "lock_hash_count"}


def lock_table_options(config_cls: type | None, server: ServerConfig) -> Any:
    """Build a strategy's options from ``[server]``: its fields named ``size`` / ``hash_count``
    take ``lock_table_size`` / ``lock_hash_count``; other fields keep their defaults."""
    if config_cls is None:
        return None
    names = {f.name for f in attrs.fields(config_cls)}
    kwargs = {field: getattr(server, key) for field, key in SERVER_KEYS.items() if field in names}
    try:
        return config_cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"server.lock_table {server.lock_table!r}: {exc}") from exc


def open_lock_table(server: ServerConfig, high_water_mark: int, registries: Registries | None = None) -> LockTable:
    """A new lock table for one partition, of the strategy ``server.lock_table``, every lock's
    estimate starting at ``high_water_mark``. Resolve once per partition open, never per append."""
    if registries is None:
        from ..plugins import default_registries

        registries = default_registries()
    info = registries.resolve("lock_table", server.lock_table)
    table: LockTable = info.factory(lock_table_options(info.config_cls, server), high_water_mark)
    return table
