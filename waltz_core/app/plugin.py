"""Built-in plugin of the app package: ``waltz up``, ``waltz demo bank|quickstart``, ``waltz client validate``."""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import click

from ..cli.context import current_runtime
from ..cli.logs import log_format_option
from ..cli.output import echo_json, json_option
from ..cli.params import partition_ids_callback
from ..hookspecs import hookimpl

_config_option = click.option("-c", "--config", "config_path", type=click.Path(dir_okay=False, exists=True),
                              help="client.toml of the cluster (default: <data-dir>/client.toml of `waltz up`).")
_data_dir_option = click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path),
                                default=Path("waltz-data"), show_default=True, help="Directory of a `waltz up` cluster.")


def _quiet_dev_mode_warning() -> None:
    """The demos run on plaintext loopback links on purpose: say so once, not per client."""
    import logging

    logging.getLogger("waltz.client").addFilter(lambda record: "not encrypted" not in record.getMessage())


def _client_config(config_path: str | None, data_dir: Path) -> Any:
    from ..config import ClientProcessConfig, load
    from ..errors import ConfigError

    path = Path(config_path) if config_path else data_dir / "client.toml"
    if not path.exists():
        raise ConfigError(f"{path} does not exist: start a cluster with `waltz up` or pass --config client.toml")
    return load(ClientProcessConfig, path, registries=current_runtime().registries)


# --------------------------------------------------------------------------------- waltz up


@click.command("up")
@_data_dir_option
@click.option("--partitions", type=click.IntRange(1), default=4, show_default=True, help="Partitions of a new cluster.")
@click.option("--servers", type=click.IntRange(1), default=1, show_default=True, help="Servers of a new cluster.")
@click.option("--coordination", default="local", show_default=True, metavar="NAME",
              help="Coordination backend by name: embedded `local` (SQLite file in the data dir), or any installed "
                   "backend of a running service (zookeeper, etcd, a plugin's; `waltz plugins`) with --connect.")
@click.option("--connect", help="Connect string of the coordination service (host:port,...).")
@click.option("--transport", default=None, metavar="NAME",
              help="Transport backend by name (tcp, zmq, a plugin's; `waltz plugins`) of a new cluster  [default: tcp]")
@click.option("--root", default="/waltz", show_default=True, help="Cluster root in the coordination service.")
@click.option("--background", is_flag=True, help="Start and return; stop later with `waltz up --stop`.")
@click.option("--stop", is_flag=True, help="Stop the --background cluster of --data-dir.")
@click.option("--ready-timeout", type=float, default=60.0, show_default=True, help="Seconds to wait for every partition.")
@click.option("--secure", is_flag=True, help="Mutual TLS on every link: a development CA and certificates are written "
                                             "to <data-dir>/certs (docs/security.md).")
@log_format_option
def up_command(data_dir: Path, partitions: int, servers: int, coordination: str, connect: str | None,
               transport: str | None, root: str, background: bool, stop: bool, ready_timeout: float,
               secure: bool) -> None:
    """Start a whole local cluster: 3 storage nodes, servers, coordination, TCP; data under --data-dir.

    Runs in the foreground until Ctrl-C (or SIGTERM), which stops every process cleanly. An
    existing cluster in --data-dir is reused (same ports, same data).
    """
    from .up import LocalCluster, UpOptions, stop_background

    _quiet_dev_mode_warning()
    if stop:
        n = stop_background(data_dir, echo=click.echo)
        click.echo(f"stopped {n} processes" if n else f"no running cluster in {data_dir.resolve()}")
        return
    cluster = LocalCluster(UpOptions(data_dir=data_dir, partitions=partitions, servers=servers,
                                     coordination=coordination, connect=connect, root=root,
                                     ready_timeout=ready_timeout, secure=secure, transport=transport),
                           echo=click.echo, runtime=current_runtime())
    stopping = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stopping.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        cluster.start()
        click.echo(cluster.connect_help())
        if background:
            pid_file = cluster.write_pid_file()
            click.echo(f"running in the background (pids in {pid_file}); stop with: "
                       f"waltz up --stop --data-dir {cluster.data_dir}")
            return
        click.echo("running; press Ctrl-C to stop")
        reported = False
        while not stopping.wait(0.5):
            problem = cluster.dead_process()
            if problem and not reported:
                click.echo(f"warning: {problem}", err=True)
                reported = True
        click.echo("stopping ...")
        cluster.stop()
        click.echo("stopped")
    except BaseException:
        if not background:
            cluster.stop()
        elif cluster.pids():
            # Started, then printing failed (`waltz up --background | head -1`: the reader went
            # away): the cluster runs on, so --stop must find it by its pid file.
            cluster.write_pid_file()
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# ------------------------------------------------------------------------------- waltz demo


@click.group("demo")
def demo_group() -> None:
    """Demo applications."""


@demo_group.command("bank")
@_config_option
@_data_dir_option
@click.option("--db", "db_path", type=click.Path(dir_okay=False, path_type=Path),
              help="SQLite file of the bank (default: <data-dir>/bank.sqlite3 or ./waltz-bank.sqlite3 with --config).")
@click.option("--auto", "operations", type=click.IntRange(1), help="Run N random operations instead of the prompt.")
@click.option("--clients", type=click.IntRange(1), default=3, show_default=True, help="Concurrent clients (--auto).")
@click.option("--accounts", type=click.IntRange(1), default=8, show_default=True, help="Accounts (--auto).")
@click.option("--seed", type=int, help="Random seed (--auto).")
@click.option("--replay/--no-replay", default=True, show_default=True, help="Re-derive balances from the log (--auto).")
def bank_command(config_path: str | None, data_dir: Path, db_path: Path | None, operations: int | None, clients: int,
                 accounts: int, seed: int | None, replay: bool) -> None:
    """The original's demo bank: balances in SQLite, applied exactly once; interactive or --auto N."""
    from ..cli.output import console as make_console
    from . import bank
    from .quickstart import render_balances

    config = _client_config(config_path, data_dir)
    _quiet_dev_mode_warning()
    if db_path is None:
        db_path = Path("waltz-bank.sqlite3") if config_path else data_dir / "bank.sqlite3"
    if operations is None:
        interactive = sys.stdin.isatty()
        bank.interactive(config, db_path, sys.stdin, click.echo,
                         prompt=(lambda: click.echo("bank> ", nl=False)) if interactive else (lambda: None))
        return
    console = make_console()
    result = bank.run_auto(config, db_path, operations, clients=clients, accounts=accounts, seed=seed)
    replayed = bank.replay_balances(config) if replay else None
    render_balances(console, result, replayed)
    verdict = bank.check(result, replayed)
    for line in verdict.lines:
        console.print(line, highlight=False)
    if not verdict.ok:
        raise click.exceptions.Exit(1)


@demo_group.command("quickstart")
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Cluster directory (default: a temporary one, removed afterwards).")
@click.option("--clients", type=click.IntRange(1), default=3, show_default=True)
@click.option("--operations", type=click.IntRange(1), default=300, show_default=True)
@click.option("--accounts", type=click.IntRange(1), default=8, show_default=True)
@click.option("--partitions", type=click.IntRange(1), default=4, show_default=True)
@click.option("--seed", type=int)
@click.option("--keep", is_flag=True, help="Keep the temporary directory (logs, data).")
def quickstart_command(data_dir: Path | None, clients: int, operations: int, accounts: int, partitions: int,
                       seed: int | None, keep: bool) -> None:
    """README command 1: `waltz up` + the demo bank end to end, then stop (about 10-20 s)."""
    from .quickstart import quickstart

    _quiet_dev_mode_warning()
    if not quickstart(data_dir, clients=clients, operations=operations, accounts=accounts, partitions=partitions,
                      seed=seed, keep=keep):
        raise click.exceptions.Exit(1)


# ----------------------------------------------------------------------------- waltz client


@click.command("validate")
@_config_option
@_data_dir_option
@click.option("--clients", "-nc", "--num-clients", type=click.IntRange(1), default=4, show_default=True)
@click.option("--txn-per-client", "-tpc", type=click.IntRange(1), default=100, show_default=True)
@click.option("--interval", "-i", type=click.FloatRange(0), default=10.0, show_default=True,
              help="Mean milliseconds between a client's transactions (exponential inter-arrival).")
@click.option("--active-partitions", "-ap", type=click.IntRange(1), default=1, show_default=True)
@click.option("--seed", type=int)
@json_option
def validate_command(config_path: str | None, data_dir: Path, clients: int, txn_per_client: int, interval: float,
                     active_partitions: int, seed: int | None, as_json: bool) -> None:
    """Optimistic-locking validation: every transaction's data must equal its id; ids gap-free."""
    import attrs

    from .validate import validate

    config = _client_config(config_path, data_dir)
    _quiet_dev_mode_warning()
    result = asyncio.run(validate(config, clients=clients, txn_per_client=txn_per_client, interval_ms=interval,
                                  active_partitions=active_partitions, seed=seed))
    if as_json:
        echo_json({**attrs.asdict(result), "expected": result.expected, "retries": result.retries,
                   "passed": result.passed})
    else:
        for line in result.report():
            click.echo(line)
    if not result.passed:
        raise click.exceptions.Exit(1)


@click.command("high-water-mark")
@_config_option
@_data_dir_option
@click.option("-p", "--partition", "partitions", metavar="IDS", callback=partition_ids_callback,
              help="Partition ids or ranges (default: all).")
@json_option
def high_water_mark_command(config_path: str | None, data_dir: Path, partitions: list[int] | None,
                            as_json: bool) -> None:
    """Print partitions' high-water marks, as their owning servers answer (the original ClientCli view)."""
    from ..client import AsyncWaltzClient, WaltzClientCallbacks
    from ..errors import ConfigError

    config = _client_config(config_path, data_dir)
    runtime = current_runtime()
    _quiet_dev_mode_warning()

    async def main() -> dict[int, int]:
        import attrs

        cfg = attrs.evolve(config, client=attrs.evolve(config.client, auto_mount=False))
        async with AsyncWaltzClient(WaltzClientCallbacks(), cfg, runtime=runtime) as client:
            ids = partitions if partitions is not None else list(range(client.num_partitions))
            bad = [p for p in ids if p >= client.num_partitions]
            if bad:
                raise ConfigError(f"-p/--partition: the cluster has partitions 0-{client.num_partitions - 1}, not {bad}")
            return {pid: await client.high_water_mark(pid) for pid in ids}

    marks = asyncio.run(main())
    if as_json:
        echo_json({"high_water_marks": {str(pid): hwm for pid, hwm in marks.items()}})
        return
    for pid, hwm in marks.items():
        click.echo(f"partition {pid}: high-water mark {hwm}")


@hookimpl
def waltz_add_commands(cli: click.Group) -> None:
    cli.add_command(up_command)
    cli.add_command(demo_group)
    client = cli.commands.get("client")
    if not isinstance(client, click.Group):
        @click.group("client")
        def client_group() -> None:
            """Client tools."""

        cli.add_command(client_group)
        client = client_group
    client.add_command(validate_command)
    client.add_command(high_water_mark_command)
