"""Options of the ``waltz`` data source, parsed and validated once, with errors that name the option.

Spark hands a data source its options as a case-insensitive mapping of strings. Everything here
is pure (no Spark, no network): the classes are built on the driver when a DataFrame is defined,
so a bad option fails there, before any task runs, with a message naming the option and what it
accepts.

Connection options (every use):

* ``config`` - path of a client TOML file (``[client]``, ``[transport]``, ``[coordination]``,
  the file ``waltz up`` and :class:`~waltz_core.testing.cluster.ClusterSpec` write), or
* ``coordination.name`` / ``coordination.connect`` / ``coordination.root`` and ``transport``
  (name) given directly; they also override the file's values when both are given;
* ``client.<key>`` - any key of the ``[client]`` table (for example ``client.rpc_timeout``).
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Mapping
from typing import Any

import attrs

from waltz_core.config import ClientProcessConfig, build
from waltz_core.errors import ConfigError

#: Default of the write option ``maxFalseConflicts``: far more than a row meets with a sane lock
#: table (a false conflict needs every slot of its key overwritten since its last check).
MAX_FALSE_CONFLICTS = 32


class SparkOptionError(ConfigError):
    """A ``waltz`` data-source option is missing, unknown or malformed."""


_CONNECTION_KEYS = {"config", "checkpointlocation", "queryname", "coordination.name", "coordination.connect", "coordination.root",
                    "coordination.session_timeout", "transport"}
READ_KEYS = _CONNECTION_KEYS | {"partitions", "startid", "endid", "rangesize", "startingoffsets",
                                "maxtransactionspertrigger", "fetchwindow", "path"}
WRITE_KEYS = _CONNECTION_KEYS | {"datacolumn", "headercolumn", "lockcolumn", "lockname", "partitioncolumn",
                                 "partitioner", "idempotent", "locksnapshot", "maxfalseconflicts", "maxretries", "timeout",
                                 "path"}


def _lower(options: Mapping[str, str]) -> dict[str, str]:
    return {str(k).lower(): str(v) for k, v in options.items()}


def _check_known(opts: Mapping[str, str], known: set[str], use: str) -> None:
    for key in opts:
        if key in known or key.startswith("client."):
            continue
        raise SparkOptionError(f"waltz {use}: unknown option {key!r} (known: "
                               f"{', '.join(sorted(known - {'path', 'checkpointlocation', 'queryname'}))}, client.<key>)")


def _int(opts: Mapping[str, str], key: str, default: int | None, *, minimum: int | None = None) -> int | None:
    raw = opts.get(key)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SparkOptionError(f"waltz option {key!r}: expected an integer, got {raw!r}") from None
    if minimum is not None and value < minimum:
        raise SparkOptionError(f"waltz option {key!r}: must be at least {minimum}, got {value}")
    return value


def _bool(opts: Mapping[str, str], key: str) -> bool:
    raw = opts.get(key, "false").strip().lower()
    if raw in ("true", "1", "yes"):
        return True
    if raw in ("false", "0", "no", ""):
        return False
    raise SparkOptionError(f"waltz option {key!r}: expected true or false, got {raw!r}")


def client_config(opts: Mapping[str, str], **client: Any) -> ClientProcessConfig:
    """The client configuration named by the connection options (``client`` keys override).

    Raises :class:`SparkOptionError` when no connection is given or the file/values are invalid.
    """
    data: dict[str, Any] = {}
    path = opts.get("config")
    if path:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError:
            raise SparkOptionError(f"waltz option 'config': no such file {path!r}") from None
        except tomllib.TOMLDecodeError as exc:
            raise SparkOptionError(f"waltz option 'config': {path} is not valid TOML: {exc}") from None
    coordination = dict(data.get("coordination", {}))
    for key in ("name", "connect", "root", "session_timeout"):
        value = opts.get(f"coordination.{key}")
        if value:
            coordination[key] = float(value) if key == "session_timeout" else value
    if not coordination.get("connect") and not path:
        raise SparkOptionError("waltz: no connection given: set option 'config' (a client TOML file) or "
                               "'coordination.connect' (with 'coordination.name' and 'coordination.root')")
    data["coordination"] = coordination
    if opts.get("transport"):
        data["transport"] = {**data.get("transport", {}), "name": opts["transport"]}
    section = dict(data.get("client", {}))
    for key, value in opts.items():
        if key.startswith("client."):
            section[key[len("client."):]] = value
    section.update(client)
    data["client"] = section
    try:
        return build(ClientProcessConfig, data)
    except ConfigError as exc:
        raise SparkOptionError(f"waltz connection options: {exc}") from None


def parse_partitions(raw: str | None) -> tuple[int, ...] | None:
    """``"0,2,5-7"`` -> (0, 2, 5, 6, 7); None/empty -> None (every partition)."""
    from waltz_core.coordination.metadata import parse_partition_ranges

    if raw is None or not raw.strip():
        return None
    try:
        return tuple(parse_partition_ranges(raw))
    except ValueError:
        raise SparkOptionError(f"waltz option 'partitions': expected ids like '0,2,5-7', got {raw!r}") from None


@attrs.frozen
class ReadOptions:
    """What a batch or streaming read was asked for (see :mod:`waltz_spark.source`)."""

    options: tuple[tuple[str, str], ...]  #: the lower-cased raw options (connection, client.*)
    partitions: tuple[int, ...] | None
    start_id: int  #: first transaction id read, per partition (batch)
    end_id: int | None  #: last transaction id read, inclusive (batch); None: the high-water mark
    range_size: int  #: transactions per Spark partition
    starting_offsets: str  #: streaming: "earliest", "latest" or a JSON {"partition": last id read}
    max_per_trigger: int | None
    fetch_window: int  #: most transactions whose data a reading task fetches with one range RPC

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> ReadOptions:
        opts = _lower(options)
        _check_known(opts, READ_KEYS, "read")
        client_config(opts)  # validate the connection now, on the driver
        start = _int(opts, "startid", 0, minimum=0)
        end = _int(opts, "endid", None, minimum=0)
        assert start is not None
        if end is not None and end < start:
            raise SparkOptionError(f"waltz options: 'endId' ({end}) is before 'startId' ({start})")
        starting = opts.get("startingoffsets", "earliest").strip()
        if starting.lower() in ("earliest", "latest"):
            starting = starting.lower()
        else:
            parse_offset_json(starting, "startingOffsets")
        return cls(options=tuple(sorted(opts.items())), partitions=parse_partitions(opts.get("partitions")),
                   start_id=start, end_id=end, range_size=_int(opts, "rangesize", 100_000, minimum=1) or 100_000,
                   starting_offsets=starting, max_per_trigger=_int(opts, "maxtransactionspertrigger", None, minimum=1),
                   fetch_window=_int(opts, "fetchwindow", 256, minimum=1) or 256)

    @property
    def raw(self) -> dict[str, str]:
        return dict(self.options)


def parse_offset_json(raw: str, what: str) -> dict[int, int]:
    """``{"0": 41, "1": -1}`` (partition -> last transaction id consumed) as ints."""
    try:
        value = json.loads(raw)
        if not isinstance(value, dict):
            raise ValueError
        out = {int(k): int(v) for k, v in value.items()}
    except (ValueError, TypeError):
        raise SparkOptionError(f"waltz option {what!r}: expected 'earliest', 'latest' or JSON like "
                               f'{{"0": 41, "1": -1}} (partition -> last id already read), got {raw!r}') from None
    if any(v < -1 for v in out.values()):
        raise SparkOptionError(f"waltz option {what!r}: ids are -1 (nothing read) or more, got {raw!r}")
    return out


@attrs.frozen
class WriteOptions:
    """How DataFrame rows become transactions (see :mod:`waltz_spark.sink`)."""

    options: tuple[tuple[str, str], ...]
    data_column: str
    header_column: str | None
    lock_column: str | None
    lock_name: str
    partition_column: str | None
    partitioner: str | None  #: "module:function" called as f(row, num_partitions) -> partition id
    idempotent: bool  #: lockColumn is an idempotency key: exactly-once against the lock snapshot
    lock_snapshot: tuple[tuple[int, int], ...] | None  #: pinned per-partition snapshot (JSON option)
    #: idempotent: times one row whose keys are not in the log is sent again after a lock conflict
    max_false_conflicts: int
    max_retries: int | None
    timeout: float | None

    @classmethod
    def parse(cls, options: Mapping[str, str], columns: list[str]) -> WriteOptions:
        opts = _lower(options)
        _check_known(opts, WRITE_KEYS, "write")
        client_config(opts)
        data_column = opts.get("datacolumn", "data")
        named = {"dataColumn": data_column, "headerColumn": opts.get("headercolumn"),
                 "lockColumn": opts.get("lockcolumn"), "partitionColumn": opts.get("partitioncolumn")}
        for option, column in named.items():
            if column is not None and column not in columns:
                raise SparkOptionError(f"waltz write option {option!r}: no column {column!r} in the DataFrame "
                                       f"(columns: {', '.join(columns)})")
        if opts.get("partitioncolumn") and opts.get("partitioner"):
            raise SparkOptionError("waltz write: give 'partitionColumn' or 'partitioner', not both")
        partitioner = opts.get("partitioner")
        if partitioner is not None and ":" not in partitioner:
            raise SparkOptionError(f"waltz write option 'partitioner': expected 'module:function', got {partitioner!r}")
        idempotent = _bool(opts, "idempotent")
        if idempotent and not opts.get("lockcolumn"):
            raise SparkOptionError("waltz write option 'idempotent': needs 'lockColumn' (the idempotency key)")
        snapshot = None
        if opts.get("locksnapshot"):
            if not idempotent:
                raise SparkOptionError("waltz write option 'lockSnapshot': only meaningful with idempotent=true")
            snapshot = tuple(sorted(parse_offset_json(opts["locksnapshot"], "lockSnapshot").items()))
        if opts.get("maxfalseconflicts") and not idempotent:
            raise SparkOptionError("waltz write option 'maxFalseConflicts': only meaningful with idempotent=true")
        max_false_conflicts = _int(opts, "maxfalseconflicts", MAX_FALSE_CONFLICTS, minimum=0)
        assert max_false_conflicts is not None
        timeout = opts.get("timeout")
        try:
            timeout_value = float(timeout) if timeout else None
        except ValueError:
            raise SparkOptionError(f"waltz write option 'timeout': expected seconds, got {timeout!r}") from None
        return cls(options=tuple(sorted(opts.items())), data_column=data_column,
                   header_column=opts.get("headercolumn"), lock_column=opts.get("lockcolumn"),
                   lock_name=opts.get("lockname", "waltz-spark"), partition_column=opts.get("partitioncolumn"),
                   partitioner=partitioner, idempotent=idempotent, lock_snapshot=snapshot,
                   max_false_conflicts=max_false_conflicts,
                   max_retries=_int(opts, "maxretries", None, minimum=0), timeout=timeout_value)

    @property
    def raw(self) -> dict[str, str]:
        return dict(self.options)
