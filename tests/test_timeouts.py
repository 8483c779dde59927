"""waltz_core.timeouts: asyncio.wait_for's behaviour without 3.11's lost cancellation, and stopping a task
without swallowing the caller's own."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest

from waltz_core.timeouts import cancel_and_wait, wait_for

WaitFor = Callable[[Awaitable[Any], float | None], Coroutine[Any, Any, Any]]


async def _cancel_as_the_result_arrives(wait: WaitFor) -> asyncio.Task[Any]:
    """A task waits with a deadline for a future; in one loop step the future gets its result
    and the task is cancelled (what a reply from a coordination thread and a close() can do)."""
    fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(wait(fut, 30))
    await asyncio.sleep(0)  # the task is waiting now
    fut.set_result("reply")
    task.cancel()
    await asyncio.wait({task}, timeout=5)
    assert task.done()
    return task


async def test_a_cancellation_that_arrives_with_the_result_cancels_the_task() -> None:
    task = await _cancel_as_the_result_arrives(wait_for)
    assert task.cancelled()


async def test_the_race_is_real_with_asyncio_wait_for_on_3_11() -> None:
    # The same steps with the standard library's wait_for: on 3.11 the cancellation is exchanged for
    # the result (CPython gh-86296), which is why Waltz code may not use it (ruff TID251); from 3.12
    # on asyncio.wait_for is built like ours and keeps it.
    task = await _cancel_as_the_result_arrives(asyncio.wait_for)
    if sys.version_info >= (3, 12):
        assert task.cancelled()
    else:
        assert not task.cancelled()
        assert task.result() == "reply"


async def test_a_closing_loop_that_cancels_its_worker_returns() -> None:
    # The shape that hung the suite: a worker waits for work, then awaits a reply with a deadline;
    # close() cancels it in the step in which the reply arrives, and awaits it.
    loop = asyncio.get_running_loop()
    work = asyncio.Event()
    replies: list[asyncio.Future[str]] = []

    async def worker() -> None:
        while True:
            await work.wait()
            work.clear()
            fut: asyncio.Future[str] = loop.create_future()
            replies.append(fut)
            await wait_for(fut, 30)

    task = asyncio.create_task(worker())
    work.set()
    while not replies:
        await asyncio.sleep(0)
    replies[0].set_result("reply")
    task.cancel()
    await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 5)  # would time out on 3.11's wait_for
    assert task.cancelled()


async def test_the_result_and_the_awaited_exception_come_through() -> None:
    async def answer() -> int:
        await asyncio.sleep(0)
        return 42

    async def fail() -> None:
        await asyncio.sleep(0)
        raise ValueError("bad reply")

    assert await wait_for(answer(), 1) == 42
    assert await wait_for(answer(), None) == 42
    with pytest.raises(ValueError, match="bad reply"):
        await wait_for(fail(), 1)
    done: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    done.set_result("at once")
    assert await wait_for(done, 0) == "at once"


async def test_the_deadline_raises_timeout_error_and_cancels_what_was_awaited() -> None:
    fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    with pytest.raises(TimeoutError):
        await wait_for(fut, 0.01)
    assert fut.cancelled()
    # and the task that timed out is not left cancelling: it goes on awaiting normally
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
    await asyncio.sleep(0)


async def test_a_result_that_arrives_as_the_deadline_fires_stays_in_the_future() -> None:
    # The client's slot wait relies on this (sender.py checks handed(slot) after a timeout): when
    # the future gets its result in the loop step in which the deadline fires, the caller gets
    # TimeoutError and the future keeps its result. A blocking callback makes both timers due in
    # one step; the result's timer is the earlier, so it runs first.
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[bool] = loop.create_future()
    loop.call_later(0.001, time.sleep, 0.1)
    loop.call_later(0.02, fut.set_result, True)
    with pytest.raises(TimeoutError):
        await wait_for(fut, 0.03)
    assert fut.done() and not fut.cancelled() and fut.result() is True


def _slow_to_stop(cleanup: float, error: BaseException | None = None) -> asyncio.Task[None]:
    """A task that, once cancelled, takes ``cleanup`` seconds to end (then raises ``error``, if any)."""

    async def run() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await asyncio.sleep(cleanup)
            if error is not None:
                raise error from None
            raise

    return asyncio.create_task(run())


async def test_cancel_and_wait_returns_once_the_task_has_ended() -> None:
    task = _slow_to_stop(0.02)
    await asyncio.sleep(0)
    await cancel_and_wait(task)
    assert task.cancelled()


async def test_cancel_and_wait_raises_what_the_task_ended_with() -> None:
    task = _slow_to_stop(0.0, ValueError("cleanup failed"))
    await asyncio.sleep(0)
    with pytest.raises(ValueError, match="cleanup failed"):
        await cancel_and_wait(task)


@pytest.mark.parametrize("careful", [True, False])
async def test_a_close_that_is_cancelled_while_it_waits_for_its_task_is_cancelled(careful: bool) -> None:
    # close() cancels its worker and waits for it; meanwhile close()'s own caller is cancelled.
    # With suppress(CancelledError) that second cancellation is swallowed and close() returns as if
    # nothing happened (careful=False shows it); cancel_and_wait lets it through.
    worker = _slow_to_stop(0.2)
    closed_normally: list[bool] = []

    async def close() -> None:
        if careful:
            await cancel_and_wait(worker)
        else:
            worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await worker
        closed_normally.append(True)

    await asyncio.sleep(0)
    closer = asyncio.create_task(close())
    await asyncio.sleep(0.05)  # close() is waiting for the worker's cleanup
    closer.cancel()
    await asyncio.wait((closer,), timeout=5)
    assert closer.done()
    if careful:
        assert closer.cancelled() and not closed_normally
    else:
        assert not closer.cancelled() and closed_normally == [True]
    await asyncio.wait((worker,), timeout=5)
    assert worker.cancelled()  # the worker still ended on its own
