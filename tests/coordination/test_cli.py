"""``waltz cluster ...`` against the local backend, through click's CliRunner and the real entry point."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from waltz_core.cli.main import build_cli, main


@pytest.fixture
def coord(tmp_path: Path) -> list[str]:
    return ["--coordination", "local", "--connect", str(tmp_path / "coord"), "--root", "/waltz"]


def run(*args: str) -> Result:
    result = CliRunner().invoke(build_cli(), list(args), catch_exceptions=False)
    return result


def run_main(*args: str) -> tuple[int, str, str]:
    """Through ``main()``: how a WaltzError becomes one line on stderr and exit status 1."""
    runner = CliRunner()
    with runner.isolation() as (out, err, _):
        try:
            main(list(args))
            code = 0
        except SystemExit as exc:
            code = int(exc.code or 0)
        return code, out.getvalue().decode(), err.getvalue().decode()


def test_create_list_and_show_key(coord: list[str]) -> None:
    created = run("cluster", "create", *coord, "--name", "demo", "--partitions", "4")
    assert created.exit_code == 0, created.output
    assert "created cluster demo" in created.output
    key = run("cluster", "show-key", *coord)
    assert key.exit_code == 0
    cluster_key = uuid.UUID(key.output.strip())
    listed = run("cluster", "list", *coord, "--json")
    data = json.loads(listed.output)
    assert data["cluster"] == {"name": "demo", "num_partitions": 4}
    assert data["store"] == {"cluster_key": str(cluster_key), "num_partitions": 4}
    assert sorted(data["partitions"]) == ["0", "1", "2", "3"]
    table = run("cluster", "list", *coord)
    assert table.exit_code == 0
    assert "demo" in table.output and str(cluster_key) in table.output and "Partition metadata" in table.output


def test_storage_node_edits(coord: list[str]) -> None:
    assert run("cluster", "create", *coord, "-n", "demo", "--partitions", "10").exit_code == 0
    for port in (7000, 7100):
        result = run("cluster", "add-storage-node", *coord, "-s", f"127.0.0.1:{port}", "-a", str(port + 1), "-g", "0")
        assert result.exit_code == 0, result.output
    assert run("cluster", "assign-partition", *coord, "-p", "0-6,9", "-s", "127.0.0.1:7000").exit_code == 0
    data = json.loads(run("cluster", "list", *coord, "--json").output)
    assert data["replica_assignments"] == {"127.0.0.1:7000": [0, 1, 2, 3, 4, 5, 6, 9], "127.0.0.1:7100": []}
    assert data["connections"] == {"127.0.0.1:7000": 7001, "127.0.0.1:7100": 7101}
    assert data["groups"] == {"127.0.0.1:7000": 0, "127.0.0.1:7100": 0}
    table = run("cluster", "list", *coord).output
    assert "0-6,9" in table
    # Their only replicas: refused unless --force (a partition would keep none).
    code, _, err = run_main("cluster", "unassign-partition", *coord, "-p", "0-6,9", "-s", "127.0.0.1:7000")
    assert code == 1 and err.count("\n") == 1, err
    assert "partitions 0-6,9 would keep fewer than a majority of their replicas (partition 0: 0 of 1)" in err
    assert run("cluster", "unassign-partition", *coord, "-p", "0-6,9", "-s", "127.0.0.1:7000", "--force").exit_code == 0
    auto = run("cluster", "auto-assign", *coord, "-g", "0")
    assert auto.exit_code == 0 and "127.0.0.1:7000: 0,2,4,6,8" in auto.output
    code, _, err = run_main("cluster", "remove-storage-node", *coord, "-s", "127.0.0.1:7100")
    assert code == 1 and err.count("\n") == 1 and "still has partitions 1,3,5,7,9 assigned" in err
    assert run("cluster", "unassign-partition", *coord, "-p", "1,3,5,7,9", "-s", "127.0.0.1:7100",
               "--force").exit_code == 0
    assert run("cluster", "remove-storage-node", *coord, "-s", "127.0.0.1:7100").exit_code == 0
    data = json.loads(run("cluster", "list", *coord, "--json").output)
    assert data["groups"] == {"127.0.0.1:7000": 0}


def test_unassigning_keeps_a_majority_of_each_partitions_replicas_unless_forced(coord: list[str]) -> None:
    """Moving one replica at a time (3 -> 4 -> 3) and dropping a lost node's (3 -> 2) pass; going
    below a majority of the replicas a partition has (2 -> 1) could leave only replicas that lack
    committed records, and is refused without --force."""
    assert run("cluster", "create", *coord, "-n", "demo", "--partitions", "2").exit_code == 0
    nodes = [f"127.0.0.1:{port}" for port in (7000, 7100, 7200, 7300)]
    for node in nodes:
        assert run("cluster", "add-storage-node", *coord, "-s", node, "-a", "1", "-g", "0").exit_code == 0
    for node in nodes[:3]:
        assert run("cluster", "assign-partition", *coord, "-p", "0-1", "-s", node).exit_code == 0
    assert run("cluster", "assign-partition", *coord, "-p", "0-1", "-s", nodes[3]).exit_code == 0  # 4 replicas
    assert run("cluster", "unassign-partition", *coord, "-p", "0-1", "-s", nodes[0]).exit_code == 0  # 3 of 4
    assert run("cluster", "unassign-partition", *coord, "-p", "0", "-s", nodes[1]).exit_code == 0  # 2 of 3
    code, _, err = run_main("cluster", "unassign-partition", *coord, "-p", "0-1", "-s", nodes[2])
    assert code == 1 and "partition 0 would keep 1 of its 2 replicas, fewer than a majority: its committed" in err
    data = json.loads(run("cluster", "list", *coord, "--json").output)
    assert data["replica_assignments"][nodes[2]] == [0, 1]  # refused as a whole: nothing changed
    assert run("cluster", "unassign-partition", *coord, "-p", "0-1", "-s", nodes[2], "--force").exit_code == 0


def test_delete_needs_the_name(coord: list[str]) -> None:
    assert run("cluster", "create", *coord, "-n", "demo", "--partitions", "2").exit_code == 0
    code, _, err = run_main("cluster", "delete", *coord, "-n", "other")
    assert code == 1 and "named 'demo', not 'other'" in err
    assert run("cluster", "delete", *coord, "-n", "demo").exit_code == 0
    code, _, err = run_main("cluster", "list", *coord)
    assert code == 1 and err.startswith("error: no Waltz cluster under /waltz")


def test_config_file_and_overrides(tmp_path: Path) -> None:
    config = tmp_path / "cli.toml"
    config.write_text(f'[coordination]\nname = "local"\nconnect = "{tmp_path / "coord"}"\nroot = "/from-file"\n')
    assert run("cluster", "create", "--config", str(config), "-n", "f", "--partitions", "1").exit_code == 0
    listed = json.loads(run("cluster", "list", "--config", str(config), "--json").output)
    assert listed["root"] == "/from-file"
    code, _, err = run_main("cluster", "list", "--config", str(config), "--root", "/elsewhere")
    assert code == 1 and "no Waltz cluster under /elsewhere" in err


@pytest.mark.parametrize(("args", "message"), [
    (["--coordination", "nosuch"], "error: --coordination: coordination.name: no coordination backend named 'nosuch' (registered:"),
    (["--root", "relative"], "error: coordination.root must be an absolute path"),
])
def test_bad_backend_and_root_are_one_line(coord: list[str], args: list[str], message: str) -> None:
    code, out, err = run_main("cluster", "list", *coord, *args)
    assert code == 1 and out == ""
    assert err.startswith(message) and err.count("\n") == 1, err
    assert "Traceback" not in err


def test_unreachable_store_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, _, err = run_main("cluster", "create", "--connect", str(blocker / "sub"), "-n", "c", "--partitions", "1")
    assert code == 1 and "cannot create directory" in err and err.count("\n") == 1 and "Traceback" not in err


def test_a_command_that_reads_leaves_no_directory_behind(tmp_path: Path) -> None:
    missing = tmp_path / "typo" / "coord"
    for command in (["list"], ["show-key"], ["delete", "--force"], ["remove-storage-node", "-s", "h:1"]):
        code, out, err = run_main("cluster", *command, "--connect", str(missing))
        assert code == 1 and out == "", (command, out)
        assert err == (f"error: no Waltz cluster under /waltz in the local coordination backend: its directory "
                       f"{missing} does not exist\n"), (command, err)
    assert not (tmp_path / "typo").exists()


@pytest.mark.parametrize("connect", ["localhost:2181", "198.18.0.9:2181,198.18.0.10:2181", "http://127.0.0.1:2379",
                                     "[::1]:2379"])
def test_a_host_port_for_the_local_backend_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       connect: str) -> None:
    monkeypatch.chdir(tmp_path)
    for command in (["list"], ["create", "-n", "c", "--partitions", "1"]):
        code, out, err = run_main("cluster", *command, "--connect", connect)
        assert code == 1 and out == ""
        assert err.startswith(f"error: coordination connect string {connect!r} looks like host:port, but the backend "
                              f"is local") and "--coordination zookeeper or etcd" in err, err
    assert list(tmp_path.iterdir()) == []


def test_a_directory_named_like_host_port_works_once_it_exists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "zk:2181").mkdir()
    assert run("cluster", "create", "--connect", "zk:2181", "-n", "c", "--partitions", "1").exit_code == 0
    assert json.loads(run("cluster", "list", "--connect", "zk:2181", "--json").output)["cluster"]["name"] == "c"


def test_existing_cluster_and_bad_ranges(coord: list[str]) -> None:
    assert run("cluster", "create", *coord, "-n", "demo", "--partitions", "3").exit_code == 0
    code, _, err = run_main("cluster", "create", *coord, "-n", "demo", "--partitions", "3")
    assert code == 1 and "/waltz already exists" in err and err.count("\n") == 1
    assert run("cluster", "add-storage-node", *coord, "-s", "h:1", "-a", "2", "-g", "0").exit_code == 0
    code, _, err = run_main("cluster", "assign-partition", *coord, "-p", "2-1", "-s", "h:1")
    assert code == 2 and "invalid partition range '2-1'" in err
    code, _, err = run_main("cluster", "assign-partition", *coord, "-p", "0-5", "-s", "h:1")
    assert code == 1 and "partitions 3-5 do not exist" in err
    code, _, err = run_main("cluster", "add-storage-node", *coord, "-s", "nohostport", "-a", "2", "-g", "0")
    assert code == 1 and "host:port" in err


def test_a_forced_unassign_also_takes_the_replica_out_of_the_next_recoverys_vote(
        coord: list[str], tmp_path: Path) -> None:
    """The next recovery votes among the previous session's replicas (``replica_set``) and waits
    for a majority of them. A replica taken out without --force still counts there (offline): the
    records only it and another hold stay safe. With --force the operator declares it lost: it
    leaves ``replica_set`` too, or the partition would wait for it for ever."""
    import asyncio

    from waltz_core.config import CoordinationConfig
    from waltz_core.coordination import open_coordination, recipes
    from waltz_core.runtime import Runtime

    assert run("cluster", "create", *coord, "-n", "demo", "--partitions", "1").exit_code == 0
    nodes = [f"127.0.0.1:{port}" for port in (7000, 7100, 7200)]
    for node in nodes:
        assert run("cluster", "add-storage-node", *coord, "-s", node, "-a", "1", "-g", "0").exit_code == 0
        assert run("cluster", "assign-partition", *coord, "-p", "0", "-s", node).exit_code == 0

    async def metadata(replica_set: list[str] | None = None) -> recipes.PartitionMetadata:
        config = CoordinationConfig(name="local", connect=str(tmp_path / "coord"), root="/waltz")
        backend = open_coordination(config, Runtime.load().registries)
        await backend.start()
        try:
            sm = recipes.StoreMetadata(backend, "/waltz")
            meta, version = await sm.get_partition_metadata(0)
            if replica_set is not None:  # what a session that finished its recovery writes
                await sm.cas_partition_metadata(0, recipes.PartitionMetadata(1, 3, {}, replica_set), version)
                meta, _ = await sm.get_partition_metadata(0)
            return meta
        finally:
            await backend.close()

    asyncio.run(metadata(nodes))
    assert run("cluster", "unassign-partition", *coord, "-p", "0", "-s", nodes[0]).exit_code == 0
    assert asyncio.run(metadata()).replica_set == tuple(nodes)  # still a voter, counted offline
    assert run("cluster", "unassign-partition", *coord, "-p", "0", "-s", nodes[1], "--force").exit_code == 0
    assert asyncio.run(metadata()).replica_set == (nodes[0], nodes[2])
