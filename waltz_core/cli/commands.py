"""Built-in plugin: the core commands ``waltz plugins`` and ``waltz config schema``."""

from __future__ import annotations

import click

from ..hookspecs import hookimpl


@click.command("plugins")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def plugins_command(as_json: bool) -> None:
    """List every plugin and every backend it registered, with distribution and version."""
    import json

    from rich.console import Console
    from rich.table import Table

    from ..plugins import load_registries, plugin_distribution
    from ..plugins import get_plugin_manager

    pm = get_plugin_manager()
    regs = load_registries(pm)
    plugins = sorted(((name, plugin_distribution(pm, plug)) for name, plug in pm.list_name_plugin() if plug is not None))
    if as_json:
        click.echo(json.dumps({
            "plugins": [{"name": n, "distribution": d} for n, d in plugins],
            "backends": [{"kind": b.kind, "name": b.name, "plugin": b.plugin, "distribution": b.distribution,
                          "description": b.description} for b in regs.all()],
        }, indent=2))
        return
    console = Console()
    table = Table(title="Backends", title_justify="left")
    for col in ("kind", "name", "distribution", "plugin", "description"):
        table.add_column(col)
    for b in regs.all():
        table.add_row(b.kind, b.name, b.distribution, b.plugin, b.description)
    console.print(table)
    ptable = Table(title="Plugins", title_justify="left")
    ptable.add_column("plugin")
    ptable.add_column("distribution")
    for name, dist in plugins:
        ptable.add_row(name, dist)
    console.print(ptable)


@click.group("config")
def config_group() -> None:
    """Configuration tools."""


@config_group.command("schema")
@click.argument("process", required=False, type=click.Choice(["server", "storage", "client", "cli"]))
@click.option("--markdown", is_flag=True, help="Print a Markdown reference (docs/configuration.md is generated with it).")
def config_schema(process: str | None, markdown: bool) -> None:
    """Print every configuration key with its type, default and documentation."""
    from ..config import PROCESS_CONFIGS

    names = [process] if process else list(PROCESS_CONFIGS)
    click.echo(render_schema(names, markdown))


def render_schema(names: list[str], markdown: bool) -> str:
    from ..config import PROCESS_CONFIGS, schema
    from ..plugins import default_registries

    lines: list[str] = []
    for name in names:
        entries = schema(PROCESS_CONFIGS[name])
        if markdown:
            lines += [f"## `{name}` process", "", "| key | type | default | description |", "|---|---|---|---|"]
            lines += [f"| `{e.key}` | {e.type} | `{e.default}` | {e.doc} |" for e in entries]
            lines.append("")
        else:
            lines.append(f"[{name}]")
            width = max(len(e.key) for e in entries)
            lines += [f"  {e.key:<{width}}  {e.type:<10} default {e.default:<12} {e.doc}" for e in entries]
            lines.append("")
    regs = default_registries()
    backend_lines: list[str] = []
    for info in regs.all():
        if info.config_cls is None:
            continue
        section = {"transport": "transport", "coordination": "coordination"}.get(info.kind, info.kind)
        entries = schema(info.config_cls)
        if not entries:
            continue
        if markdown:
            backend_lines += [f"### `[{section}.{info.name}]` ({info.distribution})", "",
                              "| key | type | default | description |", "|---|---|---|---|"]
            backend_lines += [f"| `{e.key}` | {e.type} | `{e.default}` | {e.doc} |" for e in entries]
            backend_lines.append("")
        else:
            backend_lines.append(f"[{section}.{info.name}]  ({info.distribution})")
            width = max(len(e.key) for e in entries)
            backend_lines += [f"  {e.key:<{width}}  {e.type:<10} default {e.default:<12} {e.doc}" for e in entries]
            backend_lines.append("")
    if backend_lines:
        lines += (["## Backend options", ""] if markdown else ["# backend options"]) + backend_lines
    return "\n".join(lines)


@hookimpl
def waltz_add_commands(cli: click.Group) -> None:
    cli.add_command(plugins_command)
    cli.add_command(config_group)
