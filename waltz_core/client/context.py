"""What the parts of one client share: configuration, identity, partitions, owners, links, loop.

:class:`ClientContext` is state, not behaviour: the facade (:mod:`.core`) fills it as the client
starts, the parts (:mod:`.stream`, :mod:`.sender`, :mod:`.applier`, :mod:`.rpc`,
:mod:`.readahead`) read it. Its few helpers are the ones every part needs: refuse work once
closed, wake whoever waits for a change (``flush``), run a background task that ``close`` cancels,
call an application callback whose exception must not escape.

Threading: event loop only, except the attributes the sync client and read-ahead read from other
threads (``loop``, ``loop_thread_id``, ``closed``: plain reads).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

from ..errors import ClientClosedError, ClientError
from ..timeouts import wait_for
from .dispatch import Dispatcher, is_awaitable, name_of

if TYPE_CHECKING:
    from ..config import ClientProcessConfig
    from ..coordination.recipes import PartitionOwner
    from .api import WaltzClientCallbacks
    from .link import Links
    from .partition import Partition

log = logging.getLogger("waltz.client")


class ClientContext:
    """The shared state of one client (see the module docstring)."""

    def __init__(self, config: ClientProcessConfig, callbacks: WaltzClientCallbacks, dispatcher: Dispatcher) -> None:
        self.config = config
        self.callbacks = callbacks
        self.dispatcher = dispatcher
        self.client_id = -1
        self.num_partitions = 0
        self.partitions: dict[int, Partition] = {}  #: every partition this client mounted (INACTIVE ones too)
        self.owners: dict[int, PartitionOwner] = {}  #: the latest assignment (owned partitions only)
        self.links: Links | None = None  #: set by start()
        self.started = False
        self.closed = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.loop_thread_id: int | None = None
        self.tasks: list[asyncio.Task[Any]] = []  #: background tasks close() cancels
        self._changed: asyncio.Event | None = None

    def start(self) -> None:
        """Bind to the running loop (in ``AsyncWaltzClient.start``)."""
        self.started = True
        self.loop = asyncio.get_running_loop()
        self.loop_thread_id = threading.get_ident()
        self._changed = asyncio.Event()

    def check_open(self) -> None:
        if self.closed:
            raise ClientClosedError("the client is closed")
        if not self.started:
            raise ClientError("the client is not started (await client.start() or use 'async with')")

    def on_loop_thread(self) -> bool:
        return threading.get_ident() == self.loop_thread_id

    # ---------------------------------------------------------------------------- changes

    def ping(self) -> None:
        """Something pending got decided, or a partition changed state: wake :meth:`wait_change`."""
        ev = self._changed
        if ev is not None:
            ev.set()

    async def wait_change(self, timeout: float) -> None:
        ev = self._changed
        assert ev is not None
        with contextlib.suppress(TimeoutError):
            await wait_for(ev.wait(), timeout)
        ev.clear()

    # ------------------------------------------------------------------------------ tasks

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str | None = None) -> asyncio.Task[Any]:
        """A background task of the client (cancelled by close; forgotten once done)."""
        assert self.loop is not None
        task = self.loop.create_task(coro, name=name)
        self.tasks.append(task)
        task.add_done_callback(self._forget)
        return task

    def _forget(self, task: asyncio.Task[Any]) -> None:
        with contextlib.suppress(ValueError):
            self.tasks.remove(task)

    # -------------------------------------------------------------------------- callbacks

    async def notify(self, fn: Callable[..., Any], *args: Any) -> None:
        """Call an application callback where retries run; its exceptions are logged, never propagated."""
        try:
            await self.dispatcher.call_retry(fn, *args)
        except Exception:
            log.exception("client %d: %s raised", self.client_id, name_of(fn))

    def notify_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """:meth:`notify` without waiting for it. With callbacks on the loop a plain function is
        called at once (no task per call: lock failures can be frequent); a coroutine result, or
        the threaded dispatcher, gets a background task."""
        if self.dispatcher.threaded:
            self.spawn(self.notify(fn, *args))
            return
        try:
            result = fn(*args)
        except Exception:
            log.exception("client %d: %s raised", self.client_id, name_of(fn))
            return
        if is_awaitable(result):
            self.spawn(self._logged(result, fn))

    async def _logged(self, awaitable: Awaitable[Any], fn: Callable[..., Any]) -> None:
        try:
            await awaitable
        except Exception:
            log.exception("client %d: %s raised", self.client_id, name_of(fn))

    async def notify_submitter(self, fn: Callable[..., Any], *args: Any) -> None:
        """The same where the submitting code runs (first attempts of ``submit``)."""
        try:
            await self.dispatcher.call_submitter(fn, *args)
        except Exception:
            log.exception("client %d: %s raised", self.client_id, name_of(fn))
