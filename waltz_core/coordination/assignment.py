"""The partition assignment policy: a pure function from (partitions, live servers, current) to a new assignment.

Rules (the original's ``DynamicPartitionAssignmentPolicy``, made deterministic):

1. every partition is owned by exactly one live server (none when no server is alive);
2. balanced: every server owns ``P // n`` or ``P // n + 1`` partitions; the servers that get
   one extra are those holding the most partitions now, then preferring the most, then the
   smallest server id, so as few partitions as possible move;
3. preferred partitions are honoured first, within a server's quota; on a conflict the server
   with the smallest id wins;
4. current placement is kept wherever the quota allows;
5. the rest go, in partition order, to the server with the most room left (then smallest id);
6. a partition's generation is bumped exactly when its owner changes (including from "nobody",
   after every server died); a partition owned for the first time starts at generation 0.

No I/O and no clock: the cluster manager calls it and writes the result with compare-and-set.
"""

from __future__ import annotations

from collections.abc import Sequence

from .metadata import PartitionAssignment, PartitionInfo, ServerDescriptor


def compute_assignment(num_partitions: int, servers: Sequence[ServerDescriptor],
                       current: PartitionAssignment | None) -> PartitionAssignment:
    """The assignment the coordinator should write, given the live ``servers`` and the ``current`` one.

    ``servers`` may come in any order; duplicates of a server id count once. Returns
    ``current`` unchanged (equal) when nothing needs to move.
    """
    previous = current.by_partition() if current is not None else {}
    live = sorted({s.server_id: s for s in servers}.values(), key=lambda s: s.server_id)
    if not live:
        orphaned = [PartitionInfo(p.partition_id, p.generation, None, None)
                    for pid, p in sorted(previous.items()) if pid < num_partitions]
        return PartitionAssignment(num_partitions, orphaned)

    by_id = {s.server_id: s for s in live}
    held: dict[int, set[int]] = {s.server_id: set() for s in live}
    for pid, p in previous.items():
        if p.server_id in held and pid < num_partitions:
            held[p.server_id].add(pid)
    preferred = {s.server_id: [p for p in dict.fromkeys(s.preferred_partitions) if 0 <= p < num_partitions] for s in live}

    base, extra = divmod(num_partitions, len(live))
    # Extras go to the servers holding most now (then preferring most): re-running with the same
    # membership then reproduces the same quotas, so a stable cluster never moves a partition.
    by_claims = sorted(live, key=lambda s: (-len(held[s.server_id]), -len(preferred[s.server_id]), s.server_id))
    quota = {s.server_id: base + (1 if rank < extra else 0) for rank, s in enumerate(by_claims)}
    load = dict.fromkeys(quota, 0)
    owner: dict[int, int] = {}

    def take(pid: int, server_id: int) -> None:
        owner[pid] = server_id
        load[server_id] += 1

    for server in live:  # smallest id first: it wins conflicts over preferred partitions
        for pid in preferred[server.server_id]:
            if pid not in owner and load[server.server_id] < quota[server.server_id]:
                take(pid, server.server_id)
    for pid in range(num_partitions):
        info = previous.get(pid)
        if (pid not in owner and info is not None and info.server_id in quota
                and load[info.server_id] < quota[info.server_id]):
            take(pid, info.server_id)
    for pid in range(num_partitions):
        if pid not in owner:
            server_id = min((sid for sid in quota if load[sid] < quota[sid]), key=lambda sid: (load[sid] - quota[sid], sid))
            take(pid, server_id)

    partitions = []
    for pid in range(num_partitions):
        server_id = owner[pid]
        info = previous.get(pid)
        if info is None:
            generation = 0
        elif info.server_id == server_id:
            generation = info.generation
        else:
            generation = info.generation + 1
        partitions.append(PartitionInfo(pid, generation, server_id, by_id[server_id].endpoint))
    return PartitionAssignment(num_partitions, partitions)
