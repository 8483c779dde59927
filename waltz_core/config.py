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
``WALTZ_SERVER_PORT=55180`` or ``WALTZ_COORDINATION_CONNECT=zk1:2181``, and
``WALTZ_<SECTION>_<BACKEND>__<KEY>`` a backend's option table, for example
``WALTZ_COORDINATION_ZOOKEEPER__AUTH_SCHEME=digest``; command-line flags override both. Every
key is validated where it is declared (ports, positive sizes and timeouts), and
:func:`check_backends` checks backend names and option tables against the registered plugins
of the process's runtime, so every problem is one :class:`~waltz_core.errors.ConfigError` line
naming where the value came from and the key. Defaults follow the original Java Waltz where its
inventory gives them.

Backends and their options. Four sections name a backend (:data:`BACKEND_SECTIONS`):
``[transport] name``, ``[coordination] name``, ``[storage] layout`` and ``[server] lock_table``.
A backend's own options are the table ``[<section>.<name>]`` of that section
(``[transport.tcp]``, ``[storage.segmented]``, ``[server.hashed]``), validated by the backend's
options class; :func:`backend_options` is the one function that reads them, and the backend's
factory receives the section and the options (``factory(config, options)``, see
:mod:`waltz_core.registry`).
"""

from __future__ import annotations

import difflib
import os
import tomllib
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import attrs

from .errors import ConfigError
from .eventloop import EVENT_LOOPS
from .protocol.framing import MIN_MAX_FRAME_SIZE

if TYPE_CHECKING:
    from .plugins import Registries
    from .registry import Registry

C = TypeVar("C")


class InvalidValue(ValueError):
    """A key's validator refused its value; :func:`build` adds the section and the file."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


def requirement(check: Callable[[Any], bool], text: str) -> Callable[[Any, Any, Any], None]:
    """An attrs validator: ``check(value)`` must hold, else "<key>: <text>, got <value>"."""

    def validate(_instance: Any, attribute: Any, value: Any) -> None:
        if not check(value):
            raise InvalidValue(attribute.name, f"{text}, got {value!r}")

    return validate


def at_least(minimum: float) -> Callable[[Any, Any, Any], None]:
    return requirement(lambda v: v >= minimum, f"must be {minimum} or more")


#: Validators shared by the keys below (and by backends' options classes).
PORT = requirement(lambda v: 0 <= v <= 65535, "must be a port number from 0 to 65535 (0: any free port)")
POSITIVE = requirement(lambda v: v > 0, "must be greater than 0")
NON_NEGATIVE = at_least(0)
AT_LEAST_ONE = at_least(1)


def key(default: Any, doc: str, **kw: Any) -> Any:
    """Declare a config key: default plus documentation (the single source for the schema)."""
    if isinstance(default, (list, dict)):
        kw["factory"] = (lambda d=default: type(d)(d))  # a fresh copy per instance
        return attrs.field(metadata={"doc": doc}, **kw)
    return attrs.field(default=default, metadata={"doc": doc}, **kw)


# --------------------------------------------------------------------------------- shared sections


@attrs.frozen
class TransportConfig:
    """Which frame transport carries the links of this process."""

    name: str = key("tcp", "Transport backend name (a registered transport, see `waltz plugins`).")
    max_frame_size: int = key(16 * 1024 * 1024, "Largest frame accepted or sent, in bytes; larger frames are a protocol error.",
                              validator=at_least(MIN_MAX_FRAME_SIZE))
    connect_timeout: float = key(5.0, "Seconds to wait for a connection to be established.", validator=POSITIVE)
    options: Mapping[str, Mapping[str, Any]] = key(
        {}, "Per-backend option tables, written as [transport.<name>] (validated by that backend's options class)."
    )


@attrs.frozen
class CoordinationConfig:
    """Where cluster metadata lives."""

    name: str = key("local", "Coordination backend name: local, zookeeper, etcd or a plugin's.")
    connect: str = key("", "Backend connect string (zookeeper: host:port,...; etcd: host:port,...; local: a directory).")
    root: str = key("/waltz", "Cluster root path/prefix under which all Waltz metadata is kept.")
    session_timeout: float = key(10.0, "Seconds after which a silent session (ZooKeeper session, etcd lease, local lease) expires.",
                                 validator=POSITIVE)
    options: Mapping[str, Mapping[str, Any]] = key({}, "Per-backend option tables, written as [coordination.<name>].")


@attrs.frozen
class HttpConfig:
    """The optional HTTP endpoint (/ping, /livez, /readyz, /health, /metrics, /buildinfo)."""

    port: int = key(0, "HTTP port; 0 disables the endpoint.", validator=PORT)
    host: str = key("127.0.0.1", "Address the HTTP endpoint binds to.")


@attrs.frozen
class SecurityConfig:
    """What a listening process may do without encryption (docs/security.md)."""

    insecure: bool = key(
        False, "Allow plaintext links (no encryption, no authentication) on an address other than loopback; "
               "loopback plaintext is always allowed, for development. Elsewhere configure the transport's "
               "TLS ([transport.tcp] tls_cert/tls_key/tls_ca) or CURVE ([transport.zmq]), or set this (--insecure).")


@attrs.frozen
class ProcessConfig:
    """How the process itself runs (a server or a storage node)."""

    event_loop: str = key(
        "auto", "Event loop: auto (uvloop when installed, else asyncio), asyncio, or uvloop (an error when it is "
                "not installed; pip install 'waltz-core[speedups]'). uvloop spends less CPU per transaction "
                "(docs/performance.md).",
        validator=requirement(lambda v: v in EVENT_LOOPS, "must be one of " + ", ".join(EVENT_LOOPS)))


# ------------------------------------------------------------------------------------ per process


@attrs.frozen
class StorageNodeConfig:
    """A storage node: its ports, directory and on-disk layout."""

    host: str = key("127.0.0.1", "Address the data and admin ports bind to.")
    port: int = key(55280, "Data port (Waltz servers connect here).", validator=PORT)
    admin_port: int = key(55281, "Admin port (assignment, availability, export, metrics).", validator=PORT)
    directory: str = key("./waltz-storage", "Storage directory holding the control file and partition directories.")
    layout: str = key("segmented", "Storage layout backend name.")
    segment_size_threshold: int = key(1_000_000_000, "A new segment starts once the current data file exceeds this many bytes.",
                                      validator=AT_LEAST_ONE)
    segment_cache_capacity: int = key(5, "Segments per partition whose files stay open.", validator=AT_LEAST_ONE)
    index_checkpoint_interval: int = key(1000, "Records between index flushes; the index is rebuilt from the last checkpoint on start.",
                                         validator=AT_LEAST_ONE)
    page_cache_keep_bytes: int = key(
        32 * 1024 * 1024, "Bytes of each partition's newest synced records left in the page cache; older ones are "
                          "dropped from it as the log grows (posix_fadvise DONTNEED, Linux), so that the node's page "
                          "cache stays near partitions x this instead of filling the host's memory with records "
                          "that are written once and seldom read (docs/storage.md). 0: leave it to the kernel.",
        validator=NON_NEGATIVE)
    max_batch_records: int = key(100, "Largest group of a partition's appends written at once: one fdatasync each "
                                      "without the node journal; with it every group of a round shares the "
                                      "journal's one.", validator=AT_LEAST_ONE)
    queue_size: int = key(100, "Requests queued per partition before the node stops reading from a connection.",
                          validator=AT_LEAST_ONE)
    io_threads: int = key(0, "Threads doing the file work (writes, fdatasync, reads) of the node's partitions. 0 (the "
                             "default): the file work runs in rounds on the node's event loop, without a hand-off "
                             "to a thread (the least CPU, and the shorter latency tail measured); journal "
                             "checkpoints still run on a thread, but a slow or hung disk also stalls the node's "
                             "network handling (the HTTP endpoint keeps answering and says so). 1 or more: that "
                             "many I/O threads, each with its own journal; a partition always uses the same one; "
                             "more threads overlap the fdatasyncs of different partitions at the cost of thread "
                             "switches and, with the journal, one fdatasync per thread and round "
                             "(docs/performance.md).",
                          validator=NON_NEGATIVE)
    journal: bool = key(True, "Make the appends of every partition an I/O thread handles in one round durable with one "
                              "write and one fdatasync of a node journal (storage-dir/journal/); the partition files "
                              "are synced at checkpoints. Off: one fdatasync per partition batch. A journal left by "
                              "an unclean stop is replayed at start either way (docs/operations.md).")
    journal_checkpoint_bytes: int = key(
        64 * 1024 * 1024, "Journal bytes after which an I/O thread syncs its partitions' files and starts the journal "
                          "over (at a point drawn between half and all of it each time, so that replicas do not "
                          "stall together); bounds the journal's size and the replay after a crash.",
        validator=AT_LEAST_ONE)
    options: Mapping[str, Mapping[str, Any]] = key(
        {}, "Per-layout option tables, written as [storage.<layout>] (validated by that layout's options class).")

    def __attrs_post_init__(self) -> None:
        if self.port and self.port == self.admin_port:
            raise InvalidValue("admin_port", f"must differ from port (both {self.port})")


@attrs.frozen
class StorageProcessConfig:
    """`waltz storage start --config storage.toml`."""

    storage: StorageNodeConfig = key(StorageNodeConfig(), "The storage node.")
    transport: TransportConfig = key(TransportConfig(), "Transport for the data and admin ports.")
    coordination: CoordinationConfig = key(CoordinationConfig(), "Coordination backend (cluster key and partition count).")
    http: HttpConfig = key(HttpConfig(), "HTTP endpoint.")
    security: SecurityConfig = key(SecurityConfig(), "Plaintext rules.")
    process: ProcessConfig = key(ProcessConfig(), "The process (its event loop).")


@attrs.frozen
class ServerConfig:
    """A Waltz server: partitions, lock tables, caches, replication."""

    host: str = key("127.0.0.1", "Address the client port binds to (and is advertised).")
    port: int = key(55180, "Client port (stream and RPC connections).", validator=PORT)
    lock_table: str = key("hashed", "Lock-table strategy name: hashed (the seed's table) or exact.")
    lock_table_size: int = key(30_000, "Slots per partition in the hashed lock table (L).", validator=AT_LEAST_ONE)
    lock_hash_count: int = key(3, "Hash functions per lock in the hashed lock table (N).", validator=AT_LEAST_ONE)
    feed_cache_budget: int = key(
        64 * 1024 * 1024, "Bytes of recent feed frames (transaction headers) the server keeps for feeds, shared by "
                          "all its partitions (about 72 bytes per transaction); the oldest go first.",
        validator=NON_NEGATIVE)
    data_cache_budget: int = key(
        128 * 1024 * 1024, "Bytes of recent transaction data the server keeps for data RPCs, shared by all its "
                           "partitions (data size plus about 24 bytes per transaction); the oldest go first.",
        validator=NON_NEGATIVE)
    replication_buffer_budget: int = key(
        64 * 1024 * 1024, "Bytes of committed records the server keeps for replicas that are behind, shared by all "
                          "its partitions; a replica further behind reads from its peers instead.",
        validator=NON_NEGATIVE)
    append_queue_size: int = key(100, "Appends queued per partition before the server stops reading the connection.",
                                 validator=AT_LEAST_ONE)
    max_batch_size: int = key(100, "Largest batch of records sent to storage replicas at once.", validator=AT_LEAST_ONE)
    max_locks_per_transaction: int = key(
        4096, "Most locks (write, read and append together) one transaction may name; the server refuses a larger "
              "one (TooManyLocksError): the server checks a transaction's locks in one step, which holds up "
              "every partition of the server.",
        validator=requirement(lambda n: 1 <= n <= 2**31 - 1, "must be 1 to 2147483647"))
    storage_request_timeout: float = key(
        5.0, "Seconds a storage node may take to answer a request; past it the connection is closed, the node "
             "is marked unreachable for every partition of the server and probed in the background, and each "
             "partition goes on with the replicas that answer (bounds fail-over when a storage host vanishes).",
        validator=POSITIVE)
    initial_retry_interval: float = key(0.1, "First back-off after a storage failure, in seconds.", validator=POSITIVE)
    max_retry_interval: float = key(20.0, "Largest back-off after repeated storage failures, in seconds.", validator=POSITIVE)
    checkpoint_interval: int = key(250_000, "Transactions after which a new store session is forced (bounds recovery work).",
                                   validator=AT_LEAST_ONE)
    inbound_high_water: int = key(600, "Queued inbound messages per connection above which reading stops.",
                                  validator=AT_LEAST_ONE)
    inbound_low_water: int = key(300, "Queued inbound messages per connection below which reading resumes.",
                                 validator=NON_NEGATIVE)
    preferred_partitions: list[int] = key([], "Partitions this server asks the cluster manager for first.",
                                          validator=requirement(lambda ids: all(i >= 0 for i in ids),
                                                                "must be partition ids (0 or more)"))
    options: Mapping[str, Mapping[str, Any]] = key(
        {}, "Per-strategy option tables of lock tables, written as [server.<lock_table>] (validated by that "
            "strategy's options class).")

    def __attrs_post_init__(self) -> None:
        if self.max_retry_interval < self.initial_retry_interval:
            raise InvalidValue("max_retry_interval", f"must be at least initial_retry_interval "
                                                     f"({self.initial_retry_interval}), got {self.max_retry_interval}")
        if self.inbound_low_water >= self.inbound_high_water:
            raise InvalidValue("inbound_low_water", f"must be below inbound_high_water ({self.inbound_high_water}), "
                                                    f"got {self.inbound_low_water}")


@attrs.frozen
class ServerProcessConfig:
    """`waltz server start --config server.toml`."""

    server: ServerConfig = key(ServerConfig(), "The server.")
    transport: TransportConfig = key(TransportConfig(), "Transport for client and storage links.")
    coordination: CoordinationConfig = key(CoordinationConfig(), "Coordination backend.")
    http: HttpConfig = key(HttpConfig(), "HTTP endpoint.")
    security: SecurityConfig = key(SecurityConfig(), "Plaintext rules.")
    process: ProcessConfig = key(ProcessConfig(), "The process (its event loop).")


@attrs.frozen
class ClientConfig:
    """The client library."""

    auto_mount: bool = key(True, "Mount every partition; false lets the application choose with set_partitions().")
    max_concurrent_transactions: int = key(5, "In-flight appends per partition; submit() blocks/awaits above it, and waiting submits get freed slots first come, first served.",
                                           validator=AT_LEAST_ONE)
    long_wait_threshold: float = key(5.0, "Seconds after which a partition with pending appends is nudged with a flush.",
                                     validator=POSITIVE)
    mount_timeout: float = key(10.0, "Seconds to wait for a partition to mount before an append fails.", validator=POSITIVE)
    num_retry_workers: int = key(1, "Concurrent re-executions of failed transaction contexts.", validator=AT_LEAST_ONE)
    data_fetch_attempts: int = key(5, "Attempts to fetch a transaction's data when its checksum does not match.",
                                   validator=AT_LEAST_ONE)
    data_fetch_timeout: float = key(60.0, "Seconds a transaction data fetch keeps retrying RPC failures (backoff 10 ms to 5 s).",
                                    validator=POSITIVE)
    data_read_ahead: int = key(256, "Most transactions a sequential reader's data read-ahead fetches in one RPC "
                                    "(the window doubles from 4 up to this); 0 or 1: one transaction per RPC.",
                                validator=NON_NEGATIVE)
    rpc_timeout: float = key(10.0, "Seconds to wait for one RPC answer (transaction data, high-water mark).",
                             validator=POSITIVE)
    reconnect_delay: float = key(1.0, "Seconds before a stream connection that could not be opened is tried again.",
                                 validator=NON_NEGATIVE)
    num_consumer_threads: int = key(10, "WaltzClient (sync) threads running apply callbacks; partitions are sharded over them.",
                                    validator=AT_LEAST_ONE)


@attrs.frozen
class ClientProcessConfig:
    """Configuration handed to WaltzClient / AsyncWaltzClient."""

    client: ClientConfig = key(ClientConfig(), "The client.")
    transport: TransportConfig = key(TransportConfig(), "Transport for server links.")
    coordination: CoordinationConfig = key(CoordinationConfig(), "Coordination backend (server discovery).")


@attrs.frozen
class CliConfig:
    """The `waltz` command line (cluster and admin tools). A server's, storage node's or client's
    config file works as one too: the command line reads its transport and coordination and
    leaves the process's own tables alone."""

    transport: TransportConfig = key(TransportConfig(), "Transport for admin links.")
    coordination: CoordinationConfig = key(CoordinationConfig(), "Coordination backend.")


#: Process configs, by the name used in `waltz config schema`.
PROCESS_CONFIGS: dict[str, type[Any]] = {
    "server": ServerProcessConfig,
    "storage": StorageProcessConfig,
    "client": ClientProcessConfig,
    "cli": CliConfig,
}

#: The tables of the process configs that a command line config skips (see CliConfig).
_PROCESS_TABLES = frozenset(
    f.name for c in (ServerProcessConfig, StorageProcessConfig, ClientProcessConfig) for f in attrs.fields(c)
) - {f.name for f in attrs.fields(CliConfig)}

# ------------------------------------------------------------------------------------- loading


class ConfigKeyError(ConfigError):
    """A bad value or name at a dotted key path (``server.port``); :func:`load` prefixes where the
    value came from (the file, an environment variable, a command-line flag)."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.detail = message


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _convert(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if attrs.has(tp):
        if not isinstance(value, Mapping):
            raise ConfigKeyError(where, f"expected a table, got {value!r}")
        return build(tp, value, where)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value.lower() in ("1", "true", "yes", "on")
        raise ConfigKeyError(where, f"expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigKeyError(where, f"expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise ConfigKeyError(where, f"expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigKeyError(where, f"expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigKeyError(where, f"expected a string, got {value!r}")
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, str):  # environment: comma separated
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigKeyError(where, f"expected a list, got {value!r}")
        return [_convert(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin in (Mapping, dict) or tp in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise ConfigKeyError(where, f"expected a table, got {value!r}")
        return dict(value)
    if origin in (typing.Union, types.UnionType):
        errors: list[ConfigKeyError] = []
        for alt in typing.get_args(tp):
            if alt is type(None):
                if value is None:
                    return None
                continue
            try:
                return _convert(value, alt, where)
            except ConfigKeyError as exc:
                errors.append(exc)
        raise errors[0] if errors else ConfigKeyError(where, f"invalid value {value!r}")
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


def _suggest(name: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def build(cls: type[C], data: Mapping[str, Any], where: str = "") -> C:
    """Build config class ``cls`` from a mapping, validating every key.

    Sections with an ``options`` field (those of :data:`BACKEND_SECTIONS`) take unknown
    *sub-tables* as per-backend options: ``[transport.tcp]`` becomes ``options["tcp"]`` (checked
    against the registered backends by :func:`check_backends`). Errors are :class:`ConfigKeyError`.
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
            raise ConfigKeyError(path, REMOVED_KEYS[cls.__name__, k])
        else:
            known = sorted(n for n in names if n != "options")
            raise ConfigKeyError(path, f"unknown key{_suggest(k, known)} (known keys"
                                       f"{' of [' + where + ']' if where else ''}: {', '.join(known)})")
    if options:
        kwargs["options"] = {**kwargs.get("options", {}), **options}
    try:
        return cls(**kwargs)
    except InvalidValue as exc:
        raise ConfigKeyError(f"{where}.{exc.key}" if where else exc.key, exc.message) from None
    except (TypeError, ValueError) as exc:
        raise ConfigKeyError(where or cls.__name__, str(exc)) from exc


def _has_options(cls: type) -> bool:
    return attrs.has(cls) and "options" in {f.name for f in attrs.fields(cls)}


def _env_layer(cls: type, environ: Mapping[str, str]) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """``WALTZ_<SECTION>_<KEY>`` and, for sections with backends, ``WALTZ_<SECTION>_<BACKEND>__<KEY>``
    (e.g. ``WALTZ_COORDINATION_ZOOKEEPER__AUTH_SCHEME``): the values, and the variable per key path."""
    sections = _field_types(cls)
    data: dict[str, dict[str, Any]] = {}
    sources: dict[str, str] = {}
    for env_key, value in environ.items():
        if not env_key.startswith("WALTZ_"):
            continue
        rest = env_key[len("WALTZ_"):].lower()
        section, _, field = rest.partition("_")
        sub_cls = sections.get(section)
        if sub_cls is None or not field or not attrs.has(sub_cls):
            continue  # other WALTZ_* switches (plugins, tests) are not config keys of this process
        where = f"environment variable {env_key}"
        backend, sep, option = field.partition("__")
        if sep:
            if not _has_options(sub_cls) or not backend or not option:
                raise ConfigError(f"{where}: {section} has no backend option tables (WALTZ_<SECTION>_<BACKEND>__<KEY> "
                                  f"is for {', '.join(s for s, _ in BACKEND_SECTIONS.values())})"
                                  if not _has_options(sub_cls)
                                  else f"{where}: expected WALTZ_{section.upper()}_<BACKEND>__<KEY>")
            data.setdefault(section, {}).setdefault(backend, {})[option] = value
            sources[f"{section}.{backend}.{option}"] = where
            continue
        if (sub_cls.__name__, field) in REMOVED_KEYS:
            raise ConfigError(f"{where}: {REMOVED_KEYS[sub_cls.__name__, field]}")
        fields = [f.name for f in attrs.fields(sub_cls) if f.name != "options"]
        if field not in fields:
            known = ", ".join(f"WALTZ_{section.upper()}_{f.upper()}" for f in fields)
            raise ConfigError(f"{where}: unknown key {section}.{field}{_suggest(field, fields)} (known: {known})")
        data.setdefault(section, {})[field] = value
        sources[f"{section}.{field}"] = where
    return data, sources


def _merge(data: dict[str, Any], layer: Mapping[str, Mapping[str, Any]], label: str) -> None:
    for section, values in layer.items():
        existing = data.get(section, {})
        if not isinstance(existing, Mapping):  # e.g. `server = 5`: report it, do not crash in dict()
            raise ConfigError(f"{label}: {section}: expected a table, got {existing!r}")
        merged = dict(existing)
        for k, v in values.items():
            if isinstance(v, Mapping) and isinstance(merged.get(k), Mapping):
                merged[k] = {**merged[k], **v}  # a backend table: per key
            else:
                merged[k] = v
        data[section] = merged


def _paths(data: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    for k, v in data.items():
        path = f"{prefix}{k}"
        if isinstance(v, Mapping):
            yield from _paths(v, path + ".")
        else:
            yield path


@attrs.frozen
class Loaded(Generic[C]):
    """A loaded configuration and where each key that is not a default came from."""

    config: C
    #: dotted key -> the file path, ``environment variable WALTZ_...`` or a command-line flag
    sources: Mapping[str, str]


def load_with_sources(cls: type[C], path: str | os.PathLike[str] | None = None, *,
                      environ: Mapping[str, str] | None = None,
                      overrides: Mapping[str, Mapping[str, Any]] | None = None,
                      override_sources: Mapping[str, str] | None = None,
                      registries: Registries | None = None) -> Loaded[C]:
    """:func:`load`, keeping the source of every key that is set (for ``waltz config show``)."""
    data: dict[str, Any] = {}
    label = "configuration"
    sources: dict[str, str] = {}
    if path is not None:
        label = str(path)
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"{label}: no such config file") from None
        except IsADirectoryError:
            raise ConfigError(f"{label}: is a directory, not a config file") from None
        except PermissionError:
            raise ConfigError(f"{label}: cannot be read (permission denied)") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{label}: not valid TOML: {exc}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{label}: not valid TOML: not UTF-8 text") from None
        if cls is CliConfig:  # a node's or a client's file: its transport and coordination are the CLI's
            data = {k: v for k, v in data.items() if k not in _PROCESS_TABLES}
        sources.update(dict.fromkeys(_paths(data), label))
    env, env_sources = _env_layer(cls, os.environ if environ is None else environ)
    _merge(data, env, label)
    sources.update(env_sources)
    if overrides:
        _merge(data, overrides, label)
        for p in _paths(overrides):
            sources[p] = (override_sources or {}).get(p, "command line")
    try:
        config = build(cls, data)
        if registries is not None:
            check_backends(config, registries)
    except ConfigKeyError as exc:
        origin = sources.get(exc.path) or next(
            (src for key, src in sources.items() if exc.path.startswith(key + ".") or key.startswith(exc.path + ".")),
            label)
        raise ConfigError(f"{origin}: {exc}") from None
    return Loaded(config, sources)


def load(cls: type[C], path: str | os.PathLike[str] | None = None, *, environ: Mapping[str, str] | None = None,
         overrides: Mapping[str, Mapping[str, Any]] | None = None,
         override_sources: Mapping[str, str] | None = None, registries: Registries | None = None) -> C:
    """Load a process config: TOML file (optional), then ``WALTZ_*`` variables, then ``overrides``
    (command-line flags: ``override_sources`` names them, ``{"server.port": "--port"}``).

    With ``registries`` (a process passes its runtime's: ``runtime.registries``) backend names
    and option tables are checked against the registered backends too (:func:`check_backends`);
    without, only the keys and values are (a backend is then checked when it is built from the
    registries). Errors name where the value came from and the key: ``server.toml: server.port:
    expected an integer, got 'x'``, ``environment variable WALTZ_SERVER_PORT: server.port: must be
    a port number ...``.
    """
    return load_with_sources(cls, path, environ=environ, overrides=overrides, override_sources=override_sources,
                             registries=registries).config


#: Backend kind (registry) -> (section, key of that section naming the backend). The options of
#: backend ``N`` are the section's table ``[<section>.N]``, read by :func:`backend_options`.
BACKEND_SECTIONS: dict[str, tuple[str, str]] = {
    "transport": ("transport", "name"),
    "coordination": ("coordination", "name"),
    "storage_layout": ("storage", "layout"),
    "lock_table": ("server", "lock_table"),
}
_KIND_OF_SECTION = {section: kind for kind, (section, _key) in BACKEND_SECTIONS.items()}


def _unknown_backend(kind: str, name: str, registry: Registry[Any]) -> str:
    from .registry import KNOWN_PROVIDERS

    names = registry.names()
    text = f"no {kind.replace('_', ' ')} backend named {name!r}{_suggest(name, names)}"
    hint = KNOWN_PROVIDERS.get((kind, name))
    if hint:
        return f"{text}; it is provided by {hint}"
    return f"{text} (registered: {', '.join(names) or 'none'}; `waltz plugins` lists them)"


def check_backends(config: Any, registries: Registries) -> None:
    """Every backend a process config names is registered, every backend option table names a
    registered backend, and the chosen backend's options validate: ConfigKeyError otherwise.

    An option table for a backend other than the chosen one is allowed (a file may carry both
    ``[transport.tcp]`` and ``[transport.zmq]``); one that names no backend at all (a typo such as
    ``[coordination.zookeepr]``) would be ignored silently, so it is refused.
    """
    for field in attrs.fields(type(config)):
        section = getattr(config, field.name)
        kind = _KIND_OF_SECTION.get(field.name)
        if kind is None or not attrs.has(type(section)):
            continue
        key = BACKEND_SECTIONS[kind][1]
        registry = registries.of(kind)
        name = getattr(section, key)
        if name not in registry:
            raise ConfigKeyError(f"{field.name}.{key}", _unknown_backend(kind, name, registry))
        for table, values in section.options.items():
            where = f"{field.name}.{table}"
            if table not in registry:
                raise ConfigKeyError(where, f"[{where}] is not an options table of any {kind.replace('_', ' ')} "
                                            "backend: " + _unknown_backend(kind, table, registry))
            info = registry.get(table)
            if info.config_cls is None:
                if values:
                    raise ConfigKeyError(where, f"the {table} {kind.replace('_', ' ')} takes no options")
            else:
                build(info.config_cls, values, where)


def effective_values(loaded: Loaded[Any], registries: Registries) -> list[tuple[str, Any, str]]:
    """(dotted key, value, source) for every key of a loaded config - the chosen backends' options
    included - with ``default`` as the source of keys nobody set (``waltz config show``)."""
    rows: list[tuple[str, Any, str]] = []

    def walk(obj: Any, prefix: str) -> None:
        for f in attrs.fields(type(obj)):
            value = getattr(obj, f.name)
            path = f"{prefix}{f.name}"
            if f.name == "options" and _has_options(type(obj)):
                continue  # the chosen backend's options are shown resolved, below
            if attrs.has(type(value)):
                walk(value, path + ".")
                continue
            rows.append((path, value, loaded.sources.get(path, "default")))

    walk(loaded.config, "")
    for f in attrs.fields(type(loaded.config)):
        section = getattr(loaded.config, f.name)
        kind = _KIND_OF_SECTION.get(f.name)
        if kind is None or not attrs.has(type(section)):
            continue
        name = getattr(section, BACKEND_SECTIONS[kind][1])
        info = registries.of(kind).get(name)
        options = backend_options(info.config_cls, section, kind)
        if options is not None:
            walk(options, f"{f.name}.{name}.")
        for table, values in sorted(section.options.items()):
            if table != name:  # another backend's table: kept, unused while this one is chosen
                for k, v in sorted(values.items()):
                    path = f"{f.name}.{table}.{k}"
                    rows.append((path, v, loaded.sources.get(path, "?") + " (not used)"))
    return rows


def backend_options(config_cls: type[C] | None, section: Any, kind: str) -> C | None:
    """The options of the backend ``section`` names: its ``[<section>.<name>]`` table built with
    the backend's ``config_cls`` (every key validated, defaults for the rest), or None for a
    backend without options. The one way any backend's options are read.

    :param section: the configuration section naming the backend (``TransportConfig``, ...)
    :param kind: the backend kind, a key of :data:`BACKEND_SECTIONS` (``"transport"``, ``"lock_table"``)
    :raises ConfigError: a bad key or value, or a table for a backend that takes no options
    """
    where, key = BACKEND_SECTIONS[kind]
    name = getattr(section, key)
    table = section.options.get(name, {})
    if config_cls is None:
        if table:
            raise ConfigError(f"{where}.{name}: this backend takes no options")
        return None
    return build(config_cls, table, f"{where}.{name}")


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
    for f in attrs.fields(cls):
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
