"""Built-in plugin: registers the in-memory transport."""

from __future__ import annotations

from ..config import TransportConfig
from ..hookspecs import hookimpl
from ..registry import Registry, TransportFactory
from .memory import MemoryOptions, MemoryTransport


def _memory_factory(config: TransportConfig, options: MemoryOptions | None) -> MemoryTransport:
    return MemoryTransport(config.max_frame_size, options)


@hookimpl
def waltz_register_transports(registry: Registry[TransportFactory]) -> None:
    registry.add("memory", _memory_factory, config_cls=MemoryOptions,
                 description="in-process queues, for tests (one event loop)")
