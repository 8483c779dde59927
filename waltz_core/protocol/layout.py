"""Declared message layouts, and the one generic codec per family that they drive (sans-IO).

A message is a frozen attrs class with ``TYPE: ClassVar[int]``, its type byte (0-127), whose
fields after the family head are annotated with their wire codec::

    @attrs.frozen(slots=True)
    class FeedData:
        TYPE: ClassVar[int] = 4
        req_id: ReqId                            # the family head: no annotation
        transaction_id: Annotated[int, INT64]
        header: Annotated[int, INT32]

That class body is the message's whole layout declaration. A payload is ``byte TYPE``, the head
fields (declared once per family: :class:`FamilyCodec`'s ``head``), then the other fields in
declaration order, each as its codec writes it. :class:`FamilyCodec` derives everything else
from the classes when its module is imported: the type table (two classes with one TYPE, a
field without a codec or a head that does not match are refused there), one encoder and one
decoder per class, and the ``encode``/``decode`` dispatch.

Codecs (all integers big-endian):

- fixed size: :data:`INT8`, :data:`INT32`, :data:`UINT32`, :data:`INT64`; :data:`BOOL` (one byte,
  0 or 1: any other byte is refused); :data:`UUID` (16 bytes); :class:`Enum32` (an ``IntEnum`` as
  an int; unknown values are refused); :class:`FixedTuple` and :class:`FixedAttrs` (fixed codecs
  side by side: :data:`REQ_ID`, :data:`SESSION_INFO`, :data:`RECORD_HEADER`). Consecutive fixed
  fields, type byte and head included, are packed and unpacked with one struct.
- variable size: :data:`STRING` (``int`` byte length, UTF-8), :data:`BLOB` (``int`` length,
  bytes), :data:`INT_ARRAY` (``int`` count, ints), :class:`Array` (``int`` count, elements),
  :class:`Tuple` (values side by side), :class:`Nullable` (a 0/1 byte, then the value when 1),
  :data:`RECORDS` (count, then records in the per-record layout), :data:`ONE_RECORD` (count 1,
  then one such record) and :class:`RecordBatchCodec` (a :class:`~.wire.RecordBatch`: count,
  first id, byte length, records in the stored layout).
- groups (:class:`Group`): one layout for several consecutive fields, such as a tagged union.
  The group codec annotates the first of its fields; the others carry no annotation. A family
  module defines its own groups (the client's TransactionDataResponse data-or-error).

Decoding is strict: every length and count is checked against the bytes left before anything is
allocated, a payload must end exactly after its last field, and so a decoded message re-encodes
to exactly the bytes it came from. Malformed input raises :class:`~waltz_core.errors.ProtocolError`
naming the message and the field (its name, underscores as spaces). A message class may define
``verify()``: the decoder calls it on every message it decodes (``AppendRequest`` checks its
data's CRC-32 there, raising ChecksumError).

Encoding a value that does not fit its field (an int out of range, text that is not encodable,
a group whose fields disagree) raises ProtocolError ``cannot encode <message>: <why>``; codec
writers signal it with :class:`struct.error` or :class:`ValueError`.

Fast paths: a family module may register a hand-written encoder or decoder for a message
(:meth:`FamilyCodec.encoder`, :meth:`FamilyCodec.decoder`). An override must be equivalent to the
generic codec - same bytes out, same messages or error classes in - which the protocol tests
check on random and mutated messages through :meth:`FamilyCodec.generic_encode` and
:meth:`FamilyCodec.generic_decode`, which bypass every override.
"""

from __future__ import annotations

import enum
import struct
import typing
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from operator import attrgetter
from typing import Any, Final, Generic, NoReturn, TypeAlias, TypeVar

import attrs

from ..errors import ProtocolError
from .wire import (
    I32,
    RECORD_BATCH_HEAD,
    RECORD_HEAD,
    Reader,
    Record,
    RecordBatch,
    RecordHeader,
    ReqId,
    SessionInfo,
    w_blob,
    w_int_array,
    w_record,
    w_record_batch,
    w_records,
    w_str,
)

T = TypeVar("T")
M = TypeVar("M")
E = TypeVar("E", bound=enum.IntEnum)
Buf: TypeAlias = bytes | memoryview
_FLAGS: Final = (b"\x00", b"\x01")


class Codec(ABC, Generic[T]):
    """How one field's value goes on the wire."""

    #: fewest bytes one value takes: an array's count is checked against it before allocating
    min_size: int = 0

    @abstractmethod
    def write(self, out: list[bytes], value: T) -> None:
        """Append the value's bytes to ``out`` (joined once by the caller)."""

    @abstractmethod
    def read(self, r: Reader, label: str) -> T:
        """Read one value; ``label`` names the field in errors."""


# --------------------------------------------------------------------------------- fixed size


class Fixed(Codec[T]):
    """A fixed-size value: a struct format and the conversions to and from its struct items.

    ``fmt`` unpacks the items, ``pack_fmt`` packs them: they differ for bools, which pack with
    ``?`` (any truth value as 0 or 1) and unpack with ``B`` (checked to be 0 or 1). ``paths``
    are the attribute paths from a value to its items (``""`` is the value itself), or None when
    some item is not an attribute; neighbouring fixed fields of a message are then read with a
    single :func:`operator.attrgetter` and packed with a single struct.
    """

    #: True when the value is its single struct item as decoded (plain ints): no conversion at all
    plain: bool = False
    paths: tuple[str, ...] | None = ("",)

    def __init__(self, fmt: str, pack_fmt: str | None = None) -> None:
        self.fmt = fmt
        self.pack_fmt = pack_fmt or fmt
        self.struct = struct.Struct(">" + fmt)
        self.packer = struct.Struct(">" + self.pack_fmt)
        assert self.packer.size == self.struct.size
        self.width = len(self.struct.unpack(bytes(self.struct.size)))  #: number of struct items
        self.min_size = self.struct.size
        #: the struct items of a value, for ``pack_fmt`` (default: the value is its one item)
        self.items_of: Callable[[T], tuple[Any, ...]] = _one_item

    @abstractmethod
    def build(self, items: Sequence[Any], what: str, label: str) -> T:
        """The value of ``width`` struct items; ProtocolError (naming ``what`` and ``label``) if invalid."""

    def write(self, out: list[bytes], value: T) -> None:
        out.append(self.packer.pack(*self.items_of(value)))

    def read(self, r: Reader, label: str) -> T:
        return self.build(r.unpack(self.struct, label), r.what, label)


class Int(Fixed[int]):
    """A signed or unsigned integer of one struct format character."""

    plain = True

    def build(self, items: Sequence[Any], what: str, label: str) -> int:
        v: int = items[0]
        return v


class Bool(Fixed[bool]):
    """One byte, 0 or 1: decoding refuses any other byte (the encoding stays canonical)."""

    def __init__(self) -> None:
        super().__init__("B", "?")

    def build(self, items: Sequence[Any], what: str, label: str) -> bool:
        v: int = items[0]
        if v > 1:
            raise ProtocolError(f"{what}: {label} must be 0 or 1, got {v}")
        return v == 1

    def write(self, out: list[bytes], value: bool) -> None:
        out.append(_FLAGS[1 if value else 0])

    def read(self, r: Reader, label: str) -> bool:
        return r.bool(label)


class Uuid(Fixed[uuid.UUID]):
    """A UUID as its 16 bytes."""

    paths = ("bytes",)

    def __init__(self) -> None:
        super().__init__("16s")
        self.items_of = _uuid_items

    def build(self, items: Sequence[Any], what: str, label: str) -> uuid.UUID:
        return uuid.UUID(bytes=items[0])


class Enum32(Fixed[E]):
    """An ``IntEnum`` as an ``int`` (it packs as the int it is); decoding refuses a value that is
    not a member."""

    def __init__(self, enum_cls: type[E]) -> None:
        super().__init__("i")
        self.enum_cls = enum_cls

    def build(self, items: Sequence[Any], what: str, label: str) -> E:
        try:
            return self.enum_cls(items[0])
        except ValueError:
            raise ProtocolError(f"{what}: unknown {label} {items[0]}") from None


def _one_item(value: Any) -> tuple[Any, ...]:
    return (value,)


def _as_is(value: tuple[Any, ...]) -> tuple[Any, ...]:
    return value


def _uuid_items(value: uuid.UUID) -> tuple[Any, ...]:
    return (value.bytes,)


_Parts: TypeAlias = tuple[tuple[Fixed[Any], int, int], ...]


def _fixed_parts(codecs: Sequence[Fixed[Any]]) -> tuple[str, str, _Parts]:
    """The joined unpack and pack formats of ``codecs``, and each codec's slice of the items."""
    parts = []
    pos = 0
    for c in codecs:
        parts.append((c, pos, pos + c.width))
        pos += c.width
    return "".join(c.fmt for c in codecs), "".join(c.pack_fmt for c in codecs), tuple(parts)


def _builder(parts: _Parts) -> Callable[[Sequence[Any], str, str], Sequence[Any]] | None:
    """Values from the struct items of ``parts``; None when all are plain (the items are the values)."""
    if all(c.plain for c, _, _ in parts):
        return None
    # A plain codec's value is its item; an attrs value of plain items (a request id) is its
    # class called with them, no build() in between (record header lists build thousands).
    steps: list[tuple[int, int, Callable[..., Any] | None, Callable[[Sequence[Any], str, str], Any] | None]] = []
    for c, i, j in parts:
        if c.plain:
            steps.append((i, j, None, None))
        elif isinstance(c, FixedAttrs) and c.all_plain:
            steps.append((i, j, c.cls, None))
        else:
            steps.append((i, j, None, c.build))

    def build(items: Sequence[Any], what: str, label: str) -> Sequence[Any]:
        values = []
        for i, j, cls, build_one in steps:
            if cls is not None:
                values.append(cls(*items[i:j]))
            elif build_one is not None:
                values.append(build_one(items[i:j], what, label))
            else:
                values.append(items[i])
        return values
    return build


def _paths(fields: Sequence[tuple[str, Fixed[Any]]]) -> tuple[str, ...] | None:
    """Attribute paths from an object to the struct items of its ``fields`` (None: not all are)."""
    paths: list[str] = []
    for name, c in fields:
        if c.paths is None:
            return None
        paths += [f"{name}.{p}" if p else name for p in c.paths]
    return tuple(paths)


def _items_getter(fields: Sequence[tuple[str, Fixed[Any]]]) -> Callable[[Any], tuple[Any, ...]]:
    """The struct items of an object's ``fields``: one attrgetter call when they have paths."""
    paths = _paths(fields)
    if paths is not None:
        get = attrgetter(*paths)
        return get if len(paths) > 1 else lambda value: (get(value),)  # several paths: a tuple
    getters = [(attrgetter(name), c) for name, c in fields]

    def items(value: Any) -> tuple[Any, ...]:
        out: list[Any] = []
        for get_one, c in getters:
            out.extend(c.items_of(get_one(value)))
        return tuple(out)
    return items


class FixedTuple(Fixed[tuple[Any, ...]]):
    """A tuple of fixed-size values, side by side (``(partition id, healthy)`` pairs)."""

    paths = None

    def __init__(self, *elements: Fixed[Any]) -> None:
        fmt, pack_fmt, parts = _fixed_parts(elements)
        super().__init__(fmt, pack_fmt)
        self._build = _builder(parts)
        if all(c.paths == ("",) for c in elements):
            self.items_of = _as_is  # every element is its own item (ints, bools): the tuple is its items
        else:
            def items_of(value: tuple[Any, ...]) -> tuple[Any, ...]:
                items: list[Any] = []
                for c, v in zip(elements, value, strict=True):
                    items.extend(c.items_of(v))
                return tuple(items)
            self.items_of = items_of

    def build(self, items: Sequence[Any], what: str, label: str) -> tuple[Any, ...]:
        return tuple(items if self._build is None else self._build(items, what, label))


class FixedAttrs(Fixed[T]):
    """An attrs value of fixed-size fields, in field order (request ids, session infos, ...)."""

    def __init__(self, cls: Callable[..., T], *fields: tuple[str, Fixed[Any]]) -> None:
        fmt, pack_fmt, parts = _fixed_parts([c for _, c in fields])
        super().__init__(fmt, pack_fmt)
        self.cls = cls
        self.paths = _paths(fields)
        self.items_of = _items_getter(fields)
        self._build = _builder(parts)
        self.all_plain = self._build is None  #: built by calling ``cls`` with the items

    def build(self, items: Sequence[Any], what: str, label: str) -> T:
        if self._build is None:
            return self.cls(*items)
        return self.cls(*self._build(items, what, label))


INT8: Final = Int("b")
INT32: Final = Int("i")
UINT32: Final = Int("I")
INT64: Final = Int("q")
BOOL: Final = Bool()
UUID: Final = Uuid()
#: client id, generation, partition id, sequence number
REQ_ID: Final = FixedAttrs(ReqId, ("client_id", INT32), ("generation", INT32), ("partition_id", INT32),
                           ("seq_num", INT32))
SESSION_INFO: Final = FixedAttrs(SessionInfo, ("session_id", INT64), ("low_water_mark", INT64),
                                 ("local_low_water_mark", INT64))
RECORD_HEADER: Final = FixedAttrs(RecordHeader, ("transaction_id", INT64), ("req_id", REQ_ID), ("header", INT32))


# ------------------------------------------------------------------------------ variable size


class String(Codec[str]):
    min_size = 4

    def write(self, out: list[bytes], value: str) -> None:
        w_str(out, value)

    def read(self, r: Reader, label: str) -> str:
        return r.str(label)


class Blob(Codec[bytes]):
    min_size = 4

    def write(self, out: list[bytes], value: bytes) -> None:
        w_blob(out, value)

    def read(self, r: Reader, label: str) -> bytes:
        return r.blob(label)


class IntArray(Codec[tuple[int, ...]]):
    """``int`` count, then ``int`` elements (lock lists, partition ids): precompiled structs."""

    min_size = 4

    def write(self, out: list[bytes], value: tuple[int, ...]) -> None:
        w_int_array(out, value)

    def read(self, r: Reader, label: str) -> tuple[int, ...]:
        return r.int_array(label)


class Array(Codec[tuple[T, ...]]):
    """``int`` count, then the elements, each as ``element`` writes it."""

    min_size = 4

    def __init__(self, element: Codec[T]) -> None:
        self.element = element

    def write(self, out: list[bytes], value: tuple[T, ...]) -> None:
        out.append(I32.pack(len(value)))
        element = self.element
        if isinstance(element, Fixed):
            pack, items_of = element.packer.pack, element.items_of
            out.extend([pack(*items_of(v)) for v in value])
        else:
            for v in value:
                element.write(out, v)

    def read(self, r: Reader, label: str) -> tuple[T, ...]:
        element = self.element
        n = r.count(label, max(element.min_size, 1))
        if isinstance(element, Fixed):
            # the count is checked against the bytes left: all n elements are there, unpack them at once
            size = element.struct.size
            start = r.take(n * size, label)
            rows = element.struct.iter_unpack(memoryview(r.buf)[start : start + n * size])
            if element.plain:
                return tuple([row[0] for row in rows])
            build, what = element.build, r.what
            return tuple([build(row, what, label) for row in rows])
        read = element.read
        return tuple([read(r, label) for _ in range(n)])


class Tuple(Codec[tuple[Any, ...]]):
    """Values side by side, each as its codec writes it (:class:`FixedTuple` when all are fixed)."""

    def __init__(self, *elements: Codec[Any]) -> None:
        self.elements = elements
        self.min_size = sum(c.min_size for c in elements)

    def write(self, out: list[bytes], value: tuple[Any, ...]) -> None:
        for c, v in zip(self.elements, value, strict=True):
            c.write(out, v)

    def read(self, r: Reader, label: str) -> tuple[Any, ...]:
        return tuple([c.read(r, label) for c in self.elements])


class Nullable(Codec[T | None]):
    """A presence byte (0 or 1), then the value when present. ``None`` is absent."""

    min_size = 1

    def __init__(self, inner: Codec[T], *, flag_label: str | None = None, label: str | None = None) -> None:
        self.inner = inner
        self.flag_label = flag_label  #: default: the field's label + " flag"
        self.label = label  #: the value's label in errors; default: the field's

    def write(self, out: list[bytes], value: T | None) -> None:
        if value is None:
            out.append(b"\x00")
        else:
            out.append(b"\x01")
            self.inner.write(out, value)

    def read(self, r: Reader, label: str) -> T | None:
        if not r.bool(self.flag_label or f"{label} flag"):
            return None
        return self.inner.read(r, self.label or label)


class Records(Codec[tuple[Record, ...]]):
    """``int`` count, then records in the per-record layout (transaction id, request id, header,
    ``int`` data length, data, ``uint`` data checksum)."""

    min_size = 4

    def write(self, out: list[bytes], value: tuple[Record, ...]) -> None:
        w_records(out, value)

    def read(self, r: Reader, label: str) -> tuple[Record, ...]:
        return r.records(label)


class OneRecord(Codec[Record]):
    """:data:`RECORDS` holding exactly one record (a count other than 1 is refused)."""

    min_size = 4 + RECORD_HEAD.size + 4

    def write(self, out: list[bytes], value: Record) -> None:
        out.append(I32.pack(1))
        w_record(out, value)

    def read(self, r: Reader, label: str) -> Record:
        n = r.i32(f"{label} count")
        if n != 1:
            raise ProtocolError(f"{r.what}: expected 1 {label}, got {n}")
        return r.record()


class RecordBatchCodec(Codec[RecordBatch]):
    """A :class:`~.wire.RecordBatch`: ``int`` count, ``long`` first transaction id, ``int`` byte
    length, then the records in the stored layout.

    Decoding checks the head only (O(1), the records stay a view of the frame) unless ``walk``:
    then every record's bounds and ids are checked at once, so that a malformed batch fails
    where it is decoded rather than wherever it is read later.
    """

    min_size = RECORD_BATCH_HEAD.size

    def __init__(self, *, walk: bool) -> None:
        self.walk = walk

    def write(self, out: list[bytes], value: RecordBatch) -> None:
        w_record_batch(out, value)

    def read(self, r: Reader, label: str) -> RecordBatch:
        batch = r.record_batch(label)
        if self.walk:
            batch.offsets  # noqa: B018 - walks the records (ProtocolError if malformed)
        return batch


STRING: Final = String()
BLOB: Final = Blob()
INT_ARRAY: Final = IntArray()
RECORDS: Final = Records()
ONE_RECORD: Final = OneRecord()
RECORD_HEADERS: Final = Array(RECORD_HEADER)


class Group(Codec[tuple[Any, ...]]):
    """One layout for several consecutive fields (``fields``, the annotated one first): the value
    written and read is the tuple of their values."""

    fields: tuple[str, ...]


# ------------------------------------------------------------------------------- the families

Encoder: TypeAlias = Callable[[Any], bytes]
Decoder: TypeAlias = Callable[[Buf], Any]
BodyReader: TypeAlias = Callable[[Reader], Any]


def _label(name: str) -> str:
    return name.replace("_", " ")


class _Run:
    """Consecutive fixed-size fields of a layout: packed and unpacked with one struct each way."""

    def __init__(self, fields: Sequence[tuple[str, Fixed[Any]]]) -> None:
        self.names = tuple(n for n, _ in fields)
        fmt, self.pack_fmt, parts = _fixed_parts([c for _, c in fields])
        self.struct = struct.Struct(">" + fmt)  #: unpacks the items (packing: ``pack_fmt``)
        self.label = ", ".join(map(_label, self.names))
        #: the struct items of the run's fields of a message
        self.items: Callable[[Any], tuple[Any, ...]] = _items_getter(fields)
        build, label = _builder(parts), self.label

        def values(items: Sequence[Any], what: str) -> Sequence[Any]:
            return items if build is None else build(items, what, label)

        #: the run's field values from its struct items (ProtocolError if one is invalid)
        self.values: Callable[[Sequence[Any], str], Sequence[Any]] = values


@attrs.frozen
class _Field:
    """A variable-size field of a layout, or a group of fields (``names``) with one codec."""

    names: tuple[str, ...]
    codec: Codec[Any]
    label: str


def _compile_steps(fields: Sequence[tuple[str, Codec[Any]]]) -> list[_Run | _Field]:
    """Consecutive fixed-size fields become one run; every other field (or group) is one step."""
    steps: list[_Run | _Field] = []
    run: list[tuple[str, Fixed[Any]]] = []
    for name, codec in fields:
        if isinstance(codec, Fixed):
            run.append((name, codec))
            continue
        if run:
            steps.append(_Run(run))
            run = []
        steps.append(_Field(codec.fields if isinstance(codec, Group) else (name,), codec, _label(name)))
    if run:
        steps.append(_Run(run))
    return steps


def _reader(step: _Run | _Field) -> Callable[[Reader, list[Any]], None]:
    """Reads a step's field values into ``values``."""
    if isinstance(step, _Run):
        st, label, values_of = step.struct, step.label, step.values

        def read_run(r: Reader, values: list[Any]) -> None:
            values.extend(values_of(r.unpack(st, label), r.what))
        return read_run
    read, label = step.codec.read, step.label
    if isinstance(step.codec, Group):
        def read_group(r: Reader, values: list[Any]) -> None:
            values.extend(read(r, label))
        return read_group

    def read_field(r: Reader, values: list[Any]) -> None:
        values.append(read(r, label))
    return read_field


def _writer(step: _Run | _Field, kind: int | None) -> Callable[[Any, list[bytes]], None]:
    """Writes a step's fields of a message, after the type byte ``kind`` unless it is None."""
    if isinstance(step, _Run):
        items = step.items
        if kind is None:
            pack = struct.Struct(">" + step.pack_fmt).pack

            def write_run(msg: Any, out: list[bytes]) -> None:
                out.append(pack(*items(msg)))
            return write_run
        pack = struct.Struct(">b" + step.pack_fmt).pack

        def write_first_run(msg: Any, out: list[bytes]) -> None:
            out.append(pack(kind, *items(msg)))
        return write_first_run
    get = attrgetter(*step.names)  # several names (a group): the tuple of their values
    write = step.codec.write
    if kind is None:
        def write_field(msg: Any, out: list[bytes]) -> None:
            write(out, get(msg))
        return write_field
    type_byte = bytes([kind])

    def write_first_field(msg: Any, out: list[bytes]) -> None:
        out.append(type_byte)
        write(out, get(msg))
    return write_first_field


class FamilyCodec(Generic[M]):
    """The generic codec of one message family, derived from its classes' declarations.

    ``head`` is the family's leading fields, the same first fields of every class (storage:
    session id, sequence number, partition id); ``what`` names the family in decoding errors
    (``"storage message"``), ``name`` in encoding errors. :attr:`encode` and :attr:`decode`
    dispatch on the class and on the type byte, to the class's override when one is registered
    and else to its generic codec.
    """

    def __init__(self, name: str, what: str, head: Sequence[tuple[str, Fixed[Any]]], messages: Sequence[type]) -> None:
        self.name = name
        self.what = what
        self.head = tuple(head)
        self.messages: tuple[type, ...] = tuple(messages)
        by_type: dict[int, type] = {}
        self._kind: dict[type, int] = {}
        for cls in self.messages:
            kind = getattr(cls, "TYPE", None)
            if not isinstance(kind, int) or not 0 <= kind <= 127:
                raise TypeError(f"{name} message {cls.__name__}: TYPE must be an int in [0, 127], got {kind!r}")
            if kind in by_type:
                raise TypeError(f"{name} messages {by_type[kind].__name__} and {cls.__name__} both have TYPE {kind}")
            by_type[kind] = cls
            self._kind[cls] = kind
        #: type byte -> class, derived from the classes' TYPEs
        self.by_type: Mapping[int, type] = dict(sorted(by_type.items()))
        self._generic_encoders: dict[type, Encoder] = {}
        self._generic_decoders: dict[type, Decoder] = {}
        self._body_readers: dict[type, BodyReader] = {}
        for cls in self.messages:
            self._compile(cls)
        encoders: dict[type, Encoder] = dict(self._generic_encoders)
        decoders: list[Decoder] = [self._unknown] * 256
        for cls in self.messages:
            decoders[self._kind[cls]] = self._generic_decoders[cls]
        self._encoders, self._decoders = encoders, decoders
        self.encode_overrides: set[type] = set()
        self.decode_overrides: set[type] = set()

        # The dispatch runs for every message: closures over the tables, not methods, spare an
        # attribute lookup or two per call (measurable on FeedData).
        def encode(msg: M) -> bytes:
            """One message's payload. ProtocolError if it is not a message of the family or a
            field does not fit its wire type."""
            try:
                enc = encoders[type(msg)]
            except KeyError:
                raise ProtocolError(f"not a {name} message: {type(msg).__name__}") from None
            try:
                return enc(msg)
            except (struct.error, ValueError) as exc:
                raise ProtocolError(f"cannot encode {type(msg).__name__}: {exc}") from None

        def decode(buf: Buf) -> M:
            """One payload's message. ProtocolError naming the problem if it is malformed."""
            if not buf:
                raise ProtocolError(f"{what}: empty frame")
            msg: M = decoders[buf[0]](buf)
            return msg

        self.encode: Callable[[M], bytes] = encode
        self.decode: Callable[[Buf], M] = decode

    # ------------------------------------------------------------------------------ declarations

    def fields(self, cls: type) -> list[tuple[str, Codec[Any]]]:
        """``(field name, codec)`` of every field of ``cls`` in wire order (a group: its first field)."""
        hints = typing.get_type_hints(cls, include_extras=True)
        names = [f.name for f in attrs.fields(cls)]
        head_names = [n for n, _ in self.head]
        if names[: len(head_names)] != head_names:
            raise TypeError(f"{cls.__name__}: the first fields must be the {self.name} head {head_names}, "
                            f"not {names[: len(head_names)]}")
        out: list[tuple[str, Codec[Any]]] = list(self.head)
        covered: list[str] = []  # fields a group still has to cover
        for name in names[len(head_names) :]:
            codecs = [m for m in getattr(hints[name], "__metadata__", ()) if isinstance(m, Codec)]
            if covered:
                if codecs or name != covered[0]:
                    raise TypeError(f"{cls.__name__}.{name}: the group before it covers {covered} next")
                covered.pop(0)
                continue
            if len(codecs) != 1:
                raise TypeError(f"{cls.__name__}.{name}: annotate it with one wire codec, "
                                f"Annotated[<type>, <codec>] (found {len(codecs)})")
            codec = codecs[0]
            if isinstance(codec, Group):
                if codec.fields[0] != name:
                    raise TypeError(f"{cls.__name__}.{name}: its group codec lays out {codec.fields}")
                covered = list(codec.fields[1:])
            out.append((name, codec))
        if covered:
            raise TypeError(f"{cls.__name__}: fields {covered} of a group are missing")
        return out

    def _compile(self, cls: type) -> None:
        steps = _compile_steps(self.fields(cls))
        kind = self._kind[cls]
        name = cls.__name__
        verify: Callable[[Any], None] | None = getattr(cls, "verify", None)
        readers = [_reader(s) for s in steps]

        def read_body(r: Reader) -> Any:
            # from byte 1: the dispatch has read the type byte
            values: list[Any] = []
            for read in readers:
                read(r, values)
            r.done()
            msg = cls(*values)
            if verify is not None:
                verify(msg)
            return msg

        first = steps[0]  # every head is fixed-size: a run
        if len(steps) == 1 and isinstance(first, _Run):
            # Every field fixed-size (most messages): one struct each way, no reader, no list.
            pack = struct.Struct(">b" + first.pack_fmt).pack
            unpack_from, size = first.struct.unpack_from, 1 + first.struct.size
            items, values_of = first.items, first.values

            def encode(msg: Any) -> bytes:
                return pack(kind, *items(msg))

            def decode(buf: Buf) -> Any:
                if len(buf) != size:
                    return read_body(Reader(buf, 1, name))  # raises the precise error
                msg = cls(*values_of(unpack_from(buf, 1), name))
                if verify is not None:
                    verify(msg)
                return msg
        else:
            writers = [_writer(first, kind)] + [_writer(s, None) for s in steps[1:]]

            def encode(msg: Any) -> bytes:
                out: list[bytes] = []
                for write in writers:
                    write(msg, out)
                return b"".join(out)

            def decode(buf: Buf) -> Any:
                return read_body(Reader(buf, 1, name))

        self._generic_encoders[cls] = encode
        self._generic_decoders[cls] = decode
        self._body_readers[cls] = read_body

    def _unknown(self, buf: Buf) -> NoReturn:
        raise ProtocolError(f"{self.what}: unknown message type {buf[0]}")

    # -------------------------------------------------------------------------------- overrides

    def encoder(self, cls: type[T]) -> Callable[[Callable[[T], bytes]], Callable[[T], bytes]]:
        """Decorator: register a hand-written encoder of ``cls`` (it must give the generic bytes)."""
        def register(fn: Callable[[T], bytes]) -> Callable[[T], bytes]:
            self._check_member(cls)
            self._encoders[cls] = fn
            self.encode_overrides.add(cls)
            return fn
        return register

    def decoder(self, cls: type[T]) -> Callable[[Callable[[Buf], T]], Callable[[Buf], T]]:
        """Decorator: register a hand-written decoder of ``cls``'s payloads (given whole, type byte
        included). It must accept exactly what the generic decoder accepts, and raise the same
        error classes for the rest."""
        def register(fn: Callable[[Buf], T]) -> Callable[[Buf], T]:
            self._check_member(cls)
            self._decoders[self._kind[cls]] = fn
            self.decode_overrides.add(cls)
            return fn
        return register

    def decoder_of(self, cls: type[T]) -> Callable[[Buf], T]:
        """The decoder :attr:`decode` calls for a payload of ``cls`` (its override, or the
        generic one): for a reader that tests the type byte itself and calls it directly."""
        self._check_member(cls)
        return self._decoders[self._kind[cls]]

    def _check_member(self, cls: type) -> None:
        if cls not in self._generic_encoders:
            raise TypeError(f"{cls.__name__} is not a {self.name} message")

    # ------------------------------------------------------------------------------ the generic

    def generic_encode(self, msg: M) -> bytes:
        """:attr:`encode` without overrides: what the declarations alone produce."""
        enc = self._generic_encoders.get(type(msg))
        if enc is None:
            raise ProtocolError(f"not a {self.name} message: {type(msg).__name__}")
        try:
            return enc(msg)
        except (struct.error, ValueError) as exc:
            raise ProtocolError(f"cannot encode {type(msg).__name__}: {exc}") from None

    def generic_decode(self, buf: Buf) -> M:
        """:attr:`decode` without overrides."""
        if not buf:
            raise ProtocolError(f"{self.what}: empty frame")
        cls = self.by_type.get(buf[0])
        if cls is None:
            self._unknown(buf)
        msg: M = self._generic_decoders[cls](buf)
        return msg

    def generic_decoder(self, cls: type[T]) -> Callable[[Buf], T]:
        """The generic decoder of ``cls``'s payloads (type byte included, not checked)."""
        return self._generic_decoders[cls]

    def body_reader(self, cls: type[T]) -> Callable[[Reader], T]:
        """The generic decoder of ``cls`` from a reader positioned after the type byte."""
        return self._body_readers[cls]
