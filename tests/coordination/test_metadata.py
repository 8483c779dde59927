"""Metadata values: JSON encoding, partition ranges."""

from __future__ import annotations

import json
import uuid

import pytest

from waltz_core.coordination.metadata import (
    UNRESOLVED,
    ClusterParams,
    PartitionAssignment,
    PartitionInfo,
    PartitionMetadata,
    ReplicaState,
    ServerDescriptor,
    StoreParams,
    decode,
    encode,
    format_partition_ranges,
    parse_partition_ranges,
)
from waltz_core.errors import CoordinationError


@pytest.mark.parametrize("value", [
    ClusterParams("prod", 8),
    ServerDescriptor(address="h:1", preferred_partitions=[3, 1], server_id=4),
    ServerDescriptor(address="unix:/run/waltz/server.sock", server_id=2),
    PartitionAssignment(3, [PartitionInfo(1, 2, 7, "h:1"), PartitionInfo(0, 0, None, None)]),
    StoreParams(uuid.uuid4(), 8),
    PartitionMetadata(5, 9, {"h:1": ReplicaState(9), "h:2": ReplicaState(8, 1234)}),
    PartitionMetadata(5, 9, {"h:1": ReplicaState(9)}, replica_set=["h:2", "h:1", "h:3"]),
    PartitionMetadata.EMPTY,
])
def test_values_round_trip_through_readable_json(value: object) -> None:
    raw = encode(value.to_json())  # type: ignore[attr-defined]
    assert isinstance(json.loads(raw.decode("utf-8")), dict)  # what zkCli/etcdctl users see
    assert decode("/k", raw, type(value).from_json) == value  # type: ignore[attr-defined]


def test_unresolved_is_the_original_sentinel_and_survives_json() -> None:
    assert UNRESOLVED == -9223372036854775808
    raw = encode(PartitionMetadata(1, 2, {"h:1": ReplicaState(2)}).to_json())
    assert b"-9223372036854775808" in raw
    assert decode("/k", raw, PartitionMetadata.from_json).replicas["h:1"].closing_high_water_mark == UNRESOLVED


def test_assignment_is_sorted_by_partition() -> None:
    assignment = PartitionAssignment(3, [PartitionInfo(2, 0, 1, "h:1"), PartitionInfo(0, 0, 1, "h:1")])
    decoded = decode("/k", encode(assignment.to_json()), PartitionAssignment.from_json)
    assert [p.partition_id for p in decoded.partitions] == [0, 2]
    assert decoded.for_server(1) == {0: 0, 2: 0}


@pytest.mark.parametrize("raw", [b"\xff", b"not json", b"{}", b'{"name": "x"}', b"[1]"])
def test_bad_values_raise_coordination_error_naming_the_key(raw: bytes) -> None:
    with pytest.raises(CoordinationError, match="/waltz does not hold valid Waltz metadata"):
        decode("/waltz", raw, ClusterParams.from_json)


@pytest.mark.parametrize(("text", "ids"), [
    ("0-6,9", [0, 1, 2, 3, 4, 5, 6, 9]), ("3", [3]), (" 1 , 1-2 ", [1, 2]), ("0-2,7,10-11", [0, 1, 2, 7, 10, 11]),
])
def test_partition_ranges(text: str, ids: list[int]) -> None:
    assert parse_partition_ranges(text) == ids
    assert parse_partition_ranges(format_partition_ranges(ids)) == ids


@pytest.mark.parametrize("text", ["", "a", "5-2", "-1", "1-", "1,,x"])
def test_bad_partition_ranges(text: str) -> None:
    with pytest.raises(ValueError, match="0-6,9"):
        parse_partition_ranges(text)


def test_format_partition_ranges() -> None:
    assert format_partition_ranges([5, 0, 1, 2, 9, 10]) == "0-2,5,9-10"
    assert format_partition_ranges([]) == ""


def test_server_descriptors_of_the_previous_release_still_read() -> None:
    """0.1 wrote host and port only; the address is opaque now and written next to them."""
    old = b'{"server_id": 3, "host": "10.1.2.3", "port": 55180, "preferred_partitions": [1]}'
    assert decode("/k", old, ServerDescriptor.from_json) == ServerDescriptor("10.1.2.3:55180", (1,), 3)
    assert ServerDescriptor("10.1.2.3:55180", (), 3).to_json()["host"] == "10.1.2.3"
    assert "host" not in ServerDescriptor("unix:/run/waltz/server.sock").to_json()


def test_partition_metadata_of_an_earlier_release_reads_without_a_replica_set() -> None:
    raw = b'{"generation": 3, "replicas": {}, "session_id": 12}'
    meta = decode("/k", raw, PartitionMetadata.from_json)
    assert meta.replica_set is None and "replica_set" not in meta.to_json()
    assert PartitionMetadata(1, 2, {}, replica_set=["b:1", "a:1"]).to_json()["replica_set"] == ["a:1", "b:1"]
