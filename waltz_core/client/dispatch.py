"""Where the client runs application code: the dispatcher, and calling callbacks safely.

The client's parts run on its event loop; application code (contexts, callbacks) runs where a
*dispatcher* says:

* :class:`InlineDispatcher` (the async client): on the loop; ``async def`` results are awaited;
* ``ThreadDispatcher`` (the sync client, :mod:`.sync`): apply callbacks on the partition's
  consumer thread, re-executions and outcome callbacks on the retry threads, and the first
  execution of a context on the thread that called ``WaltzClient.submit``.

A dispatcher has three entries: :meth:`~Dispatcher.call` (the partition's apply side),
:meth:`~Dispatcher.call_retry` (re-executions, outcome callbacks) and
:meth:`~Dispatcher.call_submitter` (the first execution of a context and its outcome callbacks:
the submitting thread if there is one waiting, else as ``call_retry``). ``threaded`` is False
when everything runs on the loop: the per-transaction paths then call application code directly,
without a coroutine per call.

:func:`call_logged` and :func:`await_logged` call outcome callbacks whose exceptions must never
reach the client (they are logged).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeGuard

log = logging.getLogger("waltz.client")


def is_awaitable(result: object) -> TypeGuard[Awaitable[Any]]:
    """``inspect.isawaitable`` with a fast answer for what callbacks usually return (None, a bool)."""
    return result is not None and result is not True and result is not False and inspect.isawaitable(result)


class Dispatcher(Protocol):
    """Runs application code for one client (see the module docstring)."""

    threaded: bool

    async def call(self, partition_id: int, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the apply side of ``partition_id`` (one partition's calls in order)."""
        ...

    async def call_retry(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` where re-executions and outcome callbacks run."""
        ...

    async def call_submitter(self, fn: Callable[..., Any], *args: Any, final_if_true: bool = False) -> Any:
        """``fn(*args)`` where the submitting code runs. ``final_if_true``: if ``fn`` returns a true
        value, the submit path calls nothing more through this entry (the submitter may go on)."""
        ...

    def close(self) -> None: ...


class InlineDispatcher:
    """Application code on the event loop; coroutine results are awaited."""

    threaded = False

    async def call(self, partition_id: int, fn: Callable[..., Any], *args: Any) -> Any:
        result = fn(*args)
        if is_awaitable(result):
            result = await result
        return result

    async def call_retry(self, fn: Callable[..., Any], *args: Any) -> Any:
        result = fn(*args)
        if is_awaitable(result):
            result = await result
        return result

    async def call_submitter(self, fn: Callable[..., Any], *args: Any, final_if_true: bool = False) -> Any:
        result = fn(*args)
        if is_awaitable(result):
            result = await result
        return result

    def close(self) -> None:
        pass


def name_of(fn: Callable[..., Any]) -> str:
    return str(getattr(fn, "__qualname__", fn))


def call_logged(fn: Callable[..., Any], *args: Any) -> Awaitable[Any] | None:
    """Call an application callback; its exception is logged, never raised. Returns the awaitable
    an ``async def`` callback gave (for :func:`await_logged` on the loop), else None."""
    try:
        result = fn(*args)
    except Exception:
        log.exception("%s raised", name_of(fn))
        return None
    return result if is_awaitable(result) else None


async def await_logged(pending: Awaitable[Any], fn: Callable[..., Any]) -> None:
    """Await what :func:`call_logged` returned; its exception is logged, never raised."""
    try:
        await pending
    except Exception:
        log.exception("%s raised", name_of(fn))
