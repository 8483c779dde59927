"""The runtime: one plugin manager per process, passed down explicitly; WALTZ_PLUGINS; unsafe plugins;
one factory signature for every backend kind; the negative controls of waltz_core.testing.sabotage."""

from __future__ import annotations

import logging
import os
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest

import waltz_core
from waltz_core import plugins
from waltz_core.app.local_cluster import ClusterSpec, InProcessCluster
from waltz_core.config import CoordinationConfig, ServerConfig, StorageNodeConfig, TransportConfig
from waltz_core.coordination import open_coordination
from waltz_core.coordination.local import LocalCoordination
from waltz_core.errors import PluginError
from waltz_core.hookspecs import hookimpl
from waltz_core.locks import HashedLockTable, LockRequest, open_lock_table
from waltz_core.protocol.wire import Record, ReqId, crc32
from waltz_core.runtime import Runtime
from waltz_core.storage import memory, open_layout
from waltz_core.storage.segmented import SegmentedLayout
from waltz_core.testing import sabotage
from waltz_core.transport import open_transport
from waltz_core.transport.memory import MemoryTransport

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def clean_plugin_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("WALTZ_DISABLED_PLUGINS", "WALTZ_DISABLE_PLUGIN_AUTOLOAD", "WALTZ_TRACE_PLUGINS", "WALTZ_PLUGINS"):
        monkeypatch.delenv(var, raising=False)


def test_no_module_falls_back_to_a_process_global() -> None:
    assert not hasattr(plugins, "default_registries") and not hasattr(plugins, "default_plugin_manager")
    offenders = [str(path.relative_to(ROOT)) for base in ("waltz_core", "plugins") for path in (ROOT / base).rglob("*.py")
                 if "default_registries" in path.read_text() or "default_plugin_manager" in path.read_text()]
    assert offenders == []


def test_a_runtime_is_a_plugin_manager_and_the_registries_it_filled() -> None:
    runtime = Runtime.load(autoload=False)
    assert runtime.hook is runtime.plugin_manager.hook
    assert {"memory"} <= set(runtime.registries.transport.names())
    assert runtime.registries.resolve("storage_layout", "segmented").plugin == "waltz_core.storage.plugin"
    assert runtime.unsafe == {}
    assert waltz_core.Runtime is Runtime


# ------------------------------------------------------------------------------- WALTZ_PLUGINS

EXTRA_PLUGIN = '''
from waltz_core import hookimpl


def factory(config, options):
    raise NotImplementedError


@hookimpl
def waltz_register_lock_tables(registry):
    registry.add("from-env", factory, description="registered through WALTZ_PLUGINS")
'''


def test_waltz_plugins_registers_modules_and_objects_in_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "env_waltz_plugin.py").write_text(textwrap.dedent(EXTRA_PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("WALTZ_PLUGINS", "env_waltz_plugin, waltz_core.testing.sabotage:no_fsync")
    runtime = Runtime.load(autoload=False)
    assert runtime.registries.resolve("lock_table", "from-env").plugin == "env_waltz_plugin"
    no_fsync = runtime.registries.resolve("storage_layout", sabotage.NO_FSYNC)
    assert no_fsync.plugin == "waltz_core.testing.sabotage:no_fsync"
    assert runtime.plugin_manager.get_plugin("waltz_core.testing.sabotage:no_fsync") is sabotage.no_fsync
    assert list(runtime.unsafe) == ["waltz_core.testing.sabotage:no_fsync"]
    # blocked like any other plugin, by the name it was given
    monkeypatch.setenv("WALTZ_DISABLED_PLUGINS", "waltz_core.testing.sabotage:no_fsync")
    assert sabotage.NO_FSYNC not in Runtime.load(autoload=False).registries.storage_layout


@pytest.mark.parametrize("spec", ["no_such_module_anywhere", "waltz_core.testing.sabotage:nothing_here"])
def test_a_waltz_plugins_entry_that_does_not_load_names_itself(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WALTZ_PLUGINS", spec)
    with pytest.raises(PluginError, match=f"WALTZ_PLUGINS: cannot load plugin '{spec}'"):
        Runtime.load(autoload=False)


def test_unsafe_plugins_are_listed_and_logged_loudly(caplog: pytest.LogCaptureFixture) -> None:
    runtime = Runtime.load(autoload=False, extra=[sabotage.no_lock_check])
    name = runtime.plugin_manager.get_name(sabotage.no_lock_check)
    assert runtime.unsafe == {name: sabotage.NoLockCheck.WALTZ_UNSAFE}
    with caplog.at_level(logging.WARNING):
        runtime.warn_unsafe(logging.getLogger("waltz.test"), "this test")
    assert [r.getMessage() for r in caplog.records] == [
        f"UNSAFE: plugin {name} is loaded into this test: {sabotage.NoLockCheck.WALTZ_UNSAFE}. For negative-control "
        "tests only; never run it in production."]


# ------------------------------------------------------------------- one factory signature


def test_every_backend_kind_is_built_from_its_section_and_its_options_table(tmp_path: Path) -> None:
    registries = Runtime.load(autoload=False).registries
    transport = open_transport(TransportConfig(name="memory", max_frame_size=2048,
                                               options={"memory": {"queue_frames": 8}}), registries)
    assert isinstance(transport, MemoryTransport) and transport.max_frame_size == 2048
    coordination = open_coordination(CoordinationConfig(name="local", connect=str(tmp_path / "coord"),
                                                        options={"local": {"poll_interval": 0.5}}), registries)
    assert isinstance(coordination, LocalCoordination) and coordination._options.poll_interval == 0.5
    layout = open_layout(StorageNodeConfig(directory=str(tmp_path / "seg"), segment_size_threshold=4096), registries)
    assert isinstance(layout, SegmentedLayout) and layout.directory == str(tmp_path / "seg")
    table = open_lock_table(ServerConfig(lock_table_size=64, lock_hash_count=2), 41, registries)
    assert isinstance(table, HashedLockTable) and (table.size, table.estimate(LockRequest((7,)))) == (64, 41)


# ------------------------------------------------------------------------ negative controls


def test_sabotage_environment_adds_to_waltz_plugins_and_selects_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    assert sabotage.environment("no-lock-check") == {
        "WALTZ_PLUGINS": "waltz_core.testing.sabotage:no_lock_check", "WALTZ_SERVER_LOCK_TABLE": sabotage.NO_LOCK_CHECK}
    monkeypatch.setenv("WALTZ_PLUGINS", "mine")
    assert sabotage.environment("ack-before-quorum") == {
        "WALTZ_PLUGINS": "mine,waltz_core.testing.sabotage:ack_before_quorum"}
    with pytest.raises(ValueError, match="unknown negative control 'no-brakes'"):
        sabotage.environment("no-brakes")


def test_the_no_lock_check_table_never_reports_a_conflict() -> None:
    registries = Runtime.load(autoload=False, extra=[sabotage.no_lock_check]).registries
    table = open_lock_table(ServerConfig(lock_table=sabotage.NO_LOCK_CHECK), 10, registries)
    assert isinstance(table, sabotage.NoLockCheckTable)
    assert table.estimate(LockRequest((1,))) == 10 and table.check(LockRequest((1,)), -1) is None


def test_the_no_fsync_layout_skips_only_the_append_sync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    registries = Runtime.load(autoload=False, extra=[sabotage.no_fsync]).registries
    syncs: list[int] = []
    real = os.fdatasync

    def counting(fd: int) -> None:
        syncs.append(fd)
        real(fd)

    def appended_syncs(layout_name: str) -> int:
        layout = open_layout(StorageNodeConfig(directory=str(tmp_path / layout_name), layout=layout_name), registries)
        layout.open(uuid.uuid4(), 1)
        store = layout.open_partition(0)
        store.append([Record(0, ReqId(1, 1, 0, 0), 0, b"a", crc32(b"a"))])  # the first creates the segment
        monkeypatch.setattr(os, "fdatasync", counting)
        store.append([Record(1, ReqId(1, 1, 0, 1), 0, b"b", crc32(b"b"))])
        monkeypatch.setattr(os, "fdatasync", real)
        store.close()
        layout.close()
        count = len(syncs)
        syncs.clear()
        return count

    assert appended_syncs("segmented") == 1
    assert appended_syncs(sabotage.NO_FSYNC) == 0


class LifecycleRecorder:
    """Records the lifecycle hooks it receives."""

    def __init__(self) -> None:
        self.events: list[tuple[str, ...]] = []

    @hookimpl
    def waltz_process_started(self, kind: str, name: str) -> None:
        self.events.append(("started", kind))

    @hookimpl
    def waltz_process_stopping(self, kind: str) -> None:
        self.events.append(("stopping", kind))

    @hookimpl
    def waltz_partition_opened(self, partition_id: int) -> None:
        self.events.append(("opened", str(partition_id)))


@pytest.mark.timeout(90)
async def test_lifecycle_hooks_and_the_commit_rule_are_those_of_the_cluster_s_runtime(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    recorder = LifecycleRecorder()
    runtime = Runtime.load(extra=[recorder, sabotage.ack_before_quorum])
    spec = ClusterSpec(tmp_path / "cluster", num_partitions=1, num_storages=3, num_servers=1,
                       storage_overrides={"layout": "memory"}, runtime=runtime)
    try:
        with caplog.at_level(logging.WARNING, logger="waltz"):
            async with InProcessCluster(spec) as cluster:
                store: Any = cluster.servers[0].partitions[0].store
                assert store.session.quorum == 1  # the plugin's rule, not the majority of 3
        assert recorder.events.count(("started", "storage")) == 3
        assert ("started", "server") in recorder.events and ("opened", "0") in recorder.events
        assert recorder.events.count(("stopping", "storage")) == 3 and ("stopping", "server") in recorder.events
        unsafe = [r.getMessage() for r in caplog.records if r.getMessage().startswith("UNSAFE: plugin")]
        assert len(unsafe) == 4 and all("ONE replica's acknowledgement" in line for line in unsafe)
    finally:
        for i in range(len(spec.storages)):
            memory.discard(spec.storage_config(i).storage.directory)
