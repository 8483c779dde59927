"""The closing high-water-mark vote of recovery (Waltz design, "Quorum Checking in the Recovery Process").

Pure logic, no I/O. Each reachable replica votes with the highest transaction id it holds
(after any truncation recovery already applied to it); a replica holding ``X`` votes for every
candidate ``H <= X``. Candidates are examined from the highest down:

* ``votes(H) >= quorum``: ``H`` is the closing high-water mark (every transaction at or below
  it was written by a majority, everything above could not have been);
* ``votes(H) + offline >= quorum``: the offline replicas could still make ``H`` a majority, so
  the answer is undecidable: wait, and re-evaluate whenever a replica comes back or catches up;
* otherwise ``H`` cannot have been committed; look at the next lower candidate.

With every replica online the lowest vote is always decided, so the vote is either decided or
undecidable, never empty.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs


def quorum_of(num_replicas: int) -> int:
    """Majority of ``num_replicas`` (original: ``n / 2 + 1``)."""
    if num_replicas <= 0:
        raise ValueError("a partition needs at least one replica")
    return num_replicas // 2 + 1


@attrs.frozen(slots=True)
class VoteResult:
    """Outcome of one evaluation of the vote."""

    decided: bool
    high_water_mark: int | None  #: the closing high-water mark when decided
    blocking_candidate: int | None = None  #: when undecidable: the candidate the offline replicas could still win
    reason: str = ""


def evaluate(votes: Mapping[str, int], num_replicas: int) -> VoteResult:
    """Evaluate the vote.

    :param votes: replica id -> the highest transaction id it holds, for reachable replicas only
    :param num_replicas: replicas assigned to the partition (reachable or not)
    """
    if len(votes) > num_replicas:
        raise ValueError(f"{len(votes)} votes for {num_replicas} replicas")
    quorum = quorum_of(num_replicas)
    offline = num_replicas - len(votes)
    if not votes:
        return VoteResult(False, None, None, f"no replica reachable (quorum {quorum} of {num_replicas})")
    ordered = sorted(votes.values(), reverse=True)
    for i, candidate in enumerate(ordered):
        if i + 1 < len(ordered) and ordered[i + 1] == candidate:
            continue  # count each candidate once, at its last occurrence (all holders counted)
        supporters = i + 1  # every replica at positions 0..i holds >= candidate
        if supporters >= quorum:
            return VoteResult(True, candidate, None, f"{supporters} of {num_replicas} replicas hold {candidate}")
        if supporters + offline >= quorum:
            return VoteResult(
                False, None, candidate,
                f"undecidable: {supporters} vote(s) for {candidate} plus {offline} offline replica(s) could reach "
                f"the quorum of {quorum}; waiting for a replica to return or catch up",
            )
    raise AssertionError("unreachable: the lowest candidate is supported by every reachable replica")
