"""The pure partition assignment policy: properties (hypothesis) and the original's rules by example."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from waltz_core.coordination.assignment import compute_assignment
from waltz_core.coordination.metadata import PartitionAssignment, ServerDescriptor


def server(server_id: int, preferred: tuple[int, ...] = ()) -> ServerDescriptor:
    return ServerDescriptor(address=f"127.0.0.1:{5000 + server_id}", preferred_partitions=preferred, server_id=server_id)


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[int, list[list[ServerDescriptor]]]:
    """A partition count and a sequence of live-server sets (membership changes over time)."""
    num_partitions = draw(st.integers(1, 24))
    pool = [server(i, tuple(draw(st.lists(st.integers(0, num_partitions + 2), max_size=4)))) for i in range(1, 8)]
    steps = draw(st.lists(st.lists(st.sampled_from(pool), max_size=6), min_size=1, max_size=6))
    return num_partitions, steps


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_assignment_properties_over_membership_changes(scenario: tuple[int, list[list[ServerDescriptor]]]) -> None:
    num_partitions, steps = scenario
    current: PartitionAssignment | None = None
    for servers in steps:
        new = compute_assignment(num_partitions, servers, current)
        live = {s.server_id: s for s in servers}
        previous = current.by_partition() if current else {}
        owners = {p.partition_id: p.server_id for p in new.partitions}
        if live:
            # every partition on exactly one live server
            assert sorted(owners) == list(range(num_partitions))
            assert all(owner in live for owner in owners.values())
            # balanced within one
            loads = Counter(owners.values())
            counts = [loads.get(sid, 0) for sid in live]
            assert max(counts) - min(counts) <= 1
            # endpoints come from the owner's descriptor
            assert all(p.endpoint == live[p.server_id].endpoint for p in new.partitions)
        else:
            assert all(p.server_id is None for p in new.partitions)
            assert set(owners) == {pid for pid in previous if pid < num_partitions}
        # generations bump exactly when a (new) live owner takes a partition; first ownership starts at 0
        for p in new.partitions:
            before = previous.get(p.partition_id)
            if before is None:
                assert p.generation == 0
            elif before.server_id == p.server_id or p.server_id is None:
                assert p.generation == before.generation
            else:
                assert p.generation == before.generation + 1
        # the policy is stable: the same membership again moves nothing
        assert compute_assignment(num_partitions, servers, new) == new
        current = new


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 30), st.integers(1, 6), st.data())
def test_preferred_partitions_honoured_when_they_fit(num_partitions: int, num_servers: int, data: st.DataObject) -> None:
    quota = num_partitions // num_servers
    free = list(range(num_partitions))
    servers = []
    for sid in range(1, num_servers + 1):
        wanted = data.draw(st.lists(st.sampled_from(free), max_size=quota, unique=True)) if free and quota else []
        free = [p for p in free if p not in wanted]
        servers.append(server(sid, tuple(wanted)))
    current = data.draw(st.none() | st.just(compute_assignment(num_partitions, [server(99)], None)))
    new = compute_assignment(num_partitions, servers, current)
    owners = {p.partition_id: p.server_id for p in new.partitions}
    for s in servers:
        assert all(owners[p] == s.server_id for p in s.preferred_partitions)


def test_one_server_then_two_then_one_keeps_placement() -> None:
    one = compute_assignment(4, [server(1)], PartitionAssignment(4))
    assert one.for_server(1) == {0: 0, 1: 0, 2: 0, 3: 0}
    two = compute_assignment(4, [server(1), server(2)], one)
    assert two.for_server(1) == {0: 0, 1: 0}  # kept, generation unchanged
    assert two.for_server(2) == {2: 1, 3: 1}  # moved, generation bumped
    back = compute_assignment(4, [server(1)], two)
    assert back.for_server(1) == {0: 0, 1: 0, 2: 2, 3: 2}


def test_no_servers_keeps_generations_and_next_owner_bumps_them() -> None:
    owned = compute_assignment(3, [server(1)], None)
    orphaned = compute_assignment(3, [], owned)
    assert [(p.partition_id, p.server_id, p.generation) for p in orphaned.partitions] == [(0, None, 0), (1, None, 0), (2, None, 0)]
    again = compute_assignment(3, [server(2)], orphaned)
    assert again.for_server(2) == {0: 1, 1: 1, 2: 1}


def test_preferred_conflict_smallest_server_id_wins_and_ignores_bad_ids() -> None:
    new = compute_assignment(4, [server(2, (1, 7, -1)), server(1, (1, 3))], None)
    assert new.for_server(1) == {1: 0, 3: 0}
    assert new.for_server(2) == {0: 0, 2: 0}


def test_extra_partition_goes_to_the_server_holding_more() -> None:
    current = compute_assignment(5, [server(1), server(2)], None)
    assert len(current.for_server(1)) == 3
    # server 2 now holds... nothing changes when the same servers come back in another order
    assert compute_assignment(5, [server(2), server(1)], current) == current


def test_more_partitions_later_start_at_generation_zero() -> None:
    small = compute_assignment(2, [server(1), server(2)], None)
    grown = compute_assignment(4, [server(1), server(2)], small)
    by_id = grown.by_partition()
    assert by_id[0].server_id == small.by_partition()[0].server_id and by_id[0].generation == 0
    assert by_id[2].generation == 0 and by_id[3].generation == 0
    assert grown.num_partitions == 4
