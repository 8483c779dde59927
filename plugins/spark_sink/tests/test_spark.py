"""The ``waltz`` data source against a real cluster and a real local SparkSession."""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest

from waltz_core.app.bank import BANK_HEADER
from waltz_core.client import Transaction, WaltzClient, WaltzClientCallbacks
from waltz_spark.testing import high_water_marks, write_and_record

# One Spark session and one cluster per worker: keep every Spark test on the same xdist worker.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.xdist_group("spark")]


def _rows(df: Any) -> dict[tuple[int, int], tuple[Any, ...]]:
    return {(r["partition"], r["transaction_id"]): (*tuple(r)[:6], bytes(r["data"])) for r in df.collect()}


def read(spark: Any, cluster: Any, **options: str) -> Any:
    return spark.read.format("waltz").option("config", cluster.client_toml).options(**options).load()


# --------------------------------------------------------------------------------------- batch


def test_batch_read_equals_what_a_client_applied(spark: Any, waltz_cluster: Any) -> None:
    config = waltz_cluster.spec.client_config()
    applied = write_and_record(config, [(i % 4, f"batch-{i}".encode(), i - 100) for i in range(300)])
    df = read(spark, waltz_cluster, rangeSize="40")
    assert df.rdd.getNumPartitions() >= 8  # split by partition and id range: >= 75 per partition / 40
    assert _rows(df) == applied

    # a subset of partitions and an id range
    sub = _rows(read(spark, waltz_cluster, partitions="1,3", startId="10", endId="20"))
    assert sub == {k: v for k, v in applied.items() if k[0] in (1, 3) and 10 <= k[1] <= 20}
    assert len(sub) == 22


# ----------------------------------------------------------------------------------- streaming


def _stream_once(spark: Any, cluster: Any, out: Path, checkpoint: Path, start: dict[int, int]) -> Any:
    query = (spark.readStream.format("waltz").option("config", cluster.client_toml)
             .option("startingOffsets", json.dumps({str(p): v for p, v in start.items()}))
             .option("maxTransactionsPerTrigger", "70").option("rangeSize", "25").load()
             .writeStream.format("parquet").option("path", str(out)).option("checkpointLocation", str(checkpoint))
             .trigger(availableNow=True).start())
    query.awaitTermination()
    return query


def test_streaming_read_survives_stop_and_start_without_loss_or_duplicate(spark: Any, waltz_cluster: Any,
                                                                          tmp_path: Path) -> None:
    config = waltz_cluster.spec.client_config()
    start = high_water_marks(config)
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"
    write_and_record(config, [(i % 4, f"s1-{i}".encode(), 1) for i in range(120)])
    q1 = _stream_once(spark, waltz_cluster, out, checkpoint, start)
    batches = [p["numInputRows"] for p in q1.recentProgress if p["numInputRows"]]
    assert sum(batches) == 120 and max(batches) <= 70 and len(batches) >= 2  # maxTransactionsPerTrigger

    second = write_and_record(config, [(i % 4, f"s2-{i}".encode(), 2) for i in range(90)])
    q2 = _stream_once(spark, waltz_cluster, out, checkpoint, start)  # a new run from the checkpoint
    assert sum(p["numInputRows"] for p in q2.recentProgress) == 90  # only the new transactions

    got = spark.read.parquet(str(out)).collect()
    keys = [(r["partition"], r["transaction_id"]) for r in got]
    assert len(keys) == len(set(keys)) == 210  # none twice
    expected = {k: v for k, v in second.items() if k[1] > start[k[0]]}
    assert {k: (*tuple(r)[:6], bytes(r["data"])) for k, r in zip(keys, got, strict=True)} == expected
    assert {v[6] for v in expected.values()} == {f"s1-{i}".encode() for i in range(120)} | {
        f"s2-{i}".encode() for i in range(90)}

    q3 = _stream_once(spark, waltz_cluster, out, checkpoint, start)
    assert sum(p["numInputRows"] for p in q3.recentProgress) == 0


# --------------------------------------------------------------------------------------- sinks


def test_streaming_write_of_n_rows_produces_exactly_the_expected_log(spark: Any, waltz_cluster: Any,
                                                                    tmp_path: Path) -> None:
    config = waltz_cluster.spec.client_config()
    n = 400
    source = tmp_path / "in"
    spark.createDataFrame([(f"w-{i}", i, i % 4, i) for i in range(n)], "data STRING, header INT, p INT, key BIGINT") \
        .repartition(3).write.parquet(str(source))
    before = high_water_marks(config)
    query = (spark.readStream.schema("data STRING, header INT, p INT, key BIGINT").parquet(str(source))
             .writeStream.format("waltz").option("config", waltz_cluster.client_toml)
             .option("headerColumn", "header").option("partitionColumn", "p").option("lockColumn", "key")
             .option("checkpointLocation", str(tmp_path / "cp")).trigger(availableNow=True).start())
    query.awaitTermination()
    after = high_water_marks(config)
    assert {p: after[p] - before[p] for p in after} == {p: n // 4 for p in range(4)}
    new = {k: v for k, v in write_and_record(config, []).items() if k[1] > before[k[0]]}
    assert len(new) == n
    assert {(v[0], v[6], v[2]) for v in new.values()} == {(i % 4, f"w-{i}".encode(), i) for i in range(n)}
    per_partition_ids = sorted(k[1] for k in new if k[0] == 2)
    assert per_partition_ids == list(range(before[2] + 1, after[2] + 1))  # gap-free, nothing else in between


def test_idempotent_batch_write_is_exactly_once_across_a_replay(spark: Any, waltz_cluster: Any) -> None:
    config = waltz_cluster.spec.client_config()
    snapshot = json.dumps({str(p): v for p, v in high_water_marks(config).items()})
    df = spark.createDataFrame([(f"k{i}", f"pay-{i}") for i in range(60)], "key STRING, data STRING")
    before = high_water_marks(config)
    for _ in range(2):  # the replay (same keys, same snapshot) must add nothing
        (df.write.format("waltz").mode("append").option("config", waltz_cluster.client_toml)
         .option("lockColumn", "key").option("idempotent", "true").option("lockSnapshot", snapshot).save())
    after = high_water_marks(config)
    assert sum(after.values()) - sum(before.values()) == 60
    # a plain (at-least-once) write of the same rows does append them again
    df.write.format("waltz").mode("append").option("config", waltz_cluster.client_toml).save()
    assert sum(high_water_marks(config).values()) - sum(after.values()) == 60


# ----------------------------------------------------------------------------------- bad options


@pytest.mark.parametrize(("options", "message"), [
    ({}, "no connection given"),
    ({"config": "/nonexistent/client.toml"}, "no such file"),
    ({"CONFIG": "@", "bogus": "1"}, "unknown option 'bogus'"),
    ({"CONFIG": "@", "startId": "9", "endId": "3"}, "'endId' (3) is before 'startId' (9)"),
    ({"CONFIG": "@", "partitions": "a-b"}, "option 'partitions'"),
    ({"CONFIG": "@", "partitions": "7"}, "no partition [7]"),
    ({"CONFIG": "@", "startingOffsets": "soon"}, "startingOffsets"),
    ({"CONFIG": "@", "rangeSize": "0"}, "'rangesize': must be at least 1"),
])
def test_bad_read_options_give_clear_errors(spark: Any, waltz_cluster: Any, options: dict[str, str],
                                            message: str) -> None:
    options = {k: (waltz_cluster.client_toml if v == "@" else v) for k, v in options.items()}
    with pytest.raises(Exception) as info:
        spark.read.format("waltz").options(**options).load().collect()
    assert message in str(info.value)


@pytest.mark.parametrize(("options", "mode", "message"), [
    ({}, "overwrite", "append-only"),
    ({"dataColumn": "payload"}, "append", "no column 'payload'"),
    ({"idempotent": "true"}, "append", "needs 'lockColumn'"),
    ({"partitioner": "nocolon"}, "append", "expected 'module:function'"),
])
def test_bad_write_options_give_clear_errors(spark: Any, waltz_cluster: Any, options: dict[str, str], mode: str,
                                             message: str) -> None:
    df = spark.createDataFrame([("x",)], "data STRING")
    before = high_water_marks(waltz_cluster.spec.client_config())
    with pytest.raises(Exception) as info:
        df.write.format("waltz").mode(mode).option("config", waltz_cluster.client_toml).options(**options).save()
    assert message in str(info.value)
    assert high_water_marks(waltz_cluster.spec.client_config()) == before  # nothing written


# ------------------------------------------------------------------------------------- decoders


def _pair(data: bytes) -> tuple[int, str]:
    left, right = data.split(b"|")
    return int(left), right.decode()


def test_decoders_turn_the_payload_into_typed_columns(spark: Any) -> None:
    import struct

    from waltz_spark.decoders import decode, decoders

    assert {"json", "utf8", "struct"} <= set(decoders())
    base = spark.createDataFrame([(1, b'{"a": 3, "b": "x"}'), (2, b"not json")], "id INT, data BINARY")
    js = decode(base, "json", schema="a INT, b STRING").orderBy("id").collect()
    assert [tuple(r) for r in js] == [(1, 3, "x"), (2, None, None)]
    st = decode(spark.createDataFrame([(struct.pack(">iq", 7, 2**40),)], "data BINARY"), "struct",
                format=">iq", names=["small", "big"])
    assert st.schema.simpleString() == "struct<small:int,big:bigint>" and tuple(st.first()) == (7, 2**40)
    fn = decode(spark.createDataFrame([(b"5|five",)], "data BINARY"), _pair, schema="n INT, word STRING")
    assert tuple(fn.first()) == (5, "five")
    with pytest.raises(Exception, match="no payload decoder 'xml'"):
        decode(base, "xml")


# --------------------------------------------------------------------------------- bank summary


class BankSqlite(WaltzClientCallbacks):
    """What the demo does: apply each operation exactly once into SQLite, with the high-water mark."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = threading.Lock()
        with sqlite3.connect(path) as db:
            db.executescript("CREATE TABLE accounts(account INTEGER PRIMARY KEY, balance INTEGER, ops INTEGER);"
                             "CREATE TABLE daily(day TEXT PRIMARY KEY, deposits INTEGER, withdrawals INTEGER, ops INTEGER);"
                             "CREATE TABLE hwm(partition INTEGER PRIMARY KEY, txn INTEGER);")

    def client_high_water_mark(self, partition_id: int) -> int:
        with self.lock, sqlite3.connect(self.path) as db:
            row = db.execute("SELECT txn FROM hwm WHERE partition = ?", (partition_id,)).fetchone()
        return -1 if row is None else int(row[0])

    def apply_transaction(self, transaction: Transaction) -> None:
        data = transaction.get_data()
        try:
            op = json.loads(data)
            ok = (transaction.header == BANK_HEADER and isinstance(op, dict)
                  and op.get("op") in ("deposit", "withdraw"))
        except ValueError:
            ok = False
        with self.lock, sqlite3.connect(self.path) as db:
            if ok:
                signed = op["amount"] if op["op"] == "deposit" else -op["amount"]
                db.execute("INSERT INTO accounts VALUES (?, ?, 1) ON CONFLICT(account) DO UPDATE SET "
                           "balance = balance + excluded.balance, ops = ops + 1", (op["account"], signed))
                dep, wd = (op["amount"], 0) if signed > 0 else (0, op["amount"])
                db.execute("INSERT INTO daily VALUES (?, ?, ?, 1) ON CONFLICT(day) DO UPDATE SET deposits = deposits + "
                           "excluded.deposits, withdrawals = withdrawals + excluded.withdrawals, ops = ops + 1",
                           (op["ts"][:10], dep, wd))
            db.execute("INSERT OR REPLACE INTO hwm VALUES (?, ?)", (transaction.partition_id, transaction.transaction_id))


def test_summarize_matches_the_bank_sqlite(spark: Any, waltz_cluster: Any, tmp_path: Path) -> None:
    import random

    from waltz_core.app.bank import BANK_HEADER
    from waltz_spark.summarize import bank_operation, summarize

    rng = random.Random(8)
    ops = [(rng.randrange(4), bank_operation(rng.randrange(20), rng.randrange(1, 500),
                                              rng.choice(["deposit", "withdraw"]),
                                              f"2024-05-{rng.randrange(1, 6):02d}T{rng.randrange(24):02d}:15:00+00:00"),
            BANK_HEADER)
           for _ in range(300)]
    config = waltz_cluster.spec.client_config()
    write_and_record(config, ops)
    bank = BankSqlite(tmp_path / "bank.sqlite3")
    with WaltzClient(bank, config) as client:
        client.wait_mounted(30)
        marks = {p: client.high_water_mark(p) for p in range(client.num_partitions)}
        for p, hwm in marks.items():
            deadline_ok = False
            for _ in range(600):
                if bank.client_high_water_mark(p) >= hwm:
                    deadline_ok = True
                    break
                threading.Event().wait(0.05)
            assert deadline_ok, f"partition {p} not applied to {hwm}"
    counts = summarize(spark, {"config": waltz_cluster.client_toml}, tmp_path / "summary")
    with sqlite3.connect(tmp_path / "bank.sqlite3") as db:
        accounts = {a: (b, n) for a, b, n in db.execute("SELECT account, balance, ops FROM accounts")}
        daily = {d: (dep, wd, n) for d, dep, wd, n in db.execute("SELECT day, deposits, withdrawals, ops FROM daily")}
    balances = {r["account"]: (r["balance"], r["operations"])
                for r in spark.read.parquet(str(tmp_path / "summary" / "balances")).collect()}
    days = {str(r["day"]): (r["deposits"], r["withdrawals"], r["operations"])
            for r in spark.read.parquet(str(tmp_path / "summary" / "daily")).collect()}
    assert balances == accounts and days == daily
    assert counts["operations"] == sum(n for _, n in accounts.values()) >= 300
    assert all(r["net"] == r["deposits"] - r["withdrawals"]
               for r in spark.read.parquet(str(tmp_path / "summary" / "daily")).collect())


def test_summarize_of_the_real_demo_bank_matches_its_sqlite(spark: Any, waltz_cluster: Any, tmp_path: Path) -> None:
    """The demo bank itself (``waltz demo bank --auto``) writes the log; summarize's balances equal
    the balances in the bank's SQLite database (every bank operation of the shared cluster so far
    is in both, since the bank's database applies the whole log exactly once)."""
    from waltz_core.app import bank
    from waltz_spark.summarize import summarize

    config = waltz_cluster.spec.client_config()
    db = tmp_path / "demo-bank.sqlite3"
    state = bank.run_auto(config, db, operations=120, clients=2, accounts=6, seed=3).after
    counts = summarize(spark, {"config": waltz_cluster.client_toml}, tmp_path / "demo-summary")
    balances = {r["account"]: r["balance"] for r in spark.read.parquet(str(tmp_path / "demo-summary" / "balances")).collect()}
    # The bank's database applied the whole log (exactly once), including bank transactions the
    # other tests of this session wrote: it must agree with summarize on every account.
    assert balances == state.balances
    assert counts["operations"] >= state.num_deposits + state.num_withdrawals
    days = spark.read.parquet(str(tmp_path / "demo-summary" / "daily")).collect()
    assert days and all(r["net"] == r["deposits"] - r["withdrawals"] for r in days)
