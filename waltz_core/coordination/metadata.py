"""Cluster metadata kept in coordination, and its encoding: UTF-8 JSON, one object per key.

The layout under the cluster root follows the original Waltz (docs/coordination.md has it with
examples)::

    <root>                               ClusterParams       {"name", "num_partitions"}
    <root>/serverDescriptors             PartitionAssignment {"num_partitions", "partitions": [...]}
    <root>/serverDescriptors/s_<seq>     ServerDescriptor    {"server_id", "host", "port", "preferred_partitions"}
    <root>/ids/client, <root>/ids/server counters (ASCII decimal)
    <root>/store                         StoreParams         {"cluster_key", "num_partitions"}
    <root>/store/partition/<id>          PartitionMetadata   {"generation", "session_id", "replicas": {...}}
    <root>/store/assignment              ReplicaAssignments  {"host:port": [partition ids]}
    <root>/store/group                   groups              {"host:port": group id}
    <root>/store/connection              connections         {"host:port": admin port}

JSON (not the original's Java DataOutput) keeps every value readable with ``zkCli get`` and
``etcdctl get``. Decoding is strict: a value that is not what the key should hold raises
:class:`~waltz_core.errors.CoordinationError` naming the key, never a bare ``KeyError``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, TypeVar

import attrs

from ..errors import CoordinationError

T = TypeVar("T")

#: Closing high-water mark of a replica whose store session has not been resolved yet
#: (``ReplicaState.UNRESOLVED`` of the original: ``Long.MIN_VALUE``).
UNRESOLVED: int = -(2**63)


def _int_tuple(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


@attrs.frozen(slots=True)
class ClusterParams:
    """``<root>``: the cluster's name and partition count."""

    name: str
    num_partitions: int

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "num_partitions": self.num_partitions}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ClusterParams:
        return cls(name=str(data["name"]), num_partitions=int(data["num_partitions"]))


@attrs.frozen(slots=True)
class ServerDescriptor:
    """A live Waltz server, registered as ``<root>/serverDescriptors/s_<seq>`` (ephemeral).

    ``server_id`` is ``-1`` until :class:`~waltz_core.coordination.recipes.ClusterManager`
    allocates one at registration. ``address`` is the server's listener address, opaque to the
    core (``host:port`` for tcp and zmq, ``unix:/path`` for a plugin's transport).
    """

    address: str
    preferred_partitions: tuple[int, ...] = attrs.field(default=(), converter=_int_tuple)
    server_id: int = -1

    @property
    def endpoint(self) -> str:
        return self.address

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"server_id": self.server_id, "address": self.address,
                                "preferred_partitions": list(self.preferred_partitions)}
        host, sep, port = self.address.rpartition(":")
        if sep and host and port.isdigit():
            data.update(host=host, port=int(port))  # what readers of 0.1 (host and port only) need
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ServerDescriptor:
        address = str(data["address"]) if "address" in data else f"{data['host']}:{int(data['port'])}"
        return cls(address=address, preferred_partitions=data.get("preferred_partitions", ()),
                   server_id=int(data["server_id"]))


@attrs.frozen(slots=True)
class PartitionInfo:
    """One partition in the assignment: its generation and owner (``None``: no live server owns it)."""

    partition_id: int
    generation: int
    server_id: int | None = None
    endpoint: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"partition_id": self.partition_id, "generation": self.generation,
                "server_id": self.server_id, "endpoint": self.endpoint}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PartitionInfo:
        server_id = data.get("server_id")
        endpoint = data.get("endpoint")
        return cls(partition_id=int(data["partition_id"]), generation=int(data["generation"]),
                   server_id=None if server_id is None else int(server_id),
                   endpoint=None if endpoint is None else str(endpoint))


def _pid(info: PartitionInfo) -> int:
    return info.partition_id


def _by_partition_id(infos: Iterable[PartitionInfo]) -> tuple[PartitionInfo, ...]:
    return tuple(sorted(infos, key=_pid))


@attrs.frozen(slots=True)
class PartitionAssignment:
    """``<root>/serverDescriptors``: which server owns each partition, with generations.

    ``partitions`` is sorted by partition id and holds every partition that was ever owned;
    a partition never assigned yet is absent (its first generation will be 0).
    """

    num_partitions: int
    partitions: tuple[PartitionInfo, ...] = attrs.field(default=(), converter=_by_partition_id)

    def by_partition(self) -> dict[int, PartitionInfo]:
        return {p.partition_id: p for p in self.partitions}

    def for_server(self, server_id: int) -> dict[int, int]:
        """``{partition id: generation}`` of the partitions ``server_id`` owns."""
        return {p.partition_id: p.generation for p in self.partitions if p.server_id == server_id}

    def to_json(self) -> dict[str, Any]:
        return {"num_partitions": self.num_partitions, "partitions": [p.to_json() for p in self.partitions]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PartitionAssignment:
        return cls(num_partitions=int(data["num_partitions"]),
                   partitions=[PartitionInfo.from_json(p) for p in data.get("partitions", ())])


@attrs.frozen(slots=True)
class StoreParams:
    """``<root>/store``: the cluster key every storage node checks, and the partition count."""

    cluster_key: uuid.UUID
    num_partitions: int

    def to_json(self) -> dict[str, Any]:
        return {"cluster_key": str(self.cluster_key), "num_partitions": self.num_partitions}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StoreParams:
        return cls(cluster_key=uuid.UUID(str(data["cluster_key"])), num_partitions=int(data["num_partitions"]))


@attrs.frozen(slots=True)
class ReplicaState:
    """The state of one replica (a partition on one storage node) in a partition's metadata."""

    session_id: int
    closing_high_water_mark: int = UNRESOLVED

    def to_json(self) -> dict[str, Any]:
        return {"session_id": self.session_id, "closing_high_water_mark": self.closing_high_water_mark}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ReplicaState:
        return cls(session_id=int(data["session_id"]), closing_high_water_mark=int(data["closing_high_water_mark"]))


def _replica_map(value: Mapping[str, ReplicaState]) -> dict[str, ReplicaState]:
    return dict(value)


def _optional_endpoints(value: Iterable[str] | None) -> tuple[str, ...] | None:
    return None if value is None else tuple(sorted(value))


@attrs.frozen(slots=True)
class PartitionMetadata:
    """``<root>/store/partition/<id>``: generation, store session id and replica states (keyed by ``host:port``).

    Updated only by compare-and-set (:meth:`StoreMetadata.cas_partition_metadata`). ``EMPTY`` is
    the value written at cluster creation (no store session yet).
    """

    EMPTY: ClassVar[PartitionMetadata]

    generation: int
    session_id: int
    replicas: Mapping[str, ReplicaState] = attrs.field(factory=dict, converter=_replica_map, hash=False)
    #: the replicas of the last store session that finished its recovery, so could commit: its
    #: commits are on a majority of them (None: written before this was recorded)
    replica_set: tuple[str, ...] | None = attrs.field(default=None, converter=_optional_endpoints)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"generation": self.generation, "session_id": self.session_id,
                               "replicas": {k: v.to_json() for k, v in sorted(self.replicas.items())}}
        if self.replica_set is not None:
            out["replica_set"] = list(self.replica_set)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PartitionMetadata:
        replica_set = data.get("replica_set")
        return cls(generation=int(data["generation"]), session_id=int(data["session_id"]),
                   replicas={str(k): ReplicaState.from_json(v) for k, v in data.get("replicas", {}).items()},
                   replica_set=None if replica_set is None else [str(ep) for ep in replica_set])


PartitionMetadata.EMPTY = PartitionMetadata(generation=-1, session_id=-1, replicas={})


def states_kept(meta: PartitionMetadata, assigned: Iterable[str]) -> dict[str, ReplicaState]:
    """The replica states a new store session keeps: those of the replicas assigned now and of
    the previous session's replicas (``meta.replica_set``), which the recovery's vote still counts.

    Every other state belongs to a replica that was taken out and left behind by a session that
    finished its recovery without it. That recovery resolved its closing high-water mark (step 6
    of the Waltz design, for every replica it knew), so dropping the state loses nothing: should
    the replica be assigned again, recovery finds it inconsistent and truncates it to the
    low-water mark its storage saved, a committed prefix. Dropping them keeps the metadata from
    growing with every node a partition has ever been on. A state kept must not be dropped: a
    replica taken out and assigned again before any session finished without it is a voter, and
    its own state is what lets it vote with what it holds.
    """
    keep = set(assigned) | set(meta.replica_set or ())
    return {endpoint: state for endpoint, state in meta.replicas.items() if endpoint in keep}


# ------------------------------------------------------------------------------------ encoding


def encode(data: Any) -> bytes:
    """UTF-8 JSON with sorted keys, compact but readable in zkCli/etcdctl."""
    return json.dumps(data, sort_keys=True, separators=(",", ": ")).encode("utf-8")


def decode(key: str, raw: bytes, parse: Callable[[Any], T]) -> T:
    """Decode the JSON value of ``key`` with ``parse``; a clear CoordinationError when it does not fit."""
    try:
        return parse(json.loads(raw.decode("utf-8")))
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CoordinationError(f"{key} does not hold valid Waltz metadata ({exc!r}): {raw[:80]!r}") from None


def parse_str_int_map(data: Any) -> dict[str, int]:
    return {str(k): int(v) for k, v in data.items()}


def parse_admin_map(data: Any) -> dict[str, int | str]:
    """``connections``: storage node -> its admin port on the node's host (an int, the original's
    format) or its whole admin address (a string, for addresses that are not ``host:port``)."""
    return {str(k): v if isinstance(v, str) else int(v) for k, v in data.items()}


def admin_address(storage: str, admin: int | str) -> str:
    """The address of ``storage``'s admin endpoint from its ``connections`` entry."""
    if isinstance(admin, str):
        return admin
    return f"{storage.rpartition(':')[0]}:{admin}"


def parse_replica_assignments(data: Any) -> dict[str, list[int]]:
    return {str(k): sorted(int(p) for p in v) for k, v in data.items()}


def parse_partition_ranges(text: str) -> list[int]:
    """Parse partition ids like ``"0-6,9,12-13"`` into a sorted list without duplicates.

    Raises ValueError with the offending part for anything else (negative ids, ``"5-2"``, ``"a"``).
    """
    ids: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        low_text, sep, high_text = part.partition("-")
        try:
            low = int(low_text)
            high = int(high_text) if sep else low
        except ValueError:
            raise ValueError(f"invalid partition range {part!r} (expected ids like 0-6,9)") from None
        if low < 0 or high < low:
            raise ValueError(f"invalid partition range {part!r} (expected ids like 0-6,9)")
        ids.update(range(low, high + 1))
    if not ids:
        raise ValueError(f"no partition ids in {text!r} (expected ids like 0-6,9)")
    return sorted(ids)


def format_partition_ranges(ids: Iterable[int]) -> str:
    """The inverse of :func:`parse_partition_ranges`: ``[0,1,2,5]`` -> ``"0-2,5"``."""
    out: list[str] = []
    run: list[int] = []
    for pid in sorted(set(ids)):
        if run and pid == run[-1] + 1:
            run.append(pid)
            continue
        if run:
            out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [pid]
    if run:
        out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ",".join(out)
