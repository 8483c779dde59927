"""CPU accounting of ``waltz perf`` (``/proc/<pid>/stat``: the project runs on Linux, so these run everywhere it does)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from waltz_core.perf.cpu import CpuSample, HostCpuSample, cpu_seconds, parse_stat_cpu_seconds


def _spin(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        continue  # burn CPU: the tests measure it


def test_cpu_seconds_follow_the_process_cpu_time() -> None:
    before = cpu_seconds(os.getpid())
    _spin(0.3)
    after = cpu_seconds(os.getpid())
    assert before is not None and after is not None
    assert after - before == pytest.approx(0.3, abs=0.05)  # clock ticks are 10 ms


def test_a_command_name_with_spaces_and_parentheses_is_parsed() -> None:
    # The second field is the command name in parentheses, and may contain both itself.
    tick = os.sysconf("SC_CLK_TCK")
    line = f"4242 (a b) (c) S 1 4242 4242 0 -1 4194560 100 0 0 0 {3 * tick} {tick} 0 0 20 0 1 0 5 0 0".encode()
    assert parse_stat_cpu_seconds(line) == pytest.approx(4.0)
    assert parse_stat_cpu_seconds(b"garbage") is None
    assert parse_stat_cpu_seconds(b"1 (x) S 1 2") is None


def test_sample_difference_per_transaction_and_unknown_processes() -> None:
    me = os.getpid()
    first = CpuSample.take({"client": [me], "twice": [me, me]})
    assert first is not None
    _spin(0.2)
    second = CpuSample.take({"client": [me], "twice": [me, me]})
    assert second is not None
    delta = second - first
    per_txn = delta.per_transaction_us(1000)
    assert per_txn["client"] == pytest.approx(200.0, abs=50.0)  # 0.2 s over 1000 transactions
    # /proc counts in clock ticks and each of the three reads may fall on either side of one:
    # 1000 transactions make a tick 10 us each (at 100 ticks/s).
    tick_us = 1e6 / os.sysconf("SC_CLK_TCK") / 1000
    assert per_txn["twice"] == pytest.approx(2 * per_txn["client"], abs=2 * tick_us + 0.1)
    assert delta.per_transaction_us(0) == {}
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert CpuSample.take({"gone": [dead.pid]}) is None  # an exited (reaped) process: unknown, not 0


_STAT = b"""cpu  {user} 10 {system} {idle} 40 0 {softirq} {steal} 0 0
cpu0 1 2 3 4 5 6 7 8 0 0
cpu1 1 2 3 4 5 6 7 8 0 0
intr 12345
"""


def _stat(user: int, system: int, idle: int, softirq: int, steal: int) -> bytes:
    return _STAT.replace(b"{user}", b"%d" % user).replace(b"{system}", b"%d" % system).replace(
        b"{idle}", b"%d" % idle).replace(b"{softirq}", b"%d" % softirq).replace(b"{steal}", b"%d" % steal)


def test_the_machines_busy_and_stolen_shares_over_a_window() -> None:
    before = HostCpuSample.parse(_stat(user=1000, system=200, idle=5000, softirq=50, steal=100))
    after = HostCpuSample.parse(_stat(user=1500, system=300, idle=5300, softirq=70, steal=130))
    assert before is not None and after is not None and after.cores == 2
    # 500 user + 100 system + 20 softirq busy, 300 idle, 30 steal: 950 ticks in all
    assert after.shares_since(before) == {"busy_percent": round(100 * 620 / 950, 1),
                                          "steal_percent": round(100 * 30 / 950, 1), "cores": 2}
    assert after.shares_since(after) is None  # no tick passed: unknown, not 0 %
    assert HostCpuSample.parse(b"garbage") is None
    assert HostCpuSample.parse(b"cpu  1 2 x 4") is None
    old = HostCpuSample.parse(b"cpu  1 2 3 4 5 6 7\ncpu0 1 2 3 4 5 6 7\n")  # a kernel without steal
    assert old is not None and old.ticks["steal"] == 0 and old.cores == 1


def test_the_host_sample_of_this_machine_counts_a_busy_core() -> None:
    before = HostCpuSample.take()
    assert before is not None, "the project runs on Linux: /proc/stat must be readable"
    _spin(0.3)
    after = HostCpuSample.take()
    assert after is not None
    shares = after.shares_since(before)
    assert shares is not None and shares["cores"] == os.cpu_count()
    # this process kept one core busy the whole time: at least half of it shows on 2 cores
    assert shares["busy_percent"] >= 100 / shares["cores"] / 2
    assert 0 <= shares["steal_percent"] <= 100 - shares["busy_percent"]
