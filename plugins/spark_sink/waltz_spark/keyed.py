"""Keyed payloads: the data an idempotent write appends carries the row's idempotency keys.

A Waltz transaction holds only a request id, a 32-bit header and the data; the write locks an
append carried are not in the log. The exactly-once sink must be able to *prove* that a key is in
the log before it drops a row as a duplicate (a lock conflict alone proves nothing: the ``hashed``
lock table reports false conflicts), so it writes the keys in front of the row's data::

    KEYED_MAGIC  u16 key count  (u32 length, key bytes) * count  row data

Numbers are big-endian. A key's bytes are its canonical form (:func:`canonical_key`): the same
identity as its lock id, so a key and its lock always agree on what "the same key" means.
"""

from __future__ import annotations

import struct
from typing import Any

from waltz_core.errors import ClientError

#: First bytes of a keyed payload (a NUL first: no text payload starts like this), format version 1.
KEYED_MAGIC = b"\x00WZK\x01"
_COUNT = struct.Struct(">H")
_LENGTH = struct.Struct(">I")


def canonical_key(value: Any, column: str) -> bytes:
    """``b"i"`` + 8-byte signed integer, or ``b"b"`` + the bytes of a string (UTF-8) or binary key.

    A string and the binary of its UTF-8 share one lock id, so they are one key here too.
    """
    if isinstance(value, bool):
        raise ClientError(f"waltz write: column {column!r}: a boolean is not a lock key")
    if isinstance(value, int):
        try:
            return b"i" + value.to_bytes(8, "big", signed=True)
        except OverflowError:
            raise ClientError(f"waltz write: column {column!r}: integer key {value} does not fit 64 bits") from None
    if isinstance(value, str):
        return b"b" + value.encode()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return b"b" + bytes(value)
    raise ClientError(f"waltz write: column {column!r}: a lock key must be an integer, string or binary, "
                      f"got {type(value).__name__}")


def describe_key(key: bytes) -> str:
    """A canonical key as a person reads it (error messages): ``42``, ``'order-7'`` or ``b'\\x00'``."""
    if key[:1] == b"i" and len(key) == 9:
        return str(int.from_bytes(key[1:], "big", signed=True))
    try:
        return repr(key[1:].decode())
    except UnicodeDecodeError:
        return repr(key[1:])


def encode_keyed(keys: tuple[bytes, ...], data: bytes) -> bytes:
    """The payload an idempotent write appends: ``keys`` (canonical), then ``data``."""
    parts = [KEYED_MAGIC, _COUNT.pack(len(keys))]
    for key in keys:
        parts.append(_LENGTH.pack(len(key)))
        parts.append(key)
    parts.append(data)
    return b"".join(parts)


def decode_keyed(payload: bytes) -> tuple[tuple[bytes, ...], bytes] | None:
    """``(keys, data)`` of a keyed payload; None for any other payload (a plain write's data)."""
    if not payload.startswith(KEYED_MAGIC):
        return None
    pos = len(KEYED_MAGIC)
    if len(payload) < pos + _COUNT.size:
        return None
    (count,) = _COUNT.unpack_from(payload, pos)
    pos += _COUNT.size
    keys = []
    for _ in range(count):
        if len(payload) < pos + _LENGTH.size:
            return None
        (length,) = _LENGTH.unpack_from(payload, pos)
        pos += _LENGTH.size
        if len(payload) < pos + length:
            return None
        keys.append(payload[pos:pos + length])
        pos += length
    return tuple(keys), payload[pos:]
