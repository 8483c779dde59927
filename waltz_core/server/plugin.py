"""Built-in plugin of the server package: the ``waltz server`` commands."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

import click

from ..cli.context import current_runtime
from ..cli.logs import log_format_option
from ..cli.output import console, echo_json, json_option, refused_flag
from ..hookspecs import hookimpl

if TYPE_CHECKING:
    from ..coordination.base import CoordinationBackend
    from ..transport.base import Transport

T = TypeVar("T")


@click.group("server")
def server_group() -> None:
    """Run a Waltz server and talk to running ones."""


@server_group.command("start")
@click.option("-c", "--config", "config_path", type=click.Path(dir_okay=False),
              help="server.toml (see `waltz config schema server`).")
@click.option("--port", type=int, help="Override server.port.")
@click.option("--http-port", type=int, help="Override http.port (0 disables HTTP).")
@click.option("--insecure", is_flag=True, default=None,
              help="Allow plaintext links on an address other than loopback (security.insecure; docs/security.md).")
@log_format_option
def start(config_path: str | None, port: int | None, http_port: int | None, insecure: bool | None) -> None:
    """Start a server in the foreground; Ctrl-C / SIGTERM stops it cleanly.

    It listens in plaintext only on loopback, unless --insecure: elsewhere configure TLS."""
    import asyncio
    import signal

    from ..config import ServerProcessConfig, load
    from ..eventloop import run
    from .server import run_server

    overrides: dict[str, dict[str, object]] = {}
    if port is not None:
        overrides.setdefault("server", {})["port"] = port
    if http_port is not None:
        overrides.setdefault("http", {})["port"] = http_port
    if insecure:
        overrides.setdefault("security", {})["insecure"] = True
    runtime = current_runtime()
    config = load(ServerProcessConfig, config_path, overrides=overrides,
                  override_sources={"server.port": "--port", "http.port": "--http-port",
                                    "security.insecure": "--insecure"}, registries=runtime.registries)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await run_server(config, stop, runtime)

    run(main(), config.process.event_loop)


def _admin_call(server: str, config_path: str | None, call: str, *args: object) -> object:
    import asyncio

    from ..config import CliConfig, load
    from ..transport import open_transport
    from .admin_client import ServerAdminClient

    registries = current_runtime().registries
    config = load(CliConfig, config_path, registries=registries)

    async def run() -> object:
        transport = open_transport(config.transport, registries)
        client = await ServerAdminClient.connect(transport, server)
        try:
            return await getattr(client, call)(*args)
        finally:
            await client.close()
            await transport.aclose()

    return asyncio.run(run())


@server_group.command("add-preferred-partition")
@click.option("-s", "--server", required=True, help="Server address host:port.")
@click.option("-p", "--partition", "partitions", required=True, help="Partition ids or ranges, e.g. 0-3,7.")
@click.option("-c", "--config", "config_path", type=click.Path(dir_okay=False), help="cli.toml (transport settings).")
def add_preferred(server: str, partitions: str, config_path: str | None) -> None:
    """Ask a server to prefer partitions (the cluster manager assigns them to it first)."""
    from ..cli.params import partition_ids

    ok = _admin_call(server, config_path, "add_preferred_partitions", partition_ids(partitions))
    click.echo("preferred partitions added" if ok else "refused: a partition id is out of range")
    if not ok:
        raise SystemExit(1)


@server_group.command("remove-preferred-partition")
@click.option("-s", "--server", required=True, help="Server address host:port.")
@click.option("-p", "--partition", "partitions", required=True, help="Partition ids or ranges, e.g. 0-3,7.")
@click.option("-c", "--config", "config_path", type=click.Path(dir_okay=False), help="cli.toml (transport settings).")
def remove_preferred(server: str, partitions: str, config_path: str | None) -> None:
    """Remove partitions from a server's preferred list."""
    from ..cli.params import partition_ids

    ok = _admin_call(server, config_path, "remove_preferred_partitions", partition_ids(partitions))
    click.echo("preferred partitions removed" if ok else "refused: a partition id is out of range")
    if not ok:
        raise SystemExit(1)


@server_group.command("partitions")
@click.option("-s", "--server", required=True, help="Server address host:port.")
@click.option("-c", "--config", "config_path", type=click.Path(dir_okay=False), help="cli.toml (transport settings).")
@json_option
def partitions(server: str, config_path: str | None, as_json: bool) -> None:
    """Show the partitions a server owns and whether each is healthy."""
    from rich.table import Table

    health = _admin_call(server, config_path, "partition_health")
    if as_json:
        echo_json({"server": server, "partitions": [{"partition": pid, "healthy": ok}
                                                    for pid, ok in sorted(health.items())]})  # type: ignore[attr-defined]
        return
    table = Table(title=f"partitions of {server}", title_justify="left")
    table.add_column("partition", justify="right")
    table.add_column("healthy")
    for pid, ok in sorted(health.items()):  # type: ignore[attr-defined]
        table.add_row(str(pid), "yes" if ok else "NO")
    console().print(table)


def _cluster_call(config_path: str | None, backend_name: str | None, connect: str | None, root: str | None,
                  session_timeout: float | None,
                  body: Callable[[CoordinationBackend, str, Transport], Awaitable[T]]) -> T:
    """Open coordination and transport from the CLI options, run ``body(backend, root, transport)``."""
    import asyncio

    from ..coordination import open_coordination
    from ..coordination.plugin import _load_config
    from ..transport import open_transport

    config = _load_config(config_path, backend_name, connect, root, session_timeout)
    registries = current_runtime().registries

    async def run() -> T:
        backend = open_coordination(config.coordination, registries)
        await backend.start()
        transport = open_transport(config.transport, registries)
        try:
            return await body(backend, config.coordination.root, transport)
        finally:
            await transport.aclose()
            await backend.close()

    return asyncio.run(run())


def _cluster_commands() -> list[click.Command]:
    from ..coordination.plugin import _coordination_options

    @click.command("check-connectivity")
    @_coordination_options
    @json_option
    def check_connectivity(config_path: str | None, backend_name: str | None, connect: str | None, root: str | None,
                           session_timeout: float | None, as_json: bool) -> None:
        """Ask every live server whether it reaches every storage node; exit status 1 if one does not."""
        from .verify import check_connectivity as check

        result = _cluster_call(config_path, backend_name, connect, root, session_timeout,
                               lambda b, r, t: check(b, r, t))
        if as_json:
            echo_json({"servers": {server: statuses for server, statuses in result.items()}})
            if any(st is None or not all(st.values()) for st in result.values()):
                raise SystemExit(1)
            return
        bad = False
        for server, statuses in sorted(result.items()):
            if statuses is None:
                click.echo(f"Connectivity status of {server} is: UNREACHABLE")
                bad = True
                continue
            text = ", ".join(f"{s}: {'ok' if ok else 'UNREACHABLE'}" for s, ok in sorted(statuses.items()))
            click.echo(f"Connectivity status of {server} is: {text or 'no storage nodes'}")
            bad = bad or not all(statuses.values())
        if not result:
            click.echo("no live servers")
        if bad:
            raise SystemExit(1)

    @click.command("verify")
    @_coordination_options
    @click.option("-p", "--partition", "partitions", help="Partition ids or ranges (default: all).")
    @click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True,
                  help="Seconds per RPC.")
    @refused_flag("-t", instead="in every command -t is a transaction id; write --timeout SECONDS")
    @json_option
    def verify_command(config_path: str | None, backend_name: str | None, connect: str | None, root: str | None,
                       session_timeout: float | None, partitions: str | None, timeout: float, as_json: bool) -> None:
        """Check assignment, server/storage consistency, quorum, recovery and health of every partition."""
        from rich.table import Table

        from ..cli.params import partition_ids
        from .verify import verify

        ids = partition_ids(partitions) if partitions else None
        checks = _cluster_call(config_path, backend_name, connect, root, session_timeout,
                               lambda b, r, t: verify(b, r, t, ids, timeout))
        if as_json:
            failed = [c for c in checks if not c.ok]
            echo_json({"checks": [{"partition": c.partition, "check": c.name, "ok": c.ok, "detail": c.detail}
                                  for c in checks],
                       "passed": len(checks) - len(failed), "failed": len(failed)})
            if failed:
                raise SystemExit(1)
            return
        table = Table(title="cluster verification", title_justify="left")
        for col in ("partition", "check", "result", "detail"):
            table.add_column(col)
        n_failed = 0
        for c in checks:
            n_failed += not c.ok
            table.add_row(str(c.partition), c.name, "ok" if c.ok else "[red]FAILED[/red]", c.detail)
        console().print(table)
        click.echo(f"{len(checks) - n_failed} of {len(checks)} checks passed")
        if n_failed:
            raise SystemExit(1)

    return [check_connectivity, verify_command]


@hookimpl(trylast=True)  # after the coordination plugin added `waltz cluster` (pluggy calls LIFO otherwise)
def waltz_add_commands(cli: click.Group) -> None:
    cli.add_command(server_group)
    cluster = cli.commands.get("cluster")
    if isinstance(cluster, click.Group):  # the coordination plugin's `waltz cluster`
        for command in _cluster_commands():
            cluster.add_command(command)

