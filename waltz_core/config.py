"""Configuration: attrs classes per process, TOML files, ``WALTZ_*`` environment overrides.

Every key is declared here (or in a backend's ``config_cls``) with its type, default and a
``doc`` in the field metadata; ``waltz config schema`` and ``docs/configuration.md`` are
generated from these declarations. A file looks like::

    [server]
    port = 55180

    [transport]
    name = "tcp"            # a registered transport (see `waltz plugins`)

    [transport.tcp]         # options of that backend, validated by its config class
    nodelay = true

    [coordination]
    name = "zookeeper"
    connect = "127.0.0.1:2181"
    root = "/waltz"

Environment variables override files: ``WALTZ_<SECTION>_<KEY>``, for example
``WALTZ_SERVER_PORT=55180`` or ``WALTZ_COORDINATION_CONNECT=zk1:2181``. Defaults follow the
original Java Waltz where its inventory gives them.
"""

from __future__ import annotations

import os
import tomllib
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

import attrs

from .errors import ConfigError

C = TypeVar("C")


def key(default: Any, doc: str, **kw: Any) -> Any:
    """Declare a config key: default plus documentation (the single source for the schema)."""
    if isinstance(default, (list, dict)):
        kw["factory"] = (lambda d=default: type(d)(d))  # noqa: E731 - fresh copy per instance
        return attrs.field(metadata={"doc": doc}, **kw)
    return attrs.field(default=default, metadata={"doc": doc}, **kw)


# --------------------------------------------------------------------------------- shared sections


@attrs.frozen
class TransportConfig:
    """Which frame transport carries the links of this process."""

    name: str = key("tcp", "Transport backend name (a registered transport, see `waltz plugins`).")
    max_frame_size: int = key(16 * 1024 * 1024, "Largest frame accepted or sent, in bytes; larger frames are a protocol error.")
    connect_timeout: float = key(5.0, "Seconds to wait for a connection to be established.")
    options: Mapping[str, Mapping[str, Any]] = key(
        {}, "Per-backend option tables, written as [transport.<name>] (validated by that backend's options class)."
    )


@attrs.frozen
class CoordinationConfig:
    """Where cluster metadata lives."""

    name: str = key("local", "Coordination backend name: local, zookeeper, etcd or a plugin's.")
    connect: str = key("", "Backend connect string (zookeeper: host:port,...; etcd: host:port,...; local: a directory).")
    root: str = key("/waltz", "Cluster root path/prefix under which all Waltz metadata is kept.")
    session_timeout: float = key(10.0, "Seconds after which a silent session (ZooKeeper session, etcd lease, local lease) expires.")
    options: Mapping[str, Mapping[str, Any]] = key({}, "Per-backend option tables, written as [coordination.<name>].")


@attrs.frozen
class HttpConfig:
    """The optional HTTP endpoint (/ping, /health, /metrics, /buildinfo)."""

    port: int = key(0, "HTTP port; 0 disables the endpoint.")
    host: str = key("127.0.0.1", "Address the HTTP endpoint binds to.")


# ------------------------------------------------------------------------------------ per process


@attrs.frozen
class StorageNodeConfig:
    """A storage node: its ports, directory and on-disk layout."""

    host: str = key("127.0.0.1", "Address the data and admin ports bind to.")
    port: int = key(55280, "Data port (Waltz servers connect here).")
    admin_port: int = key(55281, "Admin port (assignment, availability, export, metrics).")
    directory: str = key("./waltz-storage", "Storage directory holding the control file and partition directories.")
    layout: str = key("segmented", "Storage layout backend name.")
    segment_size_threshold: int = key(1_000_000_000, "A new segment starts once the current data file exceeds this many bytes.")
    segment_cache_capacity: int = key(5, "Segments per partition whose files stay open.")
    index_checkpoint_interval: int = key(1000, "Records between index flushes; the index is rebuilt from the last checkpoint on start.")
    max_batch_records: int = key(100, "Largest append batch written with one fdatasync.")
    queue_size: int = key(100, "Requests queued per partition before the node stops reading from a connection.")


@attrs.frozen
class StorageProcessConfig:
    """`waltz storage start --config storage.toml`."""

    storage: StorageNodeConfig = key(StorageNodeConfig(), "The storage node.")
    transport: TransportConfig = key(TransportConfig(), "Transport for the data and admin ports.")
    coordination: CoordinationConfig = key(CoordinationConfig(), "Coordination backend (cluster key and partition count).")
    http: HttpConfig = key(HttpConfig(), "HTTP endpoint.")


@attrs.frozen
class ServerConfig:
    """A Waltz server: partitions, lock tables, caches, replication."""

    host: str = key("127.0.0.1", "Address the client port binds to (and is advertised).")
    port: int = key(55180, "Client port (stream and RPC connections).")
    lock_table: str = key("hashed", "Lock-table strategy name: hashed (the seed's table) or exact.")
    lock_table_size: int = key(30_000, "Slots per partition in the hashed lock table (L).")
    lock_hash_count: int = key(3, "Hash functions per lock in the hashed lock table (N).")
    feed_cache_budget: int = key(
        64 * 1024 * 1024, "Bytes of recent feed frames (transaction headers) the server keeps for feeds, shared by "
                          "all its partitions (about 72 bytes per transaction); the oldest go first.",
        validator=attrs.validators.ge(0))
    data_cache_budget: int = key(
        128 * 1024 * 1024, "Bytes of recent transaction data the server keeps for data RPCs, shared by all its "
                           "partitions (data size plus about 260 bytes per transaction); the oldest go first.",
        validator=attrs.validators.ge(0))
    replication_buffer_budget: int = key(
        64 * 1024 * 1024, "Bytes of committed records the server keeps for replicas that are behind, shared by all "
                          "its partitions; a replica further behind reads from its peers instead.",
        validator=attrs.validators.ge(0))
    append_queue_size: int = key(100, "Appends queued per partition before the server stops reading the connection.")
    max_batch_size: int = key(100, "Largest batch of records sent to storage replicas at once.")
    storage_request_timeout: float = key(
        5.0, "Seconds a storage node may take to answer a request; past it the connection is closed, the node "
             "is marked unreachable for every partition of the server and probed in the background, and each "
             "partition goes on with the replicas that answer (bounds fail-over when a storage host vanishes).",
        validator=attrs.validators.gt(0.0))
    initial_retry_interval: float = key(0.1, "First back-off after a storage failure, in seconds.")
    max_retry_interval: float = key(20.0, "Largest back-off after repeated storage failures, in seconds.")
    checkpoint_interval: int = key(250_000, "Transactions after which a new store session is forced (bounds recovery work).")
    inbound_high_water: int = key(600, "Queued inbound messages per connection above which reading stops.")
    inbound_low_water: int = key(300, "Queued inbound messages per connection below which reading resumes.")
    preferred_partitions: list[int] = key([], "Partitions this server asks the cluster manager for first.")


@attrs.frozen
class ServerProcessConfig:
    """`waltz server start --config server.toml`."""

    server: ServerConfig = key(ServerConfig(), "The server.")
    transport: TransportConfig = key(TransportConfig(), "Transport for client and storage links.")
    coordination: CoordinationConfig = key(CoordinationConfig(), "Coordination backend.")
    http: HttpConfig = key(HttpConfig(), "HTTP endpoint.")


@attrs.frozen
class ClientConfig:
    """The client library."""

    auto_mount: bool = key(True, "Mount every partition; false lets the application choose with set_partitions().")
    max_concurrent_transactions: int = key(5, "In-flight appends per partition; submit() blocks/awaits above it, and waiting submits get freed slots first come, first served.")
    long_wait_threshold: float = key(5.0, "Seconds after which a partition with pending appends is nudged with a flush.")
    mount_timeout: float = key(10.0, "Seconds to wait for a partition to mount before an append fails.")
    num_retry_workers: int = key(1, "Concurrent re-executions of failed transaction contexts.")
    data_fetch_attempts: int = key(5, "Attempts to fetch a transaction's data when its checksum does not match.")
    data_fetch_timeout: float = key(60.0, "Seconds a transaction data fetch keeps retrying RPC failures (backoff 10 ms to 5 s).")
    data_read_ahead: int = key(256, "Most transactions a sequential reader's data read-ahead fetches in one RPC "
                                    "(the window doubles from 4 up to this); 0 or 1: one transaction per RPC.")
    rpc_timeout: float = key(10.0, "Seconds to wait for one RPC answer (transaction data, high-water mark).")
    reconnect_delay: float = key(1.0, "Seconds before a stream connection that could not be opened is tried again.")
    num_consumer_threads: int = key(10, "WaltzClient (sync) threads running apply callbacks; partitions are sharded over them.")


@attrs.frozen
class ClientProcessConfig:
    """Configuration handed to WaltzClient / AsyncWaltzClient."""

    client: ClientConfig = key(ClientConfig(), "The client.")
    transport: TransportConfig = key(TransportConfig(), "Transport for server links.")
    coordination: CoordinationConfig = key(CoordinationConfig(), "Coordination backend (server discovery).")


@attrs.frozen
class CliConfig:
    """The `waltz` command line (cluster and admin tools)."""

    transport: TransportConfig = key(TransportConfig(), "Transport for admin links.")
    coordination: CoordinationConfig = key(CoordinationConfig(), "Coordination backend.")


#: Process configs, by the name used in `waltz config schema`.
PROCESS_CONFIGS: dict[str, type] = {
    "server": ServerProcessConfig,
    "storage": StorageProcessConfig,
    "client": ClientProcessConfig,
    "cli": CliConfig,
}

# ------------------------------------------------------------------------------------- loading


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _convert(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if attrs.has(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a table, got {value!r}")
        return build(tp, value, where)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value.lower() in ("1", "true", "yes", "on")
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, str):  # environment: comma separated
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_convert(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin in (Mapping, dict) or tp in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a table, got {value!r}")
        return dict(value)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for alt in typing.get_args(tp):
            if alt is type(None):
                if value is None:
                    return None
                continue
            try:
                return _convert(value, alt, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{where}: invalid value {value!r}")
    if tp is Any:
        return value
    raise ConfigError(f"{where}: unsupported type {tp!r}")  # a bug in a config class, not user input


#: Keys that existed once: (config class, key) -> what to do instead. A file that still has one
#: gets this one line, never a silent success (the key would do nothing).
REMOVED_KEYS: dict[tuple[str, str], str] = {
    ("ServerConfig", "feed_cache_size"): "removed in 0.2: the feed cache is one budget per server now, "
                                         "set server.feed_cache_budget (bytes, all partitions together)",
    ("ServerConfig", "transaction_data_cache_size"): "removed in 0.2: the data cache is one budget per server now, "
                                                     "set server.data_cache_budget (bytes, all partitions together)",
    ("ServerConfig", "min_fetch_size"): "removed in 0.2: it did nothing (every feed reads headers from the "
                                        "cache or from storage in batches of up to 256); delete the line",
    ("ServerConfig", "realtime_threshold"): "removed in 0.2: it did nothing (a feed behind the cache reads "
                                            "storage in its own task, never holding up others); delete the line",
}


def build(cls: type[C], data: Mapping[str, Any], where: str = "") -> C:
    """Build config class ``cls`` from a mapping, validating every key.

    Sections with an ``options`` field (transport, coordination) take unknown *sub-tables* as
    per-backend options: ``[transport.tcp]`` becomes ``options["tcp"]``.
    """
    hints = _field_types(cls)
    names = {f.name for f in attrs.fields(cls)}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    options: dict[str, Any] = {}
    for k, v in data.items():
        path = f"{where}.{k}" if where else k
        if k in names:
            kwargs[k] = _convert(v, hints[k], path)
        elif "options" in names and isinstance(v, Mapping):
            options[k] = dict(v)
        elif (cls.__name__, k) in REMOVED_KEYS:
            raise ConfigError(f"{path}: {REMOVED_KEYS[cls.__name__, k]}")
        else:
            known = ", ".join(sorted(n for n in names if n != "options"))
            raise ConfigError(f"{path}: unknown key (known keys{' of [' + where + ']' if where else ''}: {known})")
    if options:
        kwargs["options"] = {**kwargs.get("options", {}), **options}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where or cls.__name__}: {exc}") from exc


def _env_overrides(cls: type, environ: Mapping[str, str]) -> dict[str, dict[str, str]]:
    sections = {f.name: f for f in attrs.fields(cls)}  # type: ignore[arg-type]
    out: dict[str, dict[str, str]] = {}
    for env_key, value in environ.items():
        if not env_key.startswith("WALTZ_"):
            continue
        rest = env_key[len("WALTZ_"):].lower()
        section, _, field = rest.partition("_")
        if section not in sections or not field:
            continue  # other WALTZ_* switches (plugins, tests) are not config keys of this process
        sub_cls = typing.get_type_hints(cls)[section]
        if not attrs.has(sub_cls):
            continue
        if (sub_cls.__name__, field) in REMOVED_KEYS:
            raise ConfigError(f"environment variable {env_key}: {REMOVED_KEYS[sub_cls.__name__, field]}")
        if field not in {f.name for f in attrs.fields(sub_cls)}:
            known = ", ".join(f"WALTZ_{section.upper()}_{f.name.upper()}" for f in attrs.fields(sub_cls) if f.name != "options")
            raise ConfigError(f"environment variable {env_key}: unknown key {section}.{field} (known: {known})")
        out.setdefault(section, {})[field] = value
    return out


def load(cls: type[C], path: str | os.PathLike[str] | None = None, *, environ: Mapping[str, str] | None = None,
         overrides: Mapping[str, Mapping[str, Any]] | None = None) -> C:
    """Load a process config: TOML file (optional), then ``WALTZ_*`` variables, then ``overrides``.

    Errors name the file and the key: ``server.toml: server.port: expected an integer, got 'x'``.
    """
    data: dict[str, Any] = {}
    label = "defaults"
    if path is not None:
        label = str(path)
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"{label}: no such config file") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{label}: not valid TOML: {exc}") from None
    env = _env_overrides(cls, os.environ if environ is None else environ)
    for layer in (env, overrides or {}):
        for section, values in layer.items():
            existing = data.get(section, {})
            if not isinstance(existing, Mapping):  # e.g. `server = 5`: report it, do not crash in dict()
                raise ConfigError(f"{label}: {section}: expected a table, got {existing!r}")
            merged = dict(existing)
            merged.update(values)
            data[section] = merged
    try:
        return build(cls, data)
    except ConfigError as exc:
        raise ConfigError(f"{label}: {exc}") from None


def backend_options(info_config_cls: type[C] | None, section: Any, where: str) -> C | None:
    """Build a backend's options object from ``section.options[<backend name>]``."""
    if info_config_cls is None:
        if section.options.get(section.name):
            raise ConfigError(f"{where}.{section.name}: this backend takes no options")
        return None
    return build(info_config_cls, section.options.get(section.name, {}), f"{where}.{section.name}")


# -------------------------------------------------------------------------------------- schema


@attrs.frozen
class SchemaEntry:
    key: str
    type: str
    default: str
    doc: str


def _type_name(tp: Any) -> str:
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__name__
    return str(tp).replace("typing.", "").replace("collections.abc.", "")


def schema(cls: type, prefix: str = "") -> list[SchemaEntry]:
    """Every key of a config class, flattened to dotted names."""
    hints = _field_types(cls)
    out: list[SchemaEntry] = []
    for f in attrs.fields(cls):  # type: ignore[arg-type]
        tp = hints[f.name]
        name = f"{prefix}{f.name}"
        if attrs.has(tp):
            out.extend(schema(tp, f"{name}."))
            continue
        if f.default is attrs.NOTHING:
            default = "required"
        elif isinstance(f.default, attrs.Factory):  # type: ignore[arg-type]
            default = repr(f.default.factory())
        else:
            default = repr(f.default)
        out.append(SchemaEntry(name, _type_name(tp), default, f.metadata.get("doc", "")))
    return out
