"""Built-in plugin for the coordination package: the ``local`` backend and ``waltz cluster ...`` commands.

The commands work with any registered backend by name (``--coordination zookeeper --connect
127.0.0.1:2181 --root /waltz``) or with a ``--config cli.toml`` (:class:`waltz_core.config.CliConfig`);
command-line options override the file. Failures are :class:`~waltz_core.errors.WaltzError`\\ s,
which ``waltz`` prints as one line (exit status 1).
"""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

from ..cli.context import current_runtime
from ..cli.output import json_option, refused_flag
from ..cli.params import partition_ids_callback
from ..config import CoordinationConfig
from ..hookspecs import hookimpl

if TYPE_CHECKING:
    from ..config import CliConfig
    from ..registry import CoordinationFactory, Registry
    from .base import CoordinationBackend
    from .local import LocalCoordination, LocalOptions

T = TypeVar("T")


def _local_factory(config: CoordinationConfig, options: LocalOptions | None) -> LocalCoordination:
    from .local import LocalCoordination

    return LocalCoordination(config, options)


@hookimpl
def waltz_register_coordination_backends(registry: Registry[CoordinationFactory]) -> None:
    from .local import LocalOptions

    registry.add("local", _local_factory, config_cls=LocalOptions,
                 description="embedded SQLite file with leases and polling watches; one host only, no server")


# --------------------------------------------------------------------------------------- CLI


def _coordination_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    options = [
        click.option("-c", "--config", "config_path", type=click.Path(dir_okay=False),
                     help="A CLI config file (TOML, [coordination] table; a client's or a node's config works too); "
                          "options below override it."),
        click.option("--coordination", "backend_name", metavar="NAME",
                     help="Coordination backend: local, zookeeper, etcd or a plugin's (default: local)."),
        click.option("--connect", metavar="CONNECT",
                     help="Backend connect string (zookeeper/etcd: host:port,...; local: a directory)."),
        click.option("--root", metavar="PATH", help="Cluster root (default: /waltz)."),
        click.option("--session-timeout", type=float, metavar="SECONDS", help="Session/lease timeout."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _load_config(config_path: str | None, backend_name: str | None, connect: str | None, root: str | None,
                 session_timeout: float | None) -> CliConfig:
    from ..config import CliConfig, load

    overrides = {k: v for k, v in (("name", backend_name), ("connect", connect), ("root", root),
                                   ("session_timeout", session_timeout)) if v is not None}
    return load(CliConfig, config_path, overrides={"coordination": overrides} if overrides else None,
                override_sources={"coordination.name": "--coordination", "coordination.connect": "--connect",
                                  "coordination.root": "--root", "coordination.session_timeout": "--session-timeout"},
                registries=current_runtime().registries)


#: A connect string of host:port pairs, which the local backend would take for a directory's name.
_HOST_PORT = r"(?:https?://)?[\w.\-\[\]:]*:\d+/?"
_HOST_PORTS = re.compile(rf"{_HOST_PORT}(?:,{_HOST_PORT})*")


def _check_local_directory(config: CoordinationConfig, *, creates: bool) -> None:
    """The local backend's connect string is a directory, which opening the backend creates. A
    command given a directory that does not exist stops here instead: a host:port meant for
    ZooKeeper or etcd is a ConfigError, and a command that only reads says there is no cluster,
    without leaving an empty directory behind."""
    if config.name != "local":
        return
    from ..errors import ClusterNotFoundError, ConfigError
    from .local import local_directory

    directory = local_directory(config)
    if directory.exists():
        return
    if _HOST_PORTS.fullmatch(config.connect):
        raise ConfigError(f"coordination connect string {config.connect!r} looks like host:port, but the backend is "
                          f"local, whose connect string is a directory; for a ZooKeeper or etcd service give "
                          f"--coordination zookeeper or etcd (or [coordination] name), for a directory of that "
                          f"name create it first")
    if not creates:
        raise ClusterNotFoundError(f"no Waltz cluster under {config.root} in the local coordination backend: "
                                   f"its directory {directory} does not exist")


def _with_backend(body: Callable[..., Awaitable[T]]) -> Callable[..., T]:
    """Turn ``async body(backend, root, **kw)`` into a click callback that opens and closes the backend."""
    return _backend_command(body, creates=False)


def _with_new_backend(body: Callable[..., Awaitable[T]]) -> Callable[..., T]:
    """:func:`_with_backend` for a command that may create the local backend's directory."""
    return _backend_command(body, creates=True)


def _backend_command(body: Callable[..., Awaitable[T]], *, creates: bool) -> Callable[..., T]:

    @_coordination_options
    @functools.wraps(body)
    def callback(config_path: str | None, backend_name: str | None, connect: str | None, root: str | None,
                 session_timeout: float | None, **kwargs: Any) -> T:
        from . import open_coordination
        from .recipes import Paths

        config = _load_config(config_path, backend_name, connect, root, session_timeout).coordination
        Paths(config.root)  # a malformed root is a ConfigError before anything connects
        _check_local_directory(config, creates=creates)
        registries = current_runtime().registries

        async def run() -> T:
            backend: CoordinationBackend = open_coordination(config, registries)
            await backend.start()
            try:
                return await body(backend, config.root, **kwargs)
            finally:
                await backend.close()

        return asyncio.run(run())

    return callback


def _console() -> Any:
    from ..cli.output import console

    return console()


@click.group("cluster")
def cluster_group() -> None:
    """Cluster metadata in the coordination backend (create, list, storage nodes, replica assignment)."""


@cluster_group.command("create")
@click.option("-n", "--name", required=True, help="Cluster name.")
@click.option("--partitions", "num_partitions", type=click.IntRange(min=1), required=True, metavar="N",
              help="Number of partitions.")
@refused_flag("-p", instead="in every command -p/--partition is partition ids; give the count with --partitions N")
@_with_new_backend
async def create_command(backend: CoordinationBackend, root: str, name: str, num_partitions: int) -> None:
    """Create a cluster under the root with a fresh cluster key (fails if the root exists)."""
    from .recipes import create_cluster

    params = await create_cluster(backend, root, name, num_partitions)
    _console().print(f"created cluster [bold]{name}[/] under {root} ({backend.name}): "
                     f"{num_partitions} partitions, cluster key {params.cluster_key}")


@cluster_group.command("delete")
@click.option("-n", "--name", help="Cluster name (must match the stored one unless --force).")
@click.option("-f", "--force", is_flag=True, help="Delete whatever is under the root, whatever its name.")
@_with_backend
async def delete_command(backend: CoordinationBackend, root: str, name: str | None, force: bool) -> None:
    """Delete the cluster under the root (recursively)."""
    from .recipes import delete_cluster

    if name is None and not force:
        raise click.UsageError("give the cluster's --name, or --force")
    await delete_cluster(backend, root, name, force=force)
    _console().print(f"deleted cluster under {root}")


@cluster_group.command("show-key")
@_with_backend
async def show_key_command(backend: CoordinationBackend, root: str) -> None:
    """Print the cluster key (a UUID)."""
    from .recipes import StoreMetadata

    click.echo(str((await StoreMetadata(backend, root).get_store_params()).cluster_key))


@cluster_group.command("list")
@json_option
@_with_backend
async def list_command(backend: CoordinationBackend, root: str, as_json: bool) -> None:
    """Show the cluster: params, servers and partition assignment, storage nodes, partition metadata."""
    from .recipes import list_cluster

    listing = await list_cluster(backend, root)
    if as_json:
        from ..cli.output import echo_json

        echo_json(_listing_json(listing))
        return
    _print_listing(listing, backend.name)


def _listing_json(listing: Any) -> dict[str, Any]:
    return {
        "root": listing.root,
        "cluster": listing.cluster.to_json(),
        "store": listing.store.to_json() if listing.store else None,
        "servers": [s.to_json() for s in listing.servers],
        "assignment": listing.assignment.to_json() if listing.assignment else None,
        "replica_assignments": listing.replica_assignments,
        "groups": listing.groups,
        "connections": listing.connections,
        "partitions": {str(pid): meta.to_json() for pid, meta in listing.partitions.items()},
    }


def _print_listing(listing: Any, backend_name: str) -> None:
    from rich.table import Table

    from .metadata import UNRESOLVED, format_partition_ranges

    console = _console()
    params = Table(title=f"Cluster under {listing.root} ({backend_name})", title_justify="left", show_header=False)
    params.add_column("key")
    params.add_column("value")
    params.add_row("name", listing.cluster.name)
    params.add_row("partitions", str(listing.cluster.num_partitions))
    params.add_row("cluster key", str(listing.store.cluster_key) if listing.store else "(no store metadata)")
    console.print(params)

    servers = Table(title="Servers and partition assignment", title_justify="left")
    for column in ("server id", "endpoint", "preferred", "partitions (generation)"):
        servers.add_column(column)
    owned = listing.assignment.partitions if listing.assignment else ()
    for server in listing.servers:
        mine = [f"{p.partition_id}({p.generation})" for p in owned if p.server_id == server.server_id]
        servers.add_row(str(server.server_id), server.endpoint,
                        format_partition_ranges(server.preferred_partitions) or "-", " ".join(mine) or "-")
    orphans = [f"{p.partition_id}({p.generation})" for p in owned if p.server_id is None]
    if orphans:
        servers.add_row("-", "(no live server)", "-", " ".join(orphans))
    console.print(servers)

    nodes = Table(title="Storage nodes", title_justify="left")
    for column in ("storage node", "group", "admin port", "partitions"):
        nodes.add_column(column)
    for storage in sorted(set(listing.replica_assignments) | set(listing.groups) | set(listing.connections)):
        nodes.add_row(storage, str(listing.groups.get(storage, "-")), str(listing.connections.get(storage, "-")),
                      format_partition_ranges(listing.replica_assignments.get(storage, [])) or "-")
    console.print(nodes)

    partitions = Table(title="Partition metadata", title_justify="left")
    for column in ("partition", "generation", "store session", "replicas (session / closing high-water mark)"):
        partitions.add_column(column)
    for pid, meta in sorted(listing.partitions.items()):
        replicas = ", ".join(
            f"{storage}: {state.session_id} / "
            f"{'UNRESOLVED' if state.closing_high_water_mark == UNRESOLVED else state.closing_high_water_mark}"
            for storage, state in sorted(meta.replicas.items()))
        partitions.add_row(str(pid), str(meta.generation), str(meta.session_id), replicas or "-")
    console.print(partitions)


def _admin_endpoint(ctx: click.Context, _param: click.Parameter, value: str | None) -> int | str | None:
    """``-a/--admin``: the admin port on the storage node's host, ``HOST:ADMIN_PORT`` on that host,
    or, for a transport whose addresses are not ``host:port`` (``unix:/path``), the admin address."""
    if value is None:
        return None
    if value.isdigit():
        port = int(value)
        if not 1 <= port <= 65535:
            raise click.BadParameter(f"{port} is not a port number from 1 to 65535")
        return port
    host, sep, port_text = value.rpartition(":")
    storage = ctx.params.get("storage") or ""
    storage_host, storage_sep, storage_port = storage.rpartition(":")
    if sep and host and port_text.isdigit() and storage_sep and storage_port.isdigit():
        if host != storage_host:
            raise click.BadParameter(f"{value!r} is on host {host!r}, the storage node on {storage_host!r}; "
                                     "the admin port is on the node's own host")
        if not 1 <= int(port_text) <= 65535:
            raise click.BadParameter(f"{port_text} is not a port number from 1 to 65535")
        return int(port_text)
    if not value.strip() or any(c.isspace() for c in value):
        raise click.BadParameter(f"{value!r} is not a port number, HOST:PORT or an address")
    return value  # an address of the cluster's transport, opaque here


@cluster_group.command("add-storage-node")
@click.option("-s", "--storage", required=True, metavar="ADDRESS", is_eager=True,
              help="The storage node's data endpoint (host:port, or the transport's own address format).")
@click.option("-a", "--admin", "--storage-admin-port", "admin", required=True, metavar="[HOST:]PORT|ADDRESS",
              callback=_admin_endpoint,
              help="The storage node's admin port on its host (or its whole admin address).")
@click.option("-g", "--group", type=click.IntRange(min=0), required=True, help="Storage group id.")
@_with_backend
async def add_storage_node_command(backend: CoordinationBackend, root: str, storage: str, admin: int | str,
                                   group: int) -> None:
    """Add a storage node to a group, with its admin endpoint and no partitions."""
    from .recipes import StoreMetadata

    await StoreMetadata(backend, root).add_storage_node(storage, admin, group)
    what = f"admin port {admin}" if isinstance(admin, int) else f"admin {admin}"
    _console().print(f"added storage node {storage} ({what}) to group {group}")


@cluster_group.command("remove-storage-node")
@click.option("-s", "--storage", required=True, metavar="HOST:PORT", help="The storage node's data endpoint.")
@_with_backend
async def remove_storage_node_command(backend: CoordinationBackend, root: str, storage: str) -> None:
    """Remove a storage node (refused while it has partitions assigned)."""
    from .recipes import StoreMetadata

    await StoreMetadata(backend, root).remove_storage_node(storage)
    _console().print(f"removed storage node {storage}")


@cluster_group.command("assign-partition")
@click.option("-p", "--partition", "partitions", required=True, metavar="IDS", callback=partition_ids_callback,
              help="Partition ids or ranges: 0-6,9.")
@click.option("-s", "--storage", required=True, metavar="HOST:PORT", help="The storage node.")
@_with_backend
async def assign_partition_command(backend: CoordinationBackend, root: str, partitions: list[int], storage: str) -> None:
    """Assign replicas of partitions to a storage node."""
    from .metadata import format_partition_ranges
    from .recipes import StoreMetadata

    await StoreMetadata(backend, root).assign_partitions(storage, partitions)
    _console().print(f"assigned partitions {format_partition_ranges(partitions)} to {storage}")


@cluster_group.command("unassign-partition")
@click.option("-p", "--partition", "partitions", required=True, metavar="IDS", callback=partition_ids_callback,
              help="Partition ids or ranges: 0-6,9.")
@click.option("-s", "--storage", required=True, metavar="HOST:PORT", help="The storage node.")
@click.option("--force", is_flag=True,
              help="Also when a partition would keep fewer than a majority of its replicas (none included), or "
                   "of the replicas its next recovery votes with. "
                   "The replicas are lost for good: the next recovery no longer waits for them and settles "
                   "for what the others hold.")
@_with_backend
async def unassign_partition_command(backend: CoordinationBackend, root: str, partitions: list[int], storage: str,
                                     force: bool) -> None:
    """Remove replicas of partitions from a storage node (refused when a partition would keep fewer
    than a majority of its replicas, or of its next recovery's voters, unless --force)."""
    from .metadata import format_partition_ranges
    from .recipes import StoreMetadata

    await StoreMetadata(backend, root).unassign_partitions(storage, partitions, keep_majority=not force, lost=force)
    _console().print(f"unassigned partitions {format_partition_ranges(partitions)} from {storage}")


@cluster_group.command("auto-assign")
@click.option("-g", "--group", type=click.IntRange(min=0), required=True, help="Storage group id.")
@_with_backend
async def auto_assign_command(backend: CoordinationBackend, root: str, group: int) -> None:
    """Round-robin every partition over the storage nodes of a group (which must have none yet)."""
    from .metadata import format_partition_ranges
    from .recipes import StoreMetadata

    planned = await StoreMetadata(backend, root).auto_assign(group)
    for storage, partitions in planned.items():
        _console().print(f"{storage}: {format_partition_ranges(partitions) or '-'}")


@hookimpl
def waltz_add_commands(cli: click.Group) -> None:
    cli.add_command(cluster_group)
