"""Where ``waltz perf`` runs: a throw-away local cluster, and the storages' Prometheus counters.

``records per fdatasync`` is read from the storage nodes, not guessed: every storage partition
counts ``waltz_storage_appended_records_total`` and every I/O thread ``waltz_storage_append_syncs_total``
(the fdatasyncs that made appends durable: one per partition batch, or one per round with the node
journal, :mod:`waltz_core.storage.node`); the ratio of their deltas over the measured window is the
group-commit factor the run achieved.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import tempfile
import urllib.request
from collections.abc import AsyncIterator, Iterable, Sequence
from pathlib import Path

import attrs

from ..config import ClientProcessConfig

RECORDS_METRIC = "waltz_storage_appended_records_total"
SYNCS_METRIC = "waltz_storage_append_syncs_total"
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


@attrs.frozen
class StorageCounters:
    """Sums over every storage node and partition scraped."""

    records: float = 0.0
    syncs: float = 0.0

    def __sub__(self, other: StorageCounters) -> StorageCounters:
        return StorageCounters(self.records - other.records, self.syncs - other.syncs)

    @property
    def records_per_sync(self) -> float | None:
        return self.records / self.syncs if self.syncs > 0 else None


def parse_prometheus(text: str, names: Iterable[str]) -> dict[str, float]:
    """Sum of every sample of each metric in ``names`` (labels ignored) in Prometheus text format."""
    wanted = set(names)
    sums = dict.fromkeys(wanted, 0.0)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match and match.group(1) in wanted:
            try:
                sums[match.group(1)] += float(match.group(3))
            except ValueError:
                continue
    return sums


def scrape_storages(urls: Sequence[str], timeout: float = 2.0) -> StorageCounters | None:
    """Read the append counters from each ``/metrics`` URL (blocking); None if there are no URLs
    or one of them cannot be read (the figure is then reported as unknown, never as 0)."""
    if not urls:
        return None
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never a proxy
    records = syncs = 0.0
    for url in urls:
        try:
            with opener.open(url, timeout=timeout) as resp:
                sums = parse_prometheus(resp.read().decode(), (RECORDS_METRIC, SYNCS_METRIC))
        except OSError:
            return None
        records += sums[RECORDS_METRIC]
        syncs += sums[SYNCS_METRIC]
    return StorageCounters(records, syncs)


@attrs.define
class LocalPerfCluster:
    """What a started ``--local`` cluster offers a benchmark."""

    client_config: ClientProcessConfig
    metrics_urls: list[str]
    server_pids: list[int]
    storage_pids: list[int]
    directory: Path


@contextlib.asynccontextmanager
async def local_cluster(partitions: int, *, storages: int = 3, ready_timeout: float = 60.0,
                        keep_dir: Path | None = None) -> AsyncIterator[LocalPerfCluster]:
    """Start ``storages`` storage processes and one server (TCP, embedded coordination, HTTP
    metrics on) in a temporary directory; stop them and remove the directory on exit.

    Runs on the caller's event loop; the processes are real subprocesses, so the benchmark's
    client does not share a GIL with them.
    """
    from ..app.local_cluster import ClusterSpec, ProcessCluster
    from ..app.up import wait_served

    directory = Path(tempfile.mkdtemp(prefix="waltz-perf-", dir=keep_dir))
    spec = ClusterSpec(directory, num_partitions=partitions, num_storages=storages, num_servers=1, http=True)
    cluster = ProcessCluster(spec)

    def dead() -> str | None:
        for kind, procs in (("storage", cluster.storages), ("server", cluster.servers)):
            for i, proc in procs.items():
                if proc.poll() is not None:
                    return f"{kind}-{i} exited with {proc.returncode}:\n{cluster.logs()}"
        return None

    try:
        await cluster.start()
        await wait_served(spec.client_config(), partitions, ready_timeout, dead)
        yield LocalPerfCluster(
            client_config=spec.client_config(),
            metrics_urls=[f"http://127.0.0.1:{node.http_port}/metrics" for node in spec.storages],
            server_pids=[p.pid for p in cluster.servers.values()],
            storage_pids=[p.pid for p in cluster.storages.values()],
            directory=directory)
    finally:
        cluster.stop()
        if keep_dir is None:
            shutil.rmtree(directory, ignore_errors=True)
