"""The perf tools' pure parts: latency histogram, Prometheus scrape parsing, profile summary."""

from __future__ import annotations

import random

import pytest

from waltz_core.perf.cluster import RECORDS_METRIC, SYNCS_METRIC, StorageCounters, parse_prometheus
from waltz_core.perf.histogram import LatencyHistogram
from waltz_core.perf.profile import top_functions


def test_percentiles_within_one_percent_of_exact() -> None:
    rng = random.Random(7)
    values = [rng.lognormvariate(-6, 1.0) for _ in range(20000)]  # ~2.5 ms median, long tail
    hist = LatencyHistogram()
    for v in values:
        hist.record(v)
    exact = sorted(values)
    for q in (50, 90, 99, 99.9):
        want = exact[int(len(exact) * q / 100) - 1]
        assert hist.percentile(q) == pytest.approx(want, rel=0.011)
    assert hist.count == len(values)
    assert hist.max == max(values)
    assert hist.percentile(100) == max(values)


def test_merge_equals_recording_into_one() -> None:
    a, b, both = LatencyHistogram(), LatencyHistogram(), LatencyHistogram()
    for i in range(1, 500):
        (a if i % 2 else b).record(i / 1e4)
        both.record(i / 1e4)
    a.merge(b)
    assert a.summary_ms() == both.summary_ms()
    with pytest.raises(ValueError):
        a.merge(LatencyHistogram(precision=0.05))


def test_empty_histogram_reports_zeros() -> None:
    assert LatencyHistogram().summary_ms() == {"p50": 0.0, "p90": 0.0, "p99": 0.0, "p99.9": 0.0, "mean": 0.0, "max": 0.0}


def test_prometheus_counters_are_summed_over_partitions() -> None:
    text = "\n".join([
        "# HELP waltz_storage_appended_records Records appended.",
        "# TYPE waltz_storage_appended_records counter",
        f'{RECORDS_METRIC}{{partition="0"}} 120',
        f'{RECORDS_METRIC}{{partition="1"}} 30',
        f'{SYNCS_METRIC}{{partition="0"}} 10',
        f'{SYNCS_METRIC}{{partition="1"}} 5',
        'waltz_storage_append_batch_seconds_count{partition="0"} 99',
    ])
    sums = parse_prometheus(text, (RECORDS_METRIC, SYNCS_METRIC))
    assert sums == {RECORDS_METRIC: 150.0, SYNCS_METRIC: 15.0}
    delta = StorageCounters(150.0, 15.0) - StorageCounters(50.0, 5.0)
    assert delta.records_per_sync == 10.0
    assert StorageCounters(0.0, 0.0).records_per_sync is None


def test_top_functions_counts_own_and_inclusive_samples(tmp_path) -> None:
    raw = tmp_path / "profile.txt"
    raw.write_text("main (a/x.py:1);loop (a/x.py:5);encode (b/wire.py:9) 30\n"
                   "main (a/x.py:1);loop (a/x.py:5) 10\n"
                   "main (a/x.py:1);loop (a/x.py:6);fsync (b/disk.py:3) 60\n")
    lines = top_functions(raw)
    assert "100 samples" in lines[0]
    assert lines[1].split()[:2] == ["60.0", "60.0"] and "fsync (b/disk.py)" in lines[1]
    assert lines[2].split()[:2] == ["30.0", "30.0"] and "encode" in lines[2]
    assert lines[3].split()[:2] == ["10.0", "100.0"] and "loop (a/x.py)" in lines[3]
