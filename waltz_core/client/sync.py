"""``WaltzClient``: the blocking facade over :class:`~.core.AsyncWaltzClient`.

The client runs its own event loop on a daemon thread (``waltz-client-loop``) unless it is given
one (the mock cluster shares its loop with the clients it serves).

Threading rules:

* ``submit(ctx)`` runs ``ctx.execute`` and the outcome callbacks of that first attempt
  (``on_exception``, ``on_completion(False)``, ``on_expiration``) on the **calling thread** (as
  the original); it blocks while the partition is not mounted and while
  ``client.max_concurrent_transactions`` appends of the partition are in flight (back pressure).
  The submit itself is the async client's one submit path (:mod:`.sender`) on the loop: the
  dispatcher hands its application code to the waiting thread (:class:`_Handoff`) and lets the
  thread go as soon as ``execute`` said yes - the send happens on the loop;
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
import queue
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, Self, TypeVar

from ..config import ClientProcessConfig
from ..errors import ClientError
from ..metrics import MetricsRegistry
from ..runtime import Runtime
from .api import TransactionContext, WaltzClientCallbacks
from .core import AsyncWaltzClient
from .discovery import Discovery

log = logging.getLogger("waltz.client")
T = TypeVar("T")


#: one call handed to a submitting thread: (fn, args, the loop's future for its outcome, final_if_true)
_Job = tuple[Callable[..., Any], tuple[Any, ...], "asyncio.Future[Any]", bool]


class _Handoff:
    """Runs the application code of one ``WaltzClient.submit`` on the thread that called it.

    The submit runs on the loop; each :meth:`call` queues a job and waits for its outcome, which
    the submitting thread, blocked in :meth:`serve`, runs and posts back.
    """

    __slots__ = ("_loop", "_jobs")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()

    async def call(self, fn: Callable[..., Any], args: tuple[Any, ...], final_if_true: bool) -> Any:
        """(Event loop) ``fn(*args)`` on the submitting thread."""
        waiter: asyncio.Future[Any] = self._loop.create_future()
        self._jobs.put((fn, args, waiter, final_if_true))
        return await waiter

    def finish(self) -> None:
        """(Event loop) The submit is over: the submitting thread stops serving."""
        self._jobs.put(None)

    def serve(self, submit: concurrent.futures.Future[None]) -> None:
        """(Submitting thread) Run the submit's jobs until it is over, then return its outcome."""
        post = self._loop.call_soon_threadsafe
        while (job := self._jobs.get()) is not None:
            fn, args, waiter, final_if_true = job
            try:
                result = _no_coroutine(fn, *args)
            except Exception as exc:  # noqa: BLE001 - the application's: its submit on the loop decides
                post(_settle, waiter, None, exc)
                continue
            except BaseException:
                post(waiter.cancel)  # the submit gives its slot back; this thread raises
                raise
            post(_settle, waiter, result, None)
            if final_if_true and result:
                submit.add_done_callback(_log_failure)
                return  # execute said yes: the rest of the submit (the send) happens on the loop
        submit.result()


def _settle(waiter: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if waiter.done():
        return
    if exc is not None:
        waiter.set_exception(exc)
    else:
        waiter.set_result(result)


def _log_failure(submit: concurrent.futures.Future[None]) -> None:
    if not submit.cancelled() and submit.exception() is not None:
        log.error("WaltzClient.submit failed after execute: %r", submit.exception())


class ThreadDispatcher:
    """Application code on consumer threads (sharded by partition), retry threads, and the threads
    blocked in ``WaltzClient.submit``."""

    threaded = True

    def __init__(self, num_consumers: int, num_retry: int) -> None:
        self.thread_ids: set[int] = set()
        self._submitters: dict[asyncio.Task[Any], _Handoff] = {}  #: submit tasks -> their waiting thread
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

    async def call_submitter(self, fn: Callable[..., Any], *args: Any, final_if_true: bool = False) -> Any:
        task = asyncio.current_task() if self._submitters else None
        handoff = self._submitters.get(task) if task is not None else None
        if handoff is None:  # AsyncWaltzClient.submit called on the loop: the retry side runs it
            return await self.call_retry(fn, *args)
        return await handoff.call(fn, args, final_if_true)

    async def submitting(self, handoff: _Handoff, submit: Awaitable[None]) -> None:
        """(Event loop) Await ``submit`` with its application code handed to ``handoff``'s thread."""
        task = asyncio.current_task()
        assert task is not None
        self._submitters[task] = handoff
        try:
            await submit
        finally:
            del self._submitters[task]
            handoff.finish()

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
                 discovery: Discovery | None = None, runtime: Runtime | None = None,
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
        self._core = AsyncWaltzClient(callbacks, self.config, discovery=discovery, runtime=runtime,
                                      _dispatcher=self._dispatcher)
        self._closed = False
        self._loop_thread_id: int | None = None  #: blocking methods refuse to run there (they would wait for themselves)
        try:
            self._loop_thread_id = asyncio.run_coroutine_threadsafe(_call(threading.get_ident), loop).result(start_timeout)
            self._run(self._core.start(), start_timeout)
        except BaseException:
            self._closed = True
            self._dispatcher.close()
            self._stop_loop()
            raise

    # ------------------------------------------------------------------------------ plumbing

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        if threading.get_ident() == self._loop_thread_id:
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
        if threading.get_ident() == self._loop_thread_id:
            raise ClientError("a blocking WaltzClient method was called on the client's event loop")
        handoff = _Handoff(self._loop)
        submit = asyncio.run_coroutine_threadsafe(self._dispatcher.submitting(handoff, self._core.submit(context)),
                                                  self._loop)
        handoff.serve(submit)

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
