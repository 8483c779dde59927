"""The ``local`` coordination backend: one SQLite file, no server, for ONE host.

Every process of a local cluster opens the same file (``<connect>/coordination.sqlite3``); SQLite's
file locking makes them agree. It is meant for development, tests and single-machine
deployments; it is not replicated and must not be used on a network file system.

How the protocol maps onto SQLite:

* ``nodes(path, parent, value, version, owner)``: one row per key. ``version`` is the store's
  global revision at the key's last write, so it changes on every write and never repeats, even
  across delete and re-create.
* writes run in ``BEGIN IMMEDIATE`` transactions (one writer at a time, WAL journal, readers are
  never blocked), which makes compare-and-set, create-if-absent and counters atomic across
  processes.
* ``sessions(id, expires_at, expires_boot)``: a session is a row with a lease renewed by a
  heartbeat task every ``session_timeout / 3``. The lease is judged on the host's clock since
  boot (``expires_boot``, ``CLOCK_BOOTTIME``, shared by every process of the host; the wall clock
  where there is none), so a step of the wall clock (NTP, an operator) neither ends every lease
  at once nor keeps a dead process's lease for the length of the step. That clock starts again
  at each boot: the store keeps the boot its leases were taken in (``meta.lease_clock``), and
  the first process of another boot ends the sessions of the earlier one. ``expires_at`` is the
  same lease on the wall clock, which earlier releases judge by: a session of such a process has
  no ``expires_boot`` and is judged by ``expires_at``, so the processes of a local cluster may
  be upgraded one at a time. Ephemeral keys carry their session id in ``owner``; whichever
  process first notices an expired lease deletes the session and its ephemeral keys. A process
  that finds its own lease expired reports LOST, opens a new session and reports CONNECTED.
* ``changes(revision, path)``: every write appends the keys it touched. Each backend checks the
  store's WAL file every ``poll_interval`` seconds (a ``stat``, on the event loop); when it was
  written, and at least every ``session_timeout / 10`` (1 s at most), it polls the latest
  revision and the leases, and calls the watches of changed keys and of their parents. If the
  log was pruned past the last revision seen, every watch fires.

All SQLite calls run on one worker thread per backend, never on the event loop.
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import itertools
import logging
import os
import socket
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import attrs

from ..config import CoordinationConfig
from ..errors import CasConflictError, CoordinationError, NodeExistsError, NoNodeError, SessionLostError
from ..retry import RetryPolicy
from ..timeouts import wait_for
from .base import SessionState, Versioned

log = logging.getLogger("waltz.coordination.local")

T = TypeVar("T")

DB_FILENAME = "coordination.sqlite3"
#: Changes kept in the log for watchers that fall behind; older ones are pruned.
CHANGE_LOG_KEEP = 10_000
#: The longest time between two polls of the change log and the leases when the store's file
#: showed no write (it is ``session_timeout / 10`` when that is shorter, ``poll_interval`` at least).
FULL_POLL_INTERVAL_MAX = 1.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes (
    path    TEXT PRIMARY KEY,
    parent  TEXT NOT NULL,
    value   BLOB NOT NULL,
    version INTEGER NOT NULL,
    owner   INTEGER
);
CREATE INDEX IF NOT EXISTS nodes_parent ON nodes(parent);
CREATE INDEX IF NOT EXISTS nodes_owner ON nodes(owner) WHERE owner IS NOT NULL;
CREATE TABLE IF NOT EXISTS sessions (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    expires_at   REAL NOT NULL,
    pid          INTEGER NOT NULL,
    host         TEXT NOT NULL,
    expires_boot REAL
);
CREATE INDEX IF NOT EXISTS sessions_expiry ON sessions(expires_at);
CREATE TABLE IF NOT EXISTS changes (revision INTEGER PRIMARY KEY, path TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sequences (parent TEXT PRIMARY KEY, next INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO meta(name, value) VALUES ('revision', 0);
"""


def _lease_clock() -> tuple[Callable[[], float], str]:
    """The clock leases are kept on, and what names it in the store: the time since boot with
    the boot's id (Linux), else the wall clock. The wall clock may step (NTP, an operator): back,
    and a dead process's lease outlives it by the step; forward, and every lease ends at once."""
    boottime = getattr(time, "CLOCK_BOOTTIME", None)
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = ""
    if boottime is None or not boot_id:
        return time.time, "wall"
    return (lambda: time.clock_gettime(boottime)), f"boottime {boot_id}"


_lease_now, LEASE_CLOCK = _lease_clock()
#: a session whose lease ran out, given ``:wall`` (time.time()) and ``:boot`` (_lease_now()): on
#: the clock since boot, or on the wall clock for a session of a release that kept only that one
_EXPIRED = "(CASE WHEN expires_boot IS NULL THEN expires_at < :wall ELSE expires_boot < :boot END)"


def _lease_times() -> dict[str, float]:
    return {"wall": time.time(), "boot": _lease_now()}


def _file_state(path: str) -> tuple[int, ...] | None:
    """What changes when a file is written: its inode, size and times (None: it is not there)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def default_local_directory() -> Path:
    """Where ``local`` keeps its file when ``connect`` is empty: ``$XDG_STATE_HOME/waltz/coordination``.

    ``XDG_STATE_HOME`` defaults to ``~/.local/state``; one directory per user, so every process
    of that user on this host finds the same clusters (they are told apart by ``root``).
    """
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "waltz" / "coordination"


def local_directory(config: CoordinationConfig) -> Path:
    """The directory ``local`` keeps its file in: ``connect``, or :func:`default_local_directory`."""
    return Path(config.connect).expanduser() if config.connect else default_local_directory()


@attrs.frozen
class LocalOptions:
    """Options of the local backend (``[coordination.local]``)."""

    poll_interval: float = attrs.field(
        default=0.05, validator=attrs.validators.gt(0),
        metadata={"doc": "Seconds between checks of the store's file for writes (watch latency); the change log "
                         "and the leases are read when it was written, and at least every session_timeout / 10 "
                         "(at most 1 s)."},
    )
    busy_timeout: float = attrs.field(
        default=10.0, validator=attrs.validators.gt(0),
        metadata={"doc": "Seconds to wait for another process's write transaction before failing."},
    )


def _check_key(key: str) -> None:
    if not key.startswith("/") or key == "/" or key.endswith("/") or "//" in key:
        raise ValueError(f"invalid coordination key {key!r}: must look like /a/b (absolute, no empty segments)")


def _parent(key: str) -> str:
    parent = key.rsplit("/", 1)[0]
    return parent or "/"


def _descendant_range(key: str) -> tuple[str, str]:
    # Every descendant of /a sorts in ["/a/", "/a0"): '0' is the character after '/'.
    return key + "/", key + "0"


class _Watch:
    __slots__ = ("key", "callback", "_watches")

    def __init__(self, key: str, callback: Callable[[], None], watches: dict[int, _Watch]) -> None:
        self.key = key
        self.callback = callback
        self._watches = watches

    def cancel(self) -> None:
        for wid, watch in list(self._watches.items()):
            if watch is self:
                del self._watches[wid]


class LocalCoordination:
    """The embedded single-host backend. Create unstarted; call :meth:`start` on the event loop that uses it."""

    name = "local"

    def __init__(self, config: CoordinationConfig, options: LocalOptions | None = None) -> None:
        self._options = options or LocalOptions()
        self._timeout = config.session_timeout
        directory = local_directory(config)
        self.directory = directory
        self.path = directory / DB_FILENAME
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._con: sqlite3.Connection | None = None
        self._session_id: int | None = None
        self._state = SessionState.SUSPENDED
        self._listeners: list[Callable[[SessionState], None]] = []
        self._watches: dict[int, _Watch] = {}
        self._watch_ids = itertools.count()
        self._last_revision = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._wake_heartbeat = asyncio.Event()
        self._started = False
        self._closed = False

    # ---------------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Open (creating if needed) the SQLite file, reap expired leases and open a session."""
        if self._started:
            return
        self._started = True
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="waltz-coord-local")
        try:
            await self._run(self._open_sync)
            self._last_revision = await self._run(self._current_revision_sync)
            self._session_id = await self._run(self._new_session_sync)
        except BaseException:
            await self._shutdown_worker()
            raise
        self._set_state(SessionState.CONNECTED)
        self._tasks = [asyncio.create_task(self._heartbeat_loop(), name="waltz-local-heartbeat"),
                       asyncio.create_task(self._poll_loop(), name="waltz-local-poll")]

    async def close(self) -> None:
        """End the session (its ephemeral keys are deleted now) and stop the worker thread; idempotent."""
        if self._closed or not self._started:
            self._closed = True
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._watches.clear()
        if self._session_id is not None and self._con is not None:
            try:
                await self._run(self._end_session_sync, self._session_id)
            except CoordinationError as exc:
                log.warning("local coordination: could not end session %s cleanly: %s", self._session_id, exc)
        await self._shutdown_worker()

    async def _shutdown_worker(self) -> None:
        if self._executor is None:
            return
        if self._con is not None:
            con, self._con = self._con, None
            await asyncio.get_running_loop().run_in_executor(self._executor, con.close)
        self._executor.shutdown(wait=False)
        self._executor = None

    @property
    def session_state(self) -> SessionState:
        return self._state

    @property
    def session_id(self) -> int | None:
        """The current session's row id (changes after a LOST)."""
        return self._session_id

    def add_session_listener(self, callback: Callable[[SessionState], None]) -> None:
        self._listeners.append(callback)

    async def force_expire(self) -> None:
        """Expire this backend's lease now, as if its heartbeats had stopped (for tests and fault injection).

        Other processes reap its ephemeral keys on their next poll; this backend reports LOST on
        its next heartbeat, which is triggered at once.
        """
        if self._session_id is None:
            return
        await self._run(self._expire_sync, self._session_id)
        self._wake_heartbeat.set()

    # ------------------------------------------------------------------------------- operations

    async def get(self, key: str) -> Versioned | None:
        _check_key(key)
        return await self._run(self._get_sync, key)

    async def create(self, key: str, value: bytes, *, ephemeral: bool = False, make_parents: bool = True) -> int:
        _check_key(key)
        return await self._write(self._create_txn, key, bytes(value), ephemeral, make_parents)

    async def create_sequential(self, prefix: str, value: bytes, *, ephemeral: bool = True) -> str:
        _check_key(prefix + "0")
        return await self._write(self._create_sequential_txn, prefix, bytes(value), ephemeral)

    async def set(self, key: str, value: bytes, *, expected_version: int | None = None) -> int:
        _check_key(key)
        return await self._write(self._set_txn, key, bytes(value), expected_version)

    async def delete(self, key: str, *, expected_version: int | None = None, recursive: bool = False) -> None:
        _check_key(key)
        await self._write(self._delete_txn, key, expected_version, recursive)

    async def children(self, key: str) -> list[str]:
        _check_key(key)
        return await self._run(self._children_sync, key)

    async def increment(self, key: str) -> int:
        _check_key(key)
        return await self._write(self._increment_txn, key)

    def watch(self, key: str, callback: Callable[[], None]) -> _Watch:
        _check_key(key)
        handle = _Watch(key, callback, self._watches)
        self._watches[next(self._watch_ids)] = handle
        return handle

    # ------------------------------------------------------------------------ loop-side helpers

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        if self._executor is None:
            raise CoordinationError("local coordination backend is not started or already closed")
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        except sqlite3.Error as exc:
            raise CoordinationError(f"local coordination store {self.path}: {exc}") from exc

    async def _write(self, txn: Callable[..., T], *args: Any) -> T:
        try:
            return await self._run(self._in_transaction, txn, *args)
        except SessionLostError:
            self._wake_heartbeat.set()  # let the heartbeat report LOST and open a new session
            raise

    def _set_state(self, state: SessionState) -> None:
        if state is self._state:
            return
        self._state = state
        for listener in list(self._listeners):
            try:
                listener(state)
            except Exception:  # a listener's bug must not stop the backend
                log.exception("session listener %r failed", listener)

    def _fire(self, changed: builtins.set[str] | None) -> None:
        """Call the watches of changed keys and of their parents (all of them when ``changed`` is None)."""
        parents: builtins.set[str] = set() if changed is None else {_parent(p) for p in changed}
        for watch in list(self._watches.values()):
            if changed is None or watch.key in changed or watch.key in parents:
                try:
                    watch.callback()
                except Exception:
                    log.exception("watch callback for %s failed", watch.key)

    async def _heartbeat_loop(self) -> None:
        interval = max(self._timeout / 3.0, 0.01)
        while True:
            try:
                await wait_for(self._wake_heartbeat.wait(), interval)
            except TimeoutError:
                pass
            self._wake_heartbeat.clear()
            try:
                alive = await self._run(self._renew_sync, self._session_id)
            except CoordinationError as exc:
                log.warning("local coordination: lease renewal failed: %s", exc)
                self._set_state(SessionState.SUSPENDED)
                continue
            if alive:
                self._set_state(SessionState.CONNECTED)
                continue
            log.warning("local coordination: session %s expired; opening a new one", self._session_id)
            self._set_state(SessionState.LOST)
            try:
                self._session_id = await self._run(self._new_session_sync)
            except CoordinationError as exc:
                log.warning("local coordination: could not open a new session: %s", exc)
                continue
            self._set_state(SessionState.CONNECTED)
            self._fire(None)  # changes may have been missed while we were gone

    async def _poll_loop(self) -> None:
        # A poll is a hop to the worker thread: about 1 ms of CPU on an idle host, so 20 a second
        # cost an idle process 2 % of a core. Every write of every process goes into the store's
        # WAL file, so a stat of it, here on the loop (a few µs, a local file), tells whether a
        # poll can find anything new. The poll still runs every ``full_every``: for leases that ran
        # out with no write, and in case a write left the file's size and time as they were (a
        # WAL restarted after a checkpoint, within one tick of the file system's clock).
        interval = self._options.poll_interval
        full_every = max(interval, min(FULL_POLL_INTERVAL_MAX, self._timeout / 10))
        wal = f"{self.path}-wal"
        seen: tuple[int, ...] | None = None
        next_full = 0.0
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            state = _file_state(wal)
            if state is not None and state == seen and now < next_full:
                continue
            # taken before the poll: a write during it changes the state, and the next turn polls
            seen, next_full = state, now + full_every
            try:
                revision, changed = await self._run(self._poll_sync, self._last_revision)
            except CoordinationError as exc:
                log.warning("local coordination: poll failed: %s", exc)
                seen = None
                continue
            if revision != self._last_revision:
                self._last_revision = revision
                self._fire(changed)

    # ---------------------------------------------------------------- worker thread (blocking)

    def _open_sync(self) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CoordinationError(f"local coordination: cannot create directory {self.directory}: {exc}") from exc
        con = sqlite3.connect(self.path, timeout=self._options.busy_timeout, isolation_level=None,
                              check_same_thread=False)
        try:
            mode = self._journal_mode_wal(con)
            if mode.lower() != "wal":
                raise CoordinationError(f"local coordination store {self.path}: cannot use WAL journal (got {mode})")
            con.execute("PRAGMA synchronous=FULL")  # session ids and partition metadata must survive a crash
            con.execute("BEGIN IMMEDIATE")
            try:
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        con.execute(statement)
                self._adopt_lease_clock(con)
                con.execute("COMMIT")
            except BaseException:
                con.execute("ROLLBACK")
                raise
        except BaseException:
            con.close()
            raise
        self._con = con

    def _adopt_lease_clock(self, con: sqlite3.Connection) -> None:
        """Add ``expires_boot`` to a store of an earlier release, and end the sessions whose
        leases were taken on the clock of another boot: it started again at this boot, so their
        expiries cannot be compared with ours, and their processes did not survive the boot."""
        if "expires_boot" not in {row[1] for row in con.execute("PRAGMA table_info(sessions)")}:
            con.execute("ALTER TABLE sessions ADD COLUMN expires_boot REAL")
        row = con.execute("SELECT value FROM meta WHERE name = 'lease_clock'").fetchone()
        if row is not None and row[0] == LEASE_CLOCK:
            return
        sessions = [session_id for (session_id,) in
                    con.execute("SELECT id FROM sessions WHERE expires_boot IS NOT NULL").fetchall()]
        if sessions:
            log.warning("local coordination: %d session(s) in %s hold leases of another boot (%s, now %s): "
                        "ending them", len(sessions), self.path, row[0] if row else "unknown", LEASE_CLOCK)
        for session_id in sessions:
            self._reap_session(con, session_id)
        con.execute("INSERT OR REPLACE INTO meta(name, value) VALUES ('lease_clock', ?)", (LEASE_CLOCK,))

    def _journal_mode_wal(self, con: sqlite3.Connection) -> str:
        """Switch the store to WAL. Several processes opening a new store at once race for the
        exclusive lock this needs, and SQLite answers that race with SQLITE_BUSY without calling
        its busy handler, so the wait that ``busy_timeout`` promises is done here (5 ms doubling to
        100 ms, jittered: the racing processes started together)."""
        policy = RetryPolicy(initial=0.005, maximum=0.1, deadline=self._options.busy_timeout)
        return policy.call_sync(lambda: str(con.execute("PRAGMA journal_mode=WAL").fetchone()[0]),
                                retry_if=lambda exc: isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc))

    def _db(self) -> sqlite3.Connection:
        if self._con is None:
            raise CoordinationError("local coordination backend is closed")
        return self._con

    def _in_transaction(self, txn: Callable[..., T], *args: Any) -> T:
        con = self._db()
        con.execute("BEGIN IMMEDIATE")
        try:
            result = txn(con, *args)
        except BaseException:
            con.execute("ROLLBACK")
            raise
        con.execute("COMMIT")
        return result

    def _current_revision_sync(self) -> int:
        return int(self._db().execute("SELECT value FROM meta WHERE name = 'revision'").fetchone()[0])

    @staticmethod
    def _log_change(con: sqlite3.Connection, path: str) -> int:
        revision = int(con.execute("UPDATE meta SET value = value + 1 WHERE name = 'revision' RETURNING value").fetchone()[0])
        con.execute("INSERT INTO changes(revision, path) VALUES (?, ?)", (revision, path))
        if revision % 1000 == 0:
            con.execute("DELETE FROM changes WHERE revision <= ?", (revision - CHANGE_LOG_KEEP,))
        return revision

    def _new_session_sync(self) -> int:
        def txn(con: sqlite3.Connection) -> int:
            now = _lease_times()
            self._reap_expired(con, now)
            cur = con.execute("INSERT INTO sessions(expires_at, expires_boot, pid, host) VALUES (?, ?, ?, ?)",
                              (now["wall"] + self._timeout, now["boot"] + self._timeout, os.getpid(),
                               socket.gethostname()))
            assert cur.lastrowid is not None
            return cur.lastrowid

        return self._in_transaction(txn)

    def _renew_sync(self, session_id: int) -> bool:
        # A lease that already expired stays expired, even if nobody reaped it yet.
        def txn(con: sqlite3.Connection) -> bool:
            now = _lease_times()
            cur = con.execute(f"UPDATE sessions SET expires_at = :wall + :timeout, expires_boot = :boot + :timeout "
                              f"WHERE id = :id AND NOT {_EXPIRED}", {**now, "timeout": self._timeout, "id": session_id})
            if cur.rowcount == 1:
                return True
            self._reap_session(con, session_id)
            return False

        return self._in_transaction(txn)

    def _expire_sync(self, session_id: int) -> None:
        self._in_transaction(lambda con: con.execute(
            "UPDATE sessions SET expires_at = 0, expires_boot = 0 WHERE id = ?", (session_id,)))

    def _end_session_sync(self, session_id: int) -> None:
        self._in_transaction(self._reap_session, session_id)

    def _reap_session(self, con: sqlite3.Connection, session_id: int) -> None:
        rows = con.execute("SELECT path FROM nodes WHERE owner = ? ORDER BY path DESC", (session_id,)).fetchall()
        for (path,) in rows:
            con.execute("DELETE FROM nodes WHERE path = ?", (path,))
            self._log_change(con, path)
        con.execute("DELETE FROM sessions WHERE id = ?", (session_id,))

    def _reap_expired(self, con: sqlite3.Connection, now: dict[str, float]) -> None:
        for (session_id,) in con.execute(f"SELECT id FROM sessions WHERE {_EXPIRED}", now).fetchall():
            log.info("local coordination: reaping expired session %s", session_id)
            self._reap_session(con, session_id)

    def _poll_sync(self, last_revision: int) -> tuple[int, builtins.set[str] | None]:
        con = self._db()
        now = _lease_times()
        if con.execute(f"SELECT 1 FROM sessions WHERE {_EXPIRED} LIMIT 1", now).fetchone():
            self._in_transaction(self._reap_expired, now)
        revision = int(con.execute("SELECT value FROM meta WHERE name = 'revision'").fetchone()[0])
        if revision == last_revision:
            return revision, set()
        rows = con.execute("SELECT revision, path FROM changes WHERE revision > ? AND revision <= ? ORDER BY revision",
                           (last_revision, revision)).fetchall()
        if not rows or rows[0][0] != last_revision + 1:
            return revision, None  # the log was pruned past what we saw: everything may have changed
        return revision, {path for _, path in rows}

    def _get_sync(self, key: str) -> Versioned | None:
        row = self._db().execute("SELECT value, version FROM nodes WHERE path = ?", (key,)).fetchone()
        return None if row is None else Versioned(bytes(row[0]), int(row[1]))

    def _children_sync(self, key: str) -> list[str]:
        rows = self._db().execute("SELECT path FROM nodes WHERE parent = ? ORDER BY path", (key,)).fetchall()
        return [path.rsplit("/", 1)[1] for (path,) in rows]

    def _owner_for(self, con: sqlite3.Connection, ephemeral: bool) -> int | None:
        if not ephemeral:
            return None
        session_id = self._session_id
        row = con.execute(f"SELECT 1 FROM sessions WHERE id = :id AND NOT {_EXPIRED}",
                          {**_lease_times(), "id": session_id}).fetchone()
        if row is None:
            raise SessionLostError(f"local coordination session {session_id} expired; retry after it is re-established")
        return session_id

    def _ensure_parents(self, con: sqlite3.Connection, key: str, make_parents: bool) -> None:
        missing: list[str] = []
        parent = _parent(key)
        while parent != "/" and con.execute("SELECT 1 FROM nodes WHERE path = ?", (parent,)).fetchone() is None:
            missing.append(parent)
            parent = _parent(parent)
        if missing and not make_parents:
            raise NoNodeError(f"cannot create {key}: parent {missing[0]} does not exist")
        for path in reversed(missing):
            self._insert(con, path, b"", None)

    def _insert(self, con: sqlite3.Connection, path: str, value: bytes, owner: int | None) -> int:
        revision = self._log_change(con, path)
        con.execute("INSERT INTO nodes(path, parent, value, version, owner) VALUES (?, ?, ?, ?, ?)",
                    (path, _parent(path), value, revision, owner))
        return revision

    def _create_txn(self, con: sqlite3.Connection, key: str, value: bytes, ephemeral: bool, make_parents: bool) -> int:
        if con.execute("SELECT 1 FROM nodes WHERE path = ?", (key,)).fetchone() is not None:
            raise NodeExistsError(f"{key} already exists")
        owner = self._owner_for(con, ephemeral)
        self._ensure_parents(con, key, make_parents)
        return self._insert(con, key, value, owner)

    def _create_sequential_txn(self, con: sqlite3.Connection, prefix: str, value: bytes, ephemeral: bool) -> str:
        owner = self._owner_for(con, ephemeral)
        parent = _parent(prefix + "0")
        self._ensure_parents(con, prefix + "0", True)
        row = con.execute("SELECT next FROM sequences WHERE parent = ?", (parent,)).fetchone()
        number = 0 if row is None else int(row[0])
        while True:
            key = f"{prefix}{number:010d}"
            number += 1
            if con.execute("SELECT 1 FROM nodes WHERE path = ?", (key,)).fetchone() is None:
                break
        con.execute("INSERT INTO sequences(parent, next) VALUES (?, ?) ON CONFLICT(parent) DO UPDATE SET next = excluded.next",
                    (parent, number))
        self._insert(con, key, value, owner)
        return key

    @staticmethod
    def _check_version(key: str, actual: int, expected: int | None) -> None:
        if expected is not None and actual != expected:
            raise CasConflictError(f"{key}: expected version {expected}, found {actual}")

    def _set_txn(self, con: sqlite3.Connection, key: str, value: bytes, expected_version: int | None) -> int:
        row = con.execute("SELECT version FROM nodes WHERE path = ?", (key,)).fetchone()
        if row is None:
            raise NoNodeError(f"{key} does not exist")
        self._check_version(key, int(row[0]), expected_version)
        revision = self._log_change(con, key)
        con.execute("UPDATE nodes SET value = ?, version = ? WHERE path = ?", (value, revision, key))
        return revision

    def _delete_txn(self, con: sqlite3.Connection, key: str, expected_version: int | None, recursive: bool) -> None:
        row = con.execute("SELECT version FROM nodes WHERE path = ?", (key,)).fetchone()
        low, high = _descendant_range(key)
        descendants = [p for (p,) in con.execute("SELECT path FROM nodes WHERE path >= ? AND path < ? ORDER BY path DESC",
                                                  (low, high)).fetchall()]
        if row is None and not descendants:
            return
        if row is not None:
            self._check_version(key, int(row[0]), expected_version)
        if descendants and not recursive:
            raise CoordinationError(f"cannot delete {key}: it has children (use recursive=True)")
        for path in descendants + ([key] if row is not None else []):
            con.execute("DELETE FROM nodes WHERE path = ?", (path,))
            self._log_change(con, path)

    def _increment_txn(self, con: sqlite3.Connection, key: str) -> int:
        row = con.execute("SELECT value FROM nodes WHERE path = ?", (key,)).fetchone()
        if row is None:
            self._ensure_parents(con, key, True)
            self._insert(con, key, b"1", None)
            return 1
        try:
            value = int(bytes(row[0]).decode("ascii") or "0") + 1
        except (UnicodeDecodeError, ValueError):
            raise CoordinationError(f"{key} is not a counter (value {bytes(row[0])[:40]!r})") from None
        revision = self._log_change(con, key)
        con.execute("UPDATE nodes SET value = ?, version = ? WHERE path = ?", (str(value).encode("ascii"), revision, key))
        return value
