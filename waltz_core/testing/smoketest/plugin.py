"""Built-in plugin: the ``waltz smoketest`` command."""

from __future__ import annotations

import asyncio
import logging
import tempfile
from pathlib import Path
from typing import Any

import click

from ...cli.logs import log_format_option
from ...hookspecs import hookimpl

#: coordination the smoke test can run itself (``local``) or start as an ensemble of its own
SELF_STARTED_COORDINATION = ("local", "zookeeper", "etcd")


@click.command("smoketest")
@click.option("--duration", type=float, default=60.0, show_default=True, help="Seconds of load under faults.")
@click.option("--min-faults", type=click.IntRange(0), default=0, show_default=True,
              help="Go on past --duration (up to twice it) until this many faults were injected.")
@click.option("--clients", type=click.IntRange(1), default=2, show_default=True)
@click.option("--partitions", type=click.IntRange(1), default=3, show_default=True)
@click.option("--servers", type=click.IntRange(1), default=2, show_default=True)
@click.option("--storages", type=click.IntRange(3), default=3, show_default=True)
@click.option("--locks", "accounts", type=click.IntRange(2, 1024), default=1000, show_default=True,
              help="Lock pool (bank accounts) per partition.")
@click.option("--coordination", default="local", show_default=True, metavar="NAME",
              help="Coordination backend by name (`waltz plugins`). ZooKeeper/etcd are started by the test (and "
                   "killed by the nemesis) unless --connect is given; any other installed backend needs --connect.")
@click.option("--connect", help="The connect string of an external coordination service (no coordination faults).")
@click.option("--coordination-nodes", type=click.IntRange(1, 7), default=1, show_default=True,
              help="Members of the ZooKeeper/etcd ensemble the smoke test starts.")
@click.option("--hosts", type=click.Choice(["loopback", "netns"]), default="loopback", show_default=True,
              help="netns: every process on a host of its own (a network namespace with an address in "
                   "198.18.0.0/15; needs root) and every lane gains the isolate fault (the host vanishes from "
                   "the network: packets dropped, no reset).")
@click.option("--seed", type=int, default=1, show_default=True)
@click.option("--no-nemesis", is_flag=True, help="Load only, no faults.")
@click.option("--moves", is_flag=True,
              help="Add the replica lane: each partition is on every storage node but one, and replicas move "
                   "between nodes while the other faults go on (needs --storages 4 or more).")
@click.option("--dir", "directory", type=click.Path(file_okay=False, path_type=Path),
              help="Working directory (cluster data, logs, history.jsonl); default: a new temporary one.")
@log_format_option
def smoketest_command(duration: float, min_faults: int, clients: int, partitions: int, servers: int, storages: int, accounts: int,
                      coordination: str, connect: str | None, coordination_nodes: int, hosts: str, seed: int,
                      no_nemesis: bool, moves: bool, directory: Path | None) -> None:
    """Chaos smoke test: a real cluster, bank transfers, kill -9/pause/proxy/isolate faults, a history checker.

    Exits 1 on any violation (lost acknowledged transaction, duplicate, gap, reordering, lock
    safety, diverging replicas, money not conserved).
    """
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from ..faults.netns import netns_available
    from .runner import SmokeOptions, run_smoketest

    if moves and (storages < 4 or no_nemesis):
        raise click.UsageError("--moves needs --storages 4 or more (each partition keeps 3 replicas or more) and "
                               "the nemesis (not --no-nemesis)")
    if hosts == "netns" and not netns_available():
        raise click.UsageError("--hosts netns needs root and iproute2's `ip` (it creates network namespaces)")
    from ...cli.context import current_runtime

    # any installed backend; a clear error otherwise
    current_runtime().registries.resolve("coordination", coordination)
    if coordination not in SELF_STARTED_COORDINATION and not connect:
        raise click.UsageError(f"--coordination {coordination} needs --connect: the smoke test starts only local, "
                               f"ZooKeeper and etcd coordination itself")
    if coordination_nodes > 1 and (coordination == "local" or connect):
        raise click.UsageError("--coordination-nodes applies to a ZooKeeper/etcd ensemble the smoke test starts "
                               "(--coordination zookeeper or etcd, without --connect)")
    # The driver's own coordination client logs every reconnection the nemesis causes; the
    # verdict and the stall figures say what matters (-v shows them again).
    kazoo_log = logging.getLogger("waltz.coordination.zookeeper.kazoo")
    if kazoo_log.getEffectiveLevel() >= logging.WARNING:
        kazoo_log.setLevel(logging.ERROR)
    directory = directory or Path(tempfile.mkdtemp(prefix="waltz-smoketest-"))
    opts = SmokeOptions(directory, duration=duration, min_faults=min_faults, clients=clients, partitions=partitions, storages=storages,
                        servers=servers, accounts=accounts, coordination=coordination, connect=connect, seed=seed,
                        nemesis=not no_nemesis, hosts=hosts, coordination_nodes=coordination_nodes, moves=moves)
    click.echo(f"smoketest in {directory}: {storages} storages, {servers} servers, {coordination} coordination"
               f"{f' ({coordination_nodes} members)' if coordination_nodes > 1 else ''}, "
               f"{clients} clients x {partitions} partitions, {accounts} locks, {duration:.0f} s"
               f"{', every process on its own host (netns)' if hosts == 'netns' else ''}"
               f"{', replicas moving' if moves else ''}")
    with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[status]}")) as bar:
        task = bar.add_task("load + faults", total=duration, status="starting")

        def progress(elapsed: float, status: dict[str, Any]) -> None:
            down = ",".join(status["down"]) or "-"
            bar.update(task, completed=min(elapsed, duration),
                       status=f"ok={status['ok']} fail={status['fail']} unknown={status['unknown']} "
                              f"faults={status['faults']} down={down}")

        result = asyncio.run(run_smoketest(opts, progress))
        bar.update(task, completed=duration, status="verified")
    for line in result.report():
        click.echo(line)
    if not result.verdict.ok:
        raise click.exceptions.Exit(1)


@hookimpl
def waltz_add_commands(cli: click.Group) -> None:
    cli.add_command(smoketest_command)
