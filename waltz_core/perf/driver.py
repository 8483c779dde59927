"""The load drivers of ``waltz perf``: producers and consumers built on the client library.

Everything runs on one asyncio event loop with :class:`~waltz_core.client.AsyncWaltzClient`, so
the figures are what an application sees: ``execute`` builds the transaction (data + CRC + write
lock), the latency of a transaction runs from the moment it is handed to ``submit()`` to its
``on_completion(True)`` (the client saw it committed in the feed), and retries are the client's
own re-executions after lock failures.

Load shapes:

* **closed loop** (``rate=None``): every client runs ``in_flight`` workers per active partition;
  a worker submits, waits until its transaction is applied, and submits the next. Outstanding
  transactions = clients x partitions x in_flight.
* **open loop** (``rate`` = transactions/s over all clients): arrivals are Poisson (exponential
  gaps, one arrival process per client and partition) and each arrival is submitted at once,
  whatever is outstanding; back pressure inside ``submit()`` (``client.max_concurrent_transactions``)
  counts in the latency (from the scheduled arrival), so a saturated cluster shows as growing
  latency, not as a silently lower offered rate.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from array import array
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from ..client import AsyncWaltzClient, PartitionLocalLock, TransactionBuilder, TransactionContext, WaltzClientCallbacks
from ..client.api import Transaction
from ..config import ClientProcessConfig
from ..errors import WaltzError
from ..inbox import Inbox
from ..timeouts import wait_for
from . import timeline
from .cluster import StorageCounters, scrape_storages
from .cpu import CpuSample, HostCpuSample
from .histogram import LatencyHistogram

#: Called about 5 times a second with (done, elapsed seconds) for a progress display.
ProgressFn = Callable[[int, float], None]


@attrs.frozen
class ProduceOptions:
    """One producer run. ``duration`` and ``count`` both bound the measured part (first reached wins)."""

    txn_size: int = 256
    clients: int = 1
    in_flight: int = 64
    rate: float | None = None
    partitions: int = 1
    lock_pool: int = 0
    own_locks: bool = False  #: each closed-loop worker writes its own lock (the etcd-comparison shape)
    duration: float | None = 10.0
    count: int | None = None
    warmup: float = 1.0
    seed: int | None = None
    drain_timeout: float = 30.0


class NothingMeasuredError(WaltzError):
    """No transaction committed in a producer run's measured window: every figure would be a zero
    that means nothing (the cluster not taking writes yet, or a window too short for it)."""


@attrs.define
class ProduceResult:
    """Figures of one producer run (the measured window only, warm-up excluded)."""

    options: ProduceOptions
    elapsed: float = 0.0
    committed: int = 0
    executions: int = 0  #: executions of the committed transactions (1 + re-executions each)
    lock_failures: int = 0
    failed: int = 0
    latency: LatencyHistogram = attrs.Factory(LatencyHistogram)
    storage: StorageCounters | None = None
    cpu: CpuSample | None = None  #: CPU seconds per process group over the measured window
    #: the whole machine over the measured window: busy and steal percent, cores (None: unknown)
    host_cpu: dict[str, float] | None = None

    @property
    def cpu_us_per_txn(self) -> dict[str, float] | None:
        return self.cpu.per_transaction_us(self.committed) if self.cpu is not None else None

    @property
    def txn_per_s(self) -> float:
        return self.committed / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def mb_per_s(self) -> float:
        return self.txn_per_s * self.options.txn_size / 1e6

    @property
    def retries_per_txn(self) -> float:
        return (self.executions - self.committed) / self.committed if self.committed else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "options": attrs.asdict(self.options),
            "elapsed_s": round(self.elapsed, 3),
            "committed": self.committed,
            "failed": self.failed,
            "transactions_per_s": round(self.txn_per_s, 1),
            "mb_per_s": round(self.mb_per_s, 3),
            "retries_per_txn": round(self.retries_per_txn, 4),
            "lock_failures": self.lock_failures,
            "latency_ms": self.latency.summary_ms(),
            "storage_records": self.storage.records if self.storage else None,
            "storage_fdatasyncs": self.storage.syncs if self.storage else None,
            "records_per_fdatasync": (round(self.storage.records_per_sync, 2)
                                      if self.storage and self.storage.records_per_sync is not None else None),
            "cpu_us_per_txn": self.cpu_us_per_txn,
            "host_cpu": self.host_cpu,
        }

    def report(self) -> list[str]:
        o, lat = self.options, self.latency.summary_ms()
        shape = f"open loop {o.rate:g}/s (Poisson)" if o.rate else f"closed loop, {o.in_flight} in flight per client/partition"
        storage = self.storage
        rps = storage.records_per_sync if storage else None
        return [
            f"producers: {o.clients} client(s), {o.partitions} partition(s), {o.txn_size} B, lock pool "
            f"{'own lock per worker' if o.own_locks else o.lock_pool}, {shape}",
            f"committed        {self.committed} in {self.elapsed:.2f} s ({self.failed} failed/expired)",
            f"transactions/s   {self.txn_per_s:,.1f}",
            f"MB/s             {self.mb_per_s:.3f}",
            f"retries/txn      {self.retries_per_txn:.4f} ({self.lock_failures} lock failures)",
            f"latency ms       p50 {lat['p50']}  p90 {lat['p90']}  p99 {lat['p99']}  p99.9 {lat['p99.9']}  "
            f"mean {lat['mean']}  max {lat['max']}",
            "records/fdatasync " + (f"{rps:.2f} ({storage.records:.0f} records, {storage.syncs:.0f} syncs "
                                    "over all storages)" if storage and rps is not None else
                                    "no syncs seen" if storage else "unknown (no storage /metrics to scrape)"),
            "CPU us/txn       " + ("  ".join(f"{k} {v:.1f}" for k, v in cpu.items()) if (cpu := self.cpu_us_per_txn)
                                   else "unknown (no /proc or no processes given)"),
            "host CPU         " + (f"busy {host['busy_percent']:.1f} %, steal {host['steal_percent']:.1f} % of "
                                   f"{host['cores']:g} cores (steal: time the hypervisor gave to others)"
                                   if (host := self.host_cpu) else "unknown (no /proc/stat)"),
        ]


class _Feed(WaltzClientCallbacks):
    """Starts each partition at the server's high-water mark; applying is a no-op (a producer)."""

    def __init__(self, hwms: dict[int, int]) -> None:
        self.hwms = hwms

    def client_high_water_mark(self, partition_id: int) -> int:
        return self.hwms.get(partition_id, -1)

    def apply_transaction(self, transaction: Transaction) -> None:
        return None


class _Run:
    """Counters shared by every context of one run (event loop only)."""

    def __init__(self, options: ProduceOptions, payload: bytes) -> None:
        self.options = options
        self.payload = payload
        self.measuring = False
        self.stopping = False
        self.result = ProduceResult(options)
        self.done = 0  # committed since the start, warm-up included (progress)
        self.finished = asyncio.Event()

    def committed(self, latency: float, executions: int) -> None:
        self.done += 1
        if self.measuring:
            r = self.result
            r.committed += 1
            r.executions += executions  # only with the commit it belongs to, or retries/txn is skewed
            r.latency.record(latency)
            count = self.options.count
            if count is not None and r.committed >= count:
                self.finished.set()


class _TimelineRun(_Run):
    """A run that also records each measured transaction's (start, completion) on the process's
    timeline (:mod:`.timeline`); chosen once per run, so a run without a timeline has no branch."""

    def __init__(self, options: ProduceOptions, payload: bytes, txns: array[float]) -> None:
        super().__init__(options, payload)
        self.txns = txns

    def committed(self, latency: float, executions: int) -> None:
        if self.measuring:
            end = time.perf_counter()
            self.txns.append(end - latency)
            self.txns.append(end)
        super().committed(latency, executions)


class _PerfTransaction(TransactionContext):
    def __init__(self, run: _Run, partition: int, lock: PartitionLocalLock | None,
                 done: Inbox[int] | None, scheduled: float | None = None, worker: int = 0) -> None:
        super().__init__()
        self.run = run
        self.partition = partition
        self.lock = lock
        #: the closed loop's workers without a transaction in flight, where this one's worker goes
        #: back once it completed (None in the open loop)
        self.done = done
        self.worker = worker
        #: latency starts here: the open loop's scheduled arrival, so a driver that falls behind
        #: its schedule (timer resolution, a busy loop) cannot hide that delay
        self.started = time.perf_counter() if scheduled is None else scheduled
        self.measured = run.measuring
        self.attempts = 0

    def partition_id(self, num_partitions: int) -> int:
        return self.partition

    def execute(self, builder: TransactionBuilder) -> bool:
        self.attempts += 1
        builder.set_transaction_data(self.run.payload)
        if self.lock is not None:
            builder.set_write_locks((self.lock,))
        return True

    def on_completion(self, result: bool) -> None:
        if result and self.measured:
            self.run.committed(time.perf_counter() - self.started, self.attempts)
        elif result:
            self.run.done += 1

    def on_application(self) -> None:
        self._release()

    def on_lock_failure(self) -> None:
        if self.measured:
            self.run.result.lock_failures += 1

    def on_exception(self, exc: BaseException) -> None:
        self._fail()

    def on_expiration(self) -> None:
        self._fail()

    def _fail(self) -> None:
        if self.measured:
            self.run.result.failed += 1
        self._release()

    def _release(self) -> None:
        done = self.done
        if done is not None:
            self.done = None  # once: a failure after the application must not give a place back twice
            done.put(self.worker)


async def start_client(config: ClientProcessConfig, partitions: Sequence[int], *, in_flight: int = 5,
                       callbacks: WaltzClientCallbacks | None = None, hwms: dict[int, int] | None = None,
                       mount_timeout: float = 30.0) -> AsyncWaltzClient:
    """A started client mounting ``partitions`` from ``hwms`` (default: the servers' current
    high-water marks, so a producer does not replay the log's history)."""
    cfg = attrs.evolve(config, client=attrs.evolve(config.client, auto_mount=False,
                                                   max_concurrent_transactions=max(1, in_flight)))
    marks: dict[int, int] = {} if hwms is None else dict(hwms)
    client = AsyncWaltzClient(callbacks or _Feed(marks), cfg)
    await client.start()
    try:
        if hwms is None:
            for pid in partitions:
                marks[pid] = await client.high_water_mark(pid)
            if isinstance(client.callbacks, _Feed):
                client.callbacks.hwms.update(marks)
        await client.set_partitions(partitions)
        await client.wait_mounted(mount_timeout)
    except BaseException:
        await client.close()
        raise
    return client


async def produce(config: ClientProcessConfig, options: ProduceOptions, *, metrics_urls: Sequence[str] = (),
                  progress: ProgressFn | None = None,
                  processes: Mapping[str, Sequence[int]] | None = None) -> ProduceResult:
    """Run producers against the cluster of ``config``; returns the measured figures.

    ``processes`` names groups of pids (e.g. ``{"server": [...], "storages": [...]}``) whose CPU
    time over the measured window is reported per transaction, next to this process's
    (``client``). Blocks the loop only for the metrics scrapes (two short HTTP GETs, in a thread).
    """
    cpu_groups = {"client": [os.getpid()], **(processes or {})}
    if options.duration is None and options.count is None:
        raise ValueError("give a duration or a count")
    rng = random.Random(options.seed)
    recorder = timeline.current()
    run = _Run(options, os.urandom(options.txn_size)) if recorder is None else \
        _TimelineRun(options, os.urandom(options.txn_size), recorder.txns)
    clients: list[AsyncWaltzClient] = []
    tasks: list[asyncio.Task[None]] = []
    partitions = list(range(options.partitions))
    try:
        for _ in range(options.clients):
            clients.append(await start_client(config, partitions, in_flight=options.in_flight))
        if any(c.num_partitions < options.partitions for c in clients):
            raise ValueError(f"the cluster has {clients[0].num_partitions} partitions, {options.partitions} asked")
        for ci, client in enumerate(clients):
            if options.rate:
                share = options.rate / options.clients / options.partitions
                tasks.extend(asyncio.create_task(_open_loop(run, client, pid, share, rng)) for pid in partitions)
            else:
                for pid in partitions:
                    own = [PartitionLocalLock("perf-own", (ci << 20) | w) for w in range(options.in_flight)] \
                        if options.own_locks else None
                    tasks.append(asyncio.create_task(_closed_loop(run, client, pid, options.in_flight, own, rng)))
        t0 = time.perf_counter()
        await _tick_until(run, t0, t0 + options.warmup, None, progress)
        before = await asyncio.to_thread(scrape_storages, metrics_urls)
        cpu_before = CpuSample.take(cpu_groups)
        host_before = HostCpuSample.take()
        run.measuring = True
        start = time.perf_counter()
        if recorder is not None:
            recorder.mark("measure_start", start)
        end = None if options.duration is None else start + options.duration
        await _tick_until(run, t0, end, run.finished, progress)
        run.result.elapsed = time.perf_counter() - start
        run.measuring = False
        if recorder is not None:
            recorder.mark("measure_end")
        cpu_after = CpuSample.take(cpu_groups)
        host_after = HostCpuSample.take()
        if cpu_before is not None and cpu_after is not None:
            run.result.cpu = cpu_after - cpu_before
        if host_before is not None and host_after is not None:
            run.result.host_cpu = host_after.shares_since(host_before)
        after = await asyncio.to_thread(scrape_storages, metrics_urls)
        if before is not None and after is not None:
            run.result.storage = after - before
        if not run.result.committed:
            raise NothingMeasuredError(
                f"no transaction committed in the {run.result.elapsed:.2f} s measured after a warm-up of "
                f"{options.warmup:g} s ({run.result.failed} failed or expired, {run.done} committed in the warm-up): "
                "the partitions may not be taking writes yet (a longer warm-up) or at all (the cluster's logs)")
        run.stopping = True
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for client in clients:
            try:
                await wait_for(client.flush(), options.drain_timeout)
            except TimeoutError:
                pass
        return run.result
    finally:
        for t in tasks:
            t.cancel()
        for client in clients:
            await client.close()


async def _tick_until(run: _Run, t0: float, end: float | None, stop: asyncio.Event | None,
                      progress: ProgressFn | None) -> None:
    while end is None or time.perf_counter() < end:
        if stop is not None and stop.is_set():
            return
        if progress is not None:
            progress(run.done, time.perf_counter() - t0)
        step = 0.2 if end is None else min(0.2, max(0.0, end - time.perf_counter()))
        if stop is None:
            await asyncio.sleep(step)
        else:
            try:
                await wait_for(stop.wait(), step)
            except TimeoutError:
                pass
    if progress is not None:
        progress(run.done, time.perf_counter() - t0)


def _pool_lock(run: _Run, rng: random.Random) -> PartitionLocalLock | None:
    pool = run.options.lock_pool
    return PartitionLocalLock("perf", rng.randrange(pool)) if pool > 0 else None


async def _closed_loop(run: _Run, client: AsyncWaltzClient, pid: int, workers: int,
                       own: list[PartitionLocalLock] | None, rng: random.Random) -> None:
    """``workers`` (``client.max_concurrent_transactions``) of one partition, each with one
    transaction in flight: a worker whose transaction completed submits the next. They share this
    task, which the completions of a batch wake once (a task per worker woke once per
    transaction: 64 wake-ups for a commit batch of 64). ``own``: each worker's own lock (else the
    pool's)."""
    free: Inbox[int] = Inbox(workers + 1)  # never full: a worker is in it or has a transaction in flight
    for worker in range(workers):
        free.put(worker)
    waiting = free.items
    while not run.stopping:
        await free.wait()
        while waiting and not run.stopping:
            worker = free.popleft()
            lock = own[worker] if own is not None else _pool_lock(run, rng)
            await client.submit(_PerfTransaction(run, pid, lock, free, worker=worker))


#: The open loop sleeps at least this long when it is ahead of its schedule, then submits every
#: arrival that is due: one wake-up per millisecond instead of one per arrival. asyncio's
#: selector rounds its timeouts up to a millisecond anyway; uvloop runs a shorter timer on the
#: next turn of the loop, and at 31,000 arrivals/s that cost the client 14 instead of 8 µs per
#: transaction and the whole cluster 49 instead of 38 (smaller batches: docs/performance.md).
#: Latency still counts from each arrival's scheduled time, the wait in the client included.
ARRIVAL_TICK = 0.001


async def _open_loop(run: _Run, client: AsyncWaltzClient, pid: int, rate: float, rng: random.Random) -> None:
    """Poisson arrivals at ``rate``/s for partition ``pid``, each submitted when it arrives.

    One loop per client and partition, each at its share of the rate: independent Poisson
    processes add up to one at the total rate, as if each arrival picked a random partition. The
    submit is awaited here, not in a task of its own: when a slot is free it returns without
    suspending (no task, no wake-up per transaction), and when the partition is at
    ``client.max_concurrent_transactions`` the later arrivals of that partition wait behind it in
    order, as tasks queued on the slot would, their latency still counted from their scheduled
    arrival (the loop catches up on its schedule when the slot frees).
    """
    next_at = time.perf_counter()
    while not run.stopping:
        next_at += rng.expovariate(rate)
        delay = next_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(max(delay, ARRIVAL_TICK))
        ctx = _PerfTransaction(run, pid, _pool_lock(run, rng), None, scheduled=next_at)
        try:
            await client.submit(ctx)
        except WaltzError:  # e.g. the partition not mounted in time: this arrival failed, not the run
            if ctx.measured and ctx.attempts == 0:  # after an execution, on_exception counted it
                run.result.failed += 1


# ------------------------------------------------------------------------------ consumers


@attrs.define
class ConsumeResult:
    """Figures of one consumer run over ``transactions`` transactions of one partition."""

    partition: int
    with_data: bool
    transactions: int = 0
    elapsed: float = 0.0
    data_bytes: int = 0

    @property
    def per_s(self) -> float:
        return self.transactions / self.elapsed if self.elapsed > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"partition": self.partition, "mode": "feed+data" if self.with_data else "feed",
                "transactions": self.transactions, "elapsed_s": round(self.elapsed, 3),
                "per_s": round(self.per_s, 1), "mb_per_s": round(self.data_bytes / self.elapsed / 1e6, 3)
                if self.with_data and self.elapsed > 0 else None}

    def report(self) -> str:
        unit = "transactions/s with data" if self.with_data else "headers/s (feed only)"
        extra = f", {self.data_bytes / self.elapsed / 1e6:.2f} MB/s" if self.with_data and self.elapsed > 0 else ""
        return f"{self.transactions} transactions of partition {self.partition} in {self.elapsed:.2f} s: " \
               f"{self.per_s:,.1f} {unit}{extra}"


class _Counting(WaltzClientCallbacks):
    """Counts the feed from the start of the log; with data, awaits each transaction's data in
    ``apply_transaction``, in order, as an application does (the client's read-ahead fetches
    ranges of transactions ahead of it)."""

    def __init__(self, target: int, with_data: bool, result: ConsumeResult) -> None:
        self.target = target
        self.with_data = with_data
        self.result = result
        self.done = asyncio.Event()
        self.error: BaseException | None = None

    def client_high_water_mark(self, partition_id: int) -> int:
        return -1

    async def apply_transaction(self, transaction: Transaction) -> None:
        if self.done.is_set():
            return
        if self.with_data:
            try:
                data = await transaction.fetch_data()
            except Exception as exc:  # noqa: BLE001 - reported, ends the run
                self.error = exc
                self.done.set()
                return
            self.result.data_bytes += len(data)
        self.result.transactions += 1
        if self.result.transactions >= self.target:
            self.done.set()


async def consume(config: ClientProcessConfig, partition: int, *, with_data: bool, limit: int | None = None,
                  read_ahead: int | None = None, timeout: float = 300.0, progress: ProgressFn | None = None
                  ) -> ConsumeResult:
    """Read partition ``partition`` from its first transaction up to its current high-water mark
    (at most ``limit`` transactions): feed only, or feed + data fetched by RPC. ``read_ahead``
    overrides ``client.data_read_ahead`` (0: one data RPC per transaction)."""
    probe = await start_client(config, [], in_flight=1)
    try:
        hwm = await probe.high_water_mark(partition)
    finally:
        await probe.close()
    target = hwm + 1 if limit is None else min(limit, hwm + 1)
    result = ConsumeResult(partition, with_data)
    if target <= 0:
        return result
    callbacks = _Counting(target, with_data, result)
    client_cfg = attrs.evolve(config.client, auto_mount=False)
    if read_ahead is not None:
        client_cfg = attrs.evolve(client_cfg, data_read_ahead=read_ahead)
    cfg = attrs.evolve(config, client=client_cfg)
    client = AsyncWaltzClient(callbacks, cfg)
    await client.start()
    try:
        start = time.perf_counter()
        await client.set_partitions([partition])
        deadline = start + timeout
        while not callbacks.done.is_set():
            if progress is not None:
                progress(result.transactions, time.perf_counter() - start)
            if time.perf_counter() > deadline:
                raise TimeoutError(f"consumed {result.transactions} of {target} transactions in {timeout}s")
            try:
                await wait_for(callbacks.done.wait(), 0.2)
            except TimeoutError:
                pass
        result.elapsed = time.perf_counter() - start
        if progress is not None:
            progress(result.transactions, result.elapsed)
        if callbacks.error is not None:
            raise callbacks.error
        return result
    finally:
        await client.close()
