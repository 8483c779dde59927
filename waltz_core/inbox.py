"""A bounded FIFO from producers to one consumer task, for per-transaction paths.

It does what an ``asyncio.Queue(maxsize)`` does, with two differences that matter once per
transaction: ``put`` is a plain call that returns a future to await only when the inbox is full,
and the consumer takes what is queued without a coroutine per item. ``asyncio.Queue`` spends a
coroutine and waiter bookkeeping on every put and get. Event loop only.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Inbox(Generic[T]):
    __slots__ = ("items", "limit", "_ready", "_space", "_armed")

    def __init__(self, limit: int) -> None:
        #: what is queued, oldest first: a consumer may test it for emptiness directly (no call);
        #: everything else goes through the methods
        self.items: deque[T] = deque()
        self.limit = max(1, limit)
        self._ready: asyncio.Future[None] | None = None  #: the consumer waits here while empty
        self._space: asyncio.Future[None] | None = None  #: producers wait here while full (shared)
        self._armed: Callable[[], None] | None = None  #: called by the next put or nudge (see arm)

    def __len__(self) -> int:
        return len(self.items)

    def put(self, item: T) -> asyncio.Future[None] | None:
        """Queue ``item`` (always); a future to await before the next put when the inbox is full."""
        items = self.items
        items.append(item)
        ready = self._ready
        if ready is not None:
            self._ready = None
            if not ready.done():
                ready.set_result(None)
        armed = self._armed
        if armed is not None:
            self._armed = None
            armed()
        if len(items) < self.limit:
            return None
        if self._space is None or self._space.done():
            self._space = asyncio.get_running_loop().create_future()
        return self._space

    async def wait(self) -> None:
        """Return once something is queued or :meth:`nudge` was called (the consumer; one at a time).

        After a nudge the inbox may still be empty: the consumer checks what it was nudged for."""
        if not self.items:
            self._ready = ready = asyncio.get_running_loop().create_future()
            await ready

    def arm(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once, at the next put or nudge (instead of a task waiting in
        :meth:`wait`). It runs inside that call, so it only takes note: e.g. queues the inbox
        for a consumer that serves several."""
        self._armed = callback

    def nudge(self) -> None:
        """Wake a consumer waiting in :meth:`wait` (or call the armed callback) although nothing was queued."""
        ready = self._ready
        if ready is not None:
            self._ready = None
            if not ready.done():
                ready.set_result(None)
        armed = self._armed
        if armed is not None:
            self._armed = None
            armed()

    def popleft(self) -> T:
        """The oldest item (IndexError when empty)."""
        item = self.items.popleft()
        if self._space is not None:  # a producer may wait for room (rare): _release's test first, inline
            self._release()
        return item

    def take(self, max_count: int) -> list[T]:
        """Up to ``max_count`` items, oldest first."""
        popleft = self.items.popleft
        batch = [popleft() for _ in range(min(len(self.items), max_count))]
        self._release()
        return batch

    def clear(self) -> None:
        """Drop everything; producers waiting for room go on (nothing will drain them otherwise)."""
        self.items.clear()
        self._release()

    def _release(self) -> None:
        space = self._space
        if space is not None and len(self.items) < self.limit:
            self._space = None
            if not space.done():
                space.set_result(None)
