"""Exactly-once application of transactions to a SQL database (original ``AbstractClientCallbacksForJDBC``).

Several application instances may share one database: every instance receives every
transaction, and exactly one of them applies it. Each partition has a row
``(partition_id, high_water_mark)`` in a table (default ``waltz_high_water_marks``); applying
transaction ``t`` runs, in **one** database transaction::

    UPDATE <table> SET high_water_mark = t WHERE partition_id = p AND high_water_mark = t - 1
    -- 1 row: this instance won: the subclass's apply(transaction, connection), then COMMIT
    -- 0 rows: another instance applied t already: ROLLBACK, skip

so the application's changes and the high-water mark commit or roll back together (exactly
once), whichever instance gets there first. Subclass :class:`SqlClientCallbacks` and implement
:meth:`~SqlClientCallbacks.apply`; it must not commit or roll back itself.

Two kinds of database handle are accepted:

* a DB-API 2.0 ``connect`` factory (``lambda: sqlite3.connect(path)``, psycopg, ...): one
  connection per thread (the sync client applies partitions on several threads); give the
  driver's ``paramstyle`` if it is not ``qmark``;
* a SQLAlchemy ``Engine`` (anything with ``begin()`` and ``dialect``): each apply runs in
  ``engine.begin()``; ``apply`` gets the SQLAlchemy ``Connection``.

A failure (``apply`` raising, a database error) rolls back and propagates: the client calls
``uncaught_exception`` and delivers the transaction again after re-mounting.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any

from .api import Transaction, WaltzClientCallbacks

_TABLE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?$")
#: paramstyle -> placeholder of the i-th (1-based) parameter named n
_PLACEHOLDERS: dict[str, Callable[[int, str], str]] = {
    "qmark": lambda i, n: "?", "format": lambda i, n: "%s", "numeric": lambda i, n: f":{i}",
    "named": lambda i, n: f":{n}", "pyformat": lambda i, n: f"%({n})s"}


class SqlClientCallbacks(WaltzClientCallbacks):
    """Callbacks that keep the client high-water mark in the application's database (see module doc)."""

    def __init__(self, database: Any, *, table: str = "waltz_high_water_marks", paramstyle: str = "qmark",
                 create_table: bool = True) -> None:
        if not _TABLE_NAME.match(table):
            raise ValueError(f"not a plain SQL table name: {table!r}")
        if paramstyle not in _PLACEHOLDERS:
            raise ValueError(f"unknown DB-API paramstyle {paramstyle!r}")
        self.table = table
        self._is_sqlalchemy = hasattr(database, "begin") and hasattr(database, "dialect")
        self._database = database
        self._paramstyle = "named" if self._is_sqlalchemy else paramstyle
        self._local = threading.local()
        if create_table:
            self._run(lambda conn: self._execute(conn, f"CREATE TABLE IF NOT EXISTS {table} "
                                                       "(partition_id INTEGER PRIMARY KEY, high_water_mark BIGINT NOT NULL)"))

    # -------------------------------------------------------------------------- subclass hook

    def apply(self, transaction: Transaction, connection: Any) -> None:
        """Apply the transaction's changes with ``connection`` (inside the open database transaction)."""
        raise NotImplementedError

    # ---------------------------------------------------------------------------- callbacks

    def client_high_water_mark(self, partition_id: int) -> int:
        def read(conn: Any) -> int:
            row = self._fetchone(conn, f"SELECT high_water_mark FROM {self.table} WHERE partition_id = {{0}}", partition_id)
            if row is not None:
                return int(row[0])
            self._execute(conn, f"INSERT INTO {self.table} (partition_id, high_water_mark) VALUES ({{0}}, {{1}})",
                          partition_id, -1)
            return -1
        try:
            return int(self._run(read))
        except Exception:  # noqa: BLE001 - the driver's IntegrityError: any other failure recurs below
            # Another instance inserted the row first: read it.
            return int(self._run(lambda conn: self._fetchone(
                conn, f"SELECT high_water_mark FROM {self.table} WHERE partition_id = {{0}}", partition_id)[0]))

    def apply_transaction(self, transaction: Transaction) -> None:
        tid = transaction.transaction_id

        def apply(conn: Any) -> None:
            won = self._execute(conn, f"UPDATE {self.table} SET high_water_mark = {{0}} "
                                      "WHERE partition_id = {1} AND high_water_mark = {2}",
                                tid, transaction.partition_id, tid - 1)
            if won == 1:
                self.apply(transaction, conn)
            else:
                raise _Skip
        try:
            self._run(apply)
        except _Skip:
            pass

    # --------------------------------------------------------------------------- plumbing

    def _sql(self, sql: str, args: tuple[Any, ...]) -> tuple[str, Any]:
        style = self._paramstyle
        names = [f"p{i}" for i in range(len(args))]
        text = sql.format(*(_PLACEHOLDERS[style](i + 1, names[i]) for i in range(len(args))))
        if style in ("named", "pyformat"):
            return text, dict(zip(names, args, strict=True))
        return text, tuple(args)

    def _execute(self, conn: Any, sql: str, *args: Any) -> int:
        text, params = self._sql(sql, args)
        if self._is_sqlalchemy:
            from sqlalchemy import text as sa_text

            return int(conn.execute(sa_text(text), params).rowcount)
        cur = conn.cursor()
        try:
            cur.execute(text, params)
            return int(cur.rowcount)
        finally:
            cur.close()

    def _fetchone(self, conn: Any, sql: str, *args: Any) -> Any:
        text, params = self._sql(sql, args)
        if self._is_sqlalchemy:
            from sqlalchemy import text as sa_text

            return conn.execute(sa_text(text), params).fetchone()
        cur = conn.cursor()
        try:
            cur.execute(text, params)
            return cur.fetchone()
        finally:
            cur.close()

    def _connection(self) -> Any:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = self._database()
        return conn

    def _run(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(connection)`` in one database transaction: commit on return, roll back on raise."""
        if self._is_sqlalchemy:
            with self._database.begin() as conn:
                return fn(conn)
        conn = self._connection()
        try:
            result = fn(conn)
        except BaseException:
            conn.rollback()
            raise
        conn.commit()
        return result

    def close(self) -> None:
        """Close this thread's DB-API connection (others close with their threads' objects)."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None


class _Skip(Exception):
    """Another instance applied the transaction: roll back (nothing was changed) and skip."""
