"""The machine's speed printed beside a performance report (``waltz_core.perf.machine``)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from waltz_core.perf import machine
from waltz_core.perf.machine import MachineSpeed


def test_the_python_mix_takes_a_positive_finite_time_per_pass() -> None:
    ns = machine.python_ns_per_op(ops=2_000, repeat=2)
    assert 0 < ns < 1e6 and math.isfinite(ns)  # a pass is far below a millisecond on any machine
    with pytest.raises(ValueError):
        machine.python_ns_per_op(ops=0)


def test_the_round_trip_reaches_a_child_and_back() -> None:
    us = machine.wakeup_round_trip_us(trips=50, batches=2)
    assert 0 < us < 1e6  # two pipe hand-offs: well below a second even on a loaded machine
    with pytest.raises(ValueError):
        machine.wakeup_round_trip_us(batches=0)


def test_fdatasyncs_are_counted_in_the_directory_and_leave_no_file(tmp_path: Path) -> None:
    rate = machine.fdatasync_per_s(tmp_path, seconds=0.2, max_syncs=20)
    assert rate > 0
    assert list(tmp_path.iterdir()) == []  # the scratch file is removed
    with pytest.raises(FileNotFoundError):
        machine.fdatasync_per_s(tmp_path / "missing", seconds=0.1)
    with pytest.raises(ValueError):
        machine.fdatasync_per_s(tmp_path, seconds=0)


def test_measure_fills_every_field_and_prints_them(tmp_path: Path) -> None:
    speed = machine.measure(tmp_path, fsync_seconds=0.1)
    assert speed.cpu_model and speed.cpu_model == machine.cpu_model()
    assert speed.python_ns_per_op > 0 and speed.wakeup_round_trip_us > 0 and speed.fdatasync_per_s > 0
    assert set(speed.to_json()) == {"cpu_model", "python_ns_per_op", "wakeup_round_trip_us", "fdatasync_per_s"}
    text = MachineSpeed("Some CPU", 512.4, 41.25, 3600.0).summary()
    assert text == ("Some CPU; Python mix 512 ns/op, process wake-up round trip 41.2 µs, "
                    "3,600 fdatasyncs/s (4 KiB appends)")
