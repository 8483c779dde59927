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
