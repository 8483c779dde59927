"""Jepsen-style operation histories as JSON lines.

Every client operation is two lines, written when it starts and when its fate is known::

    {"type": "invoke", "process": 1, "op": 17, "time": 12.3456, "partition": 0, "req_id": "1.3.0.17",
     "hwm": 41, "write_locks": [..], "read_locks": [..], "append_locks": [..]}
    {"type": "complete", "process": 1, "op": 17, "time": 12.3511, "outcome": "ok", "txn": 42}

``time`` is ``time.monotonic()`` of the recording process (one clock for the whole run: all
clients of a smoke test live in one process); ``outcome`` is ``ok`` (seen committed, ``txn`` is
its id), ``fail`` (definitely not committed, e.g. a lock failure) or ``unknown`` (timed out or
the connection broke: it may or may not be committed). Other lines: ``feed`` (one consumer's
view of a partition: ``first`` id and the request ids in order), ``nemesis`` (a fault started or
ended) and ``event`` (e.g. a mount answered ``CLIENT_AHEAD``).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

import attrs

from ..protocol.wire import ReqId

OK, FAIL, UNKNOWN = "ok", "fail", "unknown"


def req_key(req_id: ReqId | tuple[int, int, int, int]) -> str:
    """A request id as the history's string key ``client.generation.partition.seq``."""
    if isinstance(req_id, ReqId):
        return f"{req_id.client_id}.{req_id.generation}.{req_id.partition_id}.{req_id.seq_num}"
    return ".".join(str(x) for x in req_id)


@attrs.define(slots=True)
class Operation:
    """One operation assembled from its invoke and complete lines."""

    process: int
    op: int
    partition: int
    req_id: str
    invoke_time: float
    hwm: int
    write_locks: tuple[int, ...] = ()
    read_locks: tuple[int, ...] = ()
    append_locks: tuple[int, ...] = ()
    complete_time: float | None = None
    outcome: str = UNKNOWN  #: an operation never completed counts as unknown
    txn: int | None = None
    data: Any = None


class HistoryWriter:
    """Appends history lines to a file; thread-safe; flushed per line (a crash keeps what was written)."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._out: TextIO = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - open until close()
        self._lock = threading.Lock()
        self.counts = {"invoke": 0, OK: 0, FAIL: 0, UNKNOWN: 0}

    def write(self, **fields: Any) -> None:
        line = json.dumps(fields, separators=(",", ":"))
        with self._lock:
            self._out.write(line + "\n")
            self._out.flush()

    def invoke(self, process: int, op: int, partition: int, req_id: str, hwm: int, *, write_locks: Iterable[int] = (),
               read_locks: Iterable[int] = (), append_locks: Iterable[int] = (), data: Any = None,
               now: float | None = None) -> None:
        self.counts["invoke"] += 1
        self.write(type="invoke", process=process, op=op, time=time.monotonic() if now is None else now,
                   partition=partition, req_id=req_id, hwm=hwm, write_locks=list(write_locks),
                   read_locks=list(read_locks), append_locks=list(append_locks), data=data)

    def complete(self, process: int, op: int, outcome: str, txn: int | None = None, now: float | None = None) -> None:
        self.counts[outcome] += 1
        self.write(type="complete", process=process, op=op, time=time.monotonic() if now is None else now,
                   outcome=outcome, txn=txn)

    def feed(self, process: int, partition: int, first: int, req_ids: list[str]) -> None:
        self.write(type="feed", process=process, partition=partition, first=first, req_ids=req_ids)

    def nemesis(self, fault: str, target: str, phase: str, now: float | None = None, **extra: Any) -> None:
        self.write(type="nemesis", fault=fault, target=target, phase=phase,
                   time=time.monotonic() if now is None else now, **extra)

    def event(self, process: int, what: str, **extra: Any) -> None:
        self.write(type="event", process=process, what=what, time=time.monotonic(), **extra)

    def close(self) -> None:
        with self._lock:
            self._out.close()


def read_lines(path: Path | str) -> Iterator[dict[str, Any]]:
    """Every complete JSON line of a history file (a torn last line is skipped)."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except ValueError:
                continue


@attrs.define
class History:
    """A parsed history: operations by (process, op), consumer feeds, nemesis and other events."""

    operations: list[Operation] = attrs.Factory(list)
    feeds: list[dict[str, Any]] = attrs.Factory(list)
    nemesis: list[dict[str, Any]] = attrs.Factory(list)
    events: list[dict[str, Any]] = attrs.Factory(list)

    @classmethod
    def from_lines(cls, lines: Iterable[dict[str, Any]]) -> History:
        h = cls()
        ops: dict[tuple[int, int], Operation] = {}
        for e in lines:
            kind = e.get("type")
            if kind == "invoke":
                ops[(e["process"], e["op"])] = Operation(
                    e["process"], e["op"], e["partition"], e["req_id"], e["time"], e["hwm"],
                    tuple(e.get("write_locks", ())), tuple(e.get("read_locks", ())), tuple(e.get("append_locks", ())),
                    data=e.get("data"))
            elif kind == "complete":
                op = ops.get((e["process"], e["op"]))
                if op is not None:
                    op.complete_time, op.outcome, op.txn = e["time"], e["outcome"], e.get("txn")
            elif kind == "feed":
                h.feeds.append(e)
            elif kind == "nemesis":
                h.nemesis.append(e)
            else:
                h.events.append(e)
        h.operations = list(ops.values())
        return h

    @classmethod
    def load(cls, path: Path | str) -> History:
        return cls.from_lines(read_lines(path))
