"""Declared layouts: golden bytes for every message, fast paths equal to the generic codec, and
the import-time checks of the declarations (``waltz_core.protocol.layout``)."""

from __future__ import annotations

import struct
from typing import Annotated, Any, ClassVar

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from waltz_core.errors import ProtocolError
from waltz_core.protocol import admin, client, storage
from waltz_core.protocol.layout import BOOL, INT32, INT64, STRING, FamilyCodec, Group
from waltz_core.protocol.wire import Reader, ReqId

from . import goldens
from .strategies import BY_FAMILY, feed_data_batches

FAMILY_MODULES = (client, storage, admin)
FAMILY_IDS = ("client", "storage", "admin")
GOLDENS = goldens.load()

#: the hand-written fast paths, and nothing else: a new override must be added here (and so tested)
OVERRIDES = {
    client: ({client.AppendRequest, client.FeedData}, {client.AppendRequest, client.FeedData, client.LockFailure}),
    storage: ({storage.StorageAppendRequest, storage.RecordListResponse, storage.StorageAppendManyRequest},
              {storage.StorageAppendRequest, storage.RecordListResponse, storage.SuccessResponse,
               storage.StorageAppendManyRequest, storage.AppendManyResponse}),
    admin: (set(), set()),
}
OVERRIDDEN = [(fam, cls) for fam in FAMILY_MODULES for cls in sorted(OVERRIDES[fam][0] | OVERRIDES[fam][1],
                                                                      key=lambda c: c.TYPE)]


# ------------------------------------------------------------------------------------ goldens


@pytest.mark.parametrize("family", FAMILY_MODULES, ids=FAMILY_IDS)
def test_every_message_class_has_golden_samples(family: Any) -> None:
    covered = {type(c.message) for c in GOLDENS if c.family is family}
    assert covered == set(family.MESSAGES)


@pytest.mark.parametrize("case", GOLDENS, ids=lambda c: type(c.message).__name__)
def test_golden_bytes(case: goldens.Case) -> None:
    family, msg, wire = case.family, case.message, case.wire
    assert family.CODEC.generic_encode(msg) == wire  # the declaration alone
    assert family.encode(msg) == wire  # with the fast paths
    assert family.CODEC.generic_decode(wire) == msg
    assert family.decode(wire) == msg
    assert family.decode(memoryview(wire)) == msg


def test_failure_responses_carry_a_signed_32_bit_error_code() -> None:
    raw = storage.encode(storage.FailureResponse(1, 2, 3, -2, "no"))
    assert raw == struct.pack(">bqqi", 8, 1, 2, 3) + struct.pack(">i", -2) + struct.pack(">i", 2) + b"no"
    raw = admin.encode(admin.AdminFailureResponse(9, 2**31 - 1, ""))
    assert raw == struct.pack(">bq", 2, 9) + struct.pack(">i", 2**31 - 1) + struct.pack(">i", 0)
    with pytest.raises(ProtocolError, match="cannot encode FailureResponse"):
        storage.encode(storage.FailureResponse(1, 2, 3, 2**31, "no"))
    assert storage.VERSIONS == (3, 4, 5) and admin.VERSIONS == (2, 3)


# --------------------------------------------------------------------------------- fast paths


@pytest.mark.parametrize("family", FAMILY_MODULES, ids=FAMILY_IDS)
def test_the_overrides_are_the_known_fast_paths(family: Any) -> None:
    assert (family.CODEC.encode_overrides, family.CODEC.decode_overrides) == OVERRIDES[family]


@pytest.mark.parametrize(("family", "cls"), OVERRIDDEN, ids=lambda v: getattr(v, "__name__", "").rsplit(".", 1)[-1])
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fast_paths_equal_the_generic_codec(family: Any, cls: type, data: st.DataObject) -> None:
    msg = data.draw(BY_FAMILY[family][cls])
    raw = family.CODEC.generic_encode(msg)
    assert family.encode(msg) == raw
    assert family.decode(raw) == family.CODEC.generic_decode(raw) == msg


def _outcome(decode: Any, raw: bytes) -> Any:
    try:
        return decode(raw)
    except ProtocolError as exc:
        return type(exc)


@pytest.mark.parametrize(("family", "cls"), OVERRIDDEN, ids=lambda v: getattr(v, "__name__", "").rsplit(".", 1)[-1])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fast_decoders_accept_and_refuse_what_the_generic_decoder_does(family: Any, cls: type,
                                                                       data: st.DataObject) -> None:
    raw = bytearray(family.CODEC.generic_encode(data.draw(BY_FAMILY[family][cls])))
    mutation = data.draw(st.sampled_from(["truncate", "extend", "int32", "flip"]))
    if mutation == "truncate":
        del raw[data.draw(st.integers(1, len(raw) - 1)) :]
    elif mutation == "extend":
        raw += data.draw(st.binary(min_size=1, max_size=8))
    elif mutation == "int32":
        pos = data.draw(st.integers(1, max(1, len(raw) - 4)))
        raw[pos : pos + 4] = struct.pack(">i", data.draw(st.sampled_from((2**31 - 1, -1, 0, 1, 2, 40, 65536))))
    else:
        bit = data.draw(st.integers(8, len(raw) * 8 - 1))  # not the type byte
        raw[bit // 8] ^= 1 << (bit % 8)
    assert _outcome(family.decode, bytes(raw)) == _outcome(family.CODEC.generic_decode, bytes(raw))


@given(st.builds(client.FeedData, st.builds(ReqId, *[st.integers(-(2**31), 2**31 - 1)] * 4),
                 st.integers(-(2**63), 2**63 - 1), st.integers(-(2**31), 2**31 - 1)))
def test_unpack_feed_data_equals_the_generic_decoder(msg: client.FeedData) -> None:
    raw = client.CODEC.generic_encode(msg)
    assert raw == client.encode_feed_data(msg.req_id, msg.transaction_id, msg.header)
    decoded = client.CODEC.generic_decode(raw)
    q = decoded.req_id
    assert client.unpack_feed_data(raw) == (q.client_id, q.generation, q.partition_id, q.seq_num,
                                            decoded.transaction_id, decoded.header)


@given(st.lists(st.builds(client.FeedData, st.builds(ReqId, *[st.integers(-(2**31), 2**31 - 1)] * 4),
                          st.integers(-(2**63), 2**63 - 1), st.integers(-(2**31), 2**31 - 1)), max_size=20))
def test_a_run_of_feed_data_encodes_as_each_commit_alone(msgs: list[client.FeedData]) -> None:
    # the server's pending appends: (transaction id, req id, header, data, ...)
    pending = [(m.transaction_id, m.req_id, m.header, b"data", 0) for m in msgs]
    assert client.encode_feed_data_run(pending) == [client.CODEC.generic_encode(m) for m in msgs]


@given(feed_data_batches())
def test_the_feed_batch_fast_paths_equal_the_generic_codec(msg: client.FeedDataBatch) -> None:
    raw = client.CODEC.generic_encode(msg)
    payloads = [client.encode_feed_data(f.req_id, f.transaction_id, f.header) for f in msg.records]
    assert raw == client.encode_feed_batch(payloads)
    decoded = client.CODEC.generic_decode(raw)
    assert decoded == msg
    unpacked = client.unpack_feed_batch(raw)
    assert unpacked is not None
    assert list(unpacked) == [client.unpack_feed_data(p) for p in payloads]


@given(feed_data_batches(), st.data())
def test_unpack_feed_batch_refuses_what_the_generic_decoder_refuses(msg: client.FeedDataBatch,
                                                                    data: st.DataObject) -> None:
    raw = bytearray(client.CODEC.generic_encode(msg))
    mutation = data.draw(st.sampled_from(("truncate", "extend", "bit", "record type")))
    if mutation == "truncate":
        del raw[data.draw(st.integers(1, len(raw) - 1)):]
    elif mutation == "extend":
        raw += data.draw(st.binary(min_size=1, max_size=40))
    elif mutation == "bit":  # anywhere but the type byte: in the head, a record's type or fields
        bit = data.draw(st.integers(8, len(raw) * 8 - 1))
        raw[bit // 8] ^= 1 << (bit % 8)
    else:
        # the records start after the type, the request id and the count (21 bytes), 29 bytes each
        raw[21 + 29 * data.draw(st.integers(0, len(msg.records) - 1))] = data.draw(st.integers(0, 255))
    generic = _outcome(client.CODEC.generic_decode, bytes(raw))
    unpacked = client.unpack_feed_batch(bytes(raw))
    if isinstance(generic, client.FeedDataBatch):  # cut or grown by whole records: still a batch
        assert unpacked is not None
        assert list(unpacked) == [(f.req_id.client_id, f.req_id.generation, f.req_id.partition_id, f.req_id.seq_num,
                                   f.transaction_id, f.header) for f in generic.records]
    else:
        assert generic is ProtocolError
        assert unpacked is None


@given(st.integers(1, 3 * client.FEED_BATCH_MAX_RECORDS + 2))
def test_feed_batches_keep_every_record_in_order_in_frames_any_process_accepts(count: int) -> None:
    payloads = [client.encode_feed_data(ReqId(1, 2, 3, i), 100 + i, i) for i in range(count)]
    sent = client.encode_feed_batches(payloads)
    assert all(len(p) <= 1024 for p in sent)  # the smallest transport.max_frame_size allowed
    assert len(sent) == -(-count // client.FEED_BATCH_MAX_RECORDS)
    records: list[tuple[int, ...]] = []
    for payload in sent:
        batch = client.unpack_feed_batch(payload)
        single = client.unpack_feed_data(payload)
        assert (batch is None) != (single is None)  # a lone record goes as the FeedData it is
        records += list(batch) if batch is not None else [single]
    assert records == [client.unpack_feed_data(p) for p in payloads]


def test_the_append_fallback_is_the_generic_decoder() -> None:
    msg = client.AppendRequest(ReqId(1, 2, 3, 4), 5, (1,), (), (2, 3), 6, b"abc", 0)
    raw = client.CODEC.generic_encode(msg)
    from waltz_core.errors import ChecksumError

    with pytest.raises(ChecksumError):  # verify() runs on every decoded append
        client._dec_append_checked(Reader(raw, 1, "AppendRequest"))
    with pytest.raises(ChecksumError):
        client.CODEC.generic_decode(raw)


# ------------------------------------------------------------------------------ declarations


@pytest.mark.parametrize("family", FAMILY_MODULES, ids=FAMILY_IDS)
def test_the_type_table_is_derived_from_the_classes(family: Any) -> None:
    assert family.CODEC.by_type == {cls.TYPE: cls for cls in family.MESSAGES}
    assert list(family.CODEC.by_type) == sorted(cls.TYPE for cls in family.MESSAGES)
    assert [cls.TYPE for cls in family.MESSAGES] == sorted(cls.TYPE for cls in family.MESSAGES)


@attrs.frozen
class _A:
    TYPE: ClassVar[int] = 1
    seq_num: int
    value: Annotated[int, INT32]


@attrs.frozen
class _B:
    TYPE: ClassVar[int] = 1
    seq_num: int


@attrs.frozen
class _Unannotated:
    TYPE: ClassVar[int] = 2
    seq_num: int
    value: int


@attrs.frozen
class _NoHead:
    TYPE: ClassVar[int] = 3
    value: Annotated[int, INT32]


class _Pair(Group):
    fields = ("first", "second")

    def write(self, out: list[bytes], value: tuple[Any, ...]) -> None:
        out.append(struct.pack(">ii", *value))

    def read(self, r: Reader, label: str) -> tuple[Any, ...]:
        return tuple(r.unpack(struct.Struct(">ii"), label))


@attrs.frozen
class _Grouped:
    TYPE: ClassVar[int] = 4
    seq_num: int
    first: Annotated[int, _Pair()]
    second: int
    flag: Annotated[bool, BOOL]


@attrs.frozen
class _GroupCut:
    TYPE: ClassVar[int] = 5
    seq_num: int
    first: Annotated[int, _Pair()]


@attrs.frozen
class _BadType:
    TYPE: ClassVar[int] = 200
    seq_num: int


_HEAD = (("seq_num", INT64),)


@pytest.mark.parametrize(("messages", "problem"), [
    ((_A, _B), "_A and _B both have TYPE 1"),
    ((_Unannotated,), r"_Unannotated.value: annotate it with one wire codec"),
    ((_NoHead,), r"the first fields must be the test head \['seq_num'\]"),
    ((_GroupCut,), r"fields \['second'\] of a group are missing"),
    ((_BadType,), r"TYPE must be an int in \[0, 127\], got 200"),
])
def test_bad_declarations_fail_at_import(messages: tuple[type, ...], problem: str) -> None:
    with pytest.raises(TypeError, match=problem):
        FamilyCodec("test", "test message", _HEAD, messages)


def test_a_group_lays_out_its_fields_together() -> None:
    codec: FamilyCodec[Any] = FamilyCodec("test", "test message", _HEAD, (_A, _Grouped))
    msg = _Grouped(9, 1, 2, True)
    raw = codec.encode(msg)
    assert raw == struct.pack(">bqiib", 4, 9, 1, 2, 1)
    assert codec.decode(raw) == msg
    assert codec.decode(struct.pack(">bqi", 1, 9, -5)) == _A(9, -5)
    with pytest.raises(ProtocolError, match="test message: unknown message type 3"):
        codec.decode(b"\x03")
    with pytest.raises(ProtocolError, match="not a test message: _B"):
        codec.encode(_B(1))
    with pytest.raises(ProtocolError, match="_Grouped: flag must be 0 or 1, got 2"):
        codec.decode(raw[:-1] + b"\x02")


def test_an_override_must_be_a_member_of_the_family() -> None:
    codec: FamilyCodec[Any] = FamilyCodec("test", "test message", _HEAD, (_A,))
    with pytest.raises(TypeError, match="_B is not a test message"):
        codec.encoder(_B)(lambda m: b"")


def test_strings_that_cannot_be_encoded_are_protocol_errors() -> None:
    with pytest.raises(ProtocolError, match="cannot encode MetricsResponse"):
        admin.encode(admin.MetricsResponse(1, "\ud800"))  # a lone surrogate has no UTF-8
    assert STRING.min_size == 4
