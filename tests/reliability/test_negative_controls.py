"""Negative controls: each unsafe plugin MUST be caught by the checker (else the suite is broken).

The plugins are in :mod:`waltz_core.testing.sabotage`; production code knows nothing about them.

* ``no-lock-check`` (server: lock table ``unsafe-no-lock-check``): contended transfers commit on
  stale reads -> ``lock`` (and the bank loses or makes money);
* ``ack-before-quorum`` (server: a commit rule of one acknowledgement): with two storages stalled,
  transactions commit on one replica, which then crashes with the server -> ``lost`` acknowledged
  appends;
* ``no-fsync`` (storage: layout ``unsafe-no-fsync``): every storage crashes with its unsynced
  bytes lost (the fsync journal shim) -> ``lost``. The same crash on ``segmented`` is the positive
  control: all replicas down and back with lost unsynced writes loses nothing.

The processes of the cluster load them through the environment they inherit
(``sabotage.environment(name)``: ``WALTZ_PLUGINS`` plus the config variable selecting the
backend, set with ``monkeypatch.setenv`` before the cluster starts), and each logs an ``UNSAFE:``
line at start.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest

from waltz_core.storage.journal import journal_generation, journal_paths
from waltz_core.testing import sabotage
from waltz_core.testing.faults import ClusterProcesses, CrashMode, crash_lose_unsynced, sync_journal_env
from waltz_core.testing.smoketest import SmokeOptions, run_smoketest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]


def _report(result: Any) -> str:
    return "\n".join(result.report())


def _sabotage(monkeypatch: pytest.MonkeyPatch, control: str) -> str:
    """Make the cluster's processes run negative control ``control``; the line each logs at start."""
    for key, value in sabotage.environment(control).items():
        monkeypatch.setenv(key, value)
    return f"UNSAFE: plugin waltz_core.testing.sabotage:{sabotage.CONTROLS[control][0]} is loaded"


async def test_no_lock_check_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    unsafe = _sabotage(monkeypatch, "no-lock-check")
    result = await run_smoketest(SmokeOptions(tmp_path, duration=6.0, clients=3, partitions=1, servers=1, accounts=3,
                                              nemesis=False))
    print(_report(result))
    assert "lock" in result.verdict.kinds(), _report(result)
    assert unsafe in (tmp_path / "cluster" / "logs" / "server-0.log").read_text()


async def test_lock_check_holds_under_the_same_contention(tmp_path: Path) -> None:
    result = await run_smoketest(SmokeOptions(tmp_path, duration=6.0, clients=3, partitions=1, servers=1, accounts=3,
                                              nemesis=False))
    print(_report(result))
    assert result.verdict.ok, _report(result)
    assert result.verdict.stats["failed"] > 0, "the contention must produce lock failures"


async def _stall_two_storages_then_crash_the_third(procs: ClusterProcesses, proxies: Any, history: Any) -> None:
    await asyncio.sleep(1.5)
    for name in ("storage-0", "storage-1"):
        history.nemesis("pause", name, "start")
        await asyncio.to_thread(procs.pause, name)
    await asyncio.sleep(2.5)  # unsafe: transactions commit on storage-2's acknowledgement alone
    for name in ("server-0", "storage-2"):
        history.nemesis("kill", name, "start")
        await asyncio.to_thread(procs.kill, name)
    for name in ("storage-0", "storage-1"):
        await asyncio.to_thread(procs.resume, name)
    await asyncio.to_thread(procs.restart, "server-0")  # recovers from storages 0 and 1
    await asyncio.sleep(4.0)
    await asyncio.to_thread(procs.restart, "storage-2")
    await asyncio.sleep(2.0)


async def test_ack_before_quorum_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    unsafe = _sabotage(monkeypatch, "ack-before-quorum")
    result = await run_smoketest(SmokeOptions(tmp_path, duration=60.0, clients=2, partitions=1, servers=1),
                                 cluster_hook=_stall_two_storages_then_crash_the_third)
    print(_report(result))
    assert "lost" in result.verdict.kinds(), _report(result)
    assert unsafe in (tmp_path / "cluster" / "logs" / "server-0.log").read_text()


def _power_loss(journal: Path, crashed: list[Any]) -> Any:
    async def hook(procs: ClusterProcesses, proxies: Any, history: Any) -> None:
        await asyncio.sleep(3.0)
        history.nemesis("power-loss", "all", "start")
        for name in ("server-0", "storage-0", "storage-1", "storage-2"):
            await asyncio.to_thread(procs.kill, name)
        rng = random.Random(5)
        for i in range(3):
            directory = procs.cluster.spec.storage_config(i).storage.directory
            crashed.extend(crash_lose_unsynced(directory, journal, CrashMode.GARBLE if i == 0 else CrashMode.DROP, rng))
        for name in ("storage-0", "storage-1", "storage-2", "server-0"):
            await asyncio.to_thread(procs.restart, name)
        history.nemesis("power-loss", "all", "end")
        await asyncio.sleep(3.0)

    return hook


@pytest.mark.parametrize(("unsafe", "checkpoint_bytes"), [(True, None), (False, None), (False, 16384)],
                         ids=["no-fsync-caught", "fsync-survives", "fsync-survives-journal-checkpoints"])
async def test_power_loss_of_every_replica(unsafe: bool, checkpoint_bytes: int | None, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    journal = tmp_path / "sync-journal.jsonl"
    for k, v in sync_journal_env(journal).items():
        monkeypatch.setenv(k, v)
    if checkpoint_bytes is not None:  # the node journals checkpoint (and start over) every few rounds
        monkeypatch.setenv("WALTZ_STORAGE_JOURNAL_CHECKPOINT_BYTES", str(checkpoint_bytes))
    warning = _sabotage(monkeypatch, "no-fsync") if unsafe else None
    crashed: list[Any] = []
    result = await run_smoketest(SmokeOptions(tmp_path / "run", duration=60.0, clients=2, partitions=2, servers=1),
                                 cluster_hook=_power_loss(journal, crashed))
    print(_report(result), crashed, sep="\n")
    assert journal.exists(), "the fsync journal shim must be active in the storage processes"
    if warning is not None:
        assert crashed, "the power loss must lose unsynced bytes"
        assert "lost" in result.verdict.kinds(), _report(result)
        assert warning in (tmp_path / "run" / "cluster" / "logs" / "storage-0.log").read_text()
    else:
        assert result.verdict.ok, _report(result)
        assert result.verdict.stats["ok"] > 50
        # With the node journal (the default) acknowledged records may exist only in the journal when
        # the power goes: in memory (small batches are gathered before they are written), or written
        # but not synced. The journal's replay at restart had to put them back.
        logs = [(tmp_path / "run" / "cluster" / "logs" / f"storage-{i}.log").read_text() for i in range(3)]
        assert any("replayed journal" in log and "were put back" in log for log in logs), _report(result)
        if checkpoint_bytes is None:  # 60 s without a checkpoint: the segments' unsynced tails were lost too
            assert any(str(effect.path).endswith(".seq") and effect.size_after < effect.size_before
                       for effect in crashed), crashed
        else:  # the power loss came after many checkpoints, in the middle of a generation
            storage_dir = tmp_path / "run" / "cluster" / "storage-0"
            generations = [journal_generation(p) for p in journal_paths(storage_dir)]
            # Several checkpoints before it, however slow the machine (19 in 60 s on a busy 2-core one).
            assert generations and max(generations) >= 3, generations
