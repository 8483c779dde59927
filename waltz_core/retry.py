"""One retry policy for Waltz: capped exponential backoff with jitter, read from the error flags.

Every loop that retries after a failure, or waits for something with a deadline, uses a
:class:`RetryPolicy` instead of its own ``delay = min(delay * 2, cap)`` arithmetic. The policy is
data (a frozen attrs class): a loop's timing is one line that can be read, compared and tested.

Delays
    The n-th sleep (n = 0, 1, ...) is drawn uniformly from ``[d * (1 - jitter), d]`` with
    ``d = min(initial * multiplier**n, maximum)``. Jitter only shortens a delay, never lengthens
    it: it spreads the processes that failed together (a storage node restart, a coordination
    hiccup) so that they do not retry in lock step.

Limits
    ``max_attempts`` counts calls of the operation (so ``max_attempts - 1`` sleeps);
    ``deadline`` counts seconds from the first attempt (when :meth:`RetryPolicy.delays` or
    :meth:`RetryPolicy.call` was called). The sleep that would cross the deadline is clipped to
    it, so one last attempt happens at the deadline; after that the iterator stops.
    ``None`` means no limit.

Which errors
    :func:`is_retriable` reads :attr:`waltz_core.errors.WaltzError.retriable` and
    :func:`needs_refresh` reads :attr:`~waltz_core.errors.WaltzError.refresh_assignment`: the flags
    on the exception tree decide, not hand-written ``except`` lists. Non-Waltz exceptions are not
    retriable; a loop that retries ``OSError`` (or anything else) on purpose says so with
    ``retry_if``, and so does a loop whose context gives an error another meaning (for a store
    session, a "retriable" compare-and-set conflict means a newer session exists: final).

Two ways to use it::

    # an operation: retried while retry_if(exc), then the last error is re-raised
    value = await policy.call(lambda: client.read(...), refresh=assignment.refresh)

    # a reconnect loop, or a wait with a deadline: the iterator yields the sleeps
    for delay in policy.delays():
        try:
            return await connect()
        except ConnectError:
            await asyncio.sleep(delay)
    return await connect()  # the last attempt (at the deadline); its error propagates

``delays()`` yields one sleep fewer than there are attempts, hence the last attempt after the
loop; with neither a deadline nor ``max_attempts`` the loop never ends by itself.

``clock``, ``sleep`` and ``rng`` are parameters so that tests run on a fake clock without sleeping.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import attrs

from .errors import WaltzError

__all__ = ["RetryPolicy", "is_retriable", "needs_refresh"]

T = TypeVar("T")

Clock = Callable[[], float]

_RNG = random.Random()  # one shared generator: seeding a new one per loop would read os.urandom each time


def is_retriable(exc: BaseException) -> bool:
    """Whether the same request may succeed if sent again: :attr:`WaltzError.retriable`.

    Exceptions outside the Waltz tree are not retriable (a bug, or a library error that was not
    translated at its boundary).
    """
    return isinstance(exc, WaltzError) and exc.retriable


def needs_refresh(exc: BaseException) -> bool:
    """Whether the partition assignment should be re-read before retrying: :attr:`WaltzError.refresh_assignment`."""
    return isinstance(exc, WaltzError) and exc.refresh_assignment


def _non_negative(_inst: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value >= 0:  # also refuses NaN
        raise ValueError(f"RetryPolicy.{attribute.name} must be >= 0, got {value!r}")


def _optional_non_negative(inst: object, attribute: attrs.Attribute[float | None], value: float | None) -> None:
    if value is not None:
        _non_negative(inst, attribute, value)  # type: ignore[arg-type]


def _unit_interval(_inst: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"RetryPolicy.{attribute.name} must be within [0, 1], got {value!r}")


def _at_least_one(_inst: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value >= 1:
        raise ValueError(f"RetryPolicy.{attribute.name} must be >= 1, got {value!r}")


def _optional_positive_int(_inst: object, attribute: attrs.Attribute[int | None], value: int | None) -> None:
    if value is not None and value < 1:
        raise ValueError(f"RetryPolicy.{attribute.name} must be >= 1 or None, got {value!r}")


@attrs.frozen(slots=True)
class RetryPolicy:
    """Capped exponential backoff with jitter, an optional deadline and an optional attempt limit.

    Immutable: derive variants with :func:`attrs.evolve` (``attrs.evolve(policy, deadline=5.0)``).
    """

    initial: float = attrs.field(default=0.01, validator=_non_negative)  #: first delay, seconds
    maximum: float = attrs.field(default=5.0, validator=_non_negative)  #: cap of one delay, seconds
    multiplier: float = attrs.field(default=2.0, validator=_at_least_one)  #: growth per retry
    jitter: float = attrs.field(default=0.5, validator=_unit_interval)  #: each delay is drawn from [d*(1-jitter), d]
    deadline: float | None = attrs.field(default=None, validator=_optional_non_negative)  #: seconds from the first attempt
    max_attempts: int | None = attrs.field(default=None, validator=_optional_positive_int)  #: calls, not retries

    def delays(self, *, clock: Clock = time.monotonic, rng: random.Random | None = None) -> Iterator[float]:
        """The jittered sleeps between attempts; stops at ``max_attempts`` or the deadline.

        The deadline counts from this call (not from the first ``next()``), so create the iterator
        right before the first attempt. The last sleep is clipped to end at the deadline.
        """
        # evaluated now, not lazily in the generator: the deadline starts with the first attempt
        return self._delays(clock() if self.deadline is not None else 0.0, clock, rng or _RNG)

    def _delays(self, start: float, clock: Clock, rng: random.Random) -> Iterator[float]:
        base = min(self.initial, self.maximum)
        attempts = 1  # the attempt before the first sleep
        while self.max_attempts is None or attempts < self.max_attempts:
            delay = rng.uniform(base * (1.0 - self.jitter), base)
            if self.deadline is not None:
                remaining = start + self.deadline - clock()
                if remaining <= 0:
                    return
                delay = min(delay, remaining)
            yield delay
            attempts += 1
            if base < self.maximum:  # stop multiplying once capped (no overflow on endless loops)
                base = min(base * self.multiplier, self.maximum)
                if math.isnan(base):  # 0 * inf and the like: keep a usable delay
                    base = self.maximum

    async def call(
        self,
        fn: Callable[[], Awaitable[T]],
        *,
        retry_if: Callable[[BaseException], bool] = is_retriable,
        refresh: Callable[[], Awaitable[None]] | None = None,
        on_retry: Callable[[BaseException, float], None] | None = None,
        clock: Clock = time.monotonic,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
        rng: random.Random | None = None,
    ) -> T:
        """Await ``fn()`` until it returns, retrying the failures ``retry_if`` accepts.

        :param retry_if: which exceptions are retried (default :func:`is_retriable`); any other
            exception propagates at once. :class:`BaseException` that is not an :class:`Exception`
            (cancellation, KeyboardInterrupt) is never retried.
        :param refresh: awaited before the retry that follows an error with
            :func:`needs_refresh` (the partition moved: re-read the assignment first). A failing
            refresh counts as a failed attempt.
        :param on_retry: called with the error and the coming sleep before each retry (logging).
        :return: what ``fn`` returned.
        :raises: the last error once ``max_attempts`` or the deadline is exhausted.
        """
        delays = self.delays(clock=clock, rng=rng)
        pending_refresh = False
        while True:
            try:
                if pending_refresh and refresh is not None:
                    await refresh()
                    pending_refresh = False
                return await fn()
            except Exception as exc:
                delay = _next_delay(exc, delays, retry_if, on_retry)
                if delay is None:
                    raise
                pending_refresh = pending_refresh or needs_refresh(exc)
            await sleep(delay)

    def call_sync(
        self,
        fn: Callable[[], T],
        *,
        retry_if: Callable[[BaseException], bool] = is_retriable,
        refresh: Callable[[], None] | None = None,
        on_retry: Callable[[BaseException, float], None] | None = None,
        clock: Clock = time.monotonic,
        sleep: Callable[[float], object] = time.sleep,
        rng: random.Random | None = None,
    ) -> T:
        """The blocking twin of :meth:`call` (for threads and command-line code; never in a coroutine)."""
        delays = self.delays(clock=clock, rng=rng)
        pending_refresh = False
        while True:
            try:
                if pending_refresh and refresh is not None:
                    refresh()
                    pending_refresh = False
                return fn()
            except Exception as exc:
                delay = _next_delay(exc, delays, retry_if, on_retry)
                if delay is None:
                    raise
                pending_refresh = pending_refresh or needs_refresh(exc)
            sleep(delay)


def _next_delay(exc: Exception, delays: Iterator[float], retry_if: Callable[[BaseException], bool],
                on_retry: Callable[[BaseException, float], None] | None) -> float | None:
    """The sleep before retrying after ``exc``, or None to give up and re-raise it (the decision
    :meth:`RetryPolicy.call` and :meth:`RetryPolicy.call_sync` share)."""
    if not retry_if(exc):
        return None
    delay = next(delays, None)
    if delay is not None and on_retry is not None:
        on_retry(exc, delay)
    return delay
