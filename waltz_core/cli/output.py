"""How every ``waltz`` command prints: tables for people, JSON for scripts, nothing cut when piped.

* :func:`console` - a rich console; when stdout is not a terminal (a pipe, a file) it renders at
  the content's natural width, so ``waltz plugins | grep tcp`` sees whole rows (rich would wrap
  at 80 columns) and no colour codes;
* :func:`echo_json` - one JSON document on stdout (``--json`` of every inspection command);
* :data:`json_option` - that flag, spelt the same everywhere;
* :func:`refused_flag` - an old flag that now means something else elsewhere: one line that
  says what to use instead.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import click

#: Width for output that goes to a pipe or a file: tables keep their natural width, never wrap.
_UNBOUNDED = 100_000


def console(*, stderr: bool = False) -> Any:
    """A rich Console for this command's output (see the module docstring)."""
    from rich.console import Console

    probe = Console(stderr=stderr)
    if probe.is_terminal:
        return Console(stderr=stderr, soft_wrap=True)
    return Console(stderr=stderr, width=_UNBOUNDED, soft_wrap=True, no_color=True, highlight=False)


def echo_json(value: Any) -> None:
    """Print one JSON document (sorted keys, indented) on stdout."""
    click.echo(json.dumps(value, indent=2, sort_keys=True, default=str))


json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of a table.")


def refused_flag(*decls: str, instead: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A hidden option that exists only to say what replaced it (exit status 2, one line)."""

    def refuse(ctx: click.Context, param: click.Parameter, value: Any) -> None:
        if value is not None:
            raise click.UsageError(f"{'/'.join(decls)} is not accepted here: {instead}", ctx=ctx)

    return click.option(*decls, hidden=True, expose_value=False, callback=refuse, is_eager=True)
