"""The client's RPCs: high-water marks and transaction data, on the RPC connections.

:class:`Rpc` is the narrow interface the rest of the client asks the servers through:

* :meth:`Rpc.high_water_mark` - the server's committed high-water mark of a partition;
* :meth:`Rpc.data_range` - one data RPC, no retry (``TransactionDataRangeRequest``, or one
  ``TransactionDataRequest`` for a single transaction and for servers speaking only protocol
  version 1); the read-ahead's speculative fetches use it;
* :meth:`Rpc.fetch_data` - data at least from a given transaction, each CRC-32 checked, retried
  until it arrives or a deadline passes (what an application waits for).

Retries follow one :class:`~waltz_core.retry.RetryPolicy` per kind: the error flags decide
(transport failures, a partition without a server right now, a server that cannot serve yet -
not owned, not committed - are retried; a closed client is not), plus ``TimeoutError`` of an
RPC answer. Past the deadline the last error is raised as ClientTimeoutError. A data checksum
mismatch is asked again at once, up to ``client.data_fetch_attempts`` times, then ChecksumError.

Event loop only.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from ..errors import ChecksumError, ClientError, ClientTimeoutError, PartitionNotReadyError
from ..protocol import client as m
from ..protocol.client import DATA_RANGE_VERSION
from ..protocol.session import SEQ_MASK
from ..protocol.wire import ReqId, crc32
from ..retry import RetryPolicy, is_retriable

if TYPE_CHECKING:
    from .context import ClientContext

log = logging.getLogger("waltz.client")

HIGH_WATER_MARK_RETRY = RetryPolicy(initial=0.01, maximum=1.0)  #: deadline: ``client.rpc_timeout``
DATA_RETRY = RetryPolicy(initial=0.01, maximum=5.0)  #: deadline: ``client.data_fetch_timeout``

#: (data, checksums, error text) of one data RPC
DataAnswer = tuple[tuple[bytes, ...], tuple[int, ...], "str | None"]


def retriable(exc: BaseException) -> bool:
    """What the client's RPC loops retry: the error flags, and an RPC answer that timed out. Not a
    checksum mismatch: it has its own attempt count, without backoff."""
    if isinstance(exc, ChecksumError):
        return False
    return isinstance(exc, TimeoutError) or is_retriable(exc)


def verified(data: tuple[bytes, ...], checksums: tuple[int, ...]) -> int:
    """How many transactions from the start of a range have the data their checksum says."""
    good = 0
    for payload, checksum in zip(data, checksums, strict=False):  # a short reply verifies what it has
        if crc32(payload) != checksum:
            break
        good += 1
    return good


class Rpc:
    """RPCs of one client to the owners of its partitions (see the module docstring)."""

    def __init__(self, ctx: ClientContext) -> None:
        self._ctx = ctx
        cfg = ctx.config.client
        self._seq = itertools.count(1)
        self._hwm_retry = attrs.evolve(HIGH_WATER_MARK_RETRY, deadline=cfg.rpc_timeout)
        self._data_retry = attrs.evolve(DATA_RETRY, deadline=cfg.data_fetch_timeout)

    async def request(self, partition_id: int, make: Callable[[ReqId], Any]) -> Any:
        """One RPC to the partition's owner: ``make(req_id)`` sent, its answer returned."""
        ctx = self._ctx
        ctx.check_open()
        if not 0 <= partition_id < ctx.num_partitions:
            raise ClientError(f"no partition {partition_id}")
        owner = ctx.owners.get(partition_id)
        if owner is None:
            raise ClientTimeoutError(f"partition {partition_id} has no server right now")
        assert ctx.links is not None
        link = ctx.links.get(owner.endpoint)
        req = ReqId(ctx.client_id, owner.generation, partition_id, next(self._seq) & SEQ_MASK)
        return await link.rpc(make(req), ctx.config.client.rpc_timeout)

    async def high_water_mark(self, partition_id: int) -> int:
        """The server's committed high-water mark of a partition, retried until ``client.rpc_timeout``."""
        async def once() -> int:
            resp = await self.request(partition_id, m.HighWaterMarkRequest)
            if resp.transaction_id >= -1:
                return int(resp.transaction_id)
            raise PartitionNotReadyError(f"partition {partition_id} is not on the server")

        try:
            return await self._hwm_retry.call(once, retry_if=retriable)
        except Exception as exc:
            if retriable(exc):
                raise ClientTimeoutError(f"high-water mark of partition {partition_id}: {exc}") from None
            raise

    async def data_range(self, partition_id: int, first: int, max_count: int, max_bytes: int) -> DataAnswer:
        """One data RPC from transaction ``first`` (see the module docstring); no retry."""
        ctx = self._ctx
        ctx.check_open()
        owner = ctx.owners.get(partition_id)
        if owner is None:
            raise ClientTimeoutError(f"partition {partition_id} has no server right now")
        assert ctx.links is not None
        if max_count == 1 or await ctx.links.get(owner.endpoint).rpc_version() < DATA_RANGE_VERSION:
            single = await self.request(partition_id, lambda q: m.TransactionDataRequest(q, first))
            if single.data is None:
                return (), (), single.error
            return (single.data,), (single.checksum,), None
        resp = await self.request(partition_id,
                                  lambda q: m.TransactionDataRangeRequest(q, first, max_count, max_bytes))
        if resp.first_transaction_id != first:  # never from a correct server; not worth a retry loop
            raise ClientError(f"partition {partition_id}: asked for data from transaction {first}, "
                              f"got it from {resp.first_transaction_id}")
        return resp.data, resp.checksums, resp.error

    async def fetch_data(self, partition_id: int, first: int, max_count: int, max_bytes: int) -> list[bytes]:
        """Verified data of transactions from ``first`` (at least that one, at most ``max_count``):
        the verified prefix of an answer is kept; a bad first transaction is asked again."""
        cfg = self._ctx.config.client
        bad = 0

        async def once() -> list[bytes]:
            nonlocal bad
            while True:
                data, checksums, error_text = await self.data_range(partition_id, first, max_count, max_bytes)
                if not data:  # the server cannot serve it (yet): not committed, partition not ready
                    raise PartitionNotReadyError(error_text or "data fetch failed")
                good = verified(data, checksums)
                if good:
                    return list(data[:good])
                bad += 1
                log.warning("client %d: transaction %d of partition %d: data checksum mismatch (attempt %d)",
                            self._ctx.client_id, first, partition_id, bad)
                if bad >= cfg.data_fetch_attempts:
                    raise ChecksumError(f"transaction {first} of partition {partition_id}: data checksum "
                                        f"mismatch in {bad} attempts")

        try:
            return await self._data_retry.call(once, retry_if=retriable)
        except Exception as exc:
            if retriable(exc):
                raise ClientTimeoutError(f"transaction {first} of partition {partition_id}: data not fetched "
                                         f"within {cfg.data_fetch_timeout}s: {exc}") from None
            raise
