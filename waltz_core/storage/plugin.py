"""Built-in plugin for the storage package: the ``segmented`` and ``memory`` layouts and the ``storage``/``disk``
commands."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from ..hookspecs import hookimpl

if TYPE_CHECKING:
    from ..config import StorageNodeConfig
    from ..registry import Registry, StorageLayoutFactory
    from .memory import MemoryLayout
    from .segmented import SegmentedLayout


def _segmented(config: StorageNodeConfig, options: None) -> SegmentedLayout:
    from .segmented import segmented_factory  # imported when used: `waltz --help` stays fast

    return segmented_factory(config, options)


def _memory(config: StorageNodeConfig, options: None) -> MemoryLayout:
    from .memory import memory_factory

    return memory_factory(config, options)


@hookimpl
def waltz_register_storage_layouts(registry: Registry[StorageLayoutFactory]) -> None:
    registry.add("segmented", _segmented,
                 description="the seed's layout: control file, .seq data + .idx index segments, group commit")
    registry.add("memory", _memory,
                 description="in process memory, for application tests: nothing on disk, no durability")


@hookimpl
def waltz_add_commands(cli: click.Group) -> None:
    from .cli import disk_group, storage_group

    cli.add_command(storage_group)
    cli.add_command(disk_group)
