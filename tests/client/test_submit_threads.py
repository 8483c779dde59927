"""Where the one submit path runs application code: the sync client's first attempt on the
submitting thread (its outcome callbacks too), re-executions on the retry threads; the async
client's on its loop, ``async def`` included."""

from __future__ import annotations

import threading

import pytest

from waltz_core.client import TransactionBuilder, TransactionContext, WaltzClientCallbacks
from waltz_core.errors import ClientError
from waltz_core.testing.mock_cluster import MockCluster

pytestmark = pytest.mark.timeout(60)


class Quiet(WaltzClientCallbacks):
    def client_high_water_mark(self, partition_id: int) -> int:
        return -1

    def apply_transaction(self, txn) -> None:
        """These tests look at where execute and the outcome callbacks run, not at applies."""


class Recorder(TransactionContext):
    """Records the thread of every call; ``outcome`` says what ``execute`` does."""

    def __init__(self, outcome: str = "ok", **kw) -> None:
        super().__init__(**kw)
        self.outcome = outcome
        self.calls: list[tuple[str, str]] = []
        self.done = threading.Event()

    def _record(self, what: str) -> None:
        self.calls.append((what, threading.current_thread().name))

    def partition_id(self, num_partitions: int) -> int:
        return 0

    def execute(self, builder: TransactionBuilder) -> bool:
        self._record("execute")
        if self.outcome == "raise":
            raise ValueError("cannot build")
        builder.set_transaction_data(b"x")
        return self.outcome != "drop"

    def on_completion(self, result: bool) -> None:
        self._record(f"completion {result}")
        self.done.set()

    def on_exception(self, exc: BaseException) -> None:
        self._record(f"exception {type(exc).__name__}")
        self.done.set()

    def on_expiration(self) -> None:
        self._record("expiration")
        self.done.set()

    def on_lock_failure(self) -> None:
        self._record("lock failure")


def test_sync_first_attempts_run_on_the_submitting_thread() -> None:
    me = threading.current_thread().name
    with MockCluster(1) as cluster, cluster.client(Quiet()) as client:
        client.wait_mounted(5)
        ok = Recorder()
        client.submit(ok)
        # The first attempt ran here, before submit returned; the completion comes on the consumer
        # thread, and may already have come (this thread can be descheduled after submit).
        assert ok.calls[0] == ("execute", me)
        assert ok.done.wait(5) and ok.calls[1:] == [("completion True", ok.calls[-1][1])]
        assert ok.calls[-1][1] != me
        dropped = Recorder("drop")
        client.submit(dropped)
        assert dropped.calls == [("execute", me), ("completion False", me)]
        failing = Recorder("raise")
        with pytest.raises(ValueError, match="cannot build"):
            client.submit(failing)
        assert failing.calls == [("execute", me), ("exception ValueError", me)]
        expired = Recorder(timeout=0.0)
        client.submit(expired)
        assert expired.calls == [("expiration", me)]
        client.flush()
        assert not client.has_pending()
    assert len(cluster.transactions(0)) == 1


def test_sync_re_executions_run_on_the_retry_threads() -> None:
    me = threading.current_thread().name
    with MockCluster(1) as cluster, cluster.client(Quiet()) as client:
        client.wait_mounted(5)
        cluster.force_next_lock_fail()
        ctx = Recorder()
        client.submit(ctx)
        client.flush(10)
        assert ctx.calls[0] == ("execute", me)
        later = {what: thread for what, thread in ctx.calls[1:]}
        assert set(later) == {"lock failure", "execute", "completion True"}
        assert later["lock failure"].startswith("waltz-retry") and later["execute"].startswith("waltz-retry")
        assert later["completion True"].startswith("waltz-consumer")
    assert len(cluster.transactions(0)) == 1


def test_sync_submit_from_the_loop_is_refused() -> None:
    with MockCluster(1) as cluster, cluster.client(Quiet()) as client:
        error: list[BaseException] = []

        def on_loop() -> None:
            try:
                client.submit(Recorder())
            except ClientError as exc:
                error.append(exc)

        done = threading.Event()
        client.loop.call_soon_threadsafe(lambda: (on_loop(), done.set()))
        assert done.wait(5)
        assert error and "event loop" in str(error[0])


class AsyncContext(TransactionContext):
    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []

    def partition_id(self, num_partitions: int) -> int:
        return 0

    async def execute(self, builder: TransactionBuilder) -> bool:
        builder.set_transaction_data(b"async")
        self.events.append("execute")
        return True

    async def on_completion(self, result: bool) -> None:
        self.events.append(f"completion {result}")

    async def on_application(self) -> None:
        self.events.append("application")


class AsyncApply(Quiet):
    def __init__(self) -> None:
        self.applied: list[int] = []

    async def apply_transaction(self, txn) -> None:
        self.applied.append(txn.transaction_id)


async def test_async_callbacks_are_awaited_in_order() -> None:
    async with MockCluster(1) as cluster:
        app = AsyncApply()
        async with cluster.async_client(app) as client:
            ctxs = [AsyncContext() for _ in range(5)]
            for ctx in ctxs:
                await client.submit(ctx)
            await client.flush()
        assert app.applied == list(range(5))
        assert all(c.events == ["execute", "completion True", "application"] for c in ctxs)


def test_async_apply_given_to_the_sync_client_is_an_error_it_reports() -> None:
    class Reporting(AsyncApply):
        def __init__(self) -> None:
            super().__init__()
            self.uncaught: list[BaseException] = []
            self.reported = threading.Event()

        def uncaught_exception(self, partition_id: int, transaction_id: int, exc: BaseException) -> None:
            self.uncaught.append(exc)
            self.reported.set()

    with MockCluster(1) as cluster:
        with cluster.client(Quiet()) as writer:
            writer.submit(Recorder())
            writer.flush()
        app = Reporting()
        with cluster.client(app):
            assert app.reported.wait(5)
        assert isinstance(app.uncaught[0], ClientError) and "AsyncWaltzClient" in str(app.uncaught[0])
        assert app.applied == []  # nothing counted as applied
