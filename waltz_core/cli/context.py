"""The runtime of a ``waltz`` command, handed to every command through the click context.

:func:`waltz_core.cli.main.build_cli` builds the group with its runtime as the context object,
so any command (a plugin's too) reaches the plugin manager and registries of the invocation
with :func:`current_runtime`, and passes them down to what it starts: never a process global.
"""

from __future__ import annotations

import click

from ..runtime import Runtime


def current_runtime() -> Runtime:
    """The runtime of the running ``waltz`` command (call it inside a command's callback)."""
    ctx = click.get_current_context()
    runtime = ctx.find_object(Runtime)
    if runtime is None:  # a command invoked outside build_cli's group: a bug of its caller
        raise RuntimeError(f"command {ctx.info_name!r} runs without a Waltz runtime; build the group "
                           "with waltz_core.cli.main.build_cli(runtime)")
    return runtime
