"""RetryPolicy: jitter bounds, deadline clipping, attempt limits, refresh, and which errors are retried.

Everything runs on a fake clock whose sleep advances it: no test sleeps for real.
"""

from __future__ import annotations

import asyncio
import itertools
import random

import attrs
import pytest

from waltz_core.errors import (
    ClusterKeyMismatchError,
    ConnectError,
    GenerationMismatchError,
    NoNodeError,
    PartitionNotReadyError,
    SessionLostError,
    WaltzError,
)
from waltz_core.retry import RetryPolicy, is_retriable, needs_refresh


class FakeClock:
    """A monotonic clock that only moves when something sleeps on it."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep_sync(self, seconds: float) -> None:
        assert seconds >= 0
        self.sleeps.append(seconds)
        self.now += seconds

    async def sleep(self, seconds: float) -> None:
        self.sleep_sync(seconds)


# ------------------------------------------------------------------------------------- delays
@pytest.mark.parametrize("seed", range(5))
def test_delays_grow_and_stay_within_jitter_bounds(seed: int) -> None:
    policy = RetryPolicy(initial=0.01, maximum=1.0, multiplier=2.0, jitter=0.5)
    delays = list(itertools.islice(policy.delays(rng=random.Random(seed)), 20))
    nominal = [min(0.01 * 2**n, 1.0) for n in range(20)]
    for d, nom in zip(delays, nominal, strict=True):
        assert nom * 0.5 <= d <= nom
    assert max(delays) <= 1.0


def test_no_jitter_gives_the_plain_exponential_sequence() -> None:
    policy = RetryPolicy(initial=0.1, maximum=0.5, multiplier=2.0, jitter=0.0)
    assert list(itertools.islice(policy.delays(), 5)) == [0.1, 0.2, 0.4, 0.5, 0.5]


def test_full_jitter_can_reach_zero_but_never_exceeds_the_nominal_delay() -> None:
    policy = RetryPolicy(initial=1.0, maximum=1.0, jitter=1.0)
    delays = list(itertools.islice(policy.delays(rng=random.Random(1)), 200))
    assert all(0.0 <= d <= 1.0 for d in delays)
    assert len(set(delays)) > 100  # actually spread, not a constant


def test_jitter_spreads_two_processes_that_failed_together() -> None:
    policy = RetryPolicy(initial=0.5, maximum=0.5, jitter=0.5)
    a = list(itertools.islice(policy.delays(rng=random.Random(1)), 10))
    b = list(itertools.islice(policy.delays(rng=random.Random(2)), 10))
    assert a != b


def test_max_attempts_counts_calls_so_one_sleep_fewer() -> None:
    assert len(list(RetryPolicy(max_attempts=4).delays())) == 3
    assert list(RetryPolicy(max_attempts=1).delays()) == []


def test_no_limits_means_an_endless_iterator() -> None:
    it = RetryPolicy(initial=1.0, maximum=2.0).delays()
    assert len(list(itertools.islice(it, 10_000))) == 10_000


def test_deadline_clips_the_last_sleep_and_stops() -> None:
    clock = FakeClock()
    policy = RetryPolicy(initial=1.0, maximum=1.0, jitter=0.0, deadline=2.5)
    out = []
    for delay in itertools.islice(policy.delays(clock=clock), 10):
        out.append(delay)
        clock.sleep_sync(delay)
    assert out == [1.0, 1.0, 0.5]  # the third sleep ends exactly at the deadline
    assert clock.now == pytest.approx(1002.5)


def test_deadline_counts_from_the_call_not_from_the_first_next() -> None:
    clock = FakeClock()
    it = RetryPolicy(initial=1.0, maximum=1.0, jitter=0.0, deadline=2.0).delays(clock=clock)
    clock.now += 1.5  # the first attempt took 1.5 s
    out = []
    for delay in itertools.islice(it, 10):  # bounded: a bug here must fail, not eat the memory
        out.append(delay)
        clock.sleep_sync(delay)
    assert out == [0.5]


def test_deadline_already_past_yields_nothing() -> None:
    clock = FakeClock()
    it = RetryPolicy(deadline=1.0).delays(clock=clock)
    clock.now += 5.0
    assert list(it) == []


def test_deadline_and_max_attempts_whichever_comes_first() -> None:
    clock = FakeClock()
    policy = RetryPolicy(initial=1.0, maximum=1.0, jitter=0.0, deadline=100.0, max_attempts=3)
    assert list(policy.delays(clock=clock)) == [1.0, 1.0]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"initial": -1.0},
        {"maximum": float("nan")},
        {"multiplier": 0.5},
        {"jitter": 1.5},
        {"jitter": -0.1},
        {"deadline": -1.0},
        {"max_attempts": 0},
    ],
)
def test_invalid_policies_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="RetryPolicy"):
        RetryPolicy(**kwargs)  # type: ignore[arg-type]


def test_policy_is_frozen_and_evolvable() -> None:
    policy = RetryPolicy()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        policy.deadline = 3.0  # type: ignore[misc]
    assert attrs.evolve(policy, deadline=3.0).deadline == 3.0


# ------------------------------------------------------------------------------------ flags
def test_flags_are_read_from_the_exception_tree() -> None:
    assert is_retriable(ConnectError("x"))
    assert is_retriable(SessionLostError("x"))
    assert not is_retriable(NoNodeError("x"))
    assert not is_retriable(WaltzError("x"))
    assert needs_refresh(GenerationMismatchError("x"))
    assert needs_refresh(PartitionNotReadyError("x"))
    assert not needs_refresh(ConnectError("x"))


def test_non_waltz_exceptions_are_neither_retriable_nor_refreshing() -> None:
    for exc in (OSError("x"), TimeoutError(), ValueError("x"), asyncio.CancelledError()):
        assert not is_retriable(exc)
        assert not needs_refresh(exc)


def test_flags_follow_instances_that_override_them() -> None:
    err = WaltzError("x")
    err.retriable = True  # the flag is read from the instance, so one raise site may override it
    assert is_retriable(err)


# ------------------------------------------------------------------------------------- call
class Flaky:
    """Fails with the given errors in order, then returns 'ok'."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.calls = 0

    async def __call__(self) -> str:
        return self.sync()

    def sync(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "ok"


async def test_call_retries_retriable_errors_then_returns() -> None:
    clock = FakeClock()
    fn = Flaky(ConnectError("a"), ConnectError("b"))
    result = await RetryPolicy(initial=0.1, jitter=0.0).call(fn, clock=clock, sleep=clock.sleep)
    assert result == "ok" and fn.calls == 3
    assert clock.sleeps == [0.1, 0.2]


async def test_call_raises_a_non_retriable_error_at_once() -> None:
    clock = FakeClock()
    fn = Flaky(ClusterKeyMismatchError("other cluster"))
    with pytest.raises(ClusterKeyMismatchError):
        await RetryPolicy().call(fn, clock=clock, sleep=clock.sleep)
    assert fn.calls == 1 and clock.sleeps == []


async def test_call_does_not_retry_foreign_exceptions_by_default() -> None:
    clock = FakeClock()
    fn = Flaky(OSError("refused"))
    with pytest.raises(OSError):
        await RetryPolicy().call(fn, clock=clock, sleep=clock.sleep)
    assert fn.calls == 1


async def test_call_retry_if_widens_the_set_on_purpose() -> None:
    clock = FakeClock()
    fn = Flaky(OSError("refused"), ConnectError("x"))
    retry_if = lambda e: isinstance(e, OSError) or is_retriable(e)  # noqa: E731
    assert await RetryPolicy().call(fn, retry_if=retry_if, clock=clock, sleep=clock.sleep) == "ok"
    assert fn.calls == 3


async def test_call_re_raises_the_last_error_when_out_of_attempts() -> None:
    clock = FakeClock()
    errors = [ConnectError(str(i)) for i in range(5)]
    fn = Flaky(*errors)
    with pytest.raises(ConnectError) as info:
        await RetryPolicy(max_attempts=3).call(fn, clock=clock, sleep=clock.sleep)
    assert info.value is errors[2]
    assert fn.calls == 3 and len(clock.sleeps) == 2


async def test_call_re_raises_the_last_error_at_the_deadline() -> None:
    clock = FakeClock()
    fn = Flaky(*[ConnectError(str(i)) for i in range(100)])
    with pytest.raises(ConnectError):
        await RetryPolicy(initial=1.0, maximum=1.0, jitter=0.0, deadline=3.5).call(fn, clock=clock, sleep=clock.sleep)
    assert clock.now == pytest.approx(1003.5)
    assert fn.calls == 5  # at 0, 1, 2, 3 and the clipped last one at 3.5


async def test_call_refreshes_before_retrying_a_moved_partition() -> None:
    clock = FakeClock()
    log: list[str] = []

    async def refresh() -> None:
        log.append(f"refresh@{clock.now - 1000:.1f}")

    async def fn() -> str:
        log.append(f"call@{clock.now - 1000:.1f}")
        if len(log) == 1:
            raise GenerationMismatchError("moved")
        if len(log) == 3:
            raise ConnectError("link")
        return "ok"

    policy = RetryPolicy(initial=1.0, jitter=0.0)
    assert await policy.call(fn, refresh=refresh, clock=clock, sleep=clock.sleep) == "ok"
    # refreshed once, after the backoff and right before the retry; not after the ConnectError
    assert log == ["call@0.0", "refresh@1.0", "call@1.0", "call@3.0"]


async def test_call_without_refresh_still_retries_refresh_errors() -> None:
    clock = FakeClock()
    fn = Flaky(PartitionNotReadyError("recovering"))
    assert await RetryPolicy().call(fn, clock=clock, sleep=clock.sleep) == "ok"


async def test_a_failing_refresh_counts_as_a_failed_attempt() -> None:
    clock = FakeClock()
    refreshes = Flaky(SessionLostError("coordination hiccup"))

    async def refresh() -> None:
        await refreshes()

    fn = Flaky(GenerationMismatchError("moved"))
    assert await RetryPolicy().call(fn, refresh=refresh, clock=clock, sleep=clock.sleep) == "ok"
    assert refreshes.calls == 2  # the refresh failed once and was retried before calling fn again
    assert fn.calls == 2


async def test_call_never_retries_cancellation() -> None:
    clock = FakeClock()
    fn = Flaky(asyncio.CancelledError())
    with pytest.raises(asyncio.CancelledError):
        await RetryPolicy().call(fn, retry_if=lambda e: True, clock=clock, sleep=clock.sleep)
    assert fn.calls == 1


async def test_on_retry_sees_each_error_and_the_coming_sleep() -> None:
    clock = FakeClock()
    seen: list[tuple[str, float]] = []
    fn = Flaky(ConnectError("a"), ConnectError("b"))
    await RetryPolicy(initial=0.5, jitter=0.0).call(
        fn, on_retry=lambda e, d: seen.append((str(e), d)), clock=clock, sleep=clock.sleep
    )
    assert seen == [("a", 0.5), ("b", 1.0)]


# -------------------------------------------------------------------------------- call_sync
def test_call_sync_retries_and_refreshes() -> None:
    clock = FakeClock()
    refreshed: list[float] = []
    fn = Flaky(ConnectError("a"), GenerationMismatchError("moved"))
    result = RetryPolicy(initial=0.1, jitter=0.0).call_sync(
        fn.sync, refresh=lambda: refreshed.append(clock.now), clock=clock, sleep=clock.sleep_sync
    )
    assert result == "ok" and fn.calls == 3
    assert clock.sleeps == [pytest.approx(0.1), pytest.approx(0.2)]
    assert refreshed == [pytest.approx(1000.3)]


def test_call_sync_raises_non_retriable_at_once_and_last_error_at_the_limit() -> None:
    clock = FakeClock()
    with pytest.raises(NoNodeError):
        RetryPolicy().call_sync(Flaky(NoNodeError("x")).sync, clock=clock, sleep=clock.sleep_sync)
    assert clock.sleeps == []
    last = ConnectError("last")
    with pytest.raises(ConnectError) as info:
        RetryPolicy(max_attempts=2).call_sync(
            Flaky(ConnectError("first"), last).sync, clock=clock, sleep=clock.sleep_sync
        )
    assert info.value is last
