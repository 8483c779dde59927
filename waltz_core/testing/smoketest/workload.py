"""The smoke test's clients: protocol-level bank transfers with a recorded history.

Each :class:`PartitionWorker` is one client's connection to one partition. It mounts from what it
has consumed, then runs one operation at a time: a transfer of ``amt`` between two accounts of
the partition (account ``i`` is lock ``PartitionLocalLock("smoke", i)``), writing the accounts'
absolute new balances computed from its own replay of the feed at its high-water mark, under
write locks on both. The feed carries the transfer in the 32-bit header
(``a << 21 | b << 11 | amt``), so every consumer replays balances without fetching data.

Fates are the client library's rules (:class:`~waltz_core.protocol.session.Session`): ``ok``
when the append shows up in the feed, ``fail`` on a ``LockFailure`` (or when the session decides
it failed: it can never commit), ``unknown`` when no answer came within ``op_timeout`` or the
connection broke (it may still commit: the checker allows it at most once; the worker then
abandons the session's pending appends and mounts again). The worker speaks the protocol
directly (as :mod:`waltz_core.testing.probe` does) so request ids, locks and high-water marks
are exact.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import random
import time
from typing import Any

import attrs

from ...coordination.recipes import read_assignment
from ...errors import WaltzError
from ...locks.lock_id import PartitionLocalLock
from ...protocol import CLIENT
from ...protocol import client as m
from ...protocol.session import ClientAhead, LockFailed, Mounted, RemountLater, Session, SessionState
from ...protocol.wire import crc32
from ...retry import RetryPolicy
from ...timeouts import wait_for
from ...transport import MessageChannel
from ..checker import LogEntry
from ..history import FAIL, OK, UNKNOWN, HistoryWriter, req_key

log = logging.getLogger("waltz.smoketest.workload")

MAX_ACCOUNTS = 1024
MAX_AMOUNT = 2047
CONNECT_RETRY = RetryPolicy(initial=0.05, maximum=0.2)  #: between connect attempts (the run's deadline bounds them)

Outcome = tuple[str, "int | None"]  #: (ok / fail / unknown, transaction id)


def account_lock(i: int) -> int:
    return PartitionLocalLock("smoke", i).lock_hash


def encode_transfer(a: int, b: int, amt: int) -> int:
    return (a << 21) | (b << 11) | amt


def decode_transfer(header: int) -> tuple[int, int, int]:
    return header >> 21, (header >> 11) & 0x3FF, header & 0x7FF


class PartitionWorker:
    """One client's session with one partition (runs on the caller's event loop)."""

    def __init__(self, client_id: int, partition: int, transport: Any, coordination: Any, root: str,
                 history: HistoryWriter | None, *, accounts: int, initial: int, rng: random.Random,
                 op_timeout: float = 5.0, ops: itertools.count[int] | None = None) -> None:
        if not 2 <= accounts <= MAX_ACCOUNTS:
            raise ValueError(f"accounts must be in 2..{MAX_ACCOUNTS}")
        self.client_id, self.partition = client_id, partition
        self.transport, self.coordination, self.root = transport, coordination, root
        self.history = history
        self.accounts, self.initial = accounts, initial
        self.balances = [initial] * accounts
        self.locks = [account_lock(i) for i in range(accounts)]
        self.rng = rng
        self.op_timeout = op_timeout
        self.feed: list[tuple[str, int]] = []  #: (request key, header) per transaction id, from 0
        self.ahead = False  #: a mount answered CLIENT_AHEAD: this worker stops
        self._ops = ops or itertools.count(1)
        self._session: Session[asyncio.Future[Outcome]] = Session(client_id, partition)  # appends carry their outcome
        self._mounts = itertools.count(1)
        self._channel: MessageChannel | None = None
        self._reader: asyncio.Task[None] | None = None
        self._mounted: asyncio.Future[m.PartitionState] | None = None
        self._progress = asyncio.Event()  #: set by every message the reader handled

    @property
    def high_water_mark(self) -> int:
        return len(self.feed) - 1

    # ---------------------------------------------------------------------------- connection

    async def _owner(self) -> tuple[str, int] | None:
        assignment, _ = await read_assignment(self.coordination, self.root)
        for p in assignment.partitions:
            if p.partition_id == self.partition and p.endpoint:
                return p.endpoint, p.generation
        return None

    async def disconnect(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(BaseException):
                await self._reader
            self._reader = None
        if self._channel is not None:
            with contextlib.suppress(Exception):
                await self._channel.close()
            self._channel = None
        self._give_up()

    def _give_up(self) -> None:
        """The connection is gone: what is pending has an unknown fate (the next mount starts afresh)."""
        for entry in self._session.abandon():
            if not entry.item.done():
                entry.item.set_result((UNKNOWN, None))
        if self._session.state in (SessionState.MOUNTING, SessionState.READY):
            self._session.link_lost()

    async def connect(self, deadline: float) -> bool:
        """(Re)connect to the partition's owner and mount; False if the deadline passed first."""
        retry = attrs.evolve(CONNECT_RETRY, deadline=max(0.0, deadline - time.monotonic()))
        for delay in retry.delays():
            if self.ahead:
                break
            await self.disconnect()
            try:
                owner = await wait_for(self._owner(), 5)
                if owner is not None:
                    endpoint, generation = owner
                    self._session.bind(generation)
                    # A connect on a LAN that has not completed in a second will not: re-read the
                    # owner instead (the partition may have moved off a host that vanished).
                    conn = await wait_for(self.transport.connect(endpoint), 1)
                    self._channel = await MessageChannel.open(conn, CLIENT, f"smoke-{self.client_id}", timeout=5)
                    self._reader = asyncio.ensure_future(self._read(self._channel))
                    self._mounted = asyncio.get_running_loop().create_future()
                    await self._channel.send(self._session.mount(next(self._mounts)))
                    state = await wait_for(asyncio.shield(self._mounted), 10)
                    if state is m.PartitionState.READY:
                        return True
                    if state is m.PartitionState.CLIENT_AHEAD:
                        self.ahead = True
                        if self.history is not None:
                            self.history.event(self.client_id, "client-ahead", partition=self.partition,
                                               hwm=self.high_water_mark)
                        log.error("client %d partition %d: mount answered CLIENT_AHEAD at %d", self.client_id,
                                  self.partition, self.high_water_mark)
                        return False
            except (WaltzError, OSError, TimeoutError) as exc:
                log.debug("client %d partition %d: connect: %s", self.client_id, self.partition, exc)
            await asyncio.sleep(delay)
        await self.disconnect()
        return False

    async def _read(self, channel: MessageChannel) -> None:
        session = self._session
        try:
            while True:
                msg = await channel.recv()
                if type(msg) is m.FeedData:
                    self._take(msg)
                elif type(msg) is m.FeedDataBatch:  # client protocol 3: a commit's feed records in one message
                    for record in msg.records:
                        self._take(record)
                else:
                    action = session.receive(msg)
                    mounted = self._mounted
                    if isinstance(action, LockFailed):
                        _settle(action.entry.item, FAIL, None)
                    elif isinstance(action, Mounted | ClientAhead) or (
                            isinstance(action, RemountLater) and type(msg) is m.MountResponse):
                        if mounted is not None and not mounted.done():
                            mounted.set_result(msg.state)
                    elif isinstance(action, RemountLater):
                        return  # the server suspended the feed: the worker connects and mounts again
                for entry in session.take_failed():
                    _settle(entry.item, FAIL, None)  # decided: it can never commit
                self._progress.set()
        except (WaltzError, OSError, EOFError) as exc:
            log.debug("client %d partition %d: connection lost: %s", self.client_id, self.partition, exc)
        finally:
            self._give_up()
            self._progress.set()
            if self._mounted is not None and not self._mounted.done():
                self._mounted.set_exception(TimeoutError("connection lost while mounting"))
                self._mounted.exception()  # retrieved: the connect loop may no longer be waiting

    def _take(self, msg: m.FeedData) -> None:
        txn = msg.transaction_id
        q = msg.req_id
        entry = self._session.on_feed(q.client_id, q.seq_num, txn)  # a gap: ProtocolError, the connection is lost
        if txn == len(self.feed):
            self.feed.append((req_key(q), msg.header))
            self._session.hwm = txn
            a, b, amt = decode_transfer(msg.header)
            if a < self.accounts and b < self.accounts:
                self.balances[a] -= amt
                self.balances[b] += amt
        # An id below ours is a re-delivery after a remount; the checker compares views at the end.
        if entry is not None:
            _settle(entry.item, OK, txn)

    # ---------------------------------------------------------------------------- operations

    async def transfer(self) -> str:
        """One transfer; returns its outcome (``ok``/``fail``/``unknown``)."""
        channel = self._channel
        assert channel is not None
        a, b = self.rng.sample(range(self.accounts), 2)
        amt = self.rng.randint(0, max(0, min(self.balances[a], MAX_AMOUNT)))
        data = {"a": a, "b": b, "amt": amt, "na": self.balances[a] - amt, "nb": self.balances[b] + amt}
        hwm = self.high_water_mark
        fut: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        req = self._session.req_id(self._session.append(fut, 1, time.monotonic()))
        key = req_key(req)
        op = next(self._ops)
        locks = (self.locks[a], self.locks[b])
        payload = json.dumps(data, separators=(",", ":")).encode()
        if self.history is not None:
            self.history.invoke(self.client_id, op, self.partition, key, hwm, write_locks=locks, data=data)
        try:
            await channel.send(m.AppendRequest(req, hwm, locks, (), (), encode_transfer(a, b, amt), payload,
                                               crc32(payload)))
            outcome, txn = await wait_for(asyncio.shield(fut), self.op_timeout)
        except (WaltzError, OSError, TimeoutError):
            outcome, txn = UNKNOWN, None
        if self.history is not None:
            self.history.complete(self.client_id, op, outcome, txn)
        return outcome

    async def run(self, stop: asyncio.Event, on_outcome: Any = None) -> None:
        """Transfers until ``stop`` is set (reconnecting as needed)."""
        while not stop.is_set() and not self.ahead:
            disconnected = self._channel is None or self._channel.closed or self._reader is None or self._reader.done()
            if disconnected and not await self.connect(time.monotonic() + 5):
                continue
            outcome = await self.transfer()
            if on_outcome is not None:
                on_outcome(outcome)
            if outcome == UNKNOWN:
                await self.disconnect()  # a fresh mount decides what the feed really holds
        await self.disconnect()

    async def read_all(self, timeout: float) -> list[LogEntry]:
        """The whole log from id 0, through a fresh mount (flush first: the server's high-water mark)."""
        deadline = time.monotonic() + timeout
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(f"partition {self.partition}: log not read within {timeout}s")
            if not await self.connect(deadline):
                continue
            assert self._channel is not None
            flush = self._session.flush()
            try:
                await self._channel.send(flush)
                while True:  # until the flush is answered and the feed reached its answer
                    self._progress.clear()
                    if self._reader is None or self._reader.done():
                        raise OSError("connection lost")
                    if self._session.flush_done(flush.req_id.seq_num):
                        break
                    await wait_for(self._progress.wait(), max(0.1, deadline - time.monotonic()))
                break
            except (WaltzError, OSError, TimeoutError):
                continue
        await self.disconnect()
        return [LogEntry(i, k, h) for i, (k, h) in enumerate(self.feed)]


def _settle(fut: asyncio.Future[Outcome], outcome: str, txn: int | None) -> None:
    if not fut.done():
        fut.set_result((outcome, txn))
