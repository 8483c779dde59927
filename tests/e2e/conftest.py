"""The end-to-end matrix: every {transport} x {coordination} cell, chosen by entry-point NAME only.

By default every cell is collected, so ``./test.sh`` (CI) runs the whole matrix; the real
ZooKeeper and etcd servers start once per session (per xdist worker) and each cell uses its own
root. ``--waltz-transport tcp --waltz-coordination etcd`` (or $WALTZ_TEST_TRANSPORT /
$WALTZ_TEST_COORDINATION, comma-separated lists allowed) restricts the run to some cells; the
tox environments ``e2e-<transport>-<coordination>`` do exactly that. Two extra cells run with
security on (tcp + mutual TLS, zmq + CURVE) over local coordination.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest

from waltz_core.config import CoordinationConfig
from waltz_core.testing.servers import EtcdServer, ZooKeeperServer

TRANSPORTS = ("tcp", "zmq")
COORDINATIONS = ("local", "zookeeper", "etcd")


@attrs.frozen
class Cell:
    """One matrix cell: backend names as they appear in config, plus the security mode."""

    transport: str
    coordination: str
    security: str = ""  # "", "tls" (tcp) or "curve" (zmq)

    @property
    def id(self) -> str:
        return "-".join(x for x in (self.transport, self.security, self.coordination) if x)


CELLS = [Cell(t, c) for t in TRANSPORTS for c in COORDINATIONS] + [
    Cell("tcp", "local", "tls"),
    Cell("zmq", "local", "curve"),
]


def _selected(value: str, name: str) -> bool:
    wanted = {v.strip() for v in value.split(",") if v.strip()}
    return not wanted or name in wanted


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "cell" not in metafunc.fixturenames:
        return
    transports = metafunc.config.getoption("--waltz-transport")
    coordinations = metafunc.config.getoption("--waltz-coordination")
    unknown = {v.strip() for v in f"{transports},{coordinations}".split(",") if v.strip()} - {
        *TRANSPORTS, *COORDINATIONS}
    if unknown:
        raise pytest.UsageError(f"unknown backend(s) for the e2e matrix: {sorted(unknown)}; "
                                f"transports {TRANSPORTS}, coordinations {COORDINATIONS}")
    cells = [c for c in CELLS if _selected(transports, c.transport) and _selected(coordinations, c.coordination)]
    metafunc.parametrize("cell", cells, ids=[c.id for c in cells])


def _local(tmp_path: Path, request: pytest.FixtureRequest) -> CoordinationConfig:
    return CoordinationConfig(name="local", connect=str(tmp_path / "coordination"), root="/waltz", session_timeout=3.0)


def _zookeeper(tmp_path: Path, request: pytest.FixtureRequest) -> CoordinationConfig:
    zk: ZooKeeperServer = request.getfixturevalue("zookeeper_server")
    return CoordinationConfig(name="zookeeper", connect=zk.connect_string, root=f"/waltz-{uuid.uuid4().hex[:8]}",
                              session_timeout=4.0)


def _etcd(tmp_path: Path, request: pytest.FixtureRequest) -> CoordinationConfig:
    etcd: EtcdServer = request.getfixturevalue("etcd_server")
    return CoordinationConfig(name="etcd", connect=etcd.endpoints, root=f"/waltz-{uuid.uuid4().hex[:8]}",
                              session_timeout=4.0)


#: Where each coordination backend's server comes from. Only the test infrastructure differs per
#: backend (a connect string); the cluster and clients see nothing but the name in their config.
COORDINATION_SERVERS: dict[str, Callable[[Path, pytest.FixtureRequest], CoordinationConfig]] = {
    "local": _local, "zookeeper": _zookeeper, "etcd": _etcd,
}


@attrs.frozen
class Security:
    """Transport options for the cluster processes and for a client, plus options that must be refused."""

    process_options: dict[str, Any]
    client_options: dict[str, Any]
    refused_options: dict[str, Any] | None  #: credentials a server must refuse (None: plaintext cell)


def _tls(directory: Path) -> Security:
    from waltz_transport_tcp.certs import create_test_ca

    certs = create_test_ca(directory, clients=("app",))
    return Security(certs.server_options(mutual=True), certs.client_options("app"), {"tls_ca": str(certs.ca)})


def _curve(directory: Path) -> Security:
    from waltz_transport_zmq import keys

    node_public, node_secret = keys.create_keypair(directory / "keys", "node")
    app_public, app_secret = keys.create_keypair(directory / "keys", "app")
    allowed = directory / "allowed"
    allowed.mkdir()
    for public in (node_public, app_public):
        (allowed / public.name).write_bytes(public.read_bytes())
    # Every process listens and connects: the node key pair serves both roles.
    process = {"curve_server_secret_key_file": str(node_secret), "curve_allowed_clients_dir": str(allowed),
               "curve_server_public_key_file": str(node_public), "curve_client_secret_key_file": str(node_secret)}
    client = {"curve_server_public_key_file": str(node_public), "curve_client_secret_key_file": str(app_secret)}
    return Security(process, client, {"curve_server_public_key_file": str(node_public)})  # ephemeral key: refused


@pytest.fixture
def cell_coordination(cell: Cell, tmp_path: Path, request: pytest.FixtureRequest) -> CoordinationConfig:
    return COORDINATION_SERVERS[cell.coordination](tmp_path, request)


@pytest.fixture
def cell_security(cell: Cell, tmp_path: Path) -> Security:
    if cell.security == "tls":
        return _tls(tmp_path / "tls")
    if cell.security == "curve":
        return _curve(tmp_path / "curve")
    return Security({}, {}, None)
