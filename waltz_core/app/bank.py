"""``waltz demo bank``: the original's demo bank (``waltz-demo/.../DemoBankApp.java``) on SQLite.

Accounts and balances live in one SQLite file shared by every application instance; each
instance is a :class:`~waltz_core.client.WaltzClient` whose callbacks are a
:class:`~waltz_core.client.sql.SqlClientCallbacks`, so every transaction of the log is applied
to the database exactly once, whichever instance gets there first.

Operations (partition = account id mod the number of partitions):

* **deposit** - no lock: deposits commute and only raise a balance;
* **withdraw** - write lock ``withdrawal/<account>`` and read lock ``account/<account>`` (as the
  original: account-level writers such as its ``deactivate`` would fail a concurrent
  withdrawal). ``execute`` reads the balance from the database, which holds at least every
  transaction up to the client high-water mark the locks are checked against; it refuses the
  withdrawal (returns False) if it would overdraw. If another withdrawal of the account
  commits first, the server rejects this one on the write lock; the client re-executes it after
  applying the other, with the new balance.

Invariant (checked by :func:`check`): no balance is negative, and the sum of balances equals
the deposits minus the successful withdrawals - as counted by the database and, for one run, by
the producers' ``on_completion(True)`` callbacks.
"""

from __future__ import annotations

import datetime
import random
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import attrs

from ..client.api import JsonSerializer, Transaction, TransactionBuilder, TransactionContext, WaltzClientCallbacks
from ..client.sql import SqlClientCallbacks
from ..client.sync import WaltzClient
from ..config import ClientProcessConfig
from ..locks.lock_id import PartitionLocalLock

JSON = JsonSerializer()
#: Header of every bank transaction ("BANK"): other applications' transactions in the same
#: partitions are skipped (their high-water mark still advances).
BANK_HEADER = 0x42414E4B


def bank_record(op: str, account: int, amount: int, ts: str | None = None) -> dict[str, Any]:
    """The data of one bank transaction (JSON): ``{"op", "account", "amount", "ts"}``.

    ``op`` is ``deposit`` or ``withdraw``; ``amount`` is positive either way; ``ts`` is the UTC
    time the operation was built (ISO 8601), used by derived data such as daily totals
    (``waltz spark summarize``).
    """
    if op not in ("deposit", "withdraw"):
        raise ValueError(f"op must be 'deposit' or 'withdraw', got {op!r}")
    if ts is None:
        ts = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return {"op": op, "account": account, "amount": amount, "ts": ts}


class WithdrawalLock(PartitionLocalLock):
    """Written by every withdrawal of an account: two withdrawals never commit on the same read."""

    def __init__(self, account_id: int) -> None:
        super().__init__("withdrawal", account_id)


class AccountLock(PartitionLocalLock):
    """Read by withdrawals; written by account-level changes."""

    def __init__(self, account_id: int) -> None:
        super().__init__("account", account_id)


# ------------------------------------------------------------------------------- database


def connect(path: Path | str) -> sqlite3.Connection:
    """A connection to the bank database (WAL, waits up to 60 s for the write lock)."""
    conn = sqlite3.connect(str(path), timeout=60.0, check_same_thread=False)
    conn.execute("PRAGMA busy_timeout = 60000")
    return conn


def create_schema(path: Path | str) -> None:
    conn = connect(path)
    try:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("CREATE TABLE IF NOT EXISTS accounts (account_id INTEGER PRIMARY KEY, balance INTEGER NOT NULL)")
        conn.execute("CREATE TABLE IF NOT EXISTS bank_totals "
                     "(kind TEXT PRIMARY KEY, amount INTEGER NOT NULL, count INTEGER NOT NULL)")
        conn.execute("INSERT OR IGNORE INTO bank_totals VALUES ('deposit', 0, 0), ('withdraw', 0, 0)")
        conn.commit()
    finally:
        conn.close()


@attrs.frozen
class Snapshot:
    """The bank's state as the database holds it."""

    balances: dict[int, int]
    deposits: int
    withdrawals: int
    num_deposits: int
    num_withdrawals: int

    @property
    def total(self) -> int:
        return sum(self.balances.values())


def snapshot(path: Path | str) -> Snapshot:
    conn = connect(path)
    try:
        balances = {int(a): int(b) for a, b in conn.execute("SELECT account_id, balance FROM accounts ORDER BY account_id")}
        totals = {k: (int(a), int(n)) for k, a, n in conn.execute("SELECT kind, amount, count FROM bank_totals")}
    finally:
        conn.close()
    dep, wdr = totals.get("deposit", (0, 0)), totals.get("withdraw", (0, 0))
    return Snapshot(balances, dep[0], wdr[0], dep[1], wdr[1])


def apply_operation(balances: dict[int, int], totals: dict[str, int], data: dict[str, Any]) -> None:
    """The in-memory twin of :meth:`BankCallbacks.apply` (used by the log replay)."""
    sign = 1 if data["op"] == "deposit" else -1
    balances[data["account"]] = balances.get(data["account"], 0) + sign * data["amount"]
    totals[data["op"]] = totals.get(data["op"], 0) + data["amount"]


class BankCallbacks(SqlClientCallbacks):
    """One application instance's side of the feed: applies bank transactions to SQLite, exactly once."""

    def __init__(self, db_path: Path | str) -> None:
        self.db_path = Path(db_path)
        create_schema(self.db_path)
        super().__init__(lambda: connect(self.db_path), table="waltz_high_water_marks")
        self._reader = threading.local()

    def balance(self, account_id: int) -> int:
        """The account's balance as applied so far (0 for a new account); any thread."""
        conn = getattr(self._reader, "conn", None)
        if conn is None:
            conn = self._reader.conn = connect(self.db_path)
        row = conn.execute("SELECT balance FROM accounts WHERE account_id = ?", (account_id,)).fetchone()
        return int(row[0]) if row else 0

    def apply_transaction(self, transaction: Transaction) -> None:
        if transaction.header == BANK_HEADER:
            transaction.get_data()  # fetch (and cache) before the database transaction takes the write lock
        super().apply_transaction(transaction)

    def apply(self, transaction: Transaction, connection: Any) -> None:
        if transaction.header != BANK_HEADER:
            return  # not ours: only the high-water mark advances
        data = transaction.get_data(JSON)
        sign = 1 if data["op"] == "deposit" else -1
        # Applied as logged, never re-checked here: a negative balance would expose a broken lock.
        connection.execute("INSERT INTO accounts (account_id, balance) VALUES (?, ?) "
                           "ON CONFLICT(account_id) DO UPDATE SET balance = balance + excluded.balance",
                           (data["account"], sign * data["amount"]))
        connection.execute("UPDATE bank_totals SET amount = amount + ?, count = count + 1 WHERE kind = ?",
                           (data["amount"], data["op"]))


# ---------------------------------------------------------------------------- operations


@attrs.define
class Ledger:
    """What the producers of one run saw happen (callbacks of their contexts); thread-safe."""

    deposits: int = 0
    withdrawals: int = 0
    num_deposits: int = 0
    num_withdrawals: int = 0
    refused: int = 0
    lock_failures: int = 0
    failed: int = 0
    lock: threading.Lock = attrs.field(factory=threading.Lock, repr=False)

    def add(self, **deltas: int) -> None:
        with self.lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)


class BankOperation(TransactionContext):
    """A deposit or withdrawal; ``done`` is set when its outcome is final (applied, refused, failed)."""

    op = ""

    def __init__(self, bank: BankCallbacks, ledger: Ledger, account_id: int, amount: int) -> None:
        super().__init__()
        if amount <= 0:
            raise ValueError("the amount must be positive")
        self.bank = bank
        self.ledger = ledger
        self.account_id = account_id
        self.amount = amount
        self.outcome = "pending"
        self.balance_seen: int | None = None
        self.done = threading.Event()

    def partition_id(self, num_partitions: int) -> int:
        return self.account_id % num_partitions

    def _build(self, builder: TransactionBuilder) -> None:
        builder.set_header(BANK_HEADER)
        builder.set_transaction_data(bank_record(self.op, self.account_id, self.amount), JSON)

    def on_completion(self, result: bool) -> None:
        if result:
            self.outcome = "committed"
            if self.op == "deposit":
                self.ledger.add(deposits=self.amount, num_deposits=1)
            else:
                self.ledger.add(withdrawals=self.amount, num_withdrawals=1)
        else:
            self.outcome = "refused"
            self.ledger.add(refused=1)
            self.done.set()

    def on_application(self) -> None:
        self.done.set()

    def on_lock_failure(self) -> None:
        self.ledger.add(lock_failures=1)

    def on_exception(self, exc: BaseException) -> None:
        self.outcome = f"failed: {exc}"
        self.ledger.add(failed=1)
        self.done.set()

    def on_expiration(self) -> None:
        self.outcome = "expired"
        self.ledger.add(failed=1)
        self.done.set()


class Deposit(BankOperation):
    op = "deposit"

    def execute(self, builder: TransactionBuilder) -> bool:
        self._build(builder)
        return True


class Withdraw(BankOperation):
    op = "withdraw"

    def execute(self, builder: TransactionBuilder) -> bool:
        # The database holds at least everything up to builder.client_high_water_mark: a balance
        # read here is never older than the version the locks are checked against.
        balance = self.balance_seen = self.bank.balance(self.account_id)
        if balance < self.amount:
            return False
        self._build(builder)
        builder.set_write_locks([WithdrawalLock(self.account_id)])
        builder.set_read_locks([AccountLock(self.account_id)])
        return True


# ------------------------------------------------------------------------------ auto mode


@attrs.frozen
class RunResult:
    before: Snapshot
    after: Snapshot
    ledger: Ledger
    operations: int
    seconds: float


def run_auto(config: ClientProcessConfig, db_path: Path | str, operations: int, clients: int = 3,
             accounts: int = 8, seed: int | None = None,
             progress: Callable[[int], None] | None = None) -> RunResult:
    """``operations`` random deposits/withdrawals from ``clients`` concurrent application
    instances (one WaltzClient and one thread each) sharing the database; blocks until all
    are applied."""
    create_schema(db_path)
    before = snapshot(db_path)
    ledger = Ledger()
    rng = random.Random(seed)
    seeds = [rng.randrange(2**32) for _ in range(clients)]
    instances = [BankCallbacks(db_path) for _ in range(clients)]
    waltz: list[WaltzClient] = []
    errors: list[BaseException] = []
    done_count = [0]
    count_lock = threading.Lock()
    t0 = time.monotonic()
    try:
        for bank in instances:
            waltz.append(WaltzClient(bank, config))

        def worker(i: int) -> None:
            r = random.Random(seeds[i])
            share = operations // clients + (1 if i < operations % clients else 0)
            try:
                for _ in range(share):
                    account = r.randrange(accounts)
                    if r.random() < 0.55:
                        ctx: BankOperation = Deposit(instances[i], ledger, account, r.randint(1, 100))
                    else:
                        ctx = Withdraw(instances[i], ledger, account, r.randint(1, 120))
                    waltz[i].submit(ctx)
                    with count_lock:
                        done_count[0] += 1
                        if progress is not None:
                            progress(done_count[0])
                waltz[i].flush(timeout=120)
            except BaseException as exc:  # noqa: BLE001 - re-raised below on the calling thread
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,), name=f"bank-client-{i}") for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # Every instance applies every transaction (exactly one of them changes the database):
        # flush them all so the database holds everything committed by any of them.
        for c in waltz:
            c.flush(timeout=120)
    finally:
        for c in waltz:
            c.close()
        for bank in instances:
            bank.close()
    if errors:
        raise errors[0]
    return RunResult(before, snapshot(db_path), ledger, operations, time.monotonic() - t0)


@attrs.frozen
class Check:
    ok: bool
    lines: list[str]


def check(result: RunResult, replayed: dict[int, int] | None = None) -> Check:
    """The bank's invariants after a run (see the module docstring)."""
    a, b, led = result.after, result.before, result.ledger
    lines: list[str] = []
    ok = True

    def claim(good: bool, text: str) -> None:
        nonlocal ok
        ok = ok and good
        lines.append(("OK    " if good else "FAIL  ") + text)

    claim(a.total == a.deposits - a.withdrawals,
          f"sum of balances {a.total} = deposits {a.deposits} - withdrawals {a.withdrawals}")
    claim((a.deposits - b.deposits, a.withdrawals - b.withdrawals) == (led.deposits, led.withdrawals),
          f"this run: deposits {led.deposits} ({led.num_deposits}), withdrawals {led.withdrawals} "
          f"({led.num_withdrawals}) acknowledged = applied to the database exactly once")
    negative = {k: v for k, v in a.balances.items() if v < 0}
    claim(not negative, "no negative balance" + (f": {negative}" if negative else ""))
    claim(led.failed == 0, f"{led.failed} operations failed or expired")
    if replayed is not None:
        claim(replayed == a.balances, "balances re-derived by replaying the log through a fresh client match")
    return Check(ok, lines)


# ---------------------------------------------------------------------------------- replay


class _Replay(WaltzClientCallbacks):
    def __init__(self) -> None:
        self.balances: dict[int, int] = {}
        self.totals: dict[str, int] = {}
        self.hwm: dict[int, int] = {}
        self.changed = threading.Condition()

    def client_high_water_mark(self, partition_id: int) -> int:
        return -1

    def apply_transaction(self, transaction: Transaction) -> None:
        if transaction.header == BANK_HEADER:
            apply_operation(self.balances, self.totals, transaction.get_data(JSON))
        with self.changed:
            self.hwm[transaction.partition_id] = transaction.transaction_id
            self.changed.notify_all()


def replay_balances(config: ClientProcessConfig, timeout: float = 60.0) -> dict[int, int]:
    """Balances re-derived from the whole log by a fresh client (no database involved)."""
    replay = _Replay()
    with WaltzClient(replay, config) as client:
        targets = {pid: client.high_water_mark(pid) for pid in range(client.num_partitions)}
        deadline = time.monotonic() + timeout
        with replay.changed:
            while any(replay.hwm.get(pid, -1) < hwm for pid, hwm in targets.items()):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"replay did not reach {targets} (at {replay.hwm})")
                replay.changed.wait(min(left, 0.2))
    return dict(sorted(replay.balances.items()))


# ---------------------------------------------------------------------------- interactive

HELP = """commands:
  balance <account>            show a balance
  deposit <account> <amount>   add money
  withdraw <account> <amount>  take money (refused if it would overdraw)
  accounts                     every balance and the totals
  quit                         leave"""


def interactive(config: ClientProcessConfig, db_path: Path | str, stdin: TextIO, out: Callable[[str], None],
                prompt: Callable[[], None] = lambda: None, timeout: float = 30.0) -> None:
    """The prompt loop of ``waltz demo bank`` (one application instance)."""
    bank = BankCallbacks(db_path)
    ledger = Ledger()
    with WaltzClient(bank, config) as client:
        client.wait_mounted(timeout)
        client.flush(timeout)
        out(f"connected: {client.num_partitions} partitions. {HELP}")
        while True:
            prompt()
            line = stdin.readline()
            if not line:
                break
            words = line.split()
            if not words:
                continue
            cmd, args = words[0].lower(), words[1:]
            try:
                if cmd in ("quit", "exit", "q"):
                    break
                if cmd in ("help", "?"):
                    out(HELP)
                elif cmd == "balance" and len(args) == 1:
                    out(f"account {int(args[0])}: {bank.balance(int(args[0]))}")
                elif cmd == "accounts" and not args:
                    snap = snapshot(db_path)
                    for account, balance in snap.balances.items():
                        out(f"account {account}: {balance}")
                    out(f"total {snap.total} = deposits {snap.deposits} - withdrawals {snap.withdrawals}")
                elif cmd in ("deposit", "withdraw") and len(args) == 2:
                    account, amount = int(args[0]), int(args[1])
                    kind = Deposit if cmd == "deposit" else Withdraw
                    ctx = kind(bank, ledger, account, amount)
                    client.submit(ctx)
                    if not ctx.done.wait(timeout):
                        out(f"{cmd}: no outcome within {timeout}s (it may still commit)")
                    elif ctx.outcome == "refused":
                        out(f"withdrawal refused: balance {ctx.balance_seen} < {amount}")
                    elif ctx.outcome == "committed":
                        out(f"ok: account {account}: {bank.balance(account)}")
                    else:
                        out(f"{cmd}: {ctx.outcome}")
                else:
                    out(f"unknown command: {line.strip()!r}\n{HELP}")
            except ValueError as exc:
                out(f"bad input: {exc}")
    bank.close()
