"""Ports for processes told their port before they start, and what a cluster does when one is taken."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from waltz_core.app.local_cluster import ClusterSpec, ProcessCluster
from waltz_core.errors import WaltzError
from waltz_core.ports import LOWEST, _ephemeral_low, free_ports, reserve_ports


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    ports = free_ports(40)
    assert len(set(ports)) == 40
    assert all(LOWEST <= p < _ephemeral_low() for p in ports)  # never where clients take local ports
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def _plain_bind_refused(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
        return False


async def test_reserved_ports_are_refused_to_other_pickers_but_not_to_their_listeners() -> None:
    reservation = reserve_ports(3)
    ports = reservation.ports
    assert len(set(ports)) == 3 and all(LOWEST <= p < _ephemeral_low() for p in ports)
    assert all(_plain_bind_refused(p) for p in ports)  # how free_ports and reserve_ports check a port
    assert not set(ports) & set(free_ports(200))
    # The node it is meant for binds and listens while the port is still held (SO_REUSEADDR).
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", ports[0])
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", ports[0])
        writer.close()
    finally:
        server.close()
        await server.wait_closed()
    reservation.release()
    reservation.release()  # idempotent
    assert not any(_plain_bind_refused(p) for p in ports[1:])  # ports[0] has a connection in TIME_WAIT


async def test_a_cluster_holds_its_ports_from_its_configs_until_it_stops(tmp_path: Path) -> None:
    spec = ClusterSpec(tmp_path / "cluster", num_partitions=1, num_storages=1, num_servers=1,
                       storage_overrides={"layout": "memory"})
    spec.write_configs()
    port = int(spec.servers[0].address.rpartition(":")[2])
    assert _plain_bind_refused(port)
    cluster = ProcessCluster(spec)
    await cluster.start()
    cluster.stop()
    assert not _plain_bind_refused(port)


async def test_a_storage_node_that_cannot_bind_is_reported_at_once(tmp_path: Path) -> None:
    spec = ClusterSpec(tmp_path / "cluster", num_partitions=1, num_servers=1)
    spec.write_configs()
    taken_port = int(spec.storages[1].address.rpartition(":")[2])
    cluster = ProcessCluster(spec)
    with socket.socket() as squatter:  # a listener of another program (SO_REUSEADDR, as servers set it)
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", taken_port))
        squatter.listen()
        # Reported when the node exits (this message), not as a refused admin port after 60 s.
        with pytest.raises(WaltzError, match=r"storage-1 exited with status 1 while starting; end of its log:\n"
                                             r"(.|\n)*address already in use"):
            await cluster.start()
    assert not cluster.storages  # the nodes already started were stopped
