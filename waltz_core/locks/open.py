"""Opening a partition's lock table from the server configuration."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config import backend_options

if TYPE_CHECKING:
    from ..config import ServerConfig
    from ..plugins import Registries
    from .base import LockTable


def open_lock_table(server: ServerConfig, high_water_mark: int, registries: Registries) -> LockTable:
    """A new lock table for one partition, of the strategy ``server.lock_table`` in ``registries``
    (the server's runtime's), every lock's estimate starting at ``high_water_mark``.

    The factory builds the table from ``[server]`` and its ``[server.<lock_table>]`` options
    (``factory(config, options)``, nothing committed); the table is then reset to the partition's
    high-water mark. Resolve once per partition open, never per append.
    """
    info = registries.lock_table.get(server.lock_table)
    table = info.factory(server, backend_options(info.config_cls, server, "lock_table"))
    table.reset(high_water_mark)
    return table
