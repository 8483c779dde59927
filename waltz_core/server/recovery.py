"""Recovery of a partition at the start of every store session (Waltz design, "Recovery Procedure").

Run before any write of a new session, exactly as the Waltz design lays out, per reachable replica (all
replicas at once; recovery goes on as soon as the replicas that answered decide the vote, so a
replica whose host vanished costs nothing but its absence):

1. read its last session info (this also fences older sessions: the storage adopts the new
   session id) and its max transaction id;
2. if its replica state in the partition metadata and the storage disagree on the session, the
   replica is *inconsistent*: truncate it to the low-water mark saved in the storage;
3. else if the metadata already has a resolved closing high-water mark for it, truncate to that;
4. else it was engaged in the last session: it proposes its max transaction id.

Then the vote (:mod:`.vote`) over the marks of the replicas of the previous session (the last
one that finished its recovery, recorded in the partition metadata): every committed record is
on a majority of *those*, so a vote among the replicas assigned now, when a replica was added or
taken out since, would count against the wrong majority. A replica added since does not vote;
one taken out counts as offline. While undecidable, replicas behind the most advanced one catch
up from it (every reachable replica holds a prefix of the same sequence after steps 2-4),
offline replicas are retried, and the vote is re-evaluated on every change. Once decided at
``H``: replicas above ``H`` are truncated (dirty transactions), replicas below catch up until a
majority of the replicas assigned now holds ``H``, each replica at ``H`` gets the low-water mark
``H`` under the new session id, and the new replica states follow step 6 of the Waltz design's
recovery, for every replica the metadata knows.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence

import attrs

from ..coordination.metadata import UNRESOLVED, ReplicaState
from ..errors import WaltzError
from ..protocol.wire import RecordBatch
from ..retry import RetryPolicy
from .replica import ReplicaApi
from .vote import VoteResult, evaluate, quorum_of

log = logging.getLogger("waltz.server.recovery")

#: Session id of a replica state that was never written (a replica new to the metadata).
NO_SESSION = -1

CATCH_UP_BATCH = 500

#: Seconds recovery waits for more replicas to answer after the last answer: long enough for a
#: healthy replica that is merely a little slower (left out, it would be brought in by another
#: session a second later), short next to the connect and request timeouts a vanished host costs.
STRAGGLER_GRACE = 0.25


@attrs.frozen
class RecoveryResult:
    high_water_mark: int
    clean: frozenset[str]  #: at the high-water mark with the low-water mark set in this session
    lagging: Mapping[str, int]  #: reachable but behind: endpoint -> max transaction id
    replica_states: Mapping[str, ReplicaState]  #: new states to write (step 6)


@attrs.define
class _Replica:
    endpoint: str
    api: ReplicaApi | None
    mark: int = -1  #: highest transaction id it holds after the pre-vote truncation
    prepared: bool = False
    preparing: asyncio.Task[None] | None = None  #: connect + prepare in flight (may outlive one wait)


class RecoveryFailed(WaltzError):
    """A replica failed during recovery; the store starts over with a new session."""

    retriable = True


class _CopyFailed(RecoveryFailed):
    """A catch-up copy failed, and on which side: the source's read or the target's append (a
    RecoveryFailed with the cause's message, where the side does not matter)."""

    def __init__(self, replica: _Replica, cause: WaltzError) -> None:
        super().__init__(str(cause))
        self.replica = replica
        self.cause = cause


class Recovery:
    """One run of the recovery procedure for one partition and one new session."""

    def __init__(
        self,
        partition_id: int,
        session_id: int,
        assigned: list[str],
        states: Mapping[str, ReplicaState],
        connect: Callable[[str], Awaitable[ReplicaApi | None]],
        retry_interval: float = 0.1,
        max_retry_interval: float = 2.0,
        on_replica_error: Callable[[str, ReplicaApi, WaltzError], None] | None = None,
        previous: Sequence[str] | None = None,
    ) -> None:
        self.partition_id = partition_id
        #: told of every replica that answered the recovery with an error (the store holds out a
        #: node that refuses: one that does not hold the partition yet, a full disk)
        self._on_replica_error = on_replica_error
        self.session_id = session_id
        self.assigned = list(assigned)
        self.states = dict(states)
        self._connect = connect
        #: between rounds that changed nothing (no vote, no catch-up): jittered so that the
        #: partitions of a server that lost a replica do not re-poll the survivors in lock step
        self._backoff = RetryPolicy(initial=retry_interval, maximum=max_retry_interval)
        self.quorum = quorum_of(len(assigned))
        #: who votes: the replicas of the previous session (the ones assigned now if not recorded)
        self.voters = frozenset(previous or assigned)
        self.last_vote: VoteResult | None = None
        #: while the vote cannot decide: why, and which voters were not heard (the server's
        #: /readyz gives it); None otherwise
        self.waiting: str | None = None

    async def run(self) -> RecoveryResult:
        replicas = {ep: _Replica(ep, None) for ep in self.assigned}
        try:
            return await self._run(replicas)
        finally:
            await self._stop_preparing(replicas)

    async def _run(self, replicas: dict[str, _Replica]) -> RecoveryResult:
        delays = self._backoff.delays()  # endless: recovery runs until decided (or cancelled)
        while True:
            await self._prepare_reachable(replicas)
            result = self._evaluate(replicas)
            self.last_vote = result
            self.waiting = None if result.decided else f"{result.reason} ({self._unheard(replicas)})"
            if not result.decided:
                if await self._catch_up_towards_decision(replicas):
                    continue  # something changed: re-evaluate at once
                log.info("partition %d session %d: %s", self.partition_id, self.session_id, result.reason)
                await asyncio.sleep(next(delays))
                continue
            assert result.high_water_mark is not None
            # Replicas that never answered count as offline, which the decision allowed for; one
            # that answers between the decision and here is prepared and handled by _finish (a
            # mark above the decided one is dirty: it could not reach a quorum with the offline
            # replicas' help, so truncating it loses nothing committed).
            stragglers = await self._stop_preparing(replicas)
            if stragglers:
                log.info("partition %d session %d: going on without %s (no answer yet)", self.partition_id,
                         self.session_id, ", ".join(stragglers))
            return await self._finish(replicas, result.high_water_mark)

    async def _stop_preparing(self, replicas: dict[str, _Replica]) -> list[str]:
        """Cancel the prepares still in flight; the endpoints they were for."""
        running = {r.endpoint: r.preparing for r in replicas.values() if r.preparing is not None and not r.preparing.done()}
        for task in running.values():
            task.cancel()
        if running:
            await asyncio.gather(*running.values(), return_exceptions=True)
        return sorted(ep for ep, _ in running.items() if not replicas[ep].prepared)

    # --------------------------------------------------------------------------- steps 5.a-5.b

    async def _prepare_reachable(self, replicas: dict[str, _Replica]) -> None:
        """Prepare every replica not prepared yet, all at once, and wait until they have all
        answered or failed - but a replica may hang until a timeout (its host vanished), so wait
        at most ``STRAGGLER_GRACE`` once some have answered and no answer came since: the vote and
        the catch-up go on with those, and a straggler's prepare keeps running for the next
        round (or is cancelled once the vote is decided: it joins later, through a new session)."""
        for r in replicas.values():
            if not r.prepared and (r.preparing is None or r.preparing.done()):
                r.preparing = asyncio.ensure_future(self._prepare_one(r))
        pending = {r.preparing for r in replicas.values() if r.preparing is not None and not r.preparing.done()}
        while pending:
            # Once a replica answered, each of the others has STRAGGLER_GRACE after the last answer.
            answered = any(r.prepared for r in replicas.values())
            done, pending = await asyncio.wait(pending, timeout=STRAGGLER_GRACE if answered else None,
                                               return_when=asyncio.FIRST_COMPLETED)
            if not done:
                return

    async def _prepare_one(self, r: _Replica) -> None:
        if r.api is None:
            r.api = await self._connect(r.endpoint)
            if r.api is None:
                return
        try:
            r.mark = await self._prepare(r.endpoint, r.api)
            r.prepared = True
        except WaltzError as exc:
            log.warning("partition %d: replica %s unavailable for recovery: %s", self.partition_id, r.endpoint, exc)
            if self._on_replica_error is not None:
                self._on_replica_error(r.endpoint, r.api, exc)
            r.api = None

    def _unheard(self, replicas: dict[str, _Replica]) -> str:
        """The voters that did not answer, for an operator: a vote that waits needs one of them."""
        heard = {r.endpoint for r in replicas.values() if r.prepared}
        unheard = [ep if ep in replicas else f"{ep}, no longer assigned" for ep in sorted(self.voters - heard)]
        return ("replicas of the previous session not heard: " + "; ".join(unheard)) if unheard else \
            "every replica of the previous session answered"

    def _evaluate(self, replicas: dict[str, _Replica]) -> VoteResult:
        # A replica of the previous session that is no longer assigned is never asked: offline.
        # Once decided, _finish brings a majority of the replicas assigned now to the mark.
        return evaluate({r.endpoint: r.mark for r in replicas.values() if r.prepared and r.endpoint in self.voters},
                        len(self.voters))

    async def _prepare(self, endpoint: str, api: ReplicaApi) -> int:
        sid, pid = self.session_id, self.partition_id
        info = await api.last_session_info(sid, pid)
        max_id = await api.max_transaction_id(sid, pid)
        state = self.states.get(endpoint, ReplicaState(NO_SESSION, UNRESOLVED))
        if state.session_id != info.session_id:
            # Inconsistent with the metadata (restored copy, new replica, missed update): keep only
            # what the storage itself knows was committed.
            target = info.low_water_mark
            reason = f"inconsistent (metadata session {state.session_id}, storage session {info.session_id})"
        elif state.closing_high_water_mark != UNRESOLVED:
            target = state.closing_high_water_mark
            reason = "closing high-water mark already resolved"
        else:
            return max_id  # engaged in the last session: proposes its max transaction id
        if max_id > target:
            log.info("partition %d: replica %s %s: truncating %d -> %d", pid, endpoint, reason, max_id, target)
            await api.truncate(sid, pid, target)
            return target
        return max_id

    async def _catch_up_towards_decision(self, replicas: dict[str, _Replica]) -> bool:
        """Copy from the most advanced reachable replica to those behind it; True if any moved."""
        ready = [r for r in replicas.values() if r.prepared and r.api is not None]
        if len(ready) < 2:
            return False
        source = max(ready, key=lambda r: r.mark)
        moved = False
        for r in ready:
            if r is not source and r.mark < source.mark:
                try:
                    r.mark = await self._copy(source, r, source.mark)
                    moved = True
                except _CopyFailed as failed:
                    # The side that failed is prepared (connected) again in the next round, after
                    # the round's pause: re-trying at once over the same dead connection spun.
                    bad = failed.replica
                    log.warning("partition %d: catch-up of %s from %s failed at %s: %s", self.partition_id,
                                r.endpoint, source.endpoint, bad.endpoint, failed.cause)
                    if self._on_replica_error is not None and bad.api is not None:
                        self._on_replica_error(bad.endpoint, bad.api, failed.cause)
                    bad.prepared, bad.api = False, None
                    return moved
        return moved

    async def _copy(self, source: _Replica, target: _Replica, upto: int) -> int:
        """Copy records ``target.mark+1 .. upto`` from ``source``; return the new mark."""
        assert source.api is not None and target.api is not None
        sid, pid = self.session_id, self.partition_id
        mark = target.mark
        while mark < upto:
            try:
                records = await source.api.record_list(sid, pid, mark + 1, min(CATCH_UP_BATCH, upto - mark))
                if not records:
                    raise RecoveryFailed(f"replica {source.endpoint} returned no records after {mark}")
                batch = RecordBatch.of(records)  # a storage client's list is a batch already: no re-encoding
            except WaltzError as exc:
                raise _CopyFailed(source, exc) from exc
            try:
                await target.api.append(sid, pid, batch)
            except WaltzError as exc:
                raise _CopyFailed(target, exc) from exc
            mark = batch.last_transaction_id
        return mark

    # --------------------------------------------------------------------------- after the vote

    async def _finish(self, replicas: dict[str, _Replica], hwm: int) -> RecoveryResult:
        sid, pid = self.session_id, self.partition_id
        clean: set[str] = set()
        lagging: dict[str, int] = {}
        sources = [r for r in replicas.values() if r.prepared and r.api is not None and r.mark >= hwm]
        for r in replicas.values():
            if not r.prepared or r.api is None:
                continue
            try:
                if r.mark > hwm:
                    await r.api.truncate(sid, pid, hwm)  # dirty: never reached a quorum
                    r.mark = hwm
                if r.mark == hwm:
                    await r.api.set_low_water_mark(sid, pid, hwm)
                    clean.add(r.endpoint)
                else:
                    lagging[r.endpoint] = r.mark
            except WaltzError as exc:
                log.warning("partition %d: replica %s failed while closing recovery: %s", pid, r.endpoint, exc)
                r.api = None
        # Catch up laggards now while fewer than a quorum is clean; the rest catch up in the session.
        for endpoint in sorted(lagging, key=lambda e: -lagging[e]):
            if len(clean) >= self.quorum:
                break
            r = replicas[endpoint]
            source = next((s for s in sources if s.endpoint in clean), None)
            if source is None or r.api is None:
                continue
            try:
                r.mark = await self._copy(source, r, hwm)
                await r.api.set_low_water_mark(sid, pid, hwm)
                clean.add(endpoint)
                del lagging[endpoint]
            except WaltzError as exc:
                log.warning("partition %d: catch-up of %s failed: %s", pid, endpoint, exc)
                del lagging[endpoint]
        if len(clean) < self.quorum:
            raise RecoveryFailed(
                f"partition {pid}: only {len(clean)} replica(s) clean at {hwm}, quorum is {self.quorum}"
            )
        return RecoveryResult(hwm, frozenset(clean), lagging, self.new_states(clean, hwm))

    def new_states(self, clean: set[str], hwm: int) -> dict[str, ReplicaState]:
        """Step 6 of the Waltz design's recovery: the replica states written to the partition metadata.

        For every replica the metadata knows, assigned or not: one of the previous session taken
        out since gets its closing high-water mark resolved here too, so that if it is assigned
        again it is truncated to it, dirty tail and all (a state left unresolved would let it
        propose its max transaction id against a log that went on without it)."""
        out: dict[str, ReplicaState] = {}
        for endpoint in dict.fromkeys([*self.assigned, *sorted(self.states)]):
            old = self.states.get(endpoint)
            if endpoint in clean:
                out[endpoint] = ReplicaState(self.session_id, UNRESOLVED)
            elif old is None:
                # Never engaged: record where the cluster was, so a later consistent start truncates there.
                out[endpoint] = ReplicaState(NO_SESSION, hwm)
            elif old.closing_high_water_mark == UNRESOLVED:
                out[endpoint] = ReplicaState(old.session_id, hwm)
            else:
                out[endpoint] = old
        return out
