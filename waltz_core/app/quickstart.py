"""``waltz demo quickstart`` (README command 1, ``./demo.sh``): ``waltz up`` + the demo bank, end to end.

Starts a local cluster (local coordination, TCP, 3 storage nodes, 1 server) in a temporary or
given directory, runs the demo bank in automatic mode from several concurrent clients, prints
the balances and the checks that they add up (database totals, the producers' own count, and a
replay of the whole log through a fresh client), then stops the cluster.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ..cli.output import console as make_console
from . import bank
from .up import LocalCluster, UpOptions


def render_balances(console: Console, result: bank.RunResult, replayed: dict[int, int] | None) -> None:
    table = Table(title="demo bank: balances")
    table.add_column("account", justify="right")
    table.add_column("balance (SQLite)", justify="right")
    if replayed is not None:
        table.add_column("balance (log replay)", justify="right")
    for account, balance in result.after.balances.items():
        row = [str(account), str(balance)]
        if replayed is not None:
            row.append(str(replayed.get(account, 0)))
        table.add_row(*row)
    total = [f"[bold]{result.after.total}[/bold]"]
    if replayed is not None:
        total.append(f"[bold]{sum(replayed.values())}[/bold]")
    table.add_row("[bold]total[/bold]", *total)
    console.print(table)
    led = result.ledger
    console.print(f"{result.operations} operations in {result.seconds:.1f}s: {led.num_deposits} deposits "
                  f"(+{led.deposits}), {led.num_withdrawals} withdrawals (-{led.withdrawals}), "
                  f"{led.refused} withdrawals refused (would overdraw), {led.lock_failures} lock failures retried")


def quickstart(data_dir: Path | None = None, *, clients: int = 3, operations: int = 300, accounts: int = 8,
               partitions: int = 4, seed: int | None = None, keep: bool = False,
               console: Console | None = None) -> bool:
    """Run the whole demo; True if every check passed. Stops the cluster in every case."""
    console = console or make_console()
    t0 = time.monotonic()
    temporary = data_dir is None
    directory = Path(tempfile.mkdtemp(prefix="waltz-quickstart-")) if data_dir is None else data_dir
    cluster = LocalCluster(UpOptions(data_dir=directory, partitions=partitions, servers=1),
                           echo=lambda s: console.print(s, highlight=False))
    console.print(f"[bold]waltz up[/bold]: starting 3 storage nodes and 1 server in {directory} ...")
    try:
        cluster.start()
        console.print(cluster.connect_help(), highlight=False)
        config = cluster.client_config()
        console.print(f"[bold]waltz demo bank --auto {operations}[/bold]: {clients} clients, {accounts} accounts ...")
        result = bank.run_auto(config, directory / "bank.sqlite3", operations, clients=clients, accounts=accounts,
                               seed=seed)
        replayed = bank.replay_balances(config)
        render_balances(console, result, replayed)
        verdict = bank.check(result, replayed)
        for line in verdict.lines:
            console.print(("[green]" if line.startswith("OK") else "[red]") + line, highlight=False)
    finally:
        console.print("stopping the cluster ...")
        cluster.stop()
        if temporary and not keep:
            shutil.rmtree(directory, ignore_errors=True)
    if verdict.ok:
        console.print(f"[bold green]PASS[/bold green]: the balances add up (done in {time.monotonic() - t0:.1f}s)")
    else:
        console.print("[bold red]FAIL[/bold red]: the bank's invariants do not hold")
    return verdict.ok
