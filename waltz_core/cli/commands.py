"""Built-in plugin: the core commands ``waltz plugins`` and ``waltz config schema|check|show``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from ..hookspecs import hookimpl
from .context import current_runtime
from .output import console, echo_json, json_option

if TYPE_CHECKING:
    from ..plugins import Registries


@click.command("plugins")
@json_option
def plugins_command(as_json: bool) -> None:
    """List every plugin and every backend it registered, with distribution and version."""
    from rich.markup import escape
    from rich.table import Table

    from ..plugins import plugin_distribution

    runtime = current_runtime()
    pm, regs = runtime.plugin_manager, runtime.registries
    plugins = sorted(((name, plugin_distribution(pm, plug)) for name, plug in pm.list_name_plugin() if plug is not None))
    if as_json:
        echo_json({
            "plugins": [{"name": n, "distribution": d, **({"unsafe": runtime.unsafe[n]} if n in runtime.unsafe else {})}
                        for n, d in plugins],
            "backends": [{"kind": b.kind, "name": b.name, "plugin": b.plugin, "distribution": b.distribution,
                          "description": b.description} for b in regs.all()],
        })
        return
    out = console()
    table = Table(title="Backends", title_justify="left")
    for col in ("kind", "name", "distribution", "plugin", "description"):
        table.add_column(col)
    for b in regs.all():
        table.add_row(*(escape(text) for text in (b.kind, b.name, b.distribution, b.plugin, b.description)))
    out.print(table)
    ptable = Table(title="Plugins", title_justify="left")
    ptable.add_column("plugin")
    ptable.add_column("distribution")
    for name, dist in plugins:
        unsafe = runtime.unsafe.get(name)
        ptable.add_row(escape(name), escape(dist) + (f" [bold red]UNSAFE: {escape(unsafe)}[/]" if unsafe else ""))
    out.print(ptable)


@click.group("config")
def config_group() -> None:
    """Configuration tools: the schema, check a file, show the effective configuration."""


_PROCESSES = click.Choice(["server", "storage", "client", "cli"])


@config_group.command("schema")
@click.argument("process", required=False, type=_PROCESSES)
@click.option("--markdown", is_flag=True, help="Print a Markdown reference (docs/configuration.md is generated with it).")
@json_option
def config_schema(process: str | None, markdown: bool, as_json: bool) -> None:
    """Print every configuration key with its type, default and documentation."""
    from ..config import PROCESS_CONFIGS, schema

    names = [process] if process else list(PROCESS_CONFIGS)
    if as_json:
        echo_json({name: [{"key": e.key, "type": e.type, "default": e.default, "doc": e.doc}
                          for e in schema(PROCESS_CONFIGS[name])] for name in names})
        return
    click.echo(render_schema(names, markdown, current_runtime().registries))


def _process_of(path: str | None, process: str | None) -> str:
    """The process a config file is for: given, or told by its sections."""
    import tomllib

    from ..errors import ConfigError

    if process is not None or path is None:
        return process or "cli"
    try:
        with open(path, "rb") as fh:
            sections = set(tomllib.load(fh))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a config file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not valid TOML: not UTF-8 text") from None
    kinds = sorted(sections & {"server", "storage", "client"})
    if len(kinds) > 1:
        raise ConfigError(f"{path}: has sections of several processes ({', '.join('[' + k + ']' for k in kinds)}); "
                          "say which with --process")
    return kinds[0] if kinds else "cli"


@config_group.command("check")
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--process", type=_PROCESSES, help="The process the file is for (default: told by its sections).")
def config_check(path: str, process: str | None) -> None:
    """Check a configuration file as the process would load it (keys, values, backend names and
    option tables, and the WALTZ_* environment); exit status 1 with one line on the first problem."""
    from ..config import PROCESS_CONFIGS, load

    kind = _process_of(path, process)
    load(PROCESS_CONFIGS[kind], path, registries=current_runtime().registries)
    click.echo(f"{path}: a valid {kind} configuration")


@config_group.command("show")
@click.option("-c", "--config", "config_path", type=click.Path(dir_okay=False), help="The configuration file.")
@click.option("--process", type=_PROCESSES, help="The process (default: told by the file's sections, else cli).")
@json_option
def config_show(config_path: str | None, process: str | None, as_json: bool) -> None:
    """Print the effective configuration - defaults, the file, WALTZ_* variables - and where each
    value came from."""
    from rich.table import Table

    from ..config import PROCESS_CONFIGS, effective_values, load_with_sources

    kind = _process_of(config_path, process)
    registries = current_runtime().registries
    loaded = load_with_sources(PROCESS_CONFIGS[kind], config_path, registries=registries)
    rows = effective_values(loaded, registries)
    if as_json:
        echo_json({"process": kind, "file": config_path,
                   "keys": [{"key": k, "value": v, "source": src} for k, v, src in rows]})
        return
    table = Table(title=f"{kind} configuration" + (f" ({config_path})" if config_path else ""), title_justify="left")
    for col in ("key", "value", "source"):
        table.add_column(col)
    for k, v, src in rows:
        table.add_row(k, repr(v), src)
    console().print(table)


def render_schema(names: list[str], markdown: bool, registries: Registries) -> str:
    """The keys of the ``names`` processes, then the option tables of every backend in ``registries``."""
    from ..config import BACKEND_SECTIONS, PROCESS_CONFIGS, schema

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
    backend_lines: list[str] = []
    for info in registries.all():
        if info.config_cls is None:
            continue
        section = BACKEND_SECTIONS[info.kind][0]
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
def waltz_process_started() -> None:
    """A server or storage node the CLI started is serving: the start-up settings that wait for
    that moment (:mod:`.process`: ``gc.freeze()``); nothing in a process the CLI did not start."""
    from .process import started

    started()


@hookimpl
def waltz_add_commands(cli: click.Group) -> None:
    cli.add_command(plugins_command)
    cli.add_command(config_group)
