"""CPU time per process over a benchmark window, read from ``/proc`` (Linux).

On a shared 2-core machine, wall-clock throughput moves with the neighbours; CPU seconds spent
per transaction in each process (client, server, storages) moves much less, and it says which
process an optimisation has to target. Elsewhere than Linux the figure is reported as unknown.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import attrs

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` (all its threads) so far; None if unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return parse_stat_cpu_seconds(f.read())
    except OSError:
        return None


def parse_stat_cpu_seconds(raw: bytes) -> float | None:
    """utime + stime in seconds from the text of ``/proc/<pid>/stat``; None if it does not parse."""
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    end = raw.rfind(b")")
    fields = raw[end + 2 :].split() if end >= 0 else []
    try:
        return (int(fields[11]) + int(fields[12])) / _TICK  # fields 14 and 15: utime, stime
    except (IndexError, ValueError):
        return None


@attrs.frozen
class CpuSample:
    """CPU seconds of named groups of processes at one moment."""

    seconds: Mapping[str, float]

    @classmethod
    def take(cls, groups: Mapping[str, Sequence[int]]) -> CpuSample | None:
        """None when any process cannot be read (not Linux, or it exited)."""
        out = {}
        for name, pids in groups.items():
            total = 0.0
            for pid in pids:
                value = cpu_seconds(pid)
                if value is None:
                    return None
                total += value
            out[name] = total
        return cls(out)

    def __sub__(self, other: CpuSample) -> CpuSample:
        return CpuSample({k: v - other.seconds.get(k, 0.0) for k, v in self.seconds.items()})

    def per_transaction_us(self, transactions: int) -> dict[str, float]:
        """Microseconds of CPU per transaction for each group (empty when nothing committed)."""
        if transactions <= 0:
            return {}
        return {k: round(v / transactions * 1e6, 1) for k, v in self.seconds.items()}
