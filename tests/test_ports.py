"""Ports for processes told their port before they start, and what a cluster does when one is taken."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from waltz_core.app.local_cluster import ClusterSpec, ProcessCluster
from waltz_core.errors import WaltzError
from waltz_core.ports import LOWEST, _ephemeral_low, free_ports


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    ports = free_ports(40)
    assert len(set(ports)) == 40
    assert all(LOWEST <= p < _ephemeral_low() for p in ports)  # never where clients take local ports
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


async def test_a_storage_node_that_cannot_bind_is_reported_at_once(tmp_path: Path) -> None:
    spec = ClusterSpec(tmp_path / "cluster", num_partitions=1, num_servers=1)
    spec.write_configs()
    taken_port = int(spec.storages[1].address.rpartition(":")[2])
    cluster = ProcessCluster(spec)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken_port))
        squatter.listen()
        # Reported when the node exits (this message), not as a refused admin port after 60 s.
        with pytest.raises(WaltzError, match=r"storage-1 exited with status 1 while starting; end of its log:\n"
                                             r"(.|\n)*address already in use"):
            await cluster.start()
    assert not cluster.storages  # the nodes already started were stopped
