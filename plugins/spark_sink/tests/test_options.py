"""Pure pieces of the data source: option parsing, id-range splitting, per-trigger caps (no Spark run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from waltz_core.errors import ClientError
from waltz_spark.keyed import KEYED_MAGIC, canonical_key, decode_keyed, describe_key, encode_keyed
from waltz_spark.logclient import split_ranges
from waltz_spark.options import (
    MAX_FALSE_CONFLICTS,
    ReadOptions,
    SparkOptionError,
    WriteOptions,
    client_config,
    parse_partitions,
)


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
    with pytest.raises(SparkOptionError, match=r"client\.nope"):
        client_config({"config": str(path), "client.nope": "1"})
    opts = ReadOptions.parse({"Config": str(path), "maxTransactionsPerTrigger": "10", "startingOffsets": '{"1": 4}'})
    assert (opts.max_per_trigger, opts.starting_offsets, opts.end_id) == (10, '{"1": 4}', None)
    with pytest.raises(SparkOptionError, match="lockSnapshot"):
        WriteOptions.parse({"config": str(path), "lockSnapshot": "{}"}, ["data"])
    w = WriteOptions.parse({"config": str(path), "lockColumn": "k", "idempotent": "true", "lockSnapshot": '{"0": 3}'},
                           ["data", "k"])
    assert w.idempotent and w.lock_snapshot == ((0, 3),) and w.max_false_conflicts == MAX_FALSE_CONFLICTS
    idem = {"config": str(path), "lockColumn": "k", "idempotent": "true"}
    assert WriteOptions.parse({**idem, "maxFalseConflicts": "0"}, ["data", "k"]).max_false_conflicts == 0
    with pytest.raises(SparkOptionError, match="'maxfalseconflicts': must be at least 0"):
        WriteOptions.parse({**idem, "maxFalseConflicts": "-1"}, ["data", "k"])
    with pytest.raises(SparkOptionError, match="'maxFalseConflicts': only meaningful with idempotent=true"):
        WriteOptions.parse({"config": str(path), "maxFalseConflicts": "3"}, ["data"])


def test_keyed_payloads_carry_the_keys_a_lock_would_tell_apart() -> None:
    keys = (canonical_key(5, "k"), canonical_key("order-7", "k"), canonical_key(b"\xff", "k"))
    assert decode_keyed(encode_keyed(keys, b"row")) == (keys, b"row")
    assert decode_keyed(encode_keyed((), b"")) == ((), b"")
    assert [describe_key(k) for k in keys] == ["5", "'order-7'", "b'\\xff'"]
    # the same identity as the lock id: a string is its UTF-8 binary, an integer is not its text
    assert canonical_key("5", "k") == canonical_key(b"5", "k") != canonical_key(5, "k")
    # other payloads, and a truncated keyed one, are not keyed
    assert decode_keyed(b'{"amount": 5}') is None
    assert decode_keyed(encode_keyed(keys, b"")[:-1]) is None
    assert decode_keyed(KEYED_MAGIC) is None
    for bad in (True, 2**63, 1.5):
        with pytest.raises(ClientError, match="column 'k'"):
            canonical_key(bad, "k")


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
