"""Entry-point plugin module: registers the ``zookeeper`` coordination backend."""

from __future__ import annotations

from typing import TYPE_CHECKING

from waltz_core import hookimpl
from waltz_core.config import CoordinationConfig
from waltz_core.registry import CoordinationFactory, Registry

from .options import ZooKeeperOptions

if TYPE_CHECKING:
    from .backend import ZooKeeperBackend


def zookeeper_factory(config: CoordinationConfig, options: ZooKeeperOptions | None) -> ZooKeeperBackend:
    """A not yet started :class:`~waltz_coord_zookeeper.backend.ZooKeeperBackend` for ``config``.

    Imports kazoo only here, so ``waltz --help`` and plugin listing stay fast.
    """
    from .backend import ZooKeeperBackend

    return ZooKeeperBackend(config.connect, session_timeout=config.session_timeout, options=options)


@hookimpl
def waltz_register_coordination_backends(registry: Registry[CoordinationFactory]) -> None:
    registry.add("zookeeper", zookeeper_factory, config_cls=ZooKeeperOptions,
                 description="Apache ZooKeeper ensemble via kazoo (the original Waltz's coordination)")
