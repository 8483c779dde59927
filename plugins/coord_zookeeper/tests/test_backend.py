"""ZooKeeper-specific behaviour beyond the kit: registration, options, ACLs, layout, errors."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from kazoo.client import KazooClient
from kazoo.security import make_digest_acl_credential

from waltz_coord_zookeeper.backend import ZooKeeperBackend
from waltz_coord_zookeeper.options import ZooKeeperOptions, parse_acl_entry
from waltz_core.config import CoordinationConfig, build
from waltz_core.coordination import open_coordination, recipes
from waltz_core.errors import ConfigError, CoordinationError, NodeExistsError
from waltz_core.runtime import Runtime
from waltz_core.testing.servers import ZooKeeperServer, free_port

#: every backend of these tests is built by name, as a Waltz process builds it
REGISTRIES = Runtime.load().registries



def test_registered_under_zookeeper_with_its_options_class() -> None:
    info = REGISTRIES.resolve("coordination", "zookeeper")
    assert info.config_cls is ZooKeeperOptions
    backend = open_coordination(build(CoordinationConfig, {
        "name": "zookeeper", "connect": "127.0.0.1:1", "session_timeout": 5,
        "zookeeper": {"auth_scheme": "digest", "auth_credentials": "u:p"}}), REGISTRIES)
    assert isinstance(backend, ZooKeeperBackend)
    assert backend.session_timeout == 5.0 and backend.options.auth_credentials == "u:p"


def test_bad_options_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="auth_scheme and auth_credentials"):
        ZooKeeperOptions(auth_scheme="digest")
    with pytest.raises(ConfigError, match="not scheme:id:perms"):
        ZooKeeperOptions(acl=["world"])
    with pytest.raises(ConfigError, match="'x' is not one of cdrwa"):
        ZooKeeperOptions(acl=["world:anyone:rx"])
    with pytest.raises(ConfigError, match="unknown key"):
        open_coordination(build(CoordinationConfig, {"name": "zookeeper", "zookeeper": {"nope": 1}}), REGISTRIES)
    entry = parse_acl_entry("digest:alice:abc/def=:rwa")
    assert (entry.scheme, entry.id, entry.perms) == ("digest", "alice:abc/def=", 1 | 2 | 16)


async def test_unreachable_server_is_one_clear_error() -> None:
    backend = ZooKeeperBackend(f"127.0.0.1:{free_port()}", session_timeout=2.0,
                               options=ZooKeeperOptions(connect_timeout=1.0))
    with pytest.raises(CoordinationError, match=r"cannot connect to 127\.0\.0\.1:"):
        await backend.start()
    await backend.close()


@pytest.mark.integration
async def test_layout_sequence_names_and_zkcli_readable_values(zookeeper_server: ZooKeeperServer) -> None:
    backend = ZooKeeperBackend(zookeeper_server.connect_string, session_timeout=4.0)
    await backend.start()
    root = "/waltz-layout"
    try:
        await recipes.create_cluster(backend, root, "layout", 2)
        manager = recipes.ClusterManager(backend, root, recipes.ServerDescriptor(address="127.0.0.1:6001"))
        await manager.start()
        names = await backend.children(f"{root}/serverDescriptors")
        assert len(names) == 1 and names[0].startswith("s_") and names[0][2:].isdigit() and len(names[0]) == 12
        # The raw znodes hold UTF-8 JSON: what `zkCli.sh get <path>` prints.
        raw = KazooClient(hosts=zookeeper_server.connect_string)
        await asyncio.to_thread(raw.start, 10)
        try:
            data, stat = await asyncio.to_thread(raw.get, f"{root}/store/partition/1")
            assert json.loads(data.decode("utf-8"))["generation"] == -1
            descriptor, stat = await asyncio.to_thread(raw.get, f"{root}/serverDescriptors/{names[0]}")
            assert stat.ephemeralOwner == backend.session_id
            assert json.loads(descriptor)["port"] == 6001
            assert sorted(await asyncio.to_thread(raw.get_children, f"{root}/store")) == [
                "assignment", "connection", "group", "partition"]
        finally:
            await asyncio.to_thread(raw.stop)
            await asyncio.to_thread(raw.close)
        await manager.close()
    finally:
        await backend.delete(root, recursive=True)
        await backend.close()


@pytest.mark.integration
async def test_digest_auth_and_acl(zookeeper_server: ZooKeeperServer) -> None:
    digest = make_digest_acl_credential("waltz", "secret")
    owner = ZooKeeperBackend(zookeeper_server.connect_string, session_timeout=4.0, options=ZooKeeperOptions(
        auth_scheme="digest", auth_credentials="waltz:secret", acl=[f"digest:{digest}:cdrwa", "world:anyone:r"]))
    stranger = ZooKeeperBackend(zookeeper_server.connect_string, session_timeout=4.0)
    await owner.start()
    await stranger.start()
    try:
        await owner.create("/waltz-acl/key", b"v")
        got = await stranger.get("/waltz-acl/key")  # world may read
        assert got is not None and got.value == b"v"
        with pytest.raises(CoordinationError, match="not authorised"):
            await stranger.set("/waltz-acl/key", b"w")
        with pytest.raises(CoordinationError, match="not authorised"):
            await stranger.create("/waltz-acl/other", b"w")
        assert await owner.set("/waltz-acl/key", b"w") == 1
        with pytest.raises(NodeExistsError):
            await owner.create("/waltz-acl/key", b"again")
    finally:
        await owner.delete("/waltz-acl", recursive=True)
        await owner.close()
        await stranger.close()
    assert await _absent(zookeeper_server, "/waltz-acl")


async def _absent(zookeeper_server: ZooKeeperServer, key: str) -> bool:
    backend = ZooKeeperBackend(zookeeper_server.connect_string, session_timeout=4.0)
    await backend.start()
    try:
        return await backend.get(key) is None
    finally:
        await backend.close()


def test_unreachable_server_is_one_clear_cli_line(tmp_path: Path) -> None:
    """`waltz cluster list` against a ZooKeeper nobody runs: exit 1 and exactly one `error:` line."""
    import subprocess
    import sys

    from waltz_core.testing.servers import free_port

    config = tmp_path / "cli.toml"
    config.write_text(f'[coordination]\nname = "zookeeper"\nconnect = "127.0.0.1:{free_port()}"\n\n'
                      "[coordination.zookeeper]\nconnect_timeout = 2.0\n")
    result = subprocess.run([sys.executable, "-m", "waltz_core.cli", "cluster", "list", "--config", str(config)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: zookeeper: cannot connect"), result.stderr


@pytest.fixture(scope="module")
def zookeeper_with_tls(tmp_path_factory: pytest.TempPathFactory):
    """A ZooKeeper that also serves TLS (Netty, ssl.clientAuth=need) on its secure ports."""
    from waltz_core.testing import require
    from waltz_core.testing.servers import ZOOKEEPER_NETTY_JARS, zookeeper_available
    from waltz_transport_tcp.certs import create_test_ca

    require(zookeeper_available() and all(Path(j).exists() for j in ZOOKEEPER_NETTY_JARS),
            "ZooKeeper with Netty (apt zookeeper: /usr/share/java/zookeeper.jar, netty-codec.jar)")
    certs = create_test_ca(tmp_path_factory.mktemp("zk-certs"), clients=("waltz",))
    server = ZooKeeperServer(nodes=1, tls=(str(certs.ca), str(certs.node_cert), str(certs.node_key))).start()
    yield server, certs
    server.stop()


@pytest.mark.integration
async def test_tls_with_a_client_certificate(zookeeper_with_tls, caplog) -> None:
    server, certs = zookeeper_with_tls
    cert, key = certs.clients["waltz"]
    backend = ZooKeeperBackend(server.secure_connect_string, session_timeout=5.0,
                               options=ZooKeeperOptions(tls_ca=str(certs.ca), tls_cert=str(cert), tls_key=str(key)))
    with caplog.at_level("WARNING", logger="waltz.coordination.zookeeper"):
        await backend.start()
    try:
        assert await backend.create("/waltz-tls/k", b"v") >= 0
        got = await backend.get("/waltz-tls/k")
        assert got is not None and got.value == b"v"
    finally:
        await backend.delete("/waltz-tls", recursive=True)
        await backend.close()
    assert not [r for r in caplog.records if "not encrypted" in r.getMessage()]


@pytest.mark.integration
@pytest.mark.parametrize("case", ["no client certificate", "another CA", "missing file", "not PEM",
                                  "key of another certificate"])
# kazoo leaves the socket of a failed handshake to the garbage collector (closed there, with a warning)
@pytest.mark.filterwarnings("ignore:unclosed <ssl.SSLSocket:ResourceWarning")
async def test_tls_refusals_are_one_clear_error(zookeeper_with_tls, tmp_path: Path, case: str) -> None:
    from waltz_transport_tcp.certs import create_test_ca

    server, certs = zookeeper_with_tls
    cert, key = certs.clients["waltz"]
    options = {
        "no client certificate": ZooKeeperOptions(tls_ca=str(certs.ca), connect_timeout=2.0),
        "another CA": ZooKeeperOptions(tls_ca=str(create_test_ca(tmp_path / "other").ca), tls_cert=str(cert),
                                       tls_key=str(key), connect_timeout=2.0),
        "missing file": ZooKeeperOptions(tls_ca=str(tmp_path / "nowhere.pem")),
        "not PEM": ZooKeeperOptions(tls_ca=str(key)),
        "key of another certificate": ZooKeeperOptions(tls_ca=str(certs.ca), tls_cert=str(cert),
                                                       tls_key=str(certs.node_key)),
    }[case]
    backend = ZooKeeperBackend(server.secure_connect_string, session_timeout=5.0, options=options)
    # the cause is named: the handshake kazoo's last attempt failed, or the file
    match = {"missing file": r"cannot read \[coordination.zookeeper\] tls_ca",
             "not PEM": r"\[coordination.zookeeper\] tls_ca .* holds no PEM CA certificate",
             "key of another certificate": r"tls_cert .* and tls_key .* are not a PEM certificate and its private key",
             }.get(case, r"cannot connect to .* \(last attempt: .*(SSL|ssl|certificate)")
    with pytest.raises(CoordinationError, match=match):
        await backend.start()
    await backend.close()


def test_tls_options_go_together() -> None:
    with pytest.raises(ConfigError, match="tls_cert and tls_key go together"):
        ZooKeeperOptions(tls_cert="/c.pem")
    assert ZooKeeperOptions(tls=True).tls_enabled and not ZooKeeperOptions().tls_enabled


def test_plaintext_to_a_remote_member_is_logged(caplog) -> None:
    backend = ZooKeeperBackend("198.18.0.1:2181,127.0.0.1:2181", options=ZooKeeperOptions(
        auth_scheme="digest", auth_credentials="u:p"))
    with caplog.at_level("WARNING", logger="waltz.coordination.zookeeper"):
        assert backend._tls_arguments() == {}  # what start() passes to kazoo; nothing is connected here
    (record,) = [r for r in caplog.records if "not encrypted" in r.getMessage()]
    assert "198.18.0.1" in record.getMessage() and "127.0.0.1" not in record.getMessage()
    assert "digest credentials cross the network in plaintext" in record.getMessage()
