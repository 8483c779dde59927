"""A linear-time checker of Waltz histories (no NP-hard search: the log itself is the order).

Given a :class:`~waltz_core.testing.history.History` and the final log of every partition (read
through a fresh client after the faults healed), :func:`check` reports every violation of:

* ``dense`` - transaction ids are 0, 1, 2, ... without gaps;
* ``duplicate`` - no request id is committed twice;
* ``lost`` - every acknowledged (``ok``) append is in the final log, at the id it was acked with;
* ``failed-committed`` - no append that definitely failed (lock failure) is in the log;
* ``phantom`` - no committed transaction that no client invoked;
* ``real-time`` - if A was acknowledged before B was invoked, A precedes B in the log;
* ``consumer`` - every consumer saw a prefix-consistent view: the same request at every id;
* ``client-ahead`` - no mount found the server behind what a client had already consumed;
* ``lock`` - optimistic-lock safety, replayed with the ``exact`` lock table: no committed
  transaction has a write/read lock that another transaction committed after its client
  high-water mark and before it;
* ``replica`` - every replica holds the committed prefix, byte-identical to the others and to
  the log the client read;
* ``bank`` - the bank workload conserves money (sum of balances constant, none negative).

Cost: one pass over the history and one over each log, plus one sort per partition for the
real-time check (O(n log n) in the number of operations).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from ..locks.base import LockRequest
from ..locks.exact import ExactLockTable
from .history import FAIL, OK, History, Operation


@attrs.frozen
class LogEntry:
    """One committed transaction of the final log (``data`` optional)."""

    transaction_id: int
    req_id: str
    header: int
    data: bytes | None = None


@attrs.frozen
class Violation:
    kind: str
    partition: int | None
    detail: str

    def __str__(self) -> str:
        where = "" if self.partition is None else f"partition {self.partition}: "
        return f"[{self.kind}] {where}{self.detail}"


@attrs.frozen
class BankModel:
    """The bank workload: ``accounts`` per partition starting at ``initial``; op data
    ``{"a", "b", "amt", "na", "nb"}``: move ``amt`` from ``a`` to ``b``, writing the absolute new
    balances ``na``/``nb`` computed at the client high-water mark."""

    accounts: int
    initial: int


@attrs.define
class Verdict:
    violations: list[Violation] = attrs.Factory(list)
    stats: dict[str, Any] = attrs.Factory(dict)

    @property
    def ok(self) -> bool:
        return not self.violations

    def kinds(self) -> set[str]:
        return {v.kind for v in self.violations}

    def add(self, kind: str, partition: int | None, detail: str, limit: int = 20) -> None:
        # Keep the first few of each kind in full; count the rest (a broken run can have thousands).
        counts = self.stats.setdefault("violations_by_kind", {})
        counts[kind] = counts.get(kind, 0) + 1
        if counts[kind] <= limit:
            self.violations.append(Violation(kind, partition, detail))

    def report(self) -> list[str]:
        lines = [f"{k}: {v}" for k, v in sorted(self.stats.items()) if k != "violations_by_kind"]
        if self.ok:
            lines.append("verdict: OK (no violation)")
        else:
            lines.append(f"verdict: FAILED {self.stats.get('violations_by_kind')}")
            lines.extend(str(v) for v in self.violations)
        return lines


def check(history: History, logs: Mapping[int, Sequence[LogEntry]],
          replicas: Mapping[int, Mapping[str, Sequence[LogEntry]]] | None = None,
          bank: BankModel | None = None) -> Verdict:
    """Check ``history`` against the final ``logs`` (partition -> entries from id 0), optionally
    against each replica's records (partition -> replica name -> entries) and the bank model."""
    v = Verdict()
    by_req: dict[str, Operation] = {}
    for op in history.operations:
        by_req[op.req_id] = op
    v.stats.update(operations=len(history.operations),
                   ok=sum(op.outcome == OK for op in history.operations),
                   failed=sum(op.outcome == FAIL for op in history.operations),
                   unknown=sum(op.outcome not in (OK, FAIL) for op in history.operations),
                   committed=sum(len(entries) for entries in logs.values()),
                   faults=sum(1 for e in history.nemesis if e.get("phase") == "start"))
    position: dict[str, tuple[int, int]] = {}
    for partition, entries in logs.items():
        _check_log(v, partition, entries, by_req, position)
        _check_locks(v, partition, entries, by_req)
        if bank is not None:
            _check_bank(v, partition, entries, by_req, bank)
    _check_acks(v, history, position, logs)
    _check_real_time(v, history, position)
    _check_consumers(v, history, logs)
    for e in history.events:
        if e.get("what") == "client-ahead":
            v.add("client-ahead", e.get("partition"), f"client {e.get('process')} had consumed up to {e.get('hwm')} "
                  "but the server's log is shorter (committed transactions vanished)")
    if replicas is not None:
        for partition, by_replica in replicas.items():
            _check_replicas(v, partition, logs.get(partition, ()), by_replica)
    return v


def _check_log(v: Verdict, partition: int, entries: Sequence[LogEntry], by_req: Mapping[str, Operation],
               position: dict[str, tuple[int, int]]) -> None:
    for i, e in enumerate(entries):
        if e.transaction_id != i:
            v.add("dense", partition, f"entry {i} has transaction id {e.transaction_id}")
        seen = position.get(e.req_id)
        if seen is not None:
            v.add("duplicate", partition, f"request {e.req_id} committed as {seen} and {(partition, i)}")
            continue
        position[e.req_id] = (partition, i)
        op = by_req.get(e.req_id)
        if op is None:
            v.add("phantom", partition, f"transaction {i} (request {e.req_id}) was never invoked by any client")
        elif op.outcome == FAIL:
            v.add("failed-committed", partition, f"transaction {i}: request {e.req_id} was answered as failed")
        elif op.partition != partition:
            v.add("phantom", partition, f"transaction {i}: request {e.req_id} was sent to partition {op.partition}")


def _check_acks(v: Verdict, history: History, position: Mapping[str, tuple[int, int]],
                logs: Mapping[int, Sequence[LogEntry]]) -> None:
    for op in history.operations:
        if op.outcome != OK:
            continue
        at = position.get(op.req_id)
        if at is None:
            if op.partition in logs:
                v.add("lost", op.partition, f"request {op.req_id} acknowledged as transaction {op.txn} "
                      "is not in the final log")
        elif at != (op.partition, op.txn):
            v.add("lost", op.partition, f"request {op.req_id} acknowledged as transaction {op.txn} "
                  f"is at {at[1]} in the final log")


def _check_real_time(v: Verdict, history: History, position: Mapping[str, tuple[int, int]]) -> None:
    acked: dict[int, list[tuple[float, int, str]]] = defaultdict(list)
    invoked: dict[int, list[tuple[float, int, str]]] = defaultdict(list)
    for op in history.operations:
        at = position.get(op.req_id)
        if at is None:
            continue
        invoked[at[0]].append((op.invoke_time, at[1], op.req_id))
        if op.outcome == OK and op.complete_time is not None:
            acked[at[0]].append((op.complete_time, at[1], op.req_id))
    for partition, later in invoked.items():
        earlier = sorted(acked.get(partition, ()))
        later.sort()
        j, best, best_req = 0, -1, ""
        for t_invoke, pos, req in later:
            while j < len(earlier) and earlier[j][0] < t_invoke:
                if earlier[j][1] > best:
                    best, best_req = earlier[j][1], earlier[j][2]
                j += 1
            if best > pos:
                v.add("real-time", partition, f"request {req} (transaction {pos}) was invoked after request "
                      f"{best_req} was acknowledged, yet precedes it (transaction {best})")


def _check_consumers(v: Verdict, history: History, logs: Mapping[int, Sequence[LogEntry]]) -> None:
    for feed in history.feeds:
        partition, first = feed["partition"], feed["first"]
        entries = logs.get(partition)
        if entries is None:
            continue
        for i, req in enumerate(feed["req_ids"]):
            txn = first + i
            if txn >= len(entries):
                v.add("consumer", partition, f"client {feed['process']} consumed transaction {txn} "
                      f"(request {req}) beyond the final log's end {len(entries) - 1}")
                break
            if entries[txn].req_id != req:
                v.add("consumer", partition, f"client {feed['process']} saw request {req} at transaction {txn}, "
                      f"the final log has {entries[txn].req_id}")
                break


def _check_locks(v: Verdict, partition: int, entries: Sequence[LogEntry], by_req: Mapping[str, Operation]) -> None:
    table = ExactLockTable(-1)
    checked = 0
    for e in entries:
        op = by_req.get(e.req_id)
        if op is None or not (op.write_locks or op.read_locks or op.append_locks):
            continue
        request = LockRequest(op.write_locks, op.read_locks, op.append_locks)
        conflict = table.check(request, op.hwm)
        checked += 1
        if conflict is not None and conflict < e.transaction_id:
            v.add("lock", partition, f"transaction {e.transaction_id} (request {e.req_id}, client high-water mark "
                  f"{op.hwm}) committed although transaction {conflict} wrote one of its locks after that mark")
        table.commit(request, e.transaction_id)
    v.stats["lock_checked"] = v.stats.get("lock_checked", 0) + checked


def _check_bank(v: Verdict, partition: int, entries: Sequence[LogEntry], by_req: Mapping[str, Operation],
                bank: BankModel) -> None:
    balances = [bank.initial] * bank.accounts
    stale = 0
    for e in entries:
        op = by_req.get(e.req_id)
        d = op.data if op is not None else None
        if not isinstance(d, dict) or "na" not in d:
            continue
        a, b, amt = d["a"], d["b"], d["amt"]
        if d["na"] != balances[a] - amt or d["nb"] != balances[b] + amt:
            stale += 1  # written from a stale read: a lost update
        balances[a], balances[b] = d["na"], d["nb"]
    total = sum(balances)
    if total != bank.accounts * bank.initial:
        v.add("bank", partition, f"money not conserved: total {total}, expected {bank.accounts * bank.initial} "
              f"({stale} transfers computed from stale balances)")
    negative = [i for i, x in enumerate(balances) if x < 0]
    if negative:
        v.add("bank", partition, f"negative balances in accounts {negative[:10]}")


def _check_replicas(v: Verdict, partition: int, log: Sequence[LogEntry],
                    by_replica: Mapping[str, Sequence[LogEntry]]) -> None:
    committed = len(log)
    reference = [(e.transaction_id, e.req_id, e.header) for e in log]
    first_name, first = None, None
    for name, records in sorted(by_replica.items()):
        if len(records) < committed:
            v.add("replica", partition, f"{name} holds {len(records)} records, {committed} are committed")
            continue
        prefix = list(records[:committed])
        if [(r.transaction_id, r.req_id, r.header) for r in prefix] != reference:
            bad = next(i for i, r in enumerate(prefix) if (r.transaction_id, r.req_id, r.header) != reference[i])
            v.add("replica", partition, f"{name} differs from the client's log at transaction {bad}")
            continue
        if first is None:
            first_name, first = name, prefix
        elif prefix != first:
            bad = next(i for i, (x, y) in enumerate(zip(prefix, first, strict=True)) if x != y)
            v.add("replica", partition, f"{name} and {first_name} differ at transaction {bad} (data or checksum)")
