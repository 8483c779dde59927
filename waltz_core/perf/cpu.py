"""CPU time per process, and of the whole machine, over a benchmark window, read from ``/proc`` (Linux).

On a shared 2-core machine, wall-clock throughput moves with the neighbours; CPU seconds spent
per transaction in each process (client, server, storages) moves much less, and it says which
process an optimisation has to target. The machine's own shares (busy, and on a virtual machine
*steal*: time the hypervisor gave its CPUs to others, in which no process of it ran) say how
loaded the host was and how much of a latency tail may be the host's. Elsewhere than Linux the
figures are reported as unknown.
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


#: the fields of /proc/stat's ``cpu`` line, in order (man 5 proc); guest times are inside user/nice
_STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
_BUSY = ("user", "nice", "system", "irq", "softirq")


@attrs.frozen
class HostCpuSample:
    """The machine's CPU time by kind (the ``cpu`` line of /proc/stat, in clock ticks) at one moment."""

    ticks: Mapping[str, int]
    cores: int

    @classmethod
    def take(cls) -> HostCpuSample | None:
        """None where /proc/stat cannot be read or parsed (not Linux)."""
        try:
            with open("/proc/stat", "rb") as f:
                return cls.parse(f.read())
        except OSError:
            return None

    @classmethod
    def parse(cls, raw: bytes) -> HostCpuSample | None:
        lines = raw.splitlines()
        fields = lines[0].split() if lines else []
        if not fields or fields[0] != b"cpu":
            return None
        try:
            values = [int(v) for v in fields[1 : 1 + len(_STAT_FIELDS)]]
        except ValueError:
            return None
        values += [0] * (len(_STAT_FIELDS) - len(values))  # an old kernel without steal
        cores = sum(1 for line in lines[1:] if line.startswith(b"cpu"))
        return cls(dict(zip(_STAT_FIELDS, values, strict=True)), max(cores, 1))

    def shares_since(self, before: HostCpuSample) -> dict[str, float] | None:
        """Percent of the machine's CPU time since ``before`` that was busy and that was stolen,
        with the number of cores; None when no tick passed."""
        delta = {k: self.ticks[k] - before.ticks.get(k, 0) for k in _STAT_FIELDS}
        total = sum(delta.values())
        if total <= 0:
            return None
        return {"busy_percent": round(100 * sum(delta[k] for k in _BUSY) / total, 1),
                "steal_percent": round(100 * delta["steal"] / total, 1), "cores": self.cores}
