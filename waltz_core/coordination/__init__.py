"""Coordination: the backend protocol (:mod:`.base`), the built-in ``local`` backend and the recipes.

Recipes (:mod:`.recipes`: cluster params, membership and partition assignment, store metadata,
id counters) are written once against :class:`~.base.CoordinationBackend`, so every backend
(``local``, ``zookeeper``, ``etcd``) behaves the same.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config import CoordinationConfig, backend_options
from .base import CoordinationBackend, SessionState, Versioned, WatchHandle

if TYPE_CHECKING:
    from ..plugins import Registries


def open_coordination(config: CoordinationConfig, registries: Registries) -> CoordinationBackend:
    """Resolve ``config.name`` in the ``coordination`` registry of ``registries`` (the process's
    runtime's) and build the backend, unstarted.

    The backend's options come from ``[coordination.<name>]`` validated by its ``config_cls``.
    Raises :class:`~waltz_core.errors.BackendNotFoundError` for an unknown name and
    :class:`~waltz_core.errors.ConfigError` for bad options. Does not block or connect: call
    ``await backend.start()`` on the event loop that will use it.
    """
    info = registries.coordination.get(config.name)
    return info.factory(config, backend_options(info.config_cls, config, "coordination"))


__all__ = ["CoordinationBackend", "SessionState", "Versioned", "WatchHandle", "open_coordination"]
