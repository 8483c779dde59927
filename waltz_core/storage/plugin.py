"""Built-in plugin for the storage package: the ``segmented`` and ``memory`` layouts and the ``storage``/``disk``
commands."""

from __future__ import annotations

from typing import Any

import click

from ..hookspecs import hookimpl


def _segmented(directory: str, config: Any = None) -> Any:
    from .segmented import segmented_factory

    return segmented_factory(directory, config)


def _memory(directory: str, config: Any = None) -> Any:
    from .memory import memory_factory

    return memory_factory(directory, config)


@hookimpl
def waltz_register_storage_layouts(registry: Any) -> None:
    registry.add("segmented", _segmented,
                 description="the seed's layout: control file, .seq data + .idx index segments, group commit")
    registry.add("memory", _memory,
                 description="in process memory, for application tests: nothing on disk, no durability")


@hookimpl
def waltz_add_commands(cli: click.Group) -> None:
    from .cli import disk_group, storage_group

    cli.add_command(storage_group)
    cli.add_command(disk_group)
