"""Entry-point plugin module: registers the ``etcd`` coordination backend."""

from __future__ import annotations

from typing import TYPE_CHECKING

from waltz_core import hookimpl
from waltz_core.config import CoordinationConfig
from waltz_core.registry import CoordinationFactory, Registry

from .options import EtcdOptions

if TYPE_CHECKING:
    from .backend import EtcdBackend


def etcd_factory(config: CoordinationConfig, options: EtcdOptions | None) -> EtcdBackend:
    """A not yet started :class:`~waltz_coord_etcd.backend.EtcdBackend` for ``config``.

    Imports grpc/pyetcd only here, so ``waltz --help`` and plugin listing stay fast.
    """
    from .backend import EtcdBackend

    return EtcdBackend(config.connect, session_timeout=config.session_timeout, options=options)


@hookimpl
def waltz_register_coordination_backends(registry: Registry[CoordinationFactory]) -> None:
    registry.add("etcd", etcd_factory, config_cls=EtcdOptions,
                 description="etcd v3 via etcd-sdk-python: leases, mod_revision CAS, multi-endpoint failover")
