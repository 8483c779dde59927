"""The command line as scripts and people expect it, and no traceback for any input.

Every bad file, flag or value gets one clear line naming where it came from and the key, a
non-zero exit, and nothing changed on disk; tables are not cut when piped; --json is one JSON
document; a flag means the same thing in every command.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WALTZ = [sys.executable, "-m", "waltz_core.cli"]
NO_WALTZ_ENV = {k: v for k, v in os.environ.items() if not k.startswith("WALTZ_")}


def waltz(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run the console script in a subprocess, stdout and stderr captured (so: not a terminal)."""
    return subprocess.run([*WALTZ, *args], capture_output=True, text=True, timeout=120,
                          env={**NO_WALTZ_ENV, **(env or {})}, cwd=cwd)


def one_line_error(result: subprocess.CompletedProcess[str], *needles: str, code: int = 1) -> str:
    """The command failed with ``code`` and one stderr line holding every needle, no traceback."""
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stderr, result.stderr
    last = lines[-1]
    for needle in needles:
        assert needle in last, (needle, result.stderr)
    return last


# ------------------------------------------------------------------------------ piped tables


def test_tables_are_not_cut_when_piped() -> None:
    result = waltz("plugins")
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if "waltz-transport-tcp" in line and "transport" in line]
    # the whole row on one line, as `waltz plugins | grep waltz-transport-tcp` needs it
    assert any("tcp" in row and "optional (mutual) TLS" in row for row in rows), result.stdout
    assert "\x1b[" not in result.stdout  # no colour codes in a pipe


def test_json_outputs_parse() -> None:
    for args in (["plugins", "--json"], ["config", "schema", "--json"], ["config", "schema", "server", "--json"]):
        result = waltz(*args)
        assert result.returncode == 0, result.stderr
        json.loads(result.stdout)
    schema = json.loads(waltz("config", "schema", "server", "--json").stdout)
    assert {"key": "server.port", "type": "int", "default": "55180"}.items() <= schema["server"][1].items()


def test_shell_completion_script() -> None:
    result = waltz(env={"_WALTZ_COMPLETE": "bash_source"})
    assert result.returncode == 0 and "complete" in result.stdout and "_WALTZ_COMPLETE" in result.stdout


# ------------------------------------------------------------------------------ bad values


@pytest.mark.parametrize("port", ["70000", "-1"])
def test_a_port_out_of_range_is_one_line_from_file_flag_and_environment(tmp_path: Path, port: str) -> None:
    config = tmp_path / "server.toml"
    config.write_text(f"[server]\nport = {port}\n")
    message = f"server.port: must be a port number from 0 to 65535 (0: any free port), got {port}"
    one_line_error(waltz("server", "start", "--config", str(config)), f"{config}: {message}")
    one_line_error(waltz("server", "start", "--port", port), f"--port: {message}")
    one_line_error(waltz("server", "start", env={"WALTZ_SERVER_PORT": port}),
                   f"environment variable WALTZ_SERVER_PORT: {message}")
    storage = tmp_path / "storage.toml"
    storage.write_text(f"[storage]\nadmin_port = {port}\ndirectory = '{tmp_path / 'data'}'\n")
    one_line_error(waltz("storage", "start", "--config", str(storage)), f"{storage}: storage.admin_port: must be a port")
    assert not (tmp_path / "data").exists()  # nothing created on disk


@pytest.mark.parametrize(("key", "value", "message"), [
    ("io_threads", "-1", "must be 0 or more, got -1"),
    ("io_threads", "two", "expected an integer, got 'two'"),
    ("journal_checkpoint_bytes", "0", "must be 1 or more, got 0"),
    ("journal_checkpoint_bytes", "lots", "expected an integer, got 'lots'"),
    ("journal", "maybe", "expected true or false, got 'maybe'"),
])
def test_storage_io_and_journal_keys_out_of_range_are_one_line_from_file_and_environment(
        tmp_path: Path, key: str, value: str, message: str) -> None:
    storage = tmp_path / "storage.toml"
    literal = value if value.lstrip("-").isdigit() else f'"{value}"'
    storage.write_text(f"[storage]\n{key} = {literal}\ndirectory = '{tmp_path / 'data'}'\n")
    one_line_error(waltz("storage", "start", "--config", str(storage)), f"{storage}: storage.{key}: {message}")
    one_line_error(waltz("config", "check", str(storage)), f"storage.{key}: {message}")
    plain = tmp_path / "plain.toml"
    plain.write_text(f"[storage]\ndirectory = '{tmp_path / 'data'}'\n")
    variable = f"WALTZ_STORAGE_{key.upper()}"
    one_line_error(waltz("storage", "start", "--config", str(plain), env={variable: value}),
                   f"environment variable {variable}: storage.{key}: {message}")
    assert not (tmp_path / "data").exists()  # nothing created on disk


def test_a_misspelt_backend_table_is_refused_with_a_suggestion(tmp_path: Path) -> None:
    config = tmp_path / "server.toml"
    config.write_text('[coordination]\nname = "zookeeper"\nconnect = "zk:2181"\n\n'
                      '[coordination.zookeepr]\nauth_scheme = "digest"\nauth_credentials = "u:p"\n')
    line = one_line_error(waltz("config", "check", str(config)),
                          f"{config}: coordination.zookeepr: [coordination.zookeepr] is not an options table",
                          "did you mean 'zookeeper'?")
    assert "registered: etcd, local, zookeeper" in line or "registered: " in line
    one_line_error(waltz("server", "start", "--config", str(config)), "coordination.zookeepr", "did you mean")


def test_an_unknown_backend_name_names_the_file_and_key(tmp_path: Path) -> None:
    config = tmp_path / "server.toml"
    config.write_text('[transport]\nname = "tpc"\n')
    one_line_error(waltz("config", "check", str(config)),
                   f"{config}: transport.name: no transport backend named 'tpc'; did you mean 'tcp'?")
    config.write_text('[server]\nlock_table = "hased"\n')
    one_line_error(waltz("config", "check", str(config)),
                   f"{config}: server.lock_table: no lock table backend named 'hased'; did you mean 'hashed'?")


def test_backend_option_tables_have_environment_overrides(tmp_path: Path) -> None:
    config = tmp_path / "cli.toml"
    config.write_text('[coordination]\nname = "local"\nconnect = "/tmp/nowhere"\n')
    result = waltz("config", "show", "-c", str(config), "--json",
                   env={"WALTZ_COORDINATION_LOCAL__POLL_INTERVAL": "0.25"})
    assert result.returncode == 0, result.stderr
    keys = {row["key"]: row for row in json.loads(result.stdout)["keys"]}
    assert keys["coordination.local.poll_interval"] == {
        "key": "coordination.local.poll_interval", "value": 0.25,
        "source": "environment variable WALTZ_COORDINATION_LOCAL__POLL_INTERVAL"}
    assert keys["coordination.connect"]["source"] == str(config)
    assert keys["coordination.root"]["source"] == "default"
    one_line_error(waltz("config", "check", str(config), env={"WALTZ_COORDINATION_LOCAL__POLL_INTERVAL": "soon"}),
                   "environment variable WALTZ_COORDINATION_LOCAL__POLL_INTERVAL: coordination.local.poll_interval: "
                   "expected a number, got 'soon'")
    one_line_error(waltz("config", "check", str(config), "--process", "server",
                         env={"WALTZ_HTTP_TCP__NODELAY": "1"}),
                   "environment variable WALTZ_HTTP_TCP__NODELAY: http has no backend option tables")
    # [server] names the lock table: its tables are the lock tables' (every backend section has them)
    one_line_error(waltz("config", "check", str(config), "--process", "server",
                         env={"WALTZ_SERVER_TCP__NODELAY": "1"}),
                   "environment variable WALTZ_SERVER_TCP__NODELAY: server.tcp: [server.tcp] is not an options "
                   "table of any lock table backend")
    # A variable of another process's section is not this process's business (one env for all).
    assert waltz("config", "check", str(config), env={"WALTZ_SERVER_TCP__NODELAY": "1"}).returncode == 0


def test_config_check(tmp_path: Path) -> None:
    good = tmp_path / "storage.toml"
    good.write_text(f"[storage]\nport = 7001\nadmin_port = 7002\ndirectory = '{tmp_path}'\n")
    result = waltz("config", "check", str(good))
    assert result.returncode == 0 and result.stdout.strip() == f"{good}: a valid storage configuration"
    both = tmp_path / "both.toml"
    both.write_text("[server]\nport = 1\n[storage]\nport = 2\n")
    one_line_error(waltz("config", "check", str(both)), "has sections of several processes", "--process")
    assert waltz("config", "check", str(both), "--process", "bogus").returncode == 2
    one_line_error(waltz("config", "check", str(tmp_path / "absent.toml")), "absent.toml: no such config file")
    one_line_error(waltz("config", "check", str(tmp_path)), "is a directory", code=2)  # click checks the path
    junk = tmp_path / "junk.toml"
    junk.write_bytes(b"\x00\xff[[[")
    one_line_error(waltz("config", "check", str(junk)), "not valid TOML")
    removed = tmp_path / "old.toml"
    removed.write_text("[server]\nfeed_cache_size = 1\n")
    one_line_error(waltz("config", "check", str(removed)), "server.feed_cache_size: removed in 0.2",
                   "server.feed_cache_budget")


# ------------------------------------------------------------------------------ disk tools


def test_disk_tools_refuse_junk_files_and_change_nothing(tmp_path: Path) -> None:
    segment = tmp_path / "0000000000000000000.seq"
    control = tmp_path / "waltz-storage.ctl"
    junk = os.urandom(4096)
    segment.write_bytes(junk)
    control.write_bytes(junk)
    one_line_error(waltz("disk", "dump-segment", str(segment)), f"{segment}: not a Waltz segment")
    one_line_error(waltz("disk", "segment-stats", str(segment)), f"{segment}: not a Waltz segment")
    one_line_error(waltz("disk", "dump-control-file", str(control)), f"{control}: not a Waltz control file")
    assert waltz("disk", "verify-segment", str(segment)).returncode == 1
    journal = tmp_path / "io-0.wal"
    journal.write_bytes(junk)
    one_line_error(waltz("disk", "dump-journal", str(journal)), f"{journal}: not a Waltz node journal")
    assert segment.read_bytes() == junk and control.read_bytes() == junk and journal.read_bytes() == junk
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0000000000000000000.seq", "io-0.wal", "waltz-storage.ctl"]


# ------------------------------------------------------------------------------ flags


@pytest.mark.parametrize(("args", "needle"), [
    (["storage", "list", "-s", "h:1"], "-s/--storage is not accepted here: in every command it is a storage node's "
                                       "data address"),
    (["cluster", "create", "-n", "x", "-p", "4"], "-p is not accepted here: in every command -p/--partition is "
                                                  "partition ids; give the count with --partitions N"),
    (["cluster", "verify", "-t", "3"], "-t is not accepted here: in every command -t is a transaction id"),
    (["disk", "dump-control-file", "-a", "x"], "-a is not accepted here"),
    (["storage", "max-transaction-id", "-a", "h:1", "-s", "h:2", "-p", "0", "--storage-port", "h:2"],
     "--storage-port is not accepted here"),
])
def test_a_flag_means_the_same_everywhere_and_old_meanings_say_what_replaced_them(args: list[str],
                                                                                  needle: str) -> None:
    one_line_error(waltz(*args), needle, code=2)


def test_bad_values_of_new_flags(tmp_path: Path) -> None:
    one_line_error(waltz("cluster", "add-storage-node", "-s", "h:1", "-a", "other:2", "-g", "0",
                         "--connect", str(tmp_path)), "the admin port is on the node's own host", code=2)
    one_line_error(waltz("cluster", "add-storage-node", "-s", "h:1", "-a", "99999", "-g", "0",
                         "--connect", str(tmp_path)), "99999 is not a port number", code=2)
    one_line_error(waltz("cluster", "verify", "--timeout", "0", "--connect", str(tmp_path)), "--timeout", code=2)
    one_line_error(waltz("client", "high-water-mark", "-p", "3-1", "--data-dir", str(tmp_path)), code=2)
    one_line_error(waltz("client", "high-water-mark", "--data-dir", str(tmp_path)), "client.toml does not exist")
