"""``WaltzClient``: the blocking facade over :class:`~.core.AsyncWaltzClient`.

The client runs its own event loop on a daemon thread (``waltz-client-loop``) unless it is given
one (the mock cluster shares its loop with the clients it serves).

Threading rules:

* ``submit(ctx)`` runs ``ctx.partition_id`` and ``ctx.execute`` on the **calling thread** (as the
  original); it blocks while the partition is not mounted and while
  ``client.max_concurrent_transactions`` appends of the partition are in flight (back pressure);
* re-executions after a failure, ``on_lock_failure``, ``on_expiration``, ``on_exception`` of
  retries and ``on_completion(False)`` of retries run on the **retry threads**
  (``client.num_retry_workers``, named ``waltz-retry``);
* ``client_high_water_mark``, ``apply_transaction``, ``uncaught_exception``,
  ``on_completion(True)`` and ``on_application`` run on the partition's **consumer thread**
  (``client.num_consumer_threads`` threads, partition ``p`` on thread ``p % n``), so one
  partition's transactions are applied in order, and partitions on different threads apply in
  parallel;
* from a callback you may call ``submit`` (it may block on back pressure) and
  ``Transaction.get_data``, but never ``flush`` or ``close`` (they wait for the consumer threads).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import threading
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, Self, TypeVar

from ..config import ClientProcessConfig
from ..errors import ClientError
from ..metrics import MetricsRegistry
from ..plugins import Registries
from .api import TransactionBuilder, TransactionContext, WaltzClientCallbacks
from .core import AsyncWaltzClient, _call_logged
from .discovery import Discovery

log = logging.getLogger("waltz.client")
T = TypeVar("T")


class ThreadDispatcher:
    """Application code on consumer threads (sharded by partition) and retry threads."""

    threaded = True

    def __init__(self, num_consumers: int, num_retry: int) -> None:
        self.thread_ids: set[int] = set()
        self._consumers = [
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"waltz-consumer-{i}", initializer=self._register)
            for i in range(max(1, num_consumers))
        ]
        self._retry = concurrent.futures.ThreadPoolExecutor(max(1, num_retry), thread_name_prefix="waltz-retry")

    def _register(self) -> None:
        self.thread_ids.add(threading.get_ident())

    async def call(self, partition_id: int, fn: Callable[..., Any], *args: Any) -> Any:
        pool = self._consumers[partition_id % len(self._consumers)]
        return await asyncio.wrap_future(pool.submit(_no_coroutine, fn, *args))

    async def call_retry(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.wrap_future(self._retry.submit(_no_coroutine, fn, *args))

    def close(self) -> None:
        for pool in (*self._consumers, self._retry):
            pool.shutdown(wait=False, cancel_futures=True)


def _no_coroutine(fn: Callable[..., Any], *args: Any) -> Any:
    result = fn(*args)
    if inspect.isawaitable(result):
        if inspect.iscoroutine(result):
            result.close()
        raise ClientError(f"{getattr(fn, '__qualname__', fn)} is async: use AsyncWaltzClient for async callbacks")
    return result


class WaltzClient:
    """A blocking Waltz client (see the module docstring for the threading rules).

    ``WaltzClient(callbacks, config)`` connects and starts mounting before it returns
    (``start_timeout`` bounds the discovery). Use it as a context manager or call :meth:`close`.
    """

    def __init__(self, callbacks: WaltzClientCallbacks, config: ClientProcessConfig | None = None, *,
                 discovery: Discovery | None = None, registries: Registries | None = None,
                 loop: asyncio.AbstractEventLoop | None = None, start_timeout: float = 30.0) -> None:
        self.config = config or ClientProcessConfig()
        self._own_loop = loop is None
        self._thread: threading.Thread | None = None
        if loop is None:
            loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=loop.run_forever, name="waltz-client-loop", daemon=True)
            self._thread.start()
        self._loop = loop
        cfg = self.config.client
        self._dispatcher = ThreadDispatcher(cfg.num_consumer_threads, cfg.num_retry_workers)
        self._core = AsyncWaltzClient(callbacks, self.config, discovery=discovery, registries=registries,
                                      _dispatcher=self._dispatcher)
        self._closed = False
        try:
            self._run(self._core.start(), start_timeout)
        except BaseException:
            self._closed = True
            self._dispatcher.close()
            self._stop_loop()
            raise

    # ------------------------------------------------------------------------------ plumbing

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        if threading.get_ident() == self._core._loop_thread_id:
            coro.close()
            raise ClientError("a blocking WaltzClient method was called on the client's event loop")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _not_on_consumer(self, what: str) -> None:
        if threading.get_ident() in self._dispatcher.thread_ids:
            raise ClientError(f"WaltzClient.{what}() must not be called from an apply callback (it would wait for itself)")

    def _stop_loop(self) -> None:
        if self._own_loop and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()
            self._thread = None

    # ----------------------------------------------------------------------------- the API

    @property
    def client_id(self) -> int:
        return self._core.client_id

    @property
    def num_partitions(self) -> int:
        return self._core.num_partitions

    @property
    def partitions(self) -> frozenset[int]:
        return self._core.partitions

    @property
    def metrics(self) -> MetricsRegistry:
        """The client's ``waltz_client_*`` metrics (see :attr:`AsyncWaltzClient.metrics`)."""
        return self._core.metrics

    @property
    def async_client(self) -> AsyncWaltzClient:
        """The underlying async client (its methods must be called on :attr:`loop`)."""
        return self._core

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def submit(self, context: TransactionContext) -> None:
        """Execute ``context`` on this thread and send its append; blocks for back pressure.

        If ``execute`` raises, ``on_exception`` is called and the exception re-raised; timeouts
        waiting for the partition to mount raise ClientTimeoutError.
        """
        core = self._core
        if context._expired(0):
            _call_logged(context.on_expiration)
            return
        pid = core._partition_of(context)
        p = self._run(core._acquire(pid, self.config.client.mount_timeout))
        builder = TransactionBuilder(pid, p.hwm)
        try:
            ok = context.execute(builder)
        except Exception as exc:
            self._loop.call_soon_threadsafe(p.release_slot)
            _call_logged(context.on_exception, exc)
            raise
        except BaseException:
            self._loop.call_soon_threadsafe(p.release_slot)
            raise
        if not ok:
            self._loop.call_soon_threadsafe(p.release_slot)
            _call_logged(context.on_completion, False)
            return
        self._loop.call_soon_threadsafe(core._send, p, context, builder, 1)

    def flush(self, timeout: float | None = None) -> None:
        """Block until nothing is pending and everything received is applied (see AsyncWaltzClient.flush)."""
        self._not_on_consumer("flush")
        self._run(self._core.flush(), timeout)

    def has_pending(self) -> bool:
        return self._run(_call(self._core.has_pending))

    def high_water_mark(self, partition_id: int) -> int:
        """The server's committed high-water mark of a partition (RPC)."""
        return self._run(self._core.high_water_mark(partition_id))

    def fetch_data_range(self, partition_id: int, first: int, count: int) -> list[bytes]:
        """The data of transactions ``first .. first + count - 1`` of a partition (see
        AsyncWaltzClient.fetch_data_range); may be called from apply callbacks."""
        return self._run(self._core.fetch_data_range(partition_id, first, count))

    def wait_mounted(self, timeout: float | None = None) -> None:
        self._run(self._core.wait_mounted(timeout))

    def set_partitions(self, partition_ids: Iterable[int]) -> None:
        """Mount exactly these partitions (``client.auto_mount = false`` only)."""
        self._not_on_consumer("set_partitions")
        self._run(self._core.set_partitions(partition_ids))

    def close(self) -> None:
        if self._closed:
            return
        self._not_on_consumer("close")
        self._closed = True
        try:
            self._run(self._core.close(), 60)
        finally:
            self._stop_loop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _call(fn: Callable[[], T]) -> T:
    return fn()
