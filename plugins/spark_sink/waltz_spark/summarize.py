"""The demo bank's derived data: per-account balances and daily totals, from the log, to Parquet.

The demo bank (``waltz demo bank``, :mod:`waltz_core.app.bank`) writes one transaction per
operation with header ``BANK_HEADER``; its data is JSON (:func:`waltz_core.app.bank.bank_record`)::

    {"op": "deposit", "account": 17, "amount": 250, "ts": "2024-05-01T09:30:00+00:00"}

``op`` is ``deposit`` or ``withdraw`` (``amount`` is positive either way). The job reads the
whole log (or some partitions) with the ``waltz`` data source, keeps the bank's transactions (by
header), decodes them with the ``json`` decoder and writes two Parquet tables under ``out``:

* ``balances``: ``account BIGINT, balance BIGINT, operations BIGINT`` (deposits minus withdrawals);
* ``daily``: ``day DATE, deposits BIGINT, withdrawals BIGINT, net BIGINT, operations BIGINT``.

Run it as ``waltz spark summarize --config client.toml --out DIR``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

BANK_SCHEMA = "op STRING, account BIGINT, amount BIGINT, ts STRING"


def bank_operation(account: int, amount: int, kind: str, ts: str) -> bytes:
    """One bank operation as transaction data, exactly as the demo bank writes it."""
    from waltz_core.app.bank import bank_record

    return json.dumps(bank_record(kind, account, amount, ts), separators=(",", ":")).encode()


def summarize(spark: Any, read_options: Mapping[str, str], out: str | Path) -> dict[str, int]:
    """Read the log, write ``out/balances`` and ``out/daily`` (Parquet, overwritten).

    Blocking (Spark jobs). Returns row counts: operations read, accounts and days written.
    """
    from pyspark.sql import functions as F

    from waltz_core.app.bank import BANK_HEADER

    from .decoders import decode

    raw = spark.read.format("waltz").options(**dict(read_options)).load()
    raw = raw.where(F.col("header") == F.lit(BANK_HEADER))
    ops = decode(raw, "json", schema=BANK_SCHEMA).where(F.col("op").isin("deposit", "withdraw")).cache()
    signed = F.when(F.col("op") == "deposit", F.col("amount")).otherwise(-F.col("amount"))
    balances = ops.groupBy("account").agg(F.sum(signed).cast("bigint").alias("balance"),
                                          F.count(F.lit(1)).alias("operations"))
    day = F.to_date(F.to_timestamp(F.col("ts")))
    deposits = F.sum(F.when(F.col("op") == "deposit", F.col("amount")).otherwise(0)).cast("bigint")
    withdrawals = F.sum(F.when(F.col("op") == "withdraw", F.col("amount")).otherwise(0)).cast("bigint")
    daily = (ops.groupBy(day.alias("day"))
             .agg(deposits.alias("deposits"), withdrawals.alias("withdrawals"), F.sum(signed).cast("bigint").alias("net"),
                  F.count(F.lit(1)).alias("operations")))
    out = Path(out)
    balances.orderBy("account").write.mode("overwrite").parquet(str(out / "balances"))
    daily.orderBy("day").write.mode("overwrite").parquet(str(out / "daily"))
    counts = {"operations": ops.count(), "accounts": balances.count(), "days": daily.count()}
    ops.unpersist()
    return counts
