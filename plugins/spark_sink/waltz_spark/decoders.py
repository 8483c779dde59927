"""Payload decoders: turn the binary ``data`` column into typed columns.

A registry of named decoders, each a function ``(df, column, **options) -> df`` that replaces
``column`` by the columns it decodes (every other column is kept)::

    decode(df, "json", schema="account INT, amount BIGINT, kind STRING, ts STRING")
    decode(df, "utf8", name="text")
    decode(df, "struct", format=">iq", names=["account", "amount"])
    decode(df, "keyed")          # an idempotent write's payload -> idempotency_keys, data
    decode(df, my_function, schema="a INT, b STRING")        # a user function bytes -> tuple/dict
    register_decoder("mine", my_decoder)                     # then decode(df, "mine", ...)

``json`` and ``utf8`` are Spark expressions (no Python per row); ``struct``, ``keyed`` and user
functions are Python UDFs, run in the workers (a user function is pickled by value, so it may live in a
script or test module the workers cannot import).
"""

from __future__ import annotations

import struct as _struct
import sys
from collections.abc import Callable
from typing import Any

from waltz_core.errors import ConfigError

Decoder = Callable[..., Any]
_DECODERS: dict[str, Decoder] = {}


def register_decoder(name: str, decoder: Decoder) -> None:
    """Add a named decoder ``decoder(df, column, **options) -> df``; names are unique."""
    if name in _DECODERS:
        raise ConfigError(f"a payload decoder named {name!r} is already registered")
    _DECODERS[name] = decoder


def decoders() -> list[str]:
    """The registered decoder names."""
    return sorted(_DECODERS)


def decode(df: Any, decoder: str | Callable[[bytes], Any], column: str = "data", **options: Any) -> Any:
    """``df`` with ``column`` replaced by the decoded columns (see the module docstring)."""
    if column not in df.columns:
        raise ConfigError(f"decode: no column {column!r} (columns: {', '.join(df.columns)})")
    if callable(decoder):
        return _function(df, column, fn=decoder, **options)
    try:
        impl = _DECODERS[decoder]
    except KeyError:
        raise ConfigError(f"decode: no payload decoder {decoder!r} (registered: {', '.join(decoders())})") from None
    return impl(df, column, **options)


def _expand(df: Any, column: str, struct_col: Any) -> Any:
    """Replace ``column`` by the fields of ``struct_col``, in place of the original column."""
    from pyspark.sql import functions as F

    tmp = f"__{column}_decoded"
    out = df.withColumn(tmp, struct_col)
    fields = out.schema[tmp].dataType.fieldNames()
    cols: list[Any] = []
    for name in df.columns:
        if name == column:
            cols.extend(F.col(f"{tmp}.{f}").alias(f) for f in fields)
        else:
            cols.append(F.col(name))
    return out.select(*cols)


def _json(df: Any, column: str, *, schema: str, **_: Any) -> Any:
    from pyspark.sql import functions as F

    return _expand(df, column, F.from_json(F.col(column).cast("string"), schema))


def _utf8(df: Any, column: str, *, name: str = "value", **_: Any) -> Any:
    from pyspark.sql import functions as F

    return df.withColumn(column, F.col(column).cast("string")).withColumnRenamed(column, name)


_STRUCT_TYPES = {"b": "TINYINT", "B": "SMALLINT", "h": "SMALLINT", "H": "INT", "i": "INT", "I": "BIGINT",
                 "l": "INT", "L": "BIGINT", "q": "BIGINT", "Q": "DECIMAL(20,0)", "f": "FLOAT", "d": "DOUBLE",
                 "?": "BOOLEAN", "s": "BINARY"}


def _struct_decoder(df: Any, column: str, *, format: str, names: list[str], **_: Any) -> Any:
    packer = _struct.Struct(format)
    codes = [c for c in _struct_codes(format)]
    if len(codes) != len(names):
        raise ConfigError(f"decode struct: format {format!r} has {len(codes)} fields, {len(names)} names given")
    schema = ", ".join(f"`{n}` {_STRUCT_TYPES[c]}" for n, c in zip(names, codes, strict=True))
    size = packer.size

    def unpack(data):  # type: ignore[no-untyped-def]  # no hints (see _function)
        if data is None or len(data) != size:
            return None  # not this layout: a null row rather than a failed job
        return _struct.unpack(format, data)  # struct caches compiled formats; a Struct does not pickle

    return _function(df, column, fn=unpack, schema=schema)


def _struct_codes(format: str) -> list[str]:
    out: list[str] = []
    count = ""
    for ch in format.lstrip("@=<>!"):
        if ch.isdigit():
            count += ch
            continue
        if ch not in _STRUCT_TYPES:
            raise ConfigError(f"decode struct: format code {ch!r} is not supported")
        if ch == "s":
            out.append("s")
        else:
            out.extend(ch * int(count or 1))
        count = ""
    return out


def _keyed(df: Any, column: str, **_: Any) -> Any:
    """Split what an idempotent write appended (:mod:`waltz_spark.keyed`) into its keys and the row's
    data; other payloads keep their data, with null keys."""
    from .keyed import decode_keyed

    def split(data: bytes) -> tuple[list[bytes] | None, bytes]:
        keyed = decode_keyed(data)
        return (None, data) if keyed is None else (list(keyed[0]), keyed[1])

    return _function(df, column, fn=split, schema=f"idempotency_keys ARRAY<BINARY>, `{column}` BINARY")


def _function(df: Any, column: str, *, fn: Callable[[bytes], Any], schema: str, **_: Any) -> Any:
    """A user function ``bytes -> tuple | dict | None`` as a UDF returning ``schema`` (DDL)."""
    from pyspark import cloudpickle
    from pyspark.sql import functions as F

    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    if module is not None and module.__name__ != "__main__" and not module.__name__.startswith(("pyspark", "waltz_spark")):
        # Workers may not be able to import the caller's module (a script, a test): ship it by value.
        cloudpickle.register_pickle_by_value(module)  # type: ignore[no-untyped-call]  # pyspark's copy: no hints

    def call(data):  # type: ignore[no-untyped-def]  # no hints: Spark would read them as a pandas UDF's
        return None if data is None else fn(bytes(data))

    return _expand(df, column, F.udf(call, schema)(F.col(column)))


register_decoder("json", _json)
register_decoder("utf8", _utf8)
register_decoder("struct", _struct_decoder)
register_decoder("keyed", _keyed)
