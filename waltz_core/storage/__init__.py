"""Storage: the storage node, its process and tools, and the layouts that keep its files.

A node touches its files only through a :class:`~waltz_core.storage.layout.StorageLayout`,
built by name (``[storage] layout``) from the registries of the process's runtime with
:func:`open_layout`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import StorageNodeConfig
    from ..plugins import Registries
    from .layout import StorageLayout


def open_layout(config: StorageNodeConfig, registries: Registries) -> StorageLayout:
    """Resolve ``config.layout`` in ``registries`` and build the layout on ``config.directory``
    with its validated ``[storage.<layout>]`` options, unopened (call ``open(cluster_key, n)``)."""
    from ..config import backend_options  # the package stays light to import: offline tools load it

    info = registries.storage_layout.get(config.layout)
    return info.factory(config, backend_options(info.config_cls, config, "storage_layout"))


__all__ = ["open_layout"]
