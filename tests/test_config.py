"""Configuration: TOML files, WALTZ_* overrides, validation messages, backend options, schema, defaults."""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import attrs
import pytest
from click.testing import CliRunner

from waltz_core.cli.main import build_cli
from waltz_core.config import (
    PROCESS_CONFIGS,
    CliConfig,
    ClientConfig,
    ClientProcessConfig,
    ServerConfig,
    ServerProcessConfig,
    StorageNodeConfig,
    StorageProcessConfig,
    TransportConfig,
    backend_options,
    build,
    load,
)
from waltz_core.errors import ConfigError
from waltz_core.plugins import get_plugin_manager, load_registries
from waltz_core.transport import open_transport
from waltz_core.transport.memory import MemoryOptions

NO_ENV: dict[str, str] = {}


def write(tmp_path: Path, text: str, name: str = "server.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_toml_file_is_loaded(tmp_path: Path) -> None:
    path = write(tmp_path, """
[server]
port = 6000
lock_table_size = 1_000
preferred_partitions = [1, 3]

[transport]
name = "memory"
connect_timeout = 2

[coordination]
name = "zookeeper"
connect = "127.0.0.1:21810"
""")
    cfg = load(ServerProcessConfig, path, environ=NO_ENV)
    assert cfg.server.port == 6000
    assert cfg.server.lock_table_size == 1000
    assert cfg.server.preferred_partitions == [1, 3]
    assert cfg.server.host == "127.0.0.1"  # untouched keys keep their defaults
    assert cfg.transport.name == "memory"
    assert cfg.transport.connect_timeout == 2.0 and isinstance(cfg.transport.connect_timeout, float)
    assert cfg.coordination.connect == "127.0.0.1:21810"


def test_no_file_gives_the_defaults() -> None:
    assert load(ServerProcessConfig, environ=NO_ENV) == ServerProcessConfig()


def test_environment_overrides_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, "[server]\nport = 6000\nhost = '10.0.0.1'\n")
    monkeypatch.setenv("WALTZ_SERVER_PORT", "7000")
    monkeypatch.setenv("WALTZ_COORDINATION_ROOT", "/other")
    monkeypatch.setenv("WALTZ_SERVER_PREFERRED_PARTITIONS", "4, 5")
    monkeypatch.setenv("WALTZ_DISABLED_PLUGINS", "none")  # a plugin switch, not a config key: ignored
    cfg = load(ServerProcessConfig, path)
    assert cfg.server.port == 7000
    assert cfg.server.host == "10.0.0.1"
    assert cfg.server.preferred_partitions == [4, 5]
    assert cfg.coordination.root == "/other"


def test_environment_sections_of_other_processes_are_ignored() -> None:
    cfg = load(ClientProcessConfig, environ={"WALTZ_SERVER_PORT": "not even a number", "WALTZ_CLIENT_AUTO_MOUNT": "off"})
    assert cfg.client.auto_mount is False


def test_explicit_overrides_beat_the_environment() -> None:
    cfg = load(ServerProcessConfig, environ={"WALTZ_SERVER_PORT": "7000"}, overrides={"server": {"port": 8000}})
    assert cfg.server.port == 8000


def test_bad_type_names_the_file_and_the_key(tmp_path: Path) -> None:
    path = write(tmp_path, "[server]\nport = 'eighty'\n")
    with pytest.raises(ConfigError, match=rf"^{path}: server\.port: expected an integer, got 'eighty'$"):
        load(ServerProcessConfig, path, environ=NO_ENV)


@pytest.mark.parametrize(("toml", "message"), [
    ("[client]\nauto_mount = 3\n", r"client\.auto_mount: expected true or false, got 3"),
    ("[client]\nmount_timeout = 'soon'\n", r"client\.mount_timeout: expected a number"),
    ("[transport]\nname = 5\n", r"transport\.name: expected a string, got 5"),
    ("[client]\nmax_concurrent_transactions = true\n", r"client\.max_concurrent_transactions: expected an integer"),
    ("client = 5\n", r"client: expected a table, got 5"),
])
def test_type_errors(tmp_path: Path, toml: str, message: str) -> None:
    path = write(tmp_path, toml, "client.toml")
    with pytest.raises(ConfigError, match=rf"client\.toml: {message}"):
        load(ClientProcessConfig, path, environ=NO_ENV)


def test_bad_environment_value_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"server\.port: expected an integer, got 'x'"):
        load(ServerProcessConfig, environ={"WALTZ_SERVER_PORT": "x"})


def test_a_non_table_section_with_an_environment_override_is_a_config_error(tmp_path: Path) -> None:
    path = write(tmp_path, "server = 5\n")
    with pytest.raises(ConfigError, match=r"server\.toml: server: expected a table, got 5"):
        load(ServerProcessConfig, path, environ={"WALTZ_SERVER_PORT": "1"})


def test_unknown_key_lists_the_known_keys(tmp_path: Path) -> None:
    path = write(tmp_path, "[server]\nprot = 1\n")
    with pytest.raises(ConfigError) as info:
        load(ServerProcessConfig, path, environ=NO_ENV)
    msg = str(info.value)
    assert msg.startswith(f"{path}: server.prot: unknown key; did you mean 'port'? (known keys of [server]: ")
    for f in attrs.fields(ServerConfig):
        assert f.name in msg or f.name == "options"  # the lock tables' option tables, not a key


def test_unknown_section_lists_the_sections(tmp_path: Path) -> None:
    path = write(tmp_path, "[sever]\nport = 1\n")
    with pytest.raises(ConfigError, match=r"sever: unknown key; did you mean 'server'\? "
                                          r"\(known keys: coordination, http, process, security, server, transport\)"):
        load(ServerProcessConfig, path, environ=NO_ENV)


@pytest.mark.parametrize("own_table", ["[client]\nmax_concurrent_transactions = 7",
                                       "[server]\nport = 55180\n[http]\nport = 0",
                                       "[storage]\nport = 55280\ndirectory = '/var/lib/waltz'\n[security]\ninsecure = true"])
def test_a_client_or_node_config_works_as_the_command_lines(tmp_path: Path, own_table: str) -> None:
    """`waltz cluster verify -c client.toml` (the file `waltz up` writes), or `waltz storage
    sync-partitions -c /etc/waltz/storage.toml` on a storage host: the command line takes the
    file's transport and coordination and leaves the process's own tables alone."""
    path = write(tmp_path, f"{own_table}\n[transport]\nname = 'memory'\n[coordination]\nconnect = '/c'\nroot = '/w'\n")
    cli = load(CliConfig, path, environ=NO_ENV)
    assert (cli.transport.name, cli.coordination.connect, cli.coordination.root) == ("memory", "/c", "/w")
    with pytest.raises(ConfigError, match=r"clinet: unknown key \(known keys: coordination, transport\)"):
        load(CliConfig, write(tmp_path, "[clinet]\nx = 1\n"), environ=NO_ENV)


def test_unknown_env_key_of_a_known_section_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"environment variable WALTZ_SERVER_PROT: unknown key server\.prot; did "
                                          r"you mean 'port'\? \(known: WALTZ_SERVER_HOST, WALTZ_SERVER_PORT, "):
        load(ServerProcessConfig, environ={"WALTZ_SERVER_PROT": "1"})


def test_missing_and_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such config file"):
        load(ServerProcessConfig, tmp_path / "absent.toml", environ=NO_ENV)
    path = write(tmp_path, "[server\nport = 1\n")
    with pytest.raises(ConfigError, match=rf"{path}: not valid TOML"):
        load(ServerProcessConfig, path, environ=NO_ENV)


# --------------------------------------------------------------------------- backend options


def test_backend_options_table_is_validated_by_the_backends_options_class(tmp_path: Path) -> None:
    path = write(tmp_path, "[transport]\nname = 'memory'\n\n[transport.memory]\nqueue_frames = 8\n")
    cfg = load(ServerProcessConfig, path, environ=NO_ENV)
    assert cfg.transport.options == {"memory": {"queue_frames": 8}}
    assert backend_options(MemoryOptions, cfg.transport, "transport") == MemoryOptions(queue_frames=8)
    transport = open_transport(cfg.transport, load_registries(get_plugin_manager(autoload=False)))
    assert transport.options == MemoryOptions(queue_frames=8)  # type: ignore[attr-defined]


@pytest.mark.parametrize(("table", "message"), [
    ({"queue_frames": "many"}, r"transport\.memory\.queue_frames: expected an integer, got 'many'"),
    ({"queue_size": 8}, r"transport\.memory\.queue_size: unknown key; did you mean 'queue_frames'\? "
                        r"\(known keys of \[transport\.memory\]: queue_frames\)"),
])
def test_bad_backend_options(table: dict[str, Any], message: str) -> None:
    cfg = build(TransportConfig, {"name": "memory", "memory": table})
    regs = load_registries(get_plugin_manager(autoload=False))
    with pytest.raises(ConfigError, match=message):
        open_transport(cfg, regs)


def test_options_for_a_backend_without_options_are_refused() -> None:
    section = build(TransportConfig, {"name": "plain", "plain": {"x": 1}})
    with pytest.raises(ConfigError, match=r"transport\.plain: this backend takes no options"):
        backend_options(None, section, "transport")
    assert backend_options(None, build(TransportConfig, {"name": "plain"}), "transport") is None


# ------------------------------------------------------------------------------------ schema


def dotted_keys(cls: type, prefix: str = "") -> list[str]:
    """Every leaf key of an attrs config class, independently of waltz_core.config.schema()."""
    hints = typing.get_type_hints(cls)
    out: list[str] = []
    for f in attrs.fields(cls):
        if attrs.has(hints[f.name]):
            out += dotted_keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            out.append(f"{prefix}{f.name}")
    return out


def test_config_schema_prints_every_key() -> None:
    result = CliRunner().invoke(build_cli(), ["config", "schema"])
    assert result.exit_code == 0, result.output
    sections = result.output.split("\n[")
    for process, cls in PROCESS_CONFIGS.items():
        section = next(s for s in sections if s.lstrip("[").startswith(f"{process}]"))
        printed = {line.split()[0] for line in section.splitlines()[1:] if line.startswith("  ")}
        missing = set(dotted_keys(cls)) - printed
        assert not missing, f"[{process}] lacks {missing}"
    # each line carries type, default and the doc
    port_line = next(line for line in result.output.splitlines() if line.strip().startswith("server.port "))
    assert "int" in port_line and "default 55180" in port_line and "Client port" in port_line
    # backend options are listed with the distribution that provides them
    assert "[transport.memory]" in result.output and "queue_frames" in result.output


def test_config_schema_markdown_for_one_process() -> None:
    result = CliRunner().invoke(build_cli(), ["config", "schema", "client", "--markdown"])
    assert result.exit_code == 0, result.output
    assert "## `client` process" in result.output
    assert "## `server` process" not in result.output
    for key in dotted_keys(ClientProcessConfig):
        assert f"| `{key}` |" in result.output


def test_every_key_is_documented() -> None:
    def walk(cls: type) -> list[tuple[str, Any]]:
        hints = typing.get_type_hints(cls)
        out = []
        for f in attrs.fields(cls):
            out.append((f"{cls.__name__}.{f.name}", f.metadata.get("doc")))
            if attrs.has(hints[f.name]):
                out += walk(hints[f.name])
        return out

    undocumented = [name for cls in PROCESS_CONFIGS.values() for name, doc in walk(cls) if not doc]
    assert undocumented == []


# ---------------------------------------------------------------------------------- defaults


def test_defaults_follow_the_original() -> None:
    server = ServerConfig()
    assert (server.lock_table_size, server.lock_hash_count) == (30_000, 3)
    assert server.max_batch_size == 100
    assert server.checkpoint_interval == 250_000
    storage = StorageNodeConfig()
    assert storage.segment_size_threshold == 1_000_000_000
    assert storage.max_batch_records == 100
    assert ClientConfig().max_concurrent_transactions == 5
    assert StorageProcessConfig().storage == storage


def test_list_defaults_are_not_shared_between_instances() -> None:
    a, b = ServerConfig(), ServerConfig()
    a.preferred_partitions.append(1)
    assert b.preferred_partitions == []
