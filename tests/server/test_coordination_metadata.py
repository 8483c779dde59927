"""The store's partition metadata over a real coordination backend (the built-in ``local``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from waltz_core.config import CoordinationConfig
from waltz_core.coordination import open_coordination, recipes
from waltz_core.coordination.metadata import UNRESOLVED, ReplicaState
from waltz_core.errors import GenerationMismatchError, MetadataEditError
from waltz_core.runtime import Runtime
from waltz_core.server.glue import CoordinationMetadata

pytestmark = pytest.mark.timeout(30)

ROOT = "/waltz/test"
NODES = ["127.0.0.1:7001", "127.0.0.1:7002", "127.0.0.1:7003", "127.0.0.1:7004"]


@pytest.fixture
async def store_metadata(tmp_path: Path) -> AsyncIterator[recipes.StoreMetadata]:
    config = CoordinationConfig(name="local", connect=str(tmp_path / "coord"), session_timeout=1.5)
    backend = open_coordination(config, Runtime.load().registries)
    await backend.start()
    try:
        await recipes.create_cluster(backend, ROOT, "test", 2)
        sm = recipes.StoreMetadata(backend, ROOT)
        for port, node in enumerate(NODES, start=8001):
            await sm.add_storage_node(node, port, 0)
        for node in NODES[:3]:
            await sm.assign_partitions(node, [0, 1])
        yield sm
    finally:
        await backend.close()


async def test_a_moved_replicas_state_stays_while_it_votes_and_goes_a_session_later(
        store_metadata: recipes.StoreMetadata) -> None:
    meta = CoordinationMetadata(store_metadata)
    start = await meta.begin_session(0, generation=1)
    assert (start.session_id, start.states, start.assigned, start.previous_replicas) == (0, {}, NODES[:3], None)
    engaged = {node: ReplicaState(0, UNRESOLVED) for node in NODES[:3]}
    await meta.write_states(0, 1, 0, engaged, replica_set=NODES[:3])  # session 0 finished its recovery
    # The replica on the third node moves to the fourth.
    await store_metadata.assign_partitions(NODES[3], [0])
    await store_metadata.unassign_partitions(NODES[2], [0])
    start = await meta.begin_session(0, generation=1)
    assert start.assigned == [NODES[0], NODES[1], NODES[3]]
    # The next recovery votes among session 0's replicas: its commits are on a majority of them,
    # and the one taken out keeps its state (it may be assigned again before that recovery ends).
    assert start.previous_replicas == NODES[:3]
    assert start.states == engaged
    stored, _ = await store_metadata.get_partition_metadata(0)
    assert stored.session_id == start.session_id == 1 and stored.replica_set == tuple(NODES[:3])
    # Session 1 finishes its recovery at 41: the moved replica's closing mark is resolved.
    states = {NODES[0]: ReplicaState(1, UNRESOLVED), NODES[1]: ReplicaState(1, UNRESOLVED),
              NODES[3]: ReplicaState(1, UNRESOLVED), NODES[2]: ReplicaState(0, 41)}
    await meta.write_states(0, 1, 1, states, replica_set=start.assigned)
    stored, _ = await store_metadata.get_partition_metadata(0)
    assert stored.replica_set == (NODES[0], NODES[1], NODES[3])
    await meta.write_states(0, 1, 1, {NODES[3]: ReplicaState(1, UNRESOLVED)})  # a join: the set stays
    stored, _ = await store_metadata.get_partition_metadata(0)
    assert stored.replica_set == (NODES[0], NODES[1], NODES[3])
    # Session 2: the moved replica is neither assigned nor a voter any more; its state goes.
    start = await meta.begin_session(0, generation=1)
    assert NODES[2] not in start.states and start.previous_replicas == [NODES[0], NODES[1], NODES[3]]
    stored, _ = await store_metadata.get_partition_metadata(0)
    assert NODES[2] not in stored.replicas  # the metadata does not grow with every node ever used
    # Partition 1 was not touched.
    other, _ = await store_metadata.get_partition_metadata(1)
    assert other == recipes.PartitionMetadata.EMPTY


async def test_a_stale_generation_takes_no_session(store_metadata: recipes.StoreMetadata) -> None:
    meta = CoordinationMetadata(store_metadata)
    await meta.begin_session(0, generation=5)
    with pytest.raises(GenerationMismatchError):
        await meta.begin_session(0, generation=4)
    stored, _ = await store_metadata.get_partition_metadata(0)
    assert (stored.generation, stored.session_id) == (5, 0)


async def test_unassigning_refuses_to_leave_the_next_recovery_too_few_voters(
        store_metadata: recipes.StoreMetadata) -> None:
    """Two moves in a row, before a session with the new replicas finished its recovery: a
    majority of replicas stays assigned, but only one of the three the next recovery votes among."""
    meta = CoordinationMetadata(store_metadata)
    await meta.begin_session(0, generation=1)
    engaged = {node: ReplicaState(0, UNRESOLVED) for node in NODES[:3]}
    await meta.write_states(0, 1, 0, engaged, replica_set=NODES[:3])
    await store_metadata.assign_partitions(NODES[3], [0])
    await store_metadata.unassign_partitions(NODES[2], [0], keep_majority=True)  # the first move: 2 of 3 voters stay
    assignment = await store_metadata.get_replica_assignments()
    assert sorted(ep for ep, pids in assignment.items() if 0 in pids) == [NODES[0], NODES[1], NODES[3]]
    with pytest.raises(MetadataEditError) as refused:
        await store_metadata.unassign_partitions(NODES[1], [0], keep_majority=True)
    message = str(refused.value)
    assert f"votes among the replicas of its last recovered session ({', '.join(NODES[:3])}) and needs 2" in message
    assert f"only 1 would stay assigned ({NODES[0]})" in message and "--force" in message
    assert await store_metadata.get_replica_assignments() == assignment  # nothing changed
    # Partition 1 was not moved: its voters are not in the way. A replica that is no voter (the
    # new one) goes without a question, and --force declares the voters lost for good.
    await store_metadata.unassign_partitions(NODES[3], [0], keep_majority=True)
    await store_metadata.assign_partitions(NODES[3], [0])
    await store_metadata.unassign_partitions(NODES[1], [0], lost=True)
    stored, _ = await store_metadata.get_partition_metadata(0)
    assert stored.replica_set == (NODES[0], NODES[2])
    # Once a session with the new replicas finished its recovery, they vote, and a move goes on.
    await store_metadata.assign_partitions(NODES[1], [0])
    await meta.write_states(0, 1, 0, {}, replica_set=[NODES[0], NODES[1], NODES[3]])
    await store_metadata.unassign_partitions(NODES[0], [0], keep_majority=True)
    assignment = await store_metadata.get_replica_assignments()
    assert sorted(ep for ep, pids in assignment.items() if 0 in pids) == [NODES[1], NODES[3]]
