"""Awaiting with a deadline, and stopping a task, without losing a cancellation.

On Python 3.11, :func:`asyncio.wait_for` answers a cancellation that arrives in the same loop
step as the awaited future's result with that result: the ``CancelledError`` is lost and the task
runs on (CPython gh-86296, fixed in 3.12 by building ``wait_for`` on ``asyncio.timeout``). A
``close()`` that cancels a task and then awaits it waits forever when that task goes back to
waiting for work. The test suite hung once in the ZooKeeper conformance kit with its loop idle
and nothing left to wake it, which is what this race leaves behind.

Waltz code awaits with a deadline through :func:`wait_for` (ruff's banned-api rule keeps
``asyncio.wait_for`` out of the packages). It is 3.12's construction: ``asyncio.timeout`` around
a plain ``await``, so a task cancelled while the awaited future completes raises
``CancelledError`` whether or not the future is done. A coroutine runs in the calling task, not
in a task of its own, which also saves a task per call.

:func:`cancel_and_wait` stops a task the same careful way: ``with suppress(CancelledError): await
task`` also swallows a cancellation of the caller that arrives while it waits, and the caller then
runs on as if nobody had cancelled it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")


async def wait_for(aw: Awaitable[T], timeout: float | None) -> T:
    """``await aw``, raising :class:`TimeoutError` after ``timeout`` seconds (None: no limit).

    Like :func:`asyncio.wait_for`: a future or task that times out is cancelled, and so is one
    whose waiter is cancelled. Unlike it on 3.11, a cancellation is never exchanged for a result.
    """
    async with asyncio.timeout(timeout):
        return await aw


async def cancel_and_wait(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` and wait until it has ended. An exception it ended with (other than its
    cancellation) is raised, as awaiting it would; a cancellation of the caller propagates."""
    task.cancel()
    await asyncio.wait((task,))  # a cancelled caller stops waiting; the task still ends on its own
    if not task.cancelled():
        exc = task.exception()
        if exc is not None:
            raise exc
