"""Waltz: a distributed, replicated, partitioned write-ahead log with optimistic locking.

The core holds the hook specifications, the plugin manager, configuration, errors, the sans-IO
protocol and the transport seam; backends (transports, coordination, storage layouts, lock
tables, sinks) are plugins, the built-in ones registered like any other.
"""

from __future__ import annotations

from .hookspecs import NAME, hookimpl, hookspec
from .plugins import core_version, get_plugin_manager, load_registries

__version__ = core_version()

__all__ = ["NAME", "__version__", "get_plugin_manager", "hookimpl", "hookspec", "load_registries"]
