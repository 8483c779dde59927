"""Built-in plugin of the perf package: ``waltz perf produce``, ``consume`` and ``disk``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from ..cli.logs import log_format_option
from ..hookspecs import hookimpl

T = TypeVar("T")

_target_options = [
    click.option("--config", "config_path", type=click.Path(dir_okay=False, exists=True),
                 help="client.toml of the cluster to measure."),
    click.option("--local", is_flag=True,
                 help="Start a throw-away cluster (3 storages, 1 server, TCP, fdatasync) in a temp dir, then stop it."),
    click.option("--metrics-url", "metrics_urls", multiple=True,
                 help="A storage node's http://host:port/metrics (repeat per node) for records/fdatasync; "
                      "found automatically with --local."),
    click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the text report."),
]


def _with_target(fn: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(_target_options):
        fn = option(fn)
    return fn


@contextlib.asynccontextmanager
async def _target(config_path: str | None, local: bool, partitions: int, metrics_urls: tuple[str, ...]
                  ) -> AsyncIterator[tuple[Any, list[str], dict[str, list[int]]]]:
    """(client config, metrics URLs, pids by process kind) of the cluster to measure."""
    if local == bool(config_path):
        raise click.UsageError("give exactly one of --config client.toml or --local")
    if config_path:
        from ..cli.context import current_runtime
        from ..config import ClientProcessConfig, load

        yield (load(ClientProcessConfig, Path(config_path), registries=current_runtime().registries),
               list(metrics_urls), {})
        return
    from .cluster import local_cluster

    async with local_cluster(partitions) as cluster:
        yield cluster.client_config, cluster.metrics_urls, {"server": cluster.server_pids,
                                                            "storages": cluster.storage_pids}


def _run(main: Callable[[], Awaitable[T]]) -> T:
    """``asyncio.run(main())`` where SIGTERM (``timeout``, ``kill``) cancels the run as Ctrl-C does,
    so that a ``--local`` cluster is stopped instead of left running without its parent; on the
    loop ``WALTZ_PROCESS_EVENT_LOOP`` names (default auto, see :mod:`waltz_core.eventloop`)."""

    async def guarded() -> T:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        loop.add_signal_handler(signal.SIGTERM, task.cancel)
        try:
            return await main()
        finally:
            loop.remove_signal_handler(signal.SIGTERM)

    from ..eventloop import event_loop_from_env, run

    event_loop = event_loop_from_env()
    try:
        return run(guarded(), event_loop)
    except asyncio.CancelledError:
        click.echo("waltz perf: terminated (SIGTERM); the local cluster was stopped", err=True)
        raise click.exceptions.Exit(128 + signal.SIGTERM) from None


def _quiet() -> None:
    import logging

    logging.getLogger("waltz.client").addFilter(lambda record: "not encrypted" not in record.getMessage())


@contextlib.contextmanager
def _progress(total: float | None, what: str, enabled: bool) -> Any:
    """A rich progress bar on stderr; yields ``update(done, elapsed)``."""
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.fields[status]}"),
                        TimeElapsedColumn(), console=Console(stderr=True), transient=True)
    with progress:
        task = progress.add_task(what, total=total or None, status="")

        def update(done: int, elapsed: float) -> None:
            rate = done / elapsed if elapsed > 0 else 0.0
            progress.update(task, completed=elapsed if total else done, status=f"{done:,} done, {rate:,.0f}/s")

        yield update


def _plot(result: Any, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install matplotlib)"
    buckets = list(result.latency.buckets())
    total = sum(n for _, n in buckets)
    xs, ys, seen = [], [], 0
    for edge, n in buckets:
        seen += n
        xs.append(edge * 1e3)
        ys.append(1.0 / max(1e-9, 1.0 - seen / total) if seen < total else None)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([x for x, y in zip(xs, ys, strict=True) if y], [y for y in ys if y])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_yticks([2, 10, 100, 1000], ["p50", "p90", "p99", "p99.9"])
    ax.set_xlabel("latency (ms), submit to on_completion")
    ax.set_title(f"waltz perf produce: {result.txn_per_s:,.0f} txn/s")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return f"latency plot written to {path}"


def _start_timeline(directory: Path) -> Any:
    """Record this process's timeline (label ``client``) and hand the directory to the processes
    a ``--local`` cluster starts (they inherit the environment)."""
    import os

    from .timeline import (
        ENV_DIR,
        TimelineError,
        check_directory,
        install,
        stall_threshold_from_env,
        watchdog_interval_from_env,
    )

    try:
        path = check_directory(directory)
        if any(path.glob("*.json")):
            raise TimelineError(f"timeline directory {path} already holds dumps (*.json) of another run: "
                                "give an empty or new directory")
        recorder = install(path, "client", interval=watchdog_interval_from_env(), threshold=stall_threshold_from_env())
    except TimelineError as exc:
        raise click.UsageError(str(exc)) from None
    os.environ[ENV_DIR] = str(recorder.directory.resolve())  # this one's, if WALTZ_TIMELINE_DIR set it first
    return recorder


@click.group("perf")
def perf_group() -> None:
    """Measure a cluster: producers and consumers through the client library."""


@perf_group.command("produce")
@_with_target
@click.option("--txn-size", type=click.IntRange(0), default=256, show_default=True, help="Bytes of data per transaction.")
@click.option("--clients", type=click.IntRange(1), default=1, show_default=True, help="Client instances (one loop).")
@click.option("--in-flight", type=click.IntRange(1), default=64, show_default=True,
              help="client.max_concurrent_transactions; closed loop: workers per client and partition.")
@click.option("--rate", type=click.FloatRange(0, min_open=True),
              help="Open loop: total transactions/s, Poisson arrivals. Default: closed loop.")
@click.option("--partitions", type=click.IntRange(1), default=1, show_default=True,
              help="Active partitions (and the partitions of a --local cluster).")
@click.option("--lock-pool", type=click.IntRange(0), default=0, show_default=True,
              help="Each transaction write-locks a random lock of this pool (0: no locks).")
@click.option("--duration", type=click.FloatRange(0, min_open=True), default=10.0, show_default=True,
              help="Seconds measured (after the warm-up).")
@click.option("--count", type=click.IntRange(1), help="Stop after this many measured transactions.")
@click.option("--warmup", type=click.FloatRange(0), default=2.0, show_default=True, help="Seconds not measured.")
@click.option("--seed", type=int, help="Seed of arrivals and lock choices.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the latency distribution as PNG (needs matplotlib).")
@click.option("--profile-server", "profile_path", type=click.Path(dir_okay=False, path_type=Path),
              help="With --local: py-spy record the server during the measured window (collapsed stacks).")
@click.option("--timeline", "timeline_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Record a timeline (GC, event-loop stalls, fdatasync, each transaction) in this process and, "
                   "with --local, in the server and storages; dump it in this empty directory and print which "
                   "events explain the latency tail (docs/performance.md).")
@click.option("--tail-quantile", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=0.999,
              show_default=True, help="With --timeline: the tail analysed is the transactions at or above this quantile.")
@log_format_option
def produce_command(config_path: str | None, local: bool, metrics_urls: tuple[str, ...], as_json: bool, txn_size: int,
                    clients: int, in_flight: int, rate: float | None, partitions: int, lock_pool: int, duration: float,
                    count: int | None, warmup: float, seed: int | None, plot_path: Path | None,
                    profile_path: Path | None, timeline_dir: Path | None, tail_quantile: float) -> None:
    """Producer benchmark: transactions/s, MB/s, retries, latency percentiles, records/fdatasync."""
    from .driver import ProduceOptions, produce
    from .profile import py_spy_record, top_functions

    _quiet()
    recorder = _start_timeline(timeline_dir) if timeline_dir is not None else None
    options = ProduceOptions(txn_size=txn_size, clients=clients, in_flight=in_flight, rate=rate, partitions=partitions,
                             lock_pool=lock_pool, duration=duration, count=count, warmup=warmup, seed=seed)

    async def main() -> tuple[Any, list[str]]:
        notes: list[str] = []
        async with _target(config_path, local, partitions, metrics_urls) as (config, urls, pids):
            server_pids = pids.get("server", [])
            with _progress(warmup + duration, "produce", sys.stderr.isatty()) as update:
                profiler = None
                if profile_path is not None:
                    if not server_pids:
                        raise click.UsageError("--profile-server needs --local")
                    profiler = py_spy_record(server_pids[0], profile_path, warmup, duration)
                from ..cli.process import started

                started()  # as a server does once it serves: WALTZ_GC (freeze the start-up objects)
                try:
                    result = await produce(config, options, metrics_urls=urls, progress=update, processes=pids)
                finally:
                    if profiler is not None:
                        notes.extend(await asyncio.to_thread(profiler.finish))
            if profile_path is not None and profile_path.exists():
                notes.append("server profile, top functions by own samples:")
                notes.extend(f"  {line}" for line in top_functions(profile_path))
        return result, notes

    result, notes = _run(main)
    if plot_path is not None:
        notes.append(_plot(result, plot_path))
    out = result.to_json()
    tail_lines: list[str] = []
    if recorder is not None:
        from .timeline import TimelineError, analyse, load

        recorder.dump()  # the cluster's processes wrote theirs when they stopped
        try:
            tail = analyse(load(recorder.directory), quantile=tail_quantile)
        except TimelineError as exc:
            notes.append(f"timeline: {exc}")
        else:
            out["timeline"] = tail.to_json()
            tail_lines = tail.lines()
        if not local:
            notes.append("timeline: only this client recorded; start the cluster's processes with "
                         f"WALTZ_TIMELINE_DIR={recorder.directory} to see theirs")
    if as_json:
        click.echo(json.dumps(out))
    else:
        for line in result.report():
            click.echo(line)
        if tail_lines:
            click.echo("")
        for line in tail_lines:
            click.echo(line)
    for line in notes:
        click.echo(line, err=as_json)


@perf_group.command("consume")
@_with_target
@click.option("--partition", type=click.IntRange(0), default=0, show_default=True)
@click.option("--mode", type=click.Choice(["feed", "data", "both"]), default="both", show_default=True,
              help="feed: headers only; data: feed + each transaction's data; both: one then the other.")
@click.option("--populate", type=click.IntRange(0), default=0,
              help="First append this many transactions (closed loop, 64 in flight). Default with --local: 20000.")
@click.option("--txn-size", type=click.IntRange(0), default=256, show_default=True, help="Bytes per populated transaction.")
@click.option("--limit", type=click.IntRange(1), help="Read at most this many transactions.")
@click.option("--read-ahead", type=click.IntRange(0),
              help="Data mode reads each transaction's data in order (Transaction.fetch_data); this overrides "
                   "client.data_read_ahead, the most transactions the client's read-ahead fetches per RPC "
                   "(default: the config's, 256). 0: one RPC per transaction.")
@log_format_option
def consume_command(config_path: str | None, local: bool, metrics_urls: tuple[str, ...], as_json: bool, partition: int,
                    mode: str, populate: int, txn_size: int, limit: int | None, read_ahead: int | None) -> None:
    """Consumer benchmark from the start of a populated partition: headers/s and transactions/s with data."""
    from .driver import ProduceOptions, consume, produce

    _quiet()
    if local and not populate:
        populate = 20000

    async def main() -> list[Any]:
        results = []
        async with _target(config_path, local, partition + 1, metrics_urls) as (config, _urls, _pids):
            if populate:
                with _progress(None, f"populate {populate}", sys.stderr.isatty()) as update:
                    await produce(config, ProduceOptions(txn_size=txn_size, in_flight=64, partitions=partition + 1,
                                                         duration=None, count=populate, warmup=0.0),
                                  progress=update)
            for with_data in {"feed": [False], "data": [True], "both": [False, True]}[mode]:
                with _progress(None, "consume " + ("feed+data" if with_data else "feed"), sys.stderr.isatty()) as update:
                    results.append(await consume(config, partition, with_data=with_data, limit=limit,
                                                 read_ahead=read_ahead, progress=update))
        return results

    results = _run(main)
    if as_json:
        click.echo(json.dumps({"consume": [r.to_json() for r in results]}))
    else:
        for r in results:
            click.echo(r.report())


@perf_group.command("disk")
@click.option("--dir", "directory", type=click.Path(file_okay=False, exists=True, writable=True, path_type=Path),
              help="A directory on the disk to measure (a storage node's data directory). Default: the temp "
                   "directory, where --local clusters write.")
@click.option("--rate", type=click.FloatRange(0, min_open=True), default=5000.0, show_default=True,
              help="Commits offered per second (Poisson arrivals, as `perf produce --rate`).")
@click.option("--replicas", type=click.IntRange(1, 64), default=3, show_default=True,
              help="Writers flushing the disk at once: the storage nodes that share it (1 when each node "
                   "has a disk of its own).")
@click.option("--quorum", type=click.IntRange(1), default=2, show_default=True,
              help="Replicas a commit waits for (at most --replicas).")
@click.option("--record-size", type=click.IntRange(1, 1024 * 1024), default=300, show_default=True,
              help="Bytes a commit adds to a round's write (a stored record: 256 B of data and its head).")
@click.option("--round-interval", type=click.FloatRange(0), default=0.0, show_default=True,
              help="Least milliseconds from one round's start to the next one's, as a node's CPU per round "
                   "spaces them (0: the next round starts when one ends). 1000 x a cluster's records per "
                   "fdatasync / its commits per second flushes as often as its nodes did.")
@click.option("--duration", type=click.FloatRange(0, min_open=True), default=8.0, show_default=True,
              help="Seconds of arrivals.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the text report.")
def disk_command(directory: Path | None, rate: float, replicas: int, quorum: int, record_size: int,
                 round_interval: float, duration: float, as_json: bool) -> None:
    """The commit latency a disk allows at a rate, without Waltz: writers run a storage node's
    rounds (one write and one fdatasync of what arrived) on it, and a commit is durable on a quorum."""
    import tempfile

    from .diskfloor import measure

    if quorum > replicas:
        raise click.BadParameter(f"{quorum} is more than --replicas ({replicas})", param_hint="--quorum")
    try:
        floor = measure(directory or tempfile.gettempdir(), writers=replicas, quorum=quorum, rate=rate,
                        seconds=duration, record_size=record_size, round_interval=round_interval / 1e3)
    except (OSError, RuntimeError, ValueError) as exc:
        raise click.ClickException(f"cannot measure the disk: {exc}") from None
    click.echo(json.dumps(floor.to_json()) if as_json else floor.summary())


@hookimpl
def waltz_add_commands(cli: click.Group) -> None:
    cli.add_command(perf_group)
