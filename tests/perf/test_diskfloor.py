"""The disk's floor for a replicated commit (``waltz_core.perf.diskfloor``, ``waltz perf disk``)."""

from __future__ import annotations

import json
import math
import os
from itertools import pairwise
from pathlib import Path

import pytest
from click.testing import CliRunner

from waltz_core.cli.main import build_cli
from waltz_core.perf import diskfloor

NAN = math.nan


def test_a_commit_is_durable_once_a_quorum_of_writers_has_it() -> None:
    arrivals = [0.0, 1.0, 2.0]
    durable = [[1.0, 3.0, 3.0], [2.0, 2.0, NAN], [5.0, NAN, NAN]]
    assert diskfloor.commit_latencies(arrivals, durable, 1) == [1.0, 1.0, 1.0]
    assert diskfloor.commit_latencies(arrivals, durable, 2) == [2.0, 2.0]  # the third reached one writer only
    assert diskfloor.commit_latencies(arrivals, durable, 3) == [5.0]
    with pytest.raises(ValueError, match="quorum must be 1 to 3"):
        diskfloor.commit_latencies(arrivals, durable, 4)
    with pytest.raises(ValueError, match="quorum must be 1 to 3"):
        diskfloor.commit_latencies(arrivals, durable, 0)


def test_arrivals_are_poisson_at_the_rate_and_repeatable() -> None:
    arrivals = diskfloor.poisson_arrivals(2000.0, 5.0, seed=3)
    assert arrivals == sorted(arrivals) and 0 < arrivals[0] and arrivals[-1] < 5.0
    assert len(arrivals) == pytest.approx(10_000, rel=0.05)
    assert diskfloor.poisson_arrivals(2000.0, 5.0, seed=3) == arrivals
    with pytest.raises(ValueError):
        diskfloor.poisson_arrivals(0.0, 1.0)
    with pytest.raises(ValueError, match="1e\\+09 commits/s for 1 s are 1,000,000,000 commits; at most 10,000,000"):
        diskfloor.poisson_arrivals(1e9, 1.0)  # refused before a list of a billion floats is built


def test_writers_run_rounds_over_the_arrivals_and_leave_no_file(tmp_path: Path) -> None:
    rec = diskfloor.record(tmp_path, writers=2, rate=500.0, seconds=0.4, record_size=200)
    assert list(tmp_path.iterdir()) == []
    assert len(rec.durable) == 2 and len(rec.rounds) == 2
    for durable, rounds in zip(rec.durable, rec.rounds, strict=True):
        # every arrival was made durable, after it arrived, at the end of a round that started after it
        ends = {end for _, end in rounds}
        for arrived, done in zip(rec.arrivals, durable, strict=True):
            assert arrived < done and done in ends
        # one round at a time, each ending after it starts
        assert all(start < end for start, end in rounds)
        assert all(end <= next_start for (_, end), (next_start, _) in pairwise(rounds))
        # a round took only what had arrived when it started
        for start, end in rounds:
            assert all(arrived <= start for arrived, done in zip(rec.arrivals, durable, strict=True) if done == end)


def test_rounds_start_no_sooner_than_the_interval_after_the_last(tmp_path: Path) -> None:
    rec = diskfloor.record(tmp_path, writers=1, rate=2000.0, seconds=0.3, round_interval=0.004)
    starts = [start for start, _ in rec.rounds[0]]
    assert len(starts) > 10 and all(b - a >= 0.004 for a, b in pairwise(starts))
    # so the rounds carry several arrivals each (2,000/s over 4 ms: about 8)
    assert len(rec.arrivals) / len(starts) > 3


def test_bad_arguments_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such directory"):
        diskfloor.record(tmp_path / "missing", writers=1, rate=100.0, seconds=0.1)
    with pytest.raises(ValueError):
        diskfloor.record(tmp_path, writers=0, rate=100.0, seconds=0.1)
    with pytest.raises(ValueError):
        diskfloor.record(tmp_path, writers=1, rate=100.0, seconds=0.1, record_size=0)
    with pytest.raises(ValueError):
        diskfloor.record(tmp_path, writers=1, rate=100.0, seconds=0.1, round_interval=-1.0)
    with pytest.raises(ValueError, match="quorum"):
        diskfloor.measure(tmp_path, writers=2, quorum=3, seconds=0.1)
    assert list(tmp_path.iterdir()) == []


def test_a_writer_that_cannot_create_its_file_fails_the_measure_and_keeps_the_file(tmp_path: Path) -> None:
    # A file of that name already exists (O_EXCL): the writers stop, the error is the open's, and
    # the file that was there before is still there.
    taken = tmp_path / f".waltz-disk-floor-{os.getpid()}-1"
    taken.write_bytes(b"someone's")
    with pytest.raises(FileExistsError):
        diskfloor.record(tmp_path, writers=2, rate=100.0, seconds=0.2)
    assert list(tmp_path.iterdir()) == [taken] and taken.read_bytes() == b"someone's"


def test_measure_reports_rounds_and_a_commit_floor_of_at_least_a_round(tmp_path: Path) -> None:
    floor = diskfloor.measure(tmp_path, writers=2, quorum=2, rate=400.0, seconds=0.5)
    assert floor.writers == 2 and floor.quorum == 2 and floor.rounds_per_s > 0 and floor.records_per_round >= 1
    c, f = floor.commit_ms, floor.flush_ms
    assert 0 < c["p50"] <= c["p99"] <= c["p99.9"] <= c["max"]
    # a commit waits for at least one whole round on each of the two writers
    assert c["mean"] >= f["mean"] * 0.99  # (histogram buckets are 1 % wide)
    assert "durable on 2 of 2" in floor.summary() and "rounds/s per writer" in floor.summary()
    assert set(floor.to_json()) == {"directory", "writers", "quorum", "rate", "record_size", "seconds",
                                    "round_interval", "rounds_per_s", "records_per_round", "flush_ms", "commit_ms"}
    with pytest.raises(RuntimeError, match="no commit became durable"):
        diskfloor.measure(tmp_path, writers=1, quorum=1, rate=0.001, seconds=0.1)  # no arrival at all


def test_the_disk_command_prints_json_and_refuses_bad_values(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(build_cli(), ["perf", "disk", "--dir", str(tmp_path), "--duration", "0.3",
                                         "--rate", "300", "--replicas", "1", "--quorum", "1", "--round-interval", "2",
                                         "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["writers"] == 1 and out["rate"] == 300.0 and out["round_interval"] == 0.002
    assert out["commit_ms"]["p50"] > 0
    result = runner.invoke(build_cli(), ["perf", "disk", "--dir", str(tmp_path), "--quorum", "4"])
    assert result.exit_code == 2 and "4 is more than --replicas (3)" in result.output
    result = runner.invoke(build_cli(), ["perf", "disk", "--dir", str(tmp_path / "missing")])
    assert result.exit_code == 2 and "does not exist" in result.output
    result = runner.invoke(build_cli(), ["perf", "disk", "--dir", str(tmp_path), "--rate", "0.001",
                                         "--duration", "0.1"])
    assert result.exit_code == 1 and "cannot measure the disk: no commit became durable" in result.output
    result = runner.invoke(build_cli(), ["perf", "disk", "--dir", str(tmp_path), "--rate", "1e9"])
    assert result.exit_code == 1 and "lower the rate or the duration" in result.output
    assert "Traceback" not in result.output
    assert list(tmp_path.iterdir()) == []
