"""``waltz storage ...`` (start a node, admin commands) and ``waltz disk ...`` (offline file tools).

Heavy imports happen inside the callbacks so ``waltz --help`` stays fast.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

from ..cli.context import current_runtime
from ..cli.logs import log_format_option
from ..cli.output import console, echo_json, json_option, refused_flag
from ..cli.params import partition_ids, partition_ids_callback
from ..errors import ConfigError, StorageError, WaltzError

if TYPE_CHECKING:
    from ..plugins import Registries

T = TypeVar("T")


def _cluster_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    fn = click.option("--num-partitions", type=click.IntRange(1),
                      help="Partition count (default: read from coordination).")(fn)
    fn = click.option("--cluster-key", type=click.UUID, help="Cluster key (default: read from coordination).")(fn)
    fn = click.option("-c", "--config", "config_path", type=click.Path(dir_okay=False),
                      help="CLI config (transport, coordination; a client's or a node's config works too).")(fn)
    return fn


async def _params(config: Any, cluster_key: uuid.UUID | None, num_partitions: int | None,
                  registries: Registries) -> tuple[uuid.UUID, int]:
    if cluster_key is not None and num_partitions is not None:
        return cluster_key, num_partitions
    from .process import store_params_from_coordination

    return await store_params_from_coordination(config.coordination, registries)


def _run(coro: Awaitable[T]) -> T:
    return asyncio.run(coro)  # type: ignore[arg-type]


async def _with_admin(config_path: str | None, address: str, cluster_key: uuid.UUID | None,
                      num_partitions: int | None, action: Callable[[Any], Awaitable[T]]) -> T:
    from ..config import CliConfig, load
    from ..transport import open_transport
    from .client import StorageAdminClient

    registries = current_runtime().registries
    config = load(CliConfig, config_path, registries=registries)
    key, n = await _params(config, cluster_key, num_partitions, registries)
    transport = open_transport(config.transport, registries)
    client = await StorageAdminClient.connect(transport, address, key, n)
    try:
        return await action(client)
    finally:
        await client.close()
        await transport.aclose()


# ------------------------------------------------------------------------------------ storage


@click.group("storage")
def storage_group() -> None:
    """Run a storage node and administer it through its admin port."""


@storage_group.command("start")
@click.option("-c", "--config", "config_path", type=click.Path(dir_okay=False), help="storage.toml")
@click.option("--cluster-key", type=click.UUID, help="Cluster key (default: read from coordination).")
@click.option("--num-partitions", type=click.IntRange(1), help="Partition count (default: read from coordination).")
@click.option("--insecure", is_flag=True, default=None,
              help="Allow plaintext links on an address other than loopback (security.insecure; docs/security.md).")
@log_format_option
def start_command(config_path: str | None, cluster_key: uuid.UUID | None, num_partitions: int | None,
                  insecure: bool | None) -> None:
    """Start a storage node (data port, admin port, optional HTTP) and run until SIGTERM/SIGINT.

    It listens in plaintext only on loopback, unless --insecure: elsewhere configure TLS."""
    from ..config import StorageProcessConfig, load
    from .process import run_storage

    if (cluster_key is None) != (num_partitions is None):
        raise ConfigError("--cluster-key and --num-partitions go together")
    runtime = current_runtime()
    config = load(StorageProcessConfig, config_path, overrides={"security": {"insecure": True}} if insecure else None,
                  override_sources={"security.insecure": "--insecure"}, registries=runtime.registries)
    from ..eventloop import run

    run(run_storage(config, runtime, cluster_key=cluster_key, num_partitions=num_partitions),
        config.process.event_loop)


def _admin_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``-a/--admin HOST:ADMIN_PORT`` (the node's admin endpoint) and the cluster options."""
    fn = _cluster_options(fn)
    fn = refused_flag("-s", "--storage", instead="in every command it is a storage node's data address (HOST:PORT); "
                                                 "give this node's admin endpoint with -a/--admin HOST:ADMIN_PORT")(fn)
    return click.option("-a", "--admin", "address", required=True, metavar="HOST:ADMIN_PORT",
                        help="The storage node's admin endpoint.")(fn)


@storage_group.command("list")
@_admin_options
@json_option
def list_command(address: str, config_path: str | None, cluster_key: uuid.UUID | None, num_partitions: int | None,
                 as_json: bool) -> None:
    """Assigned partitions with their session id, low-water marks and availability."""
    from rich.table import Table

    async def action(admin: Any) -> list[tuple[int, bool, Any]]:
        status = await admin.assigned_partition_status()
        return [(pid, ok, await admin.last_session_info(pid)) for pid, ok in sorted(status.items())]

    rows = _run(_with_admin(config_path, address, cluster_key, num_partitions, action))
    if as_json:
        echo_json({"storage_admin": address, "partitions": [
            {"partition": pid, "session_id": info.session_id, "low_water_mark": info.low_water_mark,
             "local_low_water_mark": info.local_low_water_mark, "assigned": True, "available": ok}
            for pid, ok, info in rows]})
        return
    table = Table(title=f"Partitions on {address}", title_justify="left")
    for col in ("partition", "session id", "low-water mark", "local low-water mark", "assigned", "available"):
        table.add_column(col, justify="right")
    for pid, ok, info in rows:
        table.add_row(str(pid), str(info.session_id), str(info.low_water_mark), str(info.local_low_water_mark),
                      "yes", "yes" if ok else "no")
    console().print(table)


@storage_group.command("add-partition")
@_admin_options
@click.option("-p", "--partition", "partitions", required=True, help="Partition ids or ranges, e.g. 0-3,7.")
def add_partition(address: str, partitions: str, config_path: str | None, cluster_key: uuid.UUID | None,
                  num_partitions: int | None) -> None:
    """Assign partitions to the node (creates their files; they are available at once)."""
    ids = partition_ids(partitions)
    _run(_with_admin(config_path, address, cluster_key, num_partitions, lambda a: a.set_assignment(ids, True)))
    click.echo(f"assigned partitions {ids} on {address}")


@storage_group.command("remove-partition")
@_admin_options
@click.option("-p", "--partition", "partitions", required=True, help="Partition ids or ranges, e.g. 0-3,7.")
@click.option("-d", "--delete-storage-files", is_flag=True, help="Also delete the partitions' segment files.")
def remove_partition(address: str, partitions: str, delete_storage_files: bool, config_path: str | None,
                     cluster_key: uuid.UUID | None, num_partitions: int | None) -> None:
    """Unassign partitions from the node (files kept unless --delete-storage-files)."""
    ids = partition_ids(partitions)
    _run(_with_admin(config_path, address, cluster_key, num_partitions,
                     lambda a: a.set_assignment(ids, False, delete_storage_files=delete_storage_files)))
    click.echo(f"unassigned partitions {ids} on {address}" + (" and deleted their files" if delete_storage_files else ""))


@storage_group.command("availability")
@_admin_options
@click.option("-p", "--partition", "partitions", required=True, help="Partition ids or ranges, e.g. 0-3,7.")
@click.option("--online/--offline", "online", required=True, help="Make the partitions available or not.")
def availability(address: str, partitions: str, online: bool, config_path: str | None, cluster_key: uuid.UUID | None,
                 num_partitions: int | None) -> None:
    """Toggle read/write availability (offline recovery needs a partition offline)."""
    ids = partition_ids(partitions)
    _run(_with_admin(config_path, address, cluster_key, num_partitions, lambda a: a.set_availability(ids, online)))
    click.echo(f"partitions {ids} on {address} are now {'online' if online else 'offline'}")


@storage_group.command("max-transaction-id")
@click.option("-a", "--admin", "admin_address", required=True, metavar="HOST:ADMIN_PORT",
              help="The node's admin endpoint (for the session id).")
@click.option("-s", "--storage", "data_address", required=True, metavar="HOST:PORT", help="The node's data address.")
@refused_flag("--storage-port", instead="give the node's data address with -s/--storage HOST:PORT")
@click.option("-p", "--partition", type=click.IntRange(0), required=True, help="One partition id.")
@click.option("-o", "--offline", is_flag=True, help="Use the offline-recovery flag (partition must be offline).")
@_cluster_options
@json_option
def max_transaction_id(admin_address: str, data_address: str, partition: int, offline: bool, config_path: str | None,
                       cluster_key: uuid.UUID | None, num_partitions: int | None, as_json: bool) -> None:
    """Print the partition's max transaction id."""

    async def main() -> int:
        from ..config import CliConfig, load
        from ..transport import open_transport
        from .client import StorageAdminClient, StorageClient

        registries = current_runtime().registries
        config = load(CliConfig, config_path, registries=registries)
        key, n = await _params(config, cluster_key, num_partitions, registries)
        transport = open_transport(config.transport, registries)
        admin = await StorageAdminClient.connect(transport, admin_address, key, n)
        try:
            session = (await admin.last_session_info(partition)).session_id
            data = await StorageClient.connect(transport, data_address, key, n, role="waltz-cli")
            try:
                return await data.max_transaction_id(session, partition, offline=offline)
            finally:
                await data.close()
        finally:
            await admin.close()
            await transport.aclose()

    value = _run(main())
    if as_json:
        echo_json({"partition": partition, "max_transaction_id": value})
    else:
        click.echo(f"Max Transaction ID: {value}")


@storage_group.command("recover-partition")
@click.option("-c", "--config", "config_path", required=True, type=click.Path(dir_okay=False, exists=True),
              help="storage.toml of the node to recover; the node must be stopped.")
@click.option("-p", "--partition", "partitions", required=True, metavar="IDS", callback=partition_ids_callback,
              help="Partition ids or ranges to rebuild.")
@click.option("--from", "source", required=True, metavar="HOST:ADMIN_PORT",
              help="Admin endpoint of a healthy replica holding the partitions (the most advanced one).")
@click.option("--force", is_flag=True,
              help="Go on when another replica cannot be asked whether it holds more than the source.")
@click.option("--cluster-key", type=click.UUID, help="Cluster key (default: read from coordination).")
@click.option("--num-partitions", type=click.IntRange(1), help="Partition count (default: read from coordination).")
@json_option
def recover_partition_command(config_path: str, partitions: list[int], source: str, force: bool,
                              cluster_key: uuid.UUID | None, num_partitions: int | None, as_json: bool) -> None:
    """Rebuild partitions of a stopped node from a healthy replica (damaged files are moved aside).

    Keeps the local records up to each partition's low-water mark that pass their checksums,
    copies the rest from --from, and gives the partition the source's session info. Refused when
    another replica holds more than the source. See docs/operations.md, "Runbook: storage damage".
    """
    import attrs

    from ..config import StorageProcessConfig, load
    from .recovery import PartitionRebuild, aside_directory, recover_partition, write_report

    registries = current_runtime().registries
    config = load(StorageProcessConfig, config_path, registries=registries)
    cfg = config.storage
    if (cluster_key is None) != (num_partitions is None):
        raise ConfigError("--cluster-key and --num-partitions go together")

    async def main() -> tuple[list[Any], Any]:
        from ..transport import listen_address, open_transport
        from . import open_layout
        from .client import StorageAdminClient

        replicas: dict[int, list[str]] = {}
        key, n = cluster_key, num_partitions
        try:
            replicas, params = await _replica_admins(config.coordination, registries)
            key, n = (key, n) if key is not None else params
        except WaltzError as exc:
            if key is None:
                raise
            log_line = f"coordination unreachable ({exc}): the other replicas cannot be checked"
            click.echo(f"warning: {log_line}", err=True)
        assert key is not None and n is not None
        bad = [p for p in partitions if p >= n]
        if bad:
            raise ConfigError(f"-p/--partition: the cluster has partitions 0-{n - 1}, not {bad}")
        transport = open_transport(config.transport, registries)
        me = listen_address(transport, cfg.host, cfg.admin_port)
        clients: dict[str, Any] = {}
        unreachable: set[str] = set()

        async def admin(address: str) -> Any:
            if address not in clients and address not in unreachable:
                try:
                    clients[address] = await StorageAdminClient.connect(transport, address, key, n)
                except (WaltzError, OSError) as exc:
                    if address == source:
                        raise ConfigError(f"--from {source}: cannot reach the source replica: {exc}") from None
                    unreachable.add(address)
            return clients.get(address)

        layout = open_layout(cfg, registries)
        aside = aside_directory(cfg.directory)
        rebuild = PartitionRebuild(layout, key, n, aside)
        try:
            src = await admin(source)
            try:
                rebuild.open()
            except StorageError as exc:
                if "locked" in str(exc):
                    raise ConfigError(f"{cfg.directory}: in use by a running storage node; stop it first "
                                      "(recover-partition rewrites its files)") from None
                raise
            results = []
            for pid in partitions:
                others = [a for a in replicas.get(pid, []) if a not in (me, source)]
                reachable = [c for a in others if (c := await admin(a)) is not None]
                missing = [a for a in others if a in unreachable]
                if not replicas:
                    missing = ["(the coordination metadata)"]
                results.append(await recover_partition(rebuild, pid, src, reachable, missing, force=force))
            return results, write_report(aside, results, source)
        finally:
            layout.close()
            for c in clients.values():
                await c.close()
            await transport.aclose()

    results, report = _run(main())
    if as_json:
        echo_json({"source": source, "report": str(report) if report else None,
                   "partitions": [attrs.asdict(r) for r in results]})
        return
    for r in results:
        click.echo(f"partition {r.partition_id}: {r.why}; copied {r.copied} records from {source}; now holds up to "
                   f"{r.max_transaction_id} (session {r.session_id}, low-water mark {r.low_water_mark})"
                   + (f"; moved aside: {', '.join(r.quarantined)}" if r.quarantined else ""))
    if report is not None:
        click.echo(f"damaged files and a report are in {report.parent}")


async def _replica_admins(coordination: Any, registries: Registries
                          ) -> tuple[dict[int, list[str]], tuple[uuid.UUID, int]]:
    """partition -> admin endpoints of the storage nodes holding it, and (cluster key, partitions)."""
    from ..coordination import open_coordination
    from ..coordination.recipes import StoreMetadata

    backend = open_coordination(coordination, registries)
    await backend.start()
    try:
        sm = StoreMetadata(backend, coordination.root)
        params = await sm.get_store_params()
        assignments = await sm.get_replica_assignments()
        admin_addresses = await sm.get_admin_addresses()
    finally:
        await backend.close()
    out: dict[int, list[str]] = {}
    for storage, pids in assignments.items():
        admin = admin_addresses.get(storage)
        if admin is None:
            continue  # assigned but never given an admin endpoint: nothing to ask
        for pid in pids:
            out.setdefault(pid, []).append(admin)
    return out, (params.cluster_key, params.num_partitions)


@storage_group.command("validate")
@click.option("-a", "--admin", "address", metavar="HOST:ADMIN_PORT", help="The running node to check.")
@click.option("-c", "--config", "config_path", type=click.Path(dir_okay=False, exists=True),
              help="With -a: a cli.toml (transport, coordination). Without: the storage.toml of a stopped node, "
                   "whose files are checked.")
@click.option("--against", "replica", required=True, metavar="HOST:ADMIN_PORT", help="A healthy replica.")
@click.option("-p", "--partition", "partitions", metavar="IDS", callback=partition_ids_callback,
              help="Partition ids or ranges (default: every partition the node holds).")
@click.option("--cluster-key", type=click.UUID, help="Cluster key (default: read from coordination).")
@click.option("--num-partitions", type=click.IntRange(1), help="Partition count (default: read from coordination).")
@json_option
def validate_command(address: str | None, config_path: str | None, replica: str, partitions: list[int] | None,
                     cluster_key: uuid.UUID | None, num_partitions: int | None, as_json: bool) -> None:
    """Compare a node's partitions with a replica's, record by record; exit status 1 on a difference.

    The common prefix must be identical; one side holding more is reported, not an error.
    """
    import attrs

    from ..cli.commands import _process_of
    from ..config import CliConfig, StorageProcessConfig, load
    from .journal import replay_into_layout
    from .recovery import compare_partition

    if address is None and (config_path is None or _process_of(config_path, None) != "storage"):
        raise click.UsageError("give the node to check: -a HOST:ADMIN_PORT (running) or -c storage.toml (stopped)")
    offline = address is None
    registries = current_runtime().registries
    config: StorageProcessConfig | CliConfig = (load(StorageProcessConfig, config_path, registries=registries)
                                                if offline else load(CliConfig, config_path, registries=registries))

    async def main() -> list[Any]:
        from ..transport import open_transport
        from . import open_layout
        from .client import StorageAdminClient

        key, n = await _params(config, cluster_key, num_partitions, registries)
        transport = open_transport(config.transport, registries)
        other = await StorageAdminClient.connect(transport, replica, key, n)
        node: StorageAdminClient | None = None
        layout: Any = None
        try:
            if isinstance(config, StorageProcessConfig):
                cfg = config.storage
                layout = open_layout(cfg, registries)
                try:
                    layout.open(key, n)
                    replay_into_layout(layout)  # acknowledged records only in the journal count too
                except StorageError as exc:
                    raise ConfigError(f"{cfg.directory}: {exc}") from None
                ids = partitions if partitions is not None else [
                    p for p in range(n) if _assigned(layout, p)]
            else:
                assert address is not None  # refused above when neither is given
                node = await StorageAdminClient.connect(transport, address, key, n)
                ids = partitions if partitions is not None else sorted(await node.assigned_partition_status())
            out = []
            for pid in ids:
                if node is not None:
                    out.append(await compare_partition(node, other, pid))
                    continue
                local = layout.open_partition(pid)
                try:
                    out.append(await compare_partition(local, other, pid))
                finally:
                    local.close()
            return out
        finally:
            if layout is not None:
                layout.close()
            if node is not None:
                await node.close()
            await other.close()
            await transport.aclose()

    results = _run(main())
    if as_json:
        echo_json({"against": replica, "partitions": [{**attrs.asdict(r), "ok": r.ok} for r in results]})
    else:
        for r in results:
            click.echo(f"partition {r.partition_id}: {'ok' if r.ok else 'DIFFERENT'}: {r.detail} "
                       f"({r.checked} records compared)")
    if not all(r.ok for r in results):
        raise SystemExit(1)


def _assigned(layout: Any, pid: int) -> bool:
    try:
        return bool(layout.read_partition_info(pid).assigned)
    except WaltzError:
        return True  # damaged struct: check its files anyway


# --------------------------------------------------------------------------------------- disk


@click.group("disk")
def disk_group() -> None:
    """Offline tools that read storage files directly (run them on a stopped node or a copy)."""


def _segment_report(segment: str) -> Any:
    """The segment's report; a file that is not a segment at all is one line and exit status 1."""
    from .disktools import read_segment

    report = read_segment(segment)
    if report.header is None:
        raise click.ClickException(f"{report.path}: not a Waltz segment: its header fails its checksum or is short "
                                   "(`waltz disk verify-segment` lists every problem)")
    return report


@disk_group.command("verify-segment")
@click.argument("segment", type=click.Path(exists=True, dir_okay=False))
@click.option("-t", "--transaction", type=int, help="Verify only this transaction.")
@json_option
def verify_segment(segment: str, transaction: int | None, as_json: bool) -> None:
    """Check every record checksum and index entry of a segment; exit status 1 on failures."""
    from rich.table import Table

    from .disktools import read_segment

    report = read_segment(segment)
    records = [r for r in report.records if transaction is None or r.transaction_id == transaction]
    if as_json:
        echo_json({"path": report.path, "records": len(records), "failures": report.failures,
                   "index_entries": report.index_entries, "index_checkpoint": report.index_checkpoint})
        if report.failures:
            raise SystemExit(1)
        return
    out = console()
    table = Table(title=report.path, title_justify="left")
    for col in ("transaction", "offset", "length", "data checksum", "record checksum"):
        table.add_column(col, justify="right")
    shown = [r for r in records if not (r.data_checksum_ok and r.record_checksum_ok)][:100]
    for r in shown:
        table.add_row(str(r.transaction_id), str(r.offset), str(r.length), "ok" if r.data_checksum_ok else "BAD",
                      "ok" if r.record_checksum_ok else "BAD")
    if shown:
        out.print(table)
    for failure in report.failures[:100]:
        out.print(f"[red]FAIL[/red] {failure}")
    out.print(f"{len(records)} records verified, {len(report.failures)} failures, index entries "
              f"{report.index_entries} (checkpointed {report.index_checkpoint})")
    if report.failures:
        raise SystemExit(1)


@disk_group.command("dump-segment")
@click.argument("segment", type=click.Path(exists=True, dir_okay=False))
@click.option("-m", "--metadata", is_flag=True, help="Only the header.")
@click.option("-r", "--records", "records_only", is_flag=True, help="Only the records.")
@click.option("-t", "--transaction", type=int, help="Only this transaction.")
@click.option("--max-bytes", type=click.IntRange(0), default=32, show_default=True, help="Data bytes shown per record.")
def dump_segment(segment: str, metadata: bool, records_only: bool, transaction: int | None, max_bytes: int) -> None:
    """Print a segment's header and records; exit status 1 when a record or the index is damaged."""
    from rich.table import Table

    report = _segment_report(segment)
    out = console()
    if not records_only:
        h = report.header
        meta = Table(title=f"{report.path} header", title_justify="left", show_header=False)
        for k, v in (("version", h.version), ("creation time (ms)", h.creation_time), ("cluster key", h.cluster_key),
                     ("partition", h.partition_id), ("first transaction", h.first_transaction_id)):
            meta.add_row(k, str(v))
        meta.add_row("records", str(len(report.records)))
        meta.add_row("index entries (checkpointed)", f"{report.index_entries} ({report.index_checkpoint})")
        out.print(meta)
    if not metadata:
        table = Table(title="records", title_justify="left")
        for col in ("transaction", "offset", "req id (client, gen, part, seq)", "header", "length", "checksums", "data"):
            table.add_column(col)
        for r in report.records:
            if transaction is not None and r.transaction_id != transaction:
                continue
            ok = "ok" if r.data_checksum_ok and r.record_checksum_ok else "BAD"
            preview = r.data[:max_bytes].hex() + ("…" if len(r.data) > max_bytes else "")
            table.add_row(str(r.transaction_id), str(r.offset), f"{r.client_id}, {r.generation}, {r.partition_id}, "
                          f"{r.seq_num}", str(r.header), str(r.length), ok, preview)
        out.print(table)
    if report.failures:
        click.echo(f"{report.path}: {len(report.failures)} problem(s), the first: {report.failures[0]} "
                   "(`waltz disk verify-segment` lists them)", err=True)
        raise SystemExit(1)


@disk_group.command("dump-control-file")
@click.argument("control_file", type=click.Path(exists=True))
@click.option("-p", "--partition", type=click.IntRange(0), help="Only this partition.")
@click.option("--assigned", "assigned_only", is_flag=True, help="Only assigned partitions.")
@refused_flag("-a", instead="in every command it is a storage node's admin endpoint; write --assigned")
def dump_control_file(control_file: str, partition: int | None, assigned_only: bool) -> None:
    """Print the control file: cluster key, partition infos (both structs), and the repair report.

    Exit status 1 when a partition has neither struct intact (the node cannot open it).
    """
    from rich.table import Table

    from .disktools import read_control_file

    report = read_control_file(control_file)
    h = report.header
    if h is None:
        raise click.ClickException(f"{report.path}: not a Waltz control file: its header fails its checksum or is "
                                   "short (`waltz storage recover-partition` rebuilds a node's files from a replica)")
    out = console()
    out.print(f"{report.path}: version {h.version}, created {h.creation_time} ms, cluster key {h.cluster_key}, "
              f"{h.num_partitions} partitions")
    table = Table(title="partitions", title_justify="left")
    for col in ("partition", "struct", "valid", "session id", "low-water mark", "local low-water mark", "flags",
                "sequence", "current"):
        table.add_column(col, justify="right")
    lost = []
    for entry in report.partitions:
        if entry.current is None:
            lost.append(entry.partition_id)
        if partition is not None and entry.partition_id != partition:
            continue
        current = entry.current
        if assigned_only and (current is None or not current.assigned):
            continue
        for i, info in enumerate(entry.structs):
            if info is None:
                table.add_row(str(entry.partition_id), str(i + 1), "[red]NO[/red]", "", "", "", "", "", "")
                continue
            flags = ",".join(n for n, on in (("assigned", info.assigned), ("available", info.available)) if on) or "-"
            table.add_row(str(entry.partition_id), str(i + 1), "yes", str(info.session_id), str(info.low_water_mark),
                          str(info.local_low_water_mark), flags, str(info.sequence_number),
                          "*" if info is current else "")
    out.print(table)
    if report.repairs:
        rtable = Table(title="repairs made when the node opened its files", title_justify="left")
        for col in ("time (ms)", "partition", "file", "action", "why"):
            rtable.add_column(col)
        for r in report.repairs:
            rtable.add_row(str(r.get("time")), str(r.get("partition")), str(r.get("file")), str(r.get("action")),
                           str(r.get("detail")))
        out.print(rtable)
    if partition is not None and partition >= len(report.partitions):
        raise click.ClickException(f"{report.path}: no partition {partition} (the file holds {len(report.partitions)})")
    if lost:
        click.echo(f"{report.path}: partitions {lost} have both partition-info structs corrupt "
                   "(`waltz storage recover-partition` rebuilds them from a replica)", err=True)
        raise SystemExit(1)


@disk_group.command("segment-stats")
@click.argument("segment", type=click.Path(exists=True, dir_okay=False))
@json_option
def segment_stats_command(segment: str, as_json: bool) -> None:
    """Record count and data sizes of a segment (min, max, average, median); exit 1 if it is damaged."""
    from rich.table import Table

    from .disktools import segment_stats

    report = _segment_report(segment)
    s = segment_stats(segment)
    rows = (("records", s.records), ("min data bytes", s.min_size), ("max data bytes", s.max_size),
            ("average data bytes", round(s.avg_size, 1)), ("median data bytes", round(s.median_size, 1)),
            ("total data bytes", s.total_data_bytes), ("file bytes", s.file_bytes))
    if as_json:
        echo_json({"path": s.path, **{k.replace(" ", "_"): v for k, v in rows}, "problems": len(report.failures)})
    else:
        table = Table(title=s.path, title_justify="left", show_header=False)
        for k, v in rows:
            table.add_row(k, str(v))
        console().print(table)
    if report.failures:
        click.echo(f"{report.path}: {len(report.failures)} problem(s), the first: {report.failures[0]} "
                   "(`waltz disk verify-segment` lists them)", err=True)
        raise SystemExit(1)


@disk_group.command("dump-journal")
@click.argument("journal", type=click.Path(exists=True, dir_okay=False))
@json_option
def dump_journal(journal: str, as_json: bool) -> None:
    """List a node journal's entries (``<storage dir>/journal/io-N.wal``): what a start of the node
    would replay. Exit status 1 if the journal cannot be read (both header slots torn)."""
    from pathlib import Path

    from rich.table import Table

    from ..errors import StorageCorruptionError
    from .journal import journal_generation, read_journal

    path = Path(journal)
    try:
        generation = journal_generation(path)
        entries, stop = read_journal(path)
    except StorageCorruptionError as exc:
        raise click.ClickException(str(exc)) from None
    except OSError as exc:
        raise click.ClickException(f"{path}: {exc.strerror or exc}") from None
    rows = [{"partition": e.partition_id, "first": e.first_transaction_id, "last": e.last_transaction_id,
             "records": e.count, "bytes": len(e.data)} for e in entries]
    if as_json:
        echo_json({"path": str(path), "generation": generation, "entries": rows, "stopped": stop})
        return
    click.echo(f"{path}: generation {generation}, {len(rows)} entries, "
               f"{sum(r['records'] for r in rows)} records (replayed when the node starts; none after a clean stop)")
    if rows:
        table = Table(show_header=True)
        for column in ("partition", "first", "last", "records", "bytes"):
            table.add_column(column, justify="right")
        for r in rows:
            table.add_row(*(str(r[c]) for c in ("partition", "first", "last", "records", "bytes")))
        console().print(table)
    if stop is not None:
        click.echo(f"reading stopped early: {stop}")


@storage_group.command("sync-partitions")
@click.option("-c", "--config", "config_path", type=click.Path(dir_okay=False), help="CLI config (transport, coordination; a client's or a node's config works too).")
def sync_partitions(config_path: str | None) -> None:
    """Make every storage node hold exactly the partitions coordination assigns it (no files deleted).

    Reads ``<root>/store/assignment`` and the admin ports from ``<root>/store/connection``, then
    assigns missing partitions and unassigns extra ones on each node (original storage-cli).
    """
    from ..config import CliConfig, load
    from ..coordination import open_coordination
    from ..coordination.recipes import StoreMetadata
    from ..transport import open_transport
    from .client import StorageAdminClient

    registries = current_runtime().registries
    config = load(CliConfig, config_path, registries=registries)

    async def main() -> list[tuple[str, list[int], list[int]]]:
        backend = open_coordination(config.coordination, registries)
        await backend.start()
        try:
            sm = StoreMetadata(backend, config.coordination.root)
            params = await sm.get_store_params()
            assignments = await sm.get_replica_assignments()
            admin_addresses = await sm.get_admin_addresses()
        finally:
            await backend.close()
        transport = open_transport(config.transport, registries)
        changes = []
        try:
            for storage, wanted in sorted(assignments.items()):
                admin_address = admin_addresses[storage]
                admin = await StorageAdminClient.connect(transport, admin_address, params.cluster_key,
                                                         params.num_partitions)
                try:
                    held = {pid for pid, _ok in (await admin.assigned_partition_status()).items()}
                    add = sorted(set(wanted) - held)
                    remove = sorted(held - set(wanted))
                    if add:
                        await admin.set_assignment(add, True)
                    if remove:
                        await admin.set_assignment(remove, False)
                    changes.append((storage, add, remove))
                finally:
                    await admin.close()
        finally:
            await transport.aclose()
        return changes

    for storage, add, remove in _run(main()):
        click.echo(f"{storage}: assigned {add or 'nothing'}, unassigned {remove or 'nothing'}")
