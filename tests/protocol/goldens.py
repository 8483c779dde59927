"""Golden wire samples: messages of every family with the exact bytes they encode to.

``goldens.json`` holds, one case a line, a message (its family, class name and field values) and
its encoding in hex. The samples were captured from the per-message codecs that the declared
layouts replaced (see ``test_layout.py``), so they pin the wire bytes independently of the code
that produces them now. ``FailureResponse`` and ``AdminFailureResponse`` are the exception: their
layouts changed on purpose (``error_type: str`` became ``error_code: int``, storage version 3 and
admin version 2); their samples were derived from the captured ones by replacing the class-name
string with a signed 32-bit code and leaving every other byte as it was.

Field values are stored by their annotated type: ``bytes`` as hex, UUIDs as strings, enums as
their int, attrs values (request ids, records, ...) as objects, record batches as their stored
layout. ``python -m tests.protocol.goldens`` appends samples for message classes that have none
(a new message); it never rewrites an existing sample.
"""

from __future__ import annotations

import enum
import json
import types
import typing
import uuid
from pathlib import Path
from typing import Any

import attrs

from waltz_core.protocol import admin, client, storage
from waltz_core.protocol.wire import RecordBatch

PATH = Path(__file__).with_name("goldens.json")
FAMILIES: dict[str, Any] = {"client": client, "storage": storage, "admin": admin}


@attrs.frozen
class Case:
    family: Any  # the family module
    message: Any
    wire: bytes


# ------------------------------------------------------------------------ values <-> JSON


def to_json(value: Any, tp: Any) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        if value is None:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return to_json(value, inner)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return [to_json(v, args[0]) for v in value]
        return [to_json(v, a) for v, a in zip(value, args, strict=True)]
    if tp is bytes:
        return value.hex()
    if tp is uuid.UUID:
        return str(value)
    if tp is RecordBatch:
        return {"count": len(value), "first": value.first_transaction_id, "data": bytes(value.data).hex()}
    if isinstance(tp, type) and issubclass(tp, enum.IntEnum):
        return int(value)
    if attrs.has(tp):
        hints = typing.get_type_hints(tp)
        return {f.name: to_json(getattr(value, f.name), hints[f.name]) for f in attrs.fields(tp)}
    assert tp in (int, bool, str), tp
    assert type(value) is tp, (value, tp)
    return value


def from_json(obj: Any, tp: Any) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        if obj is None:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return from_json(obj, inner)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(from_json(v, args[0]) for v in obj)
        return tuple(from_json(v, a) for v, a in zip(obj, args, strict=True))
    if tp is bytes:
        return bytes.fromhex(obj)
    if tp is uuid.UUID:
        return uuid.UUID(obj)
    if tp is RecordBatch:
        return RecordBatch(bytes.fromhex(obj["data"]), obj["count"], obj["first"])
    if isinstance(tp, type) and issubclass(tp, enum.IntEnum):
        return tp(obj)
    if attrs.has(tp):
        hints = typing.get_type_hints(tp)
        return tp(**{f.name: from_json(obj[f.name], hints[f.name]) for f in attrs.fields(tp)})
    assert tp in (int, bool, str), tp
    return obj


def case_to_json(family_name: str, msg: Any, wire: bytes) -> dict[str, Any]:
    cls = type(msg)
    hints = typing.get_type_hints(cls)
    return {"family": family_name, "message": cls.__name__,
            "fields": {f.name: to_json(getattr(msg, f.name), hints[f.name]) for f in attrs.fields(cls)},
            "wire": wire.hex()}


def case_from_json(obj: dict[str, Any]) -> Case:
    family = FAMILIES[obj["family"]]
    cls = getattr(family, obj["message"])
    hints = typing.get_type_hints(cls)
    fields = {name: from_json(value, hints[name]) for name, value in obj["fields"].items()}
    return Case(family, cls(**fields), bytes.fromhex(obj["wire"]))


def read_json() -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = json.loads(PATH.read_text())["cases"]
    return cases


def load() -> list[Case]:
    return [case_from_json(obj) for obj in read_json()]


def write_json(cases: list[dict[str, Any]]) -> None:
    about = __doc__.split("\n\n")[1].replace("\n", " ")
    lines = ",\n".join(json.dumps(c, ensure_ascii=True) for c in cases)
    PATH.write_text(f'{{"about": {json.dumps(about)},\n"cases": [\n{lines}\n]}}\n')


# ------------------------------------------------------------------------------ generation


def _examples(strategy: Any, n: int) -> list[Any]:
    from hypothesis import HealthCheck, given, settings

    found: list[Any] = []

    @settings(max_examples=n, database=None, derandomize=True, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(msg: Any) -> None:
        found.append(msg)

    collect()
    return found


def _pick(encoded: dict[bytes, Any], k: int, max_size: int) -> list[tuple[bytes, Any]]:
    """Up to ``k`` samples spread over the sizes present (small ones: the file stays reviewable)."""
    small = sorted(((raw, msg) for raw, msg in encoded.items() if len(raw) <= max_size),
                   key=lambda item: (len(item[0]), item[0]))
    if len(small) <= k:
        return small
    return [small[round(i * (len(small) - 1) / (k - 1))] for i in range(k)]


def _edge_cases(family: Any) -> list[Any]:
    from waltz_core.protocol.wire import Record, ReqId, crc32

    q = ReqId(-(2**31), 2**31 - 1, 0, -1)
    if family is client:
        many = tuple(range(-10, 10))  # 20 locks: beyond the precompiled small-array structs
        return [
            client.AppendRequest(q, -1, many, (), (2**31 - 1,) * 17, -(2**31), b"", crc32(b"")),
            client.AppendRequest(q, 2**63 - 1, (), (5,), (), 0, b"x", crc32(b"x")),
            client.AppendRequest(q, -(2**63), (), (), (), 7, bytes(range(256)), crc32(bytes(range(256)))),
            client.FeedData(q, 2**63 - 1, -(2**31)),
            client.FeedData(ReqId(0, 0, 0, 0), -1, 0),
            client.TransactionDataRangeResponse(q, 0, (b"",), (2**32 - 1,), "\u00e9\u4e2d\U0001f600"),
            client.ServerPartitionsAssignmentResponse(q, tuple(range(40))),
        ]
    if family is storage:
        recs = [Record(2**63 - 3 + i, q, i, bytes([i]) * i, crc32(bytes([i]) * i)) for i in range(3)]
        return [
            storage.StorageAppendRequest(-1, 2**63 - 1, -(2**31), recs, True),
            storage.StorageAppendRequest(0, 0, 0, [], False),
            storage.RecordListResponse(1, 2, 3, RecordBatch.from_records(recs[1:])),
            storage.RecordListResponse(1, 2, 3, []),
        ]
    return [admin.AdminRecordListResponse(1, 2, ())]


def extend() -> list[str]:
    """Append samples for every message class without one; return the names of those classes."""
    from .strategies import BY_FAMILY, sample_messages

    cases = read_json() if PATH.exists() else []
    have = {(c["family"], c["message"]) for c in cases}
    added = []
    for name, family in FAMILIES.items():
        candidates = sample_messages(family) + _edge_cases(family)
        for cls in family.MESSAGES:
            if (name, cls.__name__) in have:
                continue
            msgs = [m for m in candidates if type(m) is cls]
            encoded = {family.encode(m): m for m in _examples(BY_FAMILY[family][cls], 80)}
            msgs += [m for _, m in _pick(encoded, 6, 400)]
            for msg in msgs:
                raw = family.encode(msg)
                assert case_from_json(case_to_json(name, msg, raw)).message == msg
                cases.append(case_to_json(name, msg, raw))
            added.append(f"{name}.{cls.__name__}: {len(msgs)}")
    write_json(cases)
    return added


if __name__ == "__main__":
    for line in extend():
        print(line)
