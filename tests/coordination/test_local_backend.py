"""Behaviour of the ``local`` backend beyond the kit: several processes, natural lease expiry, errors."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from waltz_core.config import CoordinationConfig
from waltz_core.coordination import open_coordination
from waltz_core.coordination.base import SessionState
from waltz_core.coordination.local import (
    DB_FILENAME,
    LEASE_CLOCK,
    LocalCoordination,
    LocalOptions,
    default_local_directory,
)
from waltz_core.errors import CoordinationError, SessionLostError
from waltz_core.runtime import Runtime
from waltz_core.testing.conformance.coordination import eventually

CHILD = textwrap.dedent("""
    import asyncio, json, sys
    from waltz_core.config import CoordinationConfig
    from waltz_core.coordination.local import LocalCoordination

    async def main(directory, increments, hold):
        backend = LocalCoordination(CoordinationConfig(connect=directory, session_timeout=1.0))
        await backend.start()
        values = [await backend.increment("/proc/counter") for _ in range(increments)]
        key = await backend.create_sequential("/proc/members/m_", b"child", ephemeral=True)
        print(json.dumps({"values": values, "key": key}), flush=True)
        if hold:
            await asyncio.sleep(3600)
        await backend.close()

    asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3] == "hold"))
""")


def spawn(directory: Path, increments: int, hold: bool) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", CHILD, str(directory), str(increments), "hold" if hold else "exit"],
                            stdout=subprocess.PIPE, text=True)


async def started(directory: Path, timeout: float = 1.0) -> LocalCoordination:
    backend = LocalCoordination(CoordinationConfig(connect=str(directory), session_timeout=timeout))
    await backend.start()
    return backend


async def test_counters_are_atomic_across_processes(tmp_path: Path) -> None:
    # Three processes open the same new store at once (they race for its creation too).
    children = [spawn(tmp_path, 40, hold=False) for _ in range(3)]
    values: list[int] = []
    try:
        for child in children:
            out, _ = await asyncio.to_thread(child.communicate, timeout=60)
            assert child.returncode == 0
            values += json.loads(out)["values"]
    finally:
        for child in children:  # a failed child must not leave its siblings running into the next test
            if child.poll() is None:
                child.kill()
            child.communicate()
    assert sorted(values) == list(range(1, 121))
    backend = await started(tmp_path)
    try:
        assert await backend.increment("/proc/counter") == 121
        assert await backend.children("/proc/members") == []  # each child closed: its ephemerals are gone
    finally:
        await backend.close()


async def test_killed_process_loses_its_ephemerals_after_the_lease(tmp_path: Path) -> None:
    observer = await started(tmp_path)
    child = spawn(tmp_path, 1, hold=True)
    try:
        line = await asyncio.to_thread(child.stdout.readline)  # type: ignore[union-attr]
        key = json.loads(line)["key"]
        assert await observer.get(key) is not None
        seen: list[float] = []
        observer.watch("/proc/members", lambda: seen.append(time.monotonic()))
        os.kill(child.pid, signal.SIGKILL)
        killed_at = time.monotonic()

        async def reaped() -> bool:
            return await observer.get(key) is None

        await eventually(reaped, 10, "the killed child's ephemeral key is removed")
        elapsed = time.monotonic() - killed_at
        assert 0.3 < elapsed < 5.0, elapsed  # removed by lease expiry (1 s), not at once and not never
        # The watch fires for the removal (it may also have fired earlier, for the child's create,
        # if the observer's poll saw that late: only a call after the kill counts).
        await eventually(lambda: any(t > killed_at for t in seen), 10, "watch on the members fires")
    finally:
        if child.poll() is None:
            child.kill()
        await asyncio.to_thread(child.wait)
        child.stdout.close()  # type: ignore[union-attr]
        await observer.close()


async def test_stalled_heartbeat_expires_the_session(tmp_path: Path) -> None:
    observer = await started(tmp_path)
    stalled = await started(tmp_path, timeout=0.6)
    states: list[SessionState] = []
    stalled.add_session_listener(states.append)
    try:
        await stalled.create("/eph", b"x", ephemeral=True)
        stalled._tasks[0].cancel()  # the heartbeat stops, as in a frozen process

        async def reaped() -> bool:
            return await observer.get("/eph") is None

        await eventually(reaped, 10, "the observer's poll reaps the expired lease")
        with pytest.raises(SessionLostError):
            await stalled.create("/eph2", b"x", ephemeral=True)
        assert await observer.get("/eph2") is None
    finally:
        await stalled.close()
        await observer.close()


async def test_an_idle_backend_reads_the_store_only_after_a_write_or_once_per_full_interval(tmp_path: Path) -> None:
    # Each poll of the store is a hop to the worker thread; 20 a second cost an idle process
    # 2 % of a core. A stat of the store's WAL file tells whether there is anything to read.
    options = LocalOptions(poll_interval=0.01)
    idle = LocalCoordination(CoordinationConfig(connect=str(tmp_path), session_timeout=10.0), options)
    polls: list[float] = []
    poll_sync = idle._poll_sync

    def counted(last_revision: int) -> tuple[int, set[str] | None]:
        polls.append(time.monotonic())
        return poll_sync(last_revision)

    idle._poll_sync = counted  # type: ignore[method-assign]
    writer = await started(tmp_path, timeout=10.0)
    await idle.start()
    try:
        seen: list[float] = []
        idle.watch("/k", lambda: seen.append(time.monotonic()))
        await asyncio.sleep(0.1)
        polls.clear()
        await asyncio.sleep(0.6)
        # 60 checks at 0.01 s; the store is read at most once a second when nothing was written
        assert len(polls) <= 1, polls
        written_at = time.monotonic()
        await writer.create("/k", b"v")
        await eventually(lambda: bool(seen), 5, "the watch fires for another backend's write")
        assert seen[0] - written_at < 0.5, seen[0] - written_at  # seen at the next check, not the next full poll
        # with no write, the full poll still comes, every session_timeout / 10 (1 s at most)
        polls.clear()
        await asyncio.sleep(1.5)
        assert 1 <= len(polls) <= 3, polls
    finally:
        await idle.close()
        await writer.close()


async def test_store_survives_restart_and_versions_never_repeat(tmp_path: Path) -> None:
    first = await started(tmp_path)
    v1 = await first.create("/k", b"1")
    await first.delete("/k")
    await first.close()
    second = await started(tmp_path)
    try:
        v2 = await second.create("/k", b"2")
        assert v2 > v1  # a re-created key never reuses an old version (no ABA for CAS)
        got = await second.get("/k")
        assert got is not None and got.value == b"2"
    finally:
        await second.close()


async def test_unusable_directory_is_a_clear_coordination_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    backend = open_coordination(CoordinationConfig(name="local", connect=str(blocker / "coord")),
                                Runtime.load(autoload=False).registries)
    with pytest.raises(CoordinationError, match="cannot create directory"):
        await backend.start()
    await backend.close()


async def test_operations_after_close_fail_clearly(tmp_path: Path) -> None:
    backend = await started(tmp_path)
    await backend.close()
    with pytest.raises(CoordinationError, match="not started or already closed"):
        await backend.get("/x")


async def test_invalid_keys_are_rejected(tmp_path: Path) -> None:
    backend = await started(tmp_path)
    try:
        for bad in ("relative", "/", "/a/", "/a//b"):
            with pytest.raises(ValueError, match="invalid coordination key"):
                await backend.get(bad)
    finally:
        await backend.close()


def test_default_directory_follows_xdg_state_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert default_local_directory() == tmp_path / "waltz" / "coordination"
    backend = LocalCoordination(CoordinationConfig(connect=""), LocalOptions())
    assert backend.path == tmp_path / "waltz" / "coordination" / "coordination.sqlite3"


def test_options_come_from_the_coordination_local_table() -> None:
    config = CoordinationConfig(name="local", connect="/tmp/x", options={"local": {"poll_interval": 0.2}})
    backend = open_coordination(config, Runtime.load(autoload=False).registries)
    assert isinstance(backend, LocalCoordination)
    assert backend._options.poll_interval == 0.2


async def test_a_step_of_the_wall_clock_neither_ends_leases_nor_keeps_a_dead_ones(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Leases are on the host's clock since boot: the wall clock jumping an hour ahead (before:
    every lease ended at once, and every process lost its session) or back (before: a stalled
    process's lease outlived it by the hour) changes nothing."""
    live = await started(tmp_path)
    stalled = await started(tmp_path, timeout=0.6)
    states: list[SessionState] = []
    live.add_session_listener(states.append)
    real = time.time
    try:
        await live.create("/live", b"x", ephemeral=True)
        await stalled.create("/stalled", b"x", ephemeral=True)
        monkeypatch.setattr(time, "time", lambda: real() + 3600)
        await asyncio.sleep(1.5)  # several heartbeats and polls after the step
        assert await live.get("/live") is not None and states == []
        monkeypatch.setattr(time, "time", lambda: real() - 3600)
        stalled._tasks[0].cancel()  # its heartbeat stops, as in a frozen process

        async def reaped() -> bool:
            return await live.get("/stalled") is None

        await eventually(reaped, 5, "the stalled lease ends after its timeout, whatever the wall clock says")
        assert await live.get("/live") is not None and states == []
    finally:
        await stalled.close()
        await live.close()


async def test_sessions_of_another_boot_are_ended_and_an_earlier_releases_are_judged_by_the_wall_clock(
        tmp_path: Path) -> None:
    """Leases taken on the clock since boot of another boot cannot be compared with ours (it
    started again): the first process to open the store ends those sessions and their ephemeral
    keys. A session of an earlier release has only a wall-clock lease: it is judged by that, so
    a process of that release, still running, keeps its session."""
    first = await started(tmp_path)
    await first.create("/kept", b"persistent")
    await first.close()
    con = sqlite3.connect(tmp_path / DB_FILENAME, isolation_level=None)
    try:
        def session(expires_boot: float | None, ephemeral: str) -> int:
            cur = con.execute("INSERT INTO sessions(expires_at, expires_boot, pid, host) VALUES (?, ?, 1, 'h')",
                              (time.time() + 3600, expires_boot))
            con.execute("INSERT INTO nodes(path, parent, value, version, owner) VALUES (?, '/', x'', 999, ?)",
                        (ephemeral, cur.lastrowid))
            assert cur.lastrowid is not None
            return cur.lastrowid

        session(1e12, "/earlier-boot")  # an hour left on the wall clock, "for ever" on the old boot's clock
        old_release = session(None, "/earlier-release")
        con.execute("UPDATE meta SET value = 'boottime another-boot' WHERE name = 'lease_clock'")
    finally:
        con.close()
    second = await started(tmp_path)
    third = None
    try:
        assert await second.get("/earlier-boot") is None
        assert await second.get("/kept") is not None
        await asyncio.sleep(0.3)  # polls: the earlier release's lease has an hour left on the wall clock
        assert await second.get("/earlier-release") is not None
        await second.create("/eph", b"x", ephemeral=True)
        third = await started(tmp_path)  # the same boot: nothing of the second's is ended
        assert await third.get("/eph") is not None
        con = sqlite3.connect(tmp_path / DB_FILENAME, isolation_level=None)
        try:  # the earlier release's process dies: its wall-clock lease runs out
            con.execute("UPDATE sessions SET expires_at = ? WHERE id = ?", (time.time() - 1, old_release))
            assert con.execute("SELECT value FROM meta WHERE name = 'lease_clock'").fetchone() == (LEASE_CLOCK,)
        finally:
            con.close()

        async def reaped() -> bool:
            return await second.get("/earlier-release") is None

        await eventually(reaped, 5, "the earlier release's session is reaped once its wall-clock lease ran out")
        assert await third.get("/eph") is not None
    finally:
        if third is not None:
            await third.close()
        await second.close()


async def test_a_store_of_an_earlier_release_gets_the_boot_clock_and_keeps_its_live_sessions(tmp_path: Path) -> None:
    con = sqlite3.connect(tmp_path / DB_FILENAME, isolation_level=None)
    try:  # the sessions table as earlier releases made it, with a session of a running process
        con.execute("CREATE TABLE sessions (id INTEGER PRIMARY KEY AUTOINCREMENT, expires_at REAL NOT NULL, "
                    "pid INTEGER NOT NULL, host TEXT NOT NULL)")
        con.execute("INSERT INTO sessions(expires_at, pid, host) VALUES (?, 1, 'h')", (time.time() + 3600,))
    finally:
        con.close()
    backend = await started(tmp_path)
    try:
        await backend.create("/eph", b"x", ephemeral=True)
        con = sqlite3.connect(tmp_path / DB_FILENAME)
        try:
            rows = con.execute("SELECT id, expires_boot IS NULL FROM sessions ORDER BY id").fetchall()
        finally:
            con.close()
        assert rows == [(1, 1), (backend.session_id, 0)]  # the earlier one kept, as it was
    finally:
        await backend.close()
