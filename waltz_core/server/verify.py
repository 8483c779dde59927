"""Cluster verification (original ClusterCli ``verify`` and ``check-connectivity``).

Reads the metadata from coordination, asks every live server (admin RPCs) and every storage
node (admin port), and reports, per partition, the original's validations:

* ``assignment``: the partition has exactly one live owner in the assignment;
* ``server-consistency``: the owner says it has the partition;
* ``server-storage``: the owner reaches every storage node holding a replica;
* ``storage-consistency``: every storage node assigned a replica holds it (assigned and available);
* ``quorum``: a majority of the partition's replicas is reachable and available;
* ``recovery``: every replica is engaged in the current store session (none left behind);
* ``health``: the owner reports a store session for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import attrs

from ..coordination.base import CoordinationBackend
from ..coordination.metadata import UNRESOLVED
from ..coordination.recipes import StoreMetadata, list_servers, read_assignment
from ..errors import WaltzError
from ..storage.client import StorageAdminClient
from ..timeouts import wait_for
from ..transport.base import Transport
from .admin_client import ServerAdminClient
from .vote import quorum_of


@attrs.frozen
class Check:
    partition: int
    name: str
    ok: bool
    detail: str = ""


async def check_connectivity(backend: CoordinationBackend, root: str, transport: Transport,
                             timeout: float = 10.0) -> dict[str, dict[str, bool] | None]:
    """Server endpoint -> {storage: reachable} (None when the server itself is unreachable)."""
    out: dict[str, dict[str, bool] | None] = {}
    for server in await list_servers(backend, root):
        try:
            client = await ServerAdminClient.connect(transport, server.endpoint, timeout)
        except (WaltzError, OSError, TimeoutError):
            out[server.endpoint] = None
            continue
        try:
            out[server.endpoint] = await client.storage_connectivity()
        except (WaltzError, TimeoutError):
            out[server.endpoint] = None
        finally:
            await client.close()
    return out


async def verify(backend: CoordinationBackend, root: str, transport: Transport,
                 partitions: Sequence[int] | None = None, timeout: float = 10.0) -> list[Check]:
    sm = StoreMetadata(backend, root)
    params = await sm.get_store_params()
    assignment, _ = await read_assignment(backend, root)
    replicas = await sm.get_replica_assignments()
    admin_addresses = await sm.get_admin_addresses()
    pids = list(partitions) if partitions is not None else list(range(params.num_partitions))

    # Ask every owner what it serves, and every storage node what it holds - all at once, so a
    # host that vanished costs one timeout, not one per host.
    owners = {p.partition_id: p for p in assignment.partitions}

    async def server_view(endpoint: str) -> tuple[dict[int, bool], dict[str, bool]] | None:
        try:
            client = await ServerAdminClient.connect(transport, endpoint, timeout)
            try:
                return await client.partition_health(), await client.storage_connectivity()
            finally:
                await client.close()
        except (WaltzError, OSError, TimeoutError):
            return None

    async def storage_view(storage: str) -> dict[int, bool] | None:
        admin = admin_addresses.get(storage)
        if admin is None:
            return None
        try:
            client = await wait_for(
                StorageAdminClient.connect(transport, admin, params.cluster_key, params.num_partitions), timeout)
            try:
                return await wait_for(client.assigned_partition_status(), timeout)
            finally:
                await client.close()
        except (WaltzError, OSError, TimeoutError):
            return None

    endpoints = sorted({p.endpoint for p in assignment.partitions if p.endpoint})
    storages = sorted(replicas)
    server_results, storage_results = await asyncio.gather(asyncio.gather(*map(server_view, endpoints)),
                                                           asyncio.gather(*map(storage_view, storages)))
    server_views = dict(zip(endpoints, server_results, strict=True))
    storage_views = dict(zip(storages, storage_results, strict=True))

    checks: list[Check] = []
    for pid in pids:
        owner = owners.get(pid)
        holders = sorted(s for s, ids in replicas.items() if pid in ids)
        ok = owner is not None and owner.endpoint is not None
        checks.append(Check(pid, "assignment", ok, f"owner {owner.endpoint} generation {owner.generation}" if ok and owner else "no live owner"))
        view = server_views.get(owner.endpoint) if ok and owner and owner.endpoint else None
        checks.append(Check(pid, "server-consistency", view is not None and pid in view[0],
                            "owner unreachable" if view is None else ("" if pid in view[0] else "owner does not serve it")))
        if view is not None:
            missing = [s for s in holders if not view[1].get(s, False)]
            checks.append(Check(pid, "server-storage", not missing, f"unreachable from the owner: {', '.join(missing)}" if missing else ""))
            checks.append(Check(pid, "health", bool(view[0].get(pid)), "" if view[0].get(pid) else "no store session"))
        else:
            checks.append(Check(pid, "server-storage", False, "owner unreachable"))
            checks.append(Check(pid, "health", False, "owner unreachable"))
        not_holding = [s for s in holders if not (storage_views.get(s) or {}).get(pid, False)]
        checks.append(Check(pid, "storage-consistency", not not_holding,
                            f"assigned but not held/available: {', '.join(not_holding)}" if not_holding else ""))
        available = len(holders) - len(not_holding)
        q = quorum_of(len(holders)) if holders else 1
        checks.append(Check(pid, "quorum", bool(holders) and available >= q, f"{available} of {len(holders)} replicas available (quorum {q})"))
        meta, _ = await sm.get_partition_metadata(pid)
        behind = [s for s in holders if (st := meta.replicas.get(s)) is None or st.session_id != meta.session_id
                  or st.closing_high_water_mark != UNRESOLVED]
        checks.append(Check(pid, "recovery", not behind, f"not in session {meta.session_id}: {', '.join(behind)}" if behind else f"session {meta.session_id}"))
    return checks


def summarize(checks: Sequence[Check]) -> dict[str, Any]:
    failed = [c for c in checks if not c.ok]
    return {"checks": len(checks), "failed": len(failed)}
