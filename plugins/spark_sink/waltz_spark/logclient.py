"""Blocking access to the log for Spark code: high-water marks, id-range reads, row appends.

Everything here runs on a plain thread (the Spark driver's planner process, or a Python worker
running one task) and uses :class:`~waltz_core.client.WaltzClient`, which keeps its own event
loop on a daemon thread. Nothing imports Spark.

* :class:`LogInfo` - a client that mounts nothing and answers high-water-mark RPCs;
* :func:`read_range` - one partition's transactions ``first..last`` (inclusive) with their data:
  the client mounts the partition from ``first - 1`` so the feed starts at ``first``, and the data
  of up to ``window`` transactions received is fetched with one range RPC
  (``fetch_data_range``: CRC-checked and retried by the client);
* :func:`write_rows` - lives in :mod:`waltz_spark.sink`.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Any, Self

from waltz_core.client import Transaction, WaltzClient, WaltzClientCallbacks
from waltz_core.config import ClientProcessConfig
from waltz_core.errors import ClientError, ClientTimeoutError

Row = tuple[int, int, int, int, int, int, bytes]  #: partition, id, header, client id, generation, seq, data


class _NoFeed(WaltzClientCallbacks):
    """Callbacks of a client that mounts nothing (high-water-mark queries only)."""

    def client_high_water_mark(self, partition_id: int) -> int:
        return -1

    def apply_transaction(self, transaction: Transaction) -> None:
        pass


class LogInfo:
    """A connected client that mounts no partition: partition count and high-water marks.

    Blocking; call from any thread but the client's loop. Close it (or use ``with``).
    """

    def __init__(self, config: ClientProcessConfig) -> None:
        self._client = WaltzClient(_NoFeed(), _unmounted(config))

    @property
    def num_partitions(self) -> int:
        return self._client.num_partitions

    def check_partitions(self, partitions: Iterable[int] | None) -> tuple[int, ...]:
        """The partitions asked for (all when None), each checked to exist."""
        n = self.num_partitions
        if partitions is None:
            return tuple(range(n))
        chosen = tuple(partitions)
        missing = [p for p in chosen if not 0 <= p < n]
        if missing:
            raise ClientError(f"waltz option 'partitions': no partition {missing} (the cluster has {n}: 0..{n - 1})")
        return chosen

    def high_water_marks(self, partitions: Iterable[int]) -> dict[int, int]:
        """The committed high-water mark (last transaction id, -1 if empty) of each partition."""
        async def all_of(ids: list[int]) -> list[int]:
            return list(await asyncio.gather(*(self._client.async_client.high_water_mark(p) for p in ids)))

        ids = list(partitions)
        marks = asyncio.run_coroutine_threadsafe(all_of(ids), self._client.loop).result(
            self._client.config.client.rpc_timeout * 3)
        return dict(zip(ids, marks, strict=True))

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _unmounted(config: ClientProcessConfig, **client: Any) -> ClientProcessConfig:
    import attrs

    return attrs.evolve(config, client=attrs.evolve(config.client, auto_mount=False, **client))


class _RangeFeed(WaltzClientCallbacks):
    """Feeds transactions ``first..last`` of one partition into a bounded queue (consumer thread)."""

    def __init__(self, first: int, last: int, out: queue.Queue[Transaction], stop: threading.Event) -> None:
        self.first = first
        self.last = last
        self.out = out
        self.stop = stop

    def client_high_water_mark(self, partition_id: int) -> int:
        return self.first - 1

    def apply_transaction(self, transaction: Transaction) -> None:
        if transaction.transaction_id > self.last:
            return
        while not self.stop.is_set():  # back pressure: the Spark task consumes slower than the feed
            try:
                self.out.put(transaction, timeout=0.2)
                return
            except queue.Full:
                continue


def read_range(config: ClientProcessConfig, partition: int, first: int, last: int, *, window: int = 256,
               idle_timeout: float = 60.0) -> Iterator[Row]:
    """Yield the transactions ``first..last`` (inclusive) of ``partition`` in id order, with data.

    Blocking generator (a Spark task thread). Raises ClientTimeoutError when the feed stalls for
    ``idle_timeout`` seconds before ``last`` is reached (``last`` must be committed already).
    """
    if last < first:
        return
    out: queue.Queue[Transaction] = queue.Queue(maxsize=max(window * 8, 1024))
    stop = threading.Event()
    client = WaltzClient(_RangeFeed(first, last, out, stop), _unmounted(config, num_consumer_threads=1))
    try:
        client.set_partitions([partition])
        expected = first
        while expected <= last:
            try:
                batch = [out.get(timeout=idle_timeout)]
            except queue.Empty:
                raise ClientTimeoutError(f"partition {partition}: no transaction after {expected - 1} within "
                                         f"{idle_timeout}s (reading up to {last})") from None
            while len(batch) < window:
                try:
                    batch.append(out.get_nowait())
                except queue.Empty:
                    break
            # The feed is gap-free and in order: the batch is one id range (checked below). Each RPC
            # of the fetch is bounded by client.data_fetch_timeout.
            datas = client.fetch_data_range(partition, batch[0].transaction_id, len(batch))
            for txn, data in zip(batch, datas, strict=True):
                if txn.transaction_id != expected:  # the client applies gap-free and in order
                    raise ClientError(f"partition {partition}: expected transaction {expected}, "
                                      f"got {txn.transaction_id}")
                q = txn.req_id
                yield (partition, txn.transaction_id, txn.header, q.client_id, q.generation, q.seq_num, data)
                expected += 1
    finally:
        stop.set()
        client.close()


def split_ranges(bounds: dict[int, tuple[int, int]], range_size: int) -> list[tuple[int, int, int]]:
    """Per partition ``(first, last)`` -> ``(partition, first, last)`` chunks of at most ``range_size``."""
    out = []
    for pid in sorted(bounds):
        first, last = bounds[pid]
        while first <= last:
            end = min(last, first + range_size - 1)
            out.append((pid, first, end))
            first = end + 1
    return out

