"""Exactly-once writes on a lock table that reports false conflicts: no row dropped, none twice.

The cluster here has a ``hashed`` lock table of one slot and one hash: every key shares the slot,
so once anything was written after the snapshot, every key conflicts against it although none of
them is in the log. Those rows must still be written, once each; a replay of them must add nothing.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest

from waltz_spark.keyed import canonical_key
from waltz_spark.options import WriteOptions, client_config
from waltz_spark.sink import SinkWriteError, write_rows
from waltz_spark.testing import high_water_marks

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.xdist_group("spark")]


def _options(cluster: Any, snapshot: dict[int, int], **extra: str) -> dict[str, str]:
    return {"config": cluster.client_toml, "lockColumn": "key", "idempotent": "true",
            "lockSnapshot": json.dumps({str(p): v for p, v in snapshot.items()}), **extra}


def _write(spark: Any, cluster: Any, snapshot: dict[int, int], rows: list[tuple[int, str]]) -> None:
    df = spark.createDataFrame(rows, "key BIGINT, data STRING")
    df.write.format("waltz").mode("append").options(**_options(cluster, snapshot)).save()


def _direct(cluster: Any, snapshot: dict[int, int], rows: list[tuple[int, str]], **extra: str) -> Any:
    """What one Spark task does with these rows (in this process, so its WriteResult is visible)."""
    opts = WriteOptions.parse(_options(cluster, snapshot, **extra), ["key", "data"])
    return write_rows(client_config(opts.raw), [{"key": k, "data": d} for k, d in rows], opts, snapshot)


def test_false_conflicts_write_every_row_exactly_once(spark: Any, one_slot_cluster: Any) -> None:
    from waltz_spark.decoders import decode

    config = one_slot_cluster.spec.client_config()
    snapshot = high_water_marks(config)
    others = [(1000 + i, f"other-{i}") for i in range(8)]  # keys % 4: two in every partition
    rows = [(i, f"row-{i}") for i in range(24)]
    _write(spark, one_slot_cluster, snapshot, others)
    conflicts_before = one_slot_cluster.lock_failures()
    # Every partition's only slot now holds a commit after the snapshot: each of these keys
    # conflicts on its first append, although none of them was ever written.
    _write(spark, one_slot_cluster, snapshot, rows)
    assert one_slot_cluster.lock_failures() - conflicts_before >= len(rows)

    after = high_water_marks(config)
    assert sum(after.values()) - sum(snapshot.values()) == len(others) + len(rows)
    log = decode(spark.read.format("waltz").option("config", one_slot_cluster.client_toml).load(), "keyed")
    new = [r for r in log.collect() if r["transaction_id"] > snapshot[r["partition"]]]
    written = Counter((bytes(k), bytes(r["data"]).decode()) for r in new for k in r["idempotency_keys"])
    assert written == Counter((canonical_key(k, "key"), d) for k, d in others + rows)

    # The replay: every key is in the log, so every row is a duplicate and nothing is appended.
    result = _direct(one_slot_cluster, snapshot, rows)
    assert (result.committed, result.duplicates) == (0, len(rows))
    assert high_water_marks(config) == after


def test_a_row_that_keeps_conflicting_fails_the_task_instead_of_vanishing(one_slot_cluster: Any) -> None:
    config = one_slot_cluster.spec.client_config()
    snapshot = high_water_marks(config)
    first = _direct(one_slot_cluster, snapshot, [(2000 + i, f"first-{i}") for i in range(4)])
    assert (first.committed, first.duplicates) == (4, 0)
    written = high_water_marks(config)

    # New keys, the same snapshot: each conflicts on the slot the rows above wrote, and may not be
    # retried after a false conflict: the task fails loudly and the rows are not in the log.
    with pytest.raises(SinkWriteError, match=r"4 of 4 rows failed.*not in the log after the snapshot.*"
                                             r"'maxFalseConflicts' is 0\); the row was not written"):
        _direct(one_slot_cluster, snapshot, [(3000 + i, f"second-{i}") for i in range(4)], maxFalseConflicts="0")
    assert high_water_marks(config) == written

    # With retries allowed the same rows are written, each once, after their false conflicts.
    second = _direct(one_slot_cluster, snapshot, [(3000 + i, f"second-{i}") for i in range(4)])
    assert (second.committed, second.duplicates) == (4, 0) and second.false_conflicts >= 4
    assert sum(high_water_marks(config).values()) - sum(written.values()) == 4
