"""The closing high-water-mark vote, with the Waltz design's examples (Waltz design, "Quorum Checking in the Recovery Process")."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from waltz_core.server.vote import evaluate, quorum_of

H_C, H_A, H_B = 10, 20, 30  # the Waltz design's figure: HB > HA > HC


def test_quorum_is_a_majority() -> None:
    assert [quorum_of(n) for n in (1, 2, 3, 4, 5)] == [1, 2, 2, 3, 3]
    with pytest.raises(ValueError):
        quorum_of(0)


def test_healthy_all_replicas_vote_picks_highest_majority_mark() -> None:
    result = evaluate({"A": H_A, "B": H_B, "C": H_C}, num_replicas=3)
    assert result.decided and result.high_water_mark == H_A


def test_replica_b_offline_is_undecidable() -> None:
    result = evaluate({"A": H_A, "C": H_C}, num_replicas=3)
    assert not result.decided
    assert result.blocking_candidate == H_A
    assert "undecidable" in result.reason


def test_becomes_decidable_when_c_catches_up_with_a() -> None:
    result = evaluate({"A": H_A, "C": H_A}, num_replicas=3)
    assert result.decided and result.high_water_mark == H_A


def test_becomes_decidable_when_b_returns() -> None:
    assert evaluate({"A": H_A, "B": H_B, "C": H_C}, 3).high_water_mark == H_A


def test_two_offline_of_three_waits() -> None:
    result = evaluate({"A": H_A}, num_replicas=3)
    assert not result.decided and result.blocking_candidate == H_A


def test_nobody_reachable_is_not_decided() -> None:
    assert not evaluate({}, 3).decided


def test_equal_votes_are_counted_together() -> None:
    assert evaluate({"A": 5, "B": 5, "C": 3}, 3).high_water_mark == 5
    assert evaluate({"A": 7, "B": 5, "C": 5, "D": 1, "E": 9}, 5).high_water_mark == 5


@given(st.dictionaries(st.sampled_from("ABCDEFG"), st.integers(-1, 50), min_size=1), st.integers(0, 3))
def test_decision_is_safe_and_maximal(votes: dict[str, int], extra_offline: int) -> None:
    n = len(votes) + extra_offline
    q = quorum_of(n)
    result = evaluate(votes, n)
    if result.decided:
        h = result.high_water_mark
        assert h is not None
        # a majority of all replicas holds h ...
        assert sum(v >= h for v in votes.values()) >= q
        # ... and no higher mark could have reached the quorum even with every offline replica
        for v in set(votes.values()):
            if v > h:
                assert sum(x >= v for x in votes.values()) + (n - len(votes)) < q
    else:
        # undecidable only while offline replicas could change the answer
        assert n - len(votes) > 0
