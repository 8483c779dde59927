"""Command-line parameter parsing shared by every ``waltz`` command group."""

from __future__ import annotations

import click


def partition_ids(text: str) -> list[int]:
    """``"0-3,7"`` -> ``[0, 1, 2, 3, 7]``; a bad value is a click usage error naming it."""
    from ..coordination.metadata import parse_partition_ranges

    try:
        return parse_partition_ranges(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def partition_ids_callback(_ctx: click.Context, _param: click.Parameter, value: str | None) -> list[int] | None:
    """``click.option(..., callback=partition_ids_callback)``: parse partition ranges at parse time."""
    return None if value is None else partition_ids(value)
