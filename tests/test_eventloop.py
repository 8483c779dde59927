"""The event loop a process runs on: ``[process] event_loop`` (auto, asyncio, uvloop).

uvloop is a test dependency (``waltz-core[testing]``), so ``auto`` is expected to find it here; a
missing uvloop is simulated by hiding the module.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import uuid
import warnings
from pathlib import Path

import pytest

from waltz_core.config import StorageProcessConfig, load
from waltz_core.errors import ConfigError
from waltz_core.eventloop import event_loop_from_env, loop_factory, loop_name, run
from waltz_core.metrics import process_registry
from waltz_core.ports import free_ports

WALTZ = [sys.executable, "-m", "waltz_core.cli"]
NO_WALTZ_ENV = {k: v for k, v in os.environ.items() if not k.startswith("WALTZ_")}


@pytest.fixture
def no_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    """uvloop cannot be imported (``import uvloop`` raises ImportError)."""
    monkeypatch.setitem(sys.modules, "uvloop", None)


async def _which() -> tuple[str, str]:
    return loop_name(), type(asyncio.get_running_loop()).__module__


def test_auto_and_uvloop_run_on_uvloop_when_installed() -> None:
    for name in ("auto", "uvloop"):
        which, module = run(_which(), name)
        assert which == "uvloop" and module.startswith("uvloop"), (name, module)


def test_asyncio_runs_on_the_standard_loop_even_with_uvloop_installed() -> None:
    which, module = run(_which(), "asyncio")
    assert which == "asyncio" and module.startswith("asyncio"), module


def test_auto_falls_back_to_asyncio_without_uvloop(no_uvloop: None) -> None:
    assert run(_which(), "auto")[0] == "asyncio"


def test_uvloop_asked_for_but_missing_is_a_config_error_that_says_how_to_install_it(no_uvloop: None) -> None:
    with pytest.raises(ConfigError, match=r"uvloop is not installed: pip install 'waltz-core\[speedups\]'"):
        loop_factory("uvloop")


def test_a_refused_run_closes_its_coroutine() -> None:
    coro = _which()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "coroutine ... was never awaited" would be an error here
        with pytest.raises(ConfigError, match="must be one of auto, asyncio, uvloop"):
            run(coro, "trio")
    assert coro.cr_frame is None  # closed


def test_run_returns_the_result_and_propagates_errors() -> None:
    async def fail() -> None:
        raise ValueError("boom")

    assert run(asyncio.sleep(0, result=7)) == 7
    with pytest.raises(ValueError, match="boom"):
        run(fail(), "asyncio")


def test_the_environment_variable_of_waltz_perf() -> None:
    assert event_loop_from_env({}) == "auto"
    assert event_loop_from_env({"WALTZ_PROCESS_EVENT_LOOP": " "}) == "auto"
    assert event_loop_from_env({"WALTZ_PROCESS_EVENT_LOOP": "asyncio"}) == "asyncio"
    with pytest.raises(ConfigError, match=r"environment variable WALTZ_PROCESS_EVENT_LOOP='libuv': must be one of"):
        event_loop_from_env({"WALTZ_PROCESS_EVENT_LOOP": "libuv"})


def test_the_config_key_is_validated_where_it_is_declared(tmp_path: Path) -> None:
    assert load(StorageProcessConfig, None, environ={}).process.event_loop == "auto"
    assert load(StorageProcessConfig, None, environ={"WALTZ_PROCESS_EVENT_LOOP": "asyncio"}).process.event_loop \
        == "asyncio"
    bad = tmp_path / "storage.toml"
    bad.write_text('[process]\nevent_loop = "uv"\n')
    with pytest.raises(ConfigError, match=r"process\.event_loop: must be one of auto, asyncio, uvloop, got 'uv'"):
        load(StorageProcessConfig, bad, environ={})


def test_build_info_names_the_loop() -> None:
    async def labels() -> dict[str, str]:
        text = process_registry("waltz-server", "1.2.3").render_prometheus()
        (line,) = [x for x in text.splitlines() if x.startswith("waltz_build_info{")]
        return dict(re.findall(r'(\w+)="([^"]*)"', line))

    assert run(labels(), "uvloop")["event_loop"] == "uvloop"
    assert run(labels(), "asyncio")["event_loop"] == "asyncio"


@pytest.mark.parametrize("env, want", [({}, "uvloop"), ({"WALTZ_PROCESS_EVENT_LOOP": "asyncio"}, "asyncio")])
def test_a_storage_node_runs_and_stops_on_the_loop_it_was_given(tmp_path: Path, env: dict[str, str],
                                                                want: str) -> None:
    port, admin = free_ports(2)
    config = tmp_path / "storage.toml"
    config.write_text(f'[storage]\nport = {port}\nadmin_port = {admin}\ndirectory = "{tmp_path / "data"}"\n')
    proc = subprocess.Popen([*WALTZ, "storage", "start", "--config", str(config), "--cluster-key", str(uuid.uuid4()),
                             "--num-partitions", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**NO_WALTZ_ENV, **env})
    try:
        assert proc.stdout is not None
        ready = proc.stdout.readline()
        assert ready.startswith("waltz storage ready") and ready.split()[-1] == f"event_loop={want}", ready
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
