"""The server's client protocol against a real in-process cluster (3 storage nodes, local coordination).

Raw protocol messages, no client library: mount states, lock failures for each lock kind,
stale connections and generations, flush, high-water mark, data RPC, catch-up feeds that are
served from storage when the feed cache no longer holds them, and bad bytes from a peer.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import attrs
import pytest

from waltz_core.errors import ConnectionClosedError, TooManyLocksError, TransactionTooLargeError, error_from_wire
from waltz_core.protocol import CLIENT, Family
from waltz_core.protocol import client as m
from waltz_core.protocol.framing import DEFAULT_MAX_FRAME_SIZE
from waltz_core.protocol.wire import crc32
from waltz_core.testing.cluster import ClusterSpec, InProcessCluster
from waltz_core.testing.conformance.coordination import eventually
from waltz_core.testing.raw_stream import RawStream
from waltz_core.transport import MessageChannel, open_transport

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[InProcessCluster]:
    spec = ClusterSpec(tmp_path, num_partitions=2, transport="tcp", http=True,
                       server_overrides={"feed_cache_budget": 72 * 40})  # a tiny feed cache: catch-up reads storage
    async with InProcessCluster(spec) as cl:
        yield cl


async def connect(cl: InProcessCluster, client_id: int, partition: int = 0, family: Family = CLIENT) -> RawStream:
    server = cl.servers[0]
    transport = open_transport(cl.spec.transport_config, cl.spec.runtime.registries)
    conn = await transport.connect(server.address)
    ch = await MessageChannel.open(conn, family, "test")
    return RawStream(ch, client_id, server.partitions[partition].generation, partition)


async def test_feed_records_come_in_batches_to_protocol_3_clients_and_one_by_one_to_older_ones(
        cluster: InProcessCluster) -> None:
    a = await connect(cluster, 1)
    await a.mount()
    for i in range(20):
        await a.append(f"t{i}".encode())
    assert await a.flush() == 19
    # Mounted after the commits: each catch-up feed posts the 20 records at once.
    new = await connect(cluster, 2)
    old = await connect(cluster, 3, family=attrs.evolve(CLIENT, versions=(1, 2)))
    assert (new.ch.version, old.ch.version) == (m.VERSIONS[-1], 2)
    for raw in (new, old):
        assert (await raw.mount()).state is m.PartitionState.READY
        assert [(f.transaction_id, f.req_id.seq_num) for f in raw.feed] == [(i, i + 2) for i in range(20)]
    assert m.FeedDataBatch in new.seen
    assert m.FeedDataBatch not in old.seen and m.FeedData in old.seen


async def test_mount_states_append_flush_hwm_and_data(cluster: InProcessCluster) -> None:
    a = await connect(cluster, 1)
    assert (await a.mount()).state is m.PartitionState.READY
    for i in range(5):
        await a.append(f"t{i}".encode())
    assert await a.flush() == 4
    assert [f.transaction_id for f in a.feed] == [0, 1, 2, 3, 4]
    # Client ahead of the server: CLIENT_AHEAD (original PR #135), never a hang.
    b = await connect(cluster, 2)
    assert (await b.mount(hwm=100)).state is m.PartitionState.CLIENT_AHEAD
    # Wrong generation: NOT_READY, so the client re-reads the assignment.
    c = await connect(cluster, 3)
    c.generation += 5
    assert (await c.mount()).state is m.PartitionState.NOT_READY
    # High-water mark and data RPC.
    q = a.q()
    await a.ch.send(m.HighWaterMarkRequest(q))
    assert (await a.until(m.HighWaterMarkResponse, q)).transaction_id == 4
    q = a.q()
    await a.ch.send(m.TransactionDataRequest(q, 3))
    resp = await a.until(m.TransactionDataResponse, q)
    assert resp.data == b"t3" and resp.checksum == crc32(b"t3") and resp.error is None
    q = a.q()
    await a.ch.send(m.TransactionDataRequest(q, 99))
    resp = await a.until(m.TransactionDataResponse, q)
    assert resp.data is None and "not committed" in resp.error


async def test_lock_kinds_follow_the_original_semantics(cluster: InProcessCluster) -> None:
    a = await connect(cluster, 1)
    await a.mount()
    lock = 12345
    await a.append(b"w0", hwm=-1, write=(lock,))
    assert await a.flush() == 0
    # A writer that has not seen txn 0 conflicts, and is told which transaction made it fail.
    q = await a.append(b"stale-write", hwm=-1, write=(lock,))
    failure = await a.until(m.LockFailure, q)
    assert failure.transaction_id == 0
    # A reader that has not seen it conflicts too; one that has does not.
    q = await a.append(b"stale-read", hwm=-1, read=(lock,))
    assert (await a.until(m.LockFailure, q)).transaction_id == 0
    await a.append(b"fresh-read", hwm=0, read=(lock,))
    assert await a.flush() == 1
    # Read locks do not advance the lock: a writer at hwm 0 still succeeds.
    await a.append(b"w2", hwm=0, write=(lock,))
    assert await a.flush() == 2
    # Append locks are not checked, but they advance the lock: a reader at hwm 2 then fails.
    await a.append(b"appender", hwm=-1, append=(lock,))
    assert await a.flush() == 3
    q = await a.append(b"reader", hwm=2, read=(lock,))
    assert (await a.until(m.LockFailure, q)).transaction_id == 3
    committed = {f.transaction_id for f in a.feed}
    assert committed == {0, 1, 2, 3}


async def test_conflicting_appends_in_flight_serialize_instead_of_failing(cluster: InProcessCluster) -> None:
    a = await connect(cluster, 1)
    await a.mount()
    # Ten appends on one lock, each computed at the head before the previous committed: the first
    # wins, the others fail (they read stale data) - none is decided on a stale table.
    reqs = [await a.append(f"x{i}".encode(), hwm=-1, write=(7,)) for i in range(10)]
    assert await a.flush() == 0
    fed = [f.req_id for f in a.feed]
    assert fed == [reqs[0]]


async def test_stale_connection_and_stale_generation_are_ignored(cluster: InProcessCluster) -> None:
    old = await connect(cluster, 5)
    await old.mount(seq_num=1)
    new = await connect(cluster, 5)
    await new.mount(seq_num=2)  # the same client id, a newer network client
    await old.append(b"from-the-old-connection")
    await new.append(b"wrong-generation", generation=new.generation + 1)
    await new.append(b"from-the-new-connection")
    assert await new.flush() == 0
    assert len(new.feed) == 1 and new.feed[0].req_id.client_id == 5


async def catch_up_from_storage(cl: InProcessCluster) -> None:
    """300 transactions, then a client that mounts from the start: its feed is read from storage
    (the clusters of these tests keep few transactions in the feed cache)."""
    a = await connect(cl, 1)
    await a.mount()
    for i in range(300):
        await a.append(f"r{i}".encode())
    assert await a.flush() == 299
    late = await connect(cl, 2)
    assert (await late.mount(hwm=-1)).state is m.PartitionState.READY
    assert [f.transaction_id for f in late.feed] == list(range(300))
    assert [f.req_id for f in late.feed] == [f.req_id for f in a.feed]


async def test_catch_up_feed_beyond_the_cache_is_read_from_storage(cluster: InProcessCluster) -> None:
    await catch_up_from_storage(cluster)


async def test_catch_up_feed_from_storage_with_small_frames(tmp_path: Path) -> None:
    """256 headers a read (7,193 bytes) did not fit a 4 KiB frame: the storage node could not
    answer, and a client behind the feed cache never caught up. A node answers within half a frame."""
    spec = ClusterSpec(tmp_path, num_partitions=1, transport="tcp", max_frame_size=4096,
                       server_overrides={"feed_cache_budget": 72 * 40})
    async with InProcessCluster(spec) as cl:
        await catch_up_from_storage(cl)


async def test_bad_bytes_close_only_that_connection(cluster: InProcessCluster) -> None:
    good = await connect(cluster, 1)
    await good.mount()
    bad = await connect(cluster, 2)
    await bad.ch.conn.send(b"\xff\x00garbage")
    with pytest.raises(ConnectionClosedError):
        await asyncio.wait_for(bad.ch.recv(), 5)
    await good.append(b"still-serving")
    assert await good.flush() == 0


async def test_http_health_and_metrics(cluster: InProcessCluster) -> None:
    server = cluster.servers[0]
    a = await connect(cluster, 1)
    await a.mount()
    await a.append(b"m")
    await a.flush()
    base = f"http://{server.http_address}"

    def get(path: str) -> tuple[int, bytes]:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(base + path, timeout=5) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    async def gauges_refreshed() -> bool:  # the per-partition gauges refresh once a second
        return b'waltz_server_high_water_mark{partition="0"} 0' in (await asyncio.to_thread(get, "/metrics"))[1]

    await eventually(gauges_refreshed, 10, "the high-water-mark gauge shows the append")

    status, body = await asyncio.to_thread(get, "/health")
    assert status == 200 and json.loads(body)["partitions"] == {"0": True, "1": True}
    status, body = await asyncio.to_thread(get, "/metrics")
    text = body.decode()
    assert status == 200 and 'waltz_server_high_water_mark{partition="0"} 0' in text
    assert "waltz_server_commit_latency_seconds_bucket" in text
    for node in cluster.spec.storages:
        assert f'waltz_server_storage_reachable{{storage="{node.address}"}} 1' in text
    assert 'waltz_server_cache_budget_bytes{cache="data"} 134217728' in text
    assert 'waltz_server_cache_bytes{cache="data"}' in text
    status, body = await asyncio.to_thread(get, "/ping")
    assert body.strip() == b"pong"
    # A storage node that stops: the server's view says so, for all its partitions at once.
    await cluster.stop_storage(2)
    gone = f'waltz_server_storage_reachable{{storage="{cluster.spec.storages[2].address}"}} 0'.encode()

    async def marked_down() -> bool:
        return gone in (await asyncio.to_thread(get, "/metrics"))[1]

    await eventually(marked_down, 20, "the stopped storage node is shown unreachable")


async def test_cluster_verify_check_connectivity_and_preferred_partitions(cluster: InProcessCluster) -> None:
    from click.testing import CliRunner

    from waltz_core.cli.main import build_cli
    from waltz_core.server.admin_client import ServerAdminClient

    spec = cluster.spec
    assert spec.coordination is not None
    args = ["--coordination", "local", "--connect", spec.coordination.connect, "--root", spec.coordination.root]
    runner = CliRunner()
    cli = build_cli()
    result = await asyncio.to_thread(runner.invoke, cli, ["cluster", "verify", *args])
    assert result.exit_code == 0, result.output
    assert "14 of 14 checks passed" in result.output
    result = await asyncio.to_thread(runner.invoke, cli, ["cluster", "check-connectivity", *args])
    assert result.exit_code == 0, result.output
    assert result.output.count(": ok") == 3
    result = await asyncio.to_thread(runner.invoke, cli, ["cluster", "verify", *args, "--json"])
    report = json.loads(result.output)
    assert result.exit_code == 0 and report["passed"] == 14 and report["failed"] == 0
    assert {c["check"] for c in report["checks"]} >= {"assignment", "quorum", "recovery", "health"}
    result = await asyncio.to_thread(runner.invoke, cli, ["cluster", "check-connectivity", *args, "--json"])
    statuses = json.loads(result.output)["servers"]
    assert list(statuses.values()) == [{node.address: True for node in spec.storages}]
    result = await asyncio.to_thread(runner.invoke, cli, ["server", "partitions", "-s", cluster.servers[0].address,
                                                          "--json"])
    assert json.loads(result.output)["partitions"] == [{"partition": 0, "healthy": True},
                                                       {"partition": 1, "healthy": True}]
    # One storage down: verify names the partition replicas it lost and exits non-zero.
    await cluster.stop_storage(2)
    result = await asyncio.to_thread(runner.invoke, cli, ["cluster", "verify", *args, "--timeout", "3"])
    assert result.exit_code == 1
    assert "FAILED" in result.output and spec.storages[2].address in result.output
    # Preferred partitions through the admin RPC: ids out of range are refused.
    transport = open_transport(spec.transport_config, spec.runtime.registries)
    admin = await ServerAdminClient.connect(transport, cluster.servers[0].address)
    try:
        assert await admin.add_preferred_partitions([1]) is True
        assert await admin.add_preferred_partitions([7]) is False
        assert sorted(await admin.partitions()) == [0, 1]
    finally:
        await admin.close()
        await transport.aclose()


async def test_a_record_no_replica_link_could_carry_is_refused_and_the_partition_goes_on(tmp_path: Path,
                                                                                         caplog) -> None:
    """A client allowed larger frames than the servers sends an append that fits the server's frame
    but whose record, with the storage append around it, would not: before, every replica left
    the session, at every recovery, and the partition never committed again. A protocol-4 client
    is told why (AppendRefused, code 705); an older one is not (its append is dropped)."""
    max_frame = 8192
    spec = ClusterSpec(tmp_path, num_partitions=1, transport="tcp", max_frame_size=max_frame)
    async with InProcessCluster(spec) as cl:
        a = await connect(cl, 1)
        old = await connect(cl, 2, family=attrs.evolve(CLIENT, versions=(1, 2, 3)))
        assert (a.ch.version, old.ch.version) == (4, 3)
        await a.mount()
        await old.mount()
        await a.append(b"before")
        largest = max_frame - m.TRANSACTION_FRAME_HEADROOM
        # fits the client's frame (49 bytes around it), not the storage append's (78 around it)
        oversize = max_frame - 60
        with caplog.at_level("WARNING", logger="waltz.server"):
            refused = [await a.append(bytes(largest + 1))]
            for _ in range(2):
                refused.append(await a.append(bytes(oversize)))
            await old.append(bytes(oversize))
        answers = [await a.until(m.AppendRefused, q) for q in refused]
        assert {(r.error_code, type(error_from_wire(r.error_code, r.message))) for r in answers} == {
            (705, TransactionTooLargeError)}
        assert f"{largest + 1} bytes of data, over the {largest}" in answers[0].message
        await a.append(bytes(largest))
        await a.append(b"after", write=(7,))
        assert await a.flush() == 2
        assert [f.req_id.seq_num for f in a.feed] == [2, 6, 7]  # the four oversize appends: never in the log
        assert m.AppendRefused not in old.seen
        logged = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        # the 1st, 2nd and 4th refusal are logged; the 4th is the old client's, dropped
        assert len(logged) == 3 and "answered" in logged[0] and "dropped: its protocol is older than 4" in logged[2]
        assert cl.servers[0].partitions[0].refused == 4
        assert cl.servers[0].partitions[0].store.session is not None  # the store session never broke


async def test_storage_nodes_with_smaller_frames_than_the_server_bound_its_transactions(tmp_path: Path,
                                                                                       caplog) -> None:
    """Storage nodes whose ``transport.max_frame_size`` is below the server's: before storage
    protocol 5 the server sent them a record over their limit, each node closed the connection
    (failing every partition's appends on it), in every new session, and the partition never
    committed again. Now the nodes tell their limit in the answer to the open, and the server
    refuses a record they could not take, as one over its own limit."""
    node_frame = 8192
    spec = ClusterSpec(tmp_path, num_partitions=1, transport="tcp", max_frame_size=4 * node_frame,
                       storage_max_frame_size=node_frame)
    with caplog.at_level("WARNING", logger="waltz.server"):
        async with InProcessCluster(spec) as cl:
            a = await connect(cl, 1)
            q = a.q()
            await a.ch.send(m.ServerLimitsRequest(q))  # a protocol-4 client is told the nodes' limit
            assert (await a.until(m.ServerLimitsResponse, q)).max_frame_size == node_frame
            await a.mount()
            await a.append(b"before")
            largest = node_frame - m.TRANSACTION_FRAME_HEADROOM
            q = await a.append(bytes(largest + 1))
            refusal = await a.until(m.AppendRefused, q)
            assert isinstance(error_from_wire(refusal.error_code, refusal.message), TransactionTooLargeError)
            assert (f"{largest + 1} bytes of data, over the {largest} a record may carry with "
                    f"transport.max_frame_size = {node_frame} on a storage node") in refusal.message
            await a.append(bytes(largest))
            await a.append(b"after", write=(3,))
            assert await a.flush() == 2
            assert [f.req_id.seq_num for f in a.feed] == [3, 5, 6]
            store = cl.servers[0].partitions[0].store
            assert store.frame_limit == node_frame
            assert store.sessions_started == 1  # no replica ever left the session
    warned = [r.getMessage() for r in caplog.records if "take frames of at most" in r.getMessage()]
    assert len(warned) == 1 and f"less than this server's transport.max_frame_size = {4 * node_frame}" in warned[0]


async def test_an_append_with_more_locks_than_the_server_takes_is_refused(tmp_path: Path) -> None:
    spec = ClusterSpec(tmp_path, num_partitions=1, transport="tcp", server_overrides={"max_locks_per_transaction": 4})
    async with InProcessCluster(spec) as cl:
        a = await connect(cl, 1)
        q = a.q()
        await a.ch.send(m.ServerLimitsRequest(q))  # what a protocol-4 client asks first
        limits = await a.until(m.ServerLimitsResponse, q)
        assert (limits.max_frame_size, limits.max_locks_per_transaction) == (DEFAULT_MAX_FRAME_SIZE, 4)
        await a.mount()
        await a.append(b"four", write=(1, 2), read=(3,), append=(4,))
        q = await a.append(b"five", write=(1, 2), read=(3,), append=(4, 5))
        refusal = await a.until(m.AppendRefused, q)
        error = error_from_wire(refusal.error_code, refusal.message)
        assert isinstance(error, TooManyLocksError) and isinstance(error, TransactionTooLargeError)
        assert "5 locks, over the server's max_locks_per_transaction = 4" in refusal.message
        await a.append(b"after", write=(1,), hwm=0)
        assert await a.flush() == 1
        assert [f.req_id.seq_num for f in a.feed] == [3, 5]  # after the limits request and the mount
