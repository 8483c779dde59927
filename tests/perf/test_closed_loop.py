"""The closed-loop producer of ``waltz perf produce``: one task per client and partition keeps
``--in-flight`` transactions outstanding, each worker submitting its next transaction when its
last one completed (driver._closed_loop), without a client or cluster."""

from __future__ import annotations

import asyncio
import random
from typing import Any

from waltz_core.client.api import PartitionLocalLock
from waltz_core.perf import driver
from waltz_core.perf.driver import ProduceOptions


class FakeClient:
    """Records submitted contexts; the test completes them."""

    def __init__(self) -> None:
        self.submitted: list[Any] = []

    async def submit(self, ctx: Any) -> None:
        self.submitted.append(ctx)


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_each_worker_keeps_one_transaction_in_flight_and_a_batch_of_completions_refills_them() -> None:
    run = driver._Run(ProduceOptions(in_flight=4), b"x")
    client = FakeClient()
    own = [PartitionLocalLock("perf-own", w) for w in range(4)]
    task = asyncio.create_task(driver._closed_loop(run, client, 0, 4, own, random.Random(1)))  # type: ignore[arg-type]
    await _settle()
    first = list(client.submitted)
    assert len(first) == 4 and sorted(c.worker for c in first) == [0, 1, 2, 3]
    assert all(c.lock == own[c.worker] for c in first), "a worker writes its own lock"
    for ctx in first[:3]:  # three complete in one loop step
        ctx.on_completion(True)
        ctx.on_application()
    first[0].on_exception(RuntimeError("after the application"))  # gives nothing back twice
    await _settle()
    refill = client.submitted[4:]
    assert sorted(c.worker for c in refill) == sorted(c.worker for c in first[:3])
    assert all(c.lock == own[c.worker] for c in refill)
    await _settle()
    assert len(client.submitted) == 7, "the fourth worker still has its transaction in flight"
    run.stopping = True
    first[3].on_application()
    await asyncio.wait_for(task, 1)
    assert len(client.submitted) == 7, "nothing is submitted once the run stops"
