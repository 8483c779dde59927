"""Pure pieces of the data source: option parsing, id-range splitting, per-trigger caps (no Spark run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from waltz_spark.logclient import split_ranges
from waltz_spark.options import ReadOptions, SparkOptionError, WriteOptions, client_config, parse_partitions


def test_partitions_and_ranges() -> None:
    assert parse_partitions("0, 2,5-7") == (0, 2, 5, 6, 7)
    assert parse_partitions("") is None
    for bad in ("x", "3-1", "-1"):
        with pytest.raises(SparkOptionError, match="partitions"):
            parse_partitions(bad)
    assert split_ranges({0: (0, 9), 1: (5, 4), 2: (3, 3)}, 4) == [(0, 0, 3), (0, 4, 7), (0, 8, 9), (2, 3, 3)]


def test_connection_from_a_file_with_overrides(tmp_path: Path) -> None:
    path = tmp_path / "client.toml"
    path.write_text('[coordination]\nname = "local"\nconnect = "/data/c"\nroot = "/w"\n[transport]\nname = "tcp"\n')
    cfg = client_config({"config": str(path), "coordination.root": "/other", "client.rpc_timeout": "3.5"})
    assert (cfg.coordination.connect, cfg.coordination.root, cfg.client.rpc_timeout) == ("/data/c", "/other", 3.5)
    with pytest.raises(SparkOptionError, match="client.nope"):
        client_config({"config": str(path), "client.nope": "1"})
    opts = ReadOptions.parse({"Config": str(path), "maxTransactionsPerTrigger": "10", "startingOffsets": '{"1": 4}'})
    assert (opts.max_per_trigger, opts.starting_offsets, opts.end_id) == (10, '{"1": 4}', None)
    with pytest.raises(SparkOptionError, match="lockSnapshot"):
        WriteOptions.parse({"config": str(path), "lockSnapshot": "{}"}, ["data"])
    w = WriteOptions.parse({"config": str(path), "lockColumn": "k", "idempotent": "true", "lockSnapshot": '{"0": 3}'},
                           ["data", "k"])
    assert w.idempotent and w.lock_snapshot == ((0, 3),)


def test_cap_offsets_shares_the_budget_fairly() -> None:
    from waltz_core.testing import require

    require(__import__("importlib").util.find_spec("pyspark") is not None, "pyspark")
    from waltz_spark.source import cap_offsets

    start = {0: -1, 1: 9, 2: 4}
    latest = {0: 99, 1: 10, 2: 4}
    assert cap_offsets(start, latest, None) == latest
    capped = cap_offsets(start, latest, 21)
    assert capped == {0: 19, 1: 10, 2: 4}  # partition 1 had 1 pending, partition 0 takes the rest
    assert sum(capped[p] - start[p] for p in start) == 21
    assert cap_offsets(start, latest, 1000) == latest
