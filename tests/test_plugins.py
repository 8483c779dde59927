"""Plugin framework: built-ins, entry points, validation, name resolution, environment switches."""

from __future__ import annotations

import json
import logging
import sys
import textwrap
import types
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from waltz_core.cli.main import build_cli
from waltz_core.errors import BackendNotFoundError, PluginError
from waltz_core.hookspecs import hookimpl
from waltz_core.plugins import (
    BUILTIN_PLUGINS,
    REGISTRY_HOOKS,
    get_plugin_manager,
    incompatible_plugins,
    load_registries,
)

#: The single source of every distribution's version.
VERSION = (Path(__file__).resolve().parent.parent / "VERSION").read_text().strip()


@pytest.fixture(autouse=True)
def clean_plugin_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # the developer's shell must not change what these tests see
    for var in ("WALTZ_DISABLED_PLUGINS", "WALTZ_DISABLE_PLUGIN_AUTOLOAD", "WALTZ_TRACE_PLUGINS", "WALTZ_PLUGINS"):
        monkeypatch.delenv(var, raising=False)


def plugin_names(pm: Any) -> set[str]:
    return {name for name, plugin in pm.list_name_plugin() if plugin is not None}


def test_builtins_are_loaded_and_register_backends() -> None:
    pm = get_plugin_manager(autoload=False)
    assert set(BUILTIN_PLUGINS) <= plugin_names(pm)
    regs = load_registries(pm)
    memory = regs.resolve("transport", "memory")
    assert memory.plugin == "waltz_core.transport.plugin"
    assert memory.distribution.startswith("waltz-core ") and memory.distribution.endswith("(built-in)")
    assert "local" in regs.coordination
    assert {info.kind for info in regs.all()} <= set(REGISTRY_HOOKS)


def test_installed_entry_point_plugins_are_loaded() -> None:
    pm = get_plugin_manager()
    assert {"transport-tcp", "transport-zmq", "coord-zookeeper", "coord-etcd", "spark-sink"} <= plugin_names(pm)
    tcp = load_registries(pm).resolve("transport", "tcp")
    assert tcp.plugin == "transport-tcp"
    assert tcp.distribution.startswith("waltz-transport-tcp ")


def test_check_pending_catches_a_misspelled_hookimpl() -> None:
    misspelled = types.ModuleType("misspelled_plugin")

    @hookimpl
    def waltz_register_transprots(registry: Any) -> None:  # typo: not a hook
        pass

    misspelled.waltz_register_transprots = waltz_register_transprots  # type: ignore[attr-defined]
    with pytest.raises(PluginError, match="waltz_register_transprots"):
        get_plugin_manager(autoload=False, extra=[misspelled])


def test_hookimpl_with_an_unknown_argument_is_a_plugin_error() -> None:
    class BadArgs:
        @hookimpl
        def waltz_register_transports(self, registry: Any, colour: str) -> None:
            pass

    with pytest.raises(PluginError, match="colour"):
        get_plugin_manager(autoload=False, extra=[BadArgs()])


def test_unknown_backend_lists_installed_names() -> None:
    regs = load_registries(get_plugin_manager())
    with pytest.raises(BackendNotFoundError) as info:
        regs.resolve("transport", "carrier-pigeon")
    msg = str(info.value)
    assert "transport 'carrier-pigeon' not found" in msg
    assert "memory" in msg and "tcp" in msg
    assert "waltz plugins" in msg


def test_known_backend_of_a_blocked_plugin_names_its_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WALTZ_DISABLED_PLUGINS", "coord-etcd, transport-tcp")
    pm = get_plugin_manager()
    assert "coord-etcd" not in plugin_names(pm) and pm.is_blocked("coord-etcd")
    regs = load_registries(pm)
    with pytest.raises(BackendNotFoundError, match=r"coordination 'etcd' not found; installed: .*local.*"
                                                   r"It is provided by waltz-coord-etcd \(pip install 'waltz-core\[etcd\]'\)"):
        regs.resolve("coordination", "etcd")
    with pytest.raises(BackendNotFoundError, match="waltz-transport-tcp"):
        regs.resolve("transport", "tcp")


def test_unknown_kind_is_a_plugin_error() -> None:
    regs = load_registries(get_plugin_manager(autoload=False))
    with pytest.raises(PluginError, match="unknown backend kind 'teleport'; kinds: transport, coordination"):
        regs.resolve("teleport", "x")


def test_disable_autoload(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WALTZ_DISABLE_PLUGIN_AUTOLOAD", "1")
    names = plugin_names(get_plugin_manager())
    assert set(BUILTIN_PLUGINS) <= names  # built-ins never depend on autoload
    assert "transport-tcp" not in names
    monkeypatch.setenv("WALTZ_DISABLE_PLUGIN_AUTOLOAD", "0")
    assert "transport-tcp" in plugin_names(get_plugin_manager())


def test_disabled_plugins_may_block_a_builtin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WALTZ_DISABLED_PLUGINS", "waltz_core.transport.plugin")
    pm = get_plugin_manager(autoload=False)
    assert "waltz_core.transport.plugin" not in plugin_names(pm)
    assert "memory" not in load_registries(pm).transport


def test_duplicate_registration_is_a_clear_plugin_error() -> None:
    class SecondMemory:
        @hookimpl
        def waltz_register_transports(self, registry: Any) -> None:
            registry.add("memory", object, description="an impostor")

    pm = get_plugin_manager(autoload=False, extra=[SecondMemory()])
    with pytest.raises(PluginError, match=r"transport 'memory' is registered twice: by 'waltz_core.transport.plugin' "
                                          r"\(waltz-core .*\) and by '\d+' \(unknown \(registered directly\)\); "
                                          r"block one with WALTZ_DISABLED_PLUGINS"):
        load_registries(pm)


def test_duplicates_blame_the_later_plugin_whatever_pluggy_s_call_order() -> None:
    # pluggy calls LIFO: a plugin registered later runs first; the loader calls in registration order.
    class First:
        @hookimpl(tryfirst=True)  # pluggy's order puts it last; registration order does not
        def waltz_register_lock_tables(self, registry: Any) -> None:
            registry.add("twin", object)

    class Second:
        @hookimpl
        def waltz_register_lock_tables(self, registry: Any) -> None:
            registry.add("twin", object)

    first, second = First(), Second()
    pm = get_plugin_manager(autoload=False, extra=[first, second])
    with pytest.raises(PluginError, match=rf"lock_table 'twin' is registered twice: by '{pm.get_name(first)}' .* "
                                          rf"and by '{pm.get_name(second)}'"):
        load_registries(pm)


def test_registration_hooks_go_through_pluggy_tracing_and_wrappers(monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    seen: list[list[str]] = []

    class Wrapper:
        @hookimpl(wrapper=True)
        def waltz_register_transports(self, registry: Any) -> Any:
            before = registry.names()
            result = yield
            seen.append(sorted(set(registry.names()) - set(before)))  # what the wrapped call added
            return result

    monkeypatch.setenv("WALTZ_TRACE_PLUGINS", "1")
    with caplog.at_level(logging.INFO, logger="waltz.plugins"):
        regs = load_registries(get_plugin_manager(autoload=False, extra=[Wrapper()]))
    assert ["memory"] in seen  # the built-in's call was wrapped (one call per implementing plugin)
    assert regs.resolve("transport", "memory").plugin == "waltz_core.transport.plugin"
    assert any("waltz_register_transports" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("bad_name", ["", "has space", "semi;colon"])
def test_backend_names_must_be_identifiers(bad_name: str) -> None:
    class BadName:
        @hookimpl
        def waltz_register_lock_tables(self, registry: Any) -> None:
            registry.add(bad_name, object)

    with pytest.raises(PluginError, match="is not a plain identifier"):
        load_registries(get_plugin_manager(autoload=False, extra=[BadName()]))


def test_config_cls_must_be_an_attrs_class() -> None:
    class NotAttrs:
        pass

    class BadOptions:
        @hookimpl
        def waltz_register_lock_tables(self, registry: Any) -> None:
            registry.add("odd", object, config_cls=NotAttrs)

    with pytest.raises(PluginError, match="config_cls must be an attrs class"):
        load_registries(get_plugin_manager(autoload=False, extra=[BadOptions()]))


# ----------------------------------------------------------------------- third-party plugin

ACME_PLUGIN = '''
"""A third-party transport plugin, installed only for this test."""
from waltz_core import hookimpl


class AcmeTransport:
    def __init__(self, config, options):
        self.config = config


@hookimpl
def waltz_register_transports(registry):
    registry.add("acme", AcmeTransport, description="ACME rocket-powered frames")
'''


@pytest.fixture
def acme_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A distribution ``acme_waltz_transport 0.1`` on sys.path, registering transport ``acme``."""
    (tmp_path / "acme_waltz_transport.py").write_text(textwrap.dedent(ACME_PLUGIN))
    dist_info = tmp_path / "acme_waltz_transport-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme_waltz_transport\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text("[waltz]\nacme = acme_waltz_transport\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "acme_waltz_transport", raising=False)
    return tmp_path


def test_third_party_plugin_is_found_through_its_entry_point(acme_plugin: Path) -> None:
    regs = load_registries(get_plugin_manager())
    acme = regs.resolve("transport", "acme")
    assert acme.plugin == "acme"
    assert acme.distribution == "acme_waltz_transport 0.1"
    assert acme.description == "ACME rocket-powered frames"


def test_waltz_plugins_json_lists_the_third_party_plugin(acme_plugin: Path) -> None:
    result = CliRunner().invoke(build_cli(), ["plugins", "--json"])
    assert result.exit_code == 0, result.output
    listing = json.loads(result.output)
    assert {"name": "acme", "distribution": "acme_waltz_transport 0.1"} in listing["plugins"]
    acme = [b for b in listing["backends"] if b["name"] == "acme"]
    assert acme == [{"kind": "transport", "name": "acme", "plugin": "acme", "distribution": "acme_waltz_transport 0.1",
                     "description": "ACME rocket-powered frames"}]


def test_third_party_plugin_is_not_loaded_without_autoload(acme_plugin: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WALTZ_DISABLE_PLUGIN_AUTOLOAD", "yes")
    assert "acme" not in load_registries(get_plugin_manager()).transport


def test_a_plugin_that_fails_to_import_names_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "broken_waltz_plugin.py").write_text("raise RuntimeError('kaboom at import')\n")
    dist_info = tmp_path / "broken_waltz_plugin-2.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken_waltz_plugin\nVersion: 2.0\n")
    (dist_info / "entry_points.txt").write_text("[waltz]\nbroken = broken_waltz_plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError, match="kaboom at import"):
        get_plugin_manager()


def test_waltz_plugins_table_lists_tcp_and_builtins() -> None:
    result = CliRunner().invoke(build_cli(), ["plugins"], terminal_width=200)
    assert result.exit_code == 0, result.output
    out = result.output
    assert "transport-tcp" in out
    assert f"waltz-transport-tcp {VERSION}" in out
    assert "waltz_core.transport.plugin" in out and "memory" in out
    tcp_rows = [line for line in out.splitlines() if " tcp " in line]
    assert len(tcp_rows) == 1 and "transport-tcp" in tcp_rows[0]  # the tcp backend row names its plugin


def test_waltz_plugins_json_lists_every_plugin_with_its_distribution() -> None:
    result = CliRunner().invoke(build_cli(), ["plugins", "--json"])
    assert result.exit_code == 0, result.output
    listing = json.loads(result.output)
    by_name = {p["name"]: p["distribution"] for p in listing["plugins"]}
    assert by_name["transport-tcp"].startswith("waltz-transport-tcp ")
    for builtin in BUILTIN_PLUGINS:
        assert by_name[builtin].endswith("(built-in)")
    assert {"kind": "transport", "name": "tcp"}.items() <= next(
        b for b in listing["backends"] if b["name"] == "tcp").items()


# ----------------------------------------------------------------------- supported core versions


@pytest.fixture
def picky_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A distribution ``picky_waltz_plugin 3.0`` (no hooks) that supports waltz-core 99 only."""
    (tmp_path / "picky_waltz_plugin.py").write_text('"""Supports a core that does not exist yet."""\n')
    dist_info = tmp_path / "picky_waltz_plugin-3.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: picky_waltz_plugin\nVersion: 3.0\n"
        "Requires-Dist: waltz-core<100,>=99\n"
        'Requires-Dist: waltz-core[testing]<0.0.1; extra == "test"\n')
    (dist_info / "entry_points.txt").write_text("[waltz]\npicky = picky_waltz_plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "picky_waltz_plugin", raising=False)
    return tmp_path


def test_a_plugin_that_excludes_the_running_core_is_one_warning_not_a_crash(
        picky_plugin: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="waltz.plugins"):
        pm = get_plugin_manager()
    warnings = [r.getMessage() for r in caplog.records if r.name == "waltz.plugins"]
    # one line, for the main requirement; the one behind the plugin's "test" extra does not count
    assert warnings == [f"plugin distribution picky_waltz_plugin 3.0 requires waltz-core<100,>=99, but waltz-core "
                        f"{VERSION} is running: upgrade the plugin or pin waltz-core"]
    assert "tcp" in load_registries(pm).transport


def test_the_plugins_of_this_repository_support_this_core_and_only_its_minor_series(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="waltz.plugins"):
        pm = get_plugin_manager()
    assert not [r for r in caplog.records if r.name == "waltz.plugins"]
    assert incompatible_plugins(pm, VERSION) == []
    major, minor, _ = VERSION.split(".")
    refusing = {dist.split()[0] for dist, _ in incompatible_plugins(pm, f"{major}.{int(minor) + 1}.0")}
    assert {"waltz-transport-tcp", "waltz-transport-zmq", "waltz-coord-zookeeper", "waltz-coord-etcd",
            "waltz-spark"} <= refusing


def test_without_packaging_the_check_is_skipped(picky_plugin: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pm = get_plugin_manager()
    assert incompatible_plugins(pm, VERSION)
    monkeypatch.setitem(sys.modules, "packaging.requirements", None)  # import fails as if not installed
    assert incompatible_plugins(pm, VERSION) == []


def test_the_core_version_is_read_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server gives its version in every client handshake: reading the installed metadata each
    time cost 0.66 ms and a file, and failed the handshake in a process out of descriptors."""
    import importlib.metadata

    from waltz_core.plugins import core_version

    first = core_version()
    calls: list[str] = []

    def no_more_reads(name: str) -> str:
        calls.append(name)
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(importlib.metadata, "version", no_more_reads)
    assert [core_version() for _ in range(3)] == [first] * 3
    assert calls == []
